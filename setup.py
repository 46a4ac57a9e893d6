"""tfpod: train large models across many accelerators and hosts with TensorFlow DTensor.

`input/` and `models/` install as tfpod.input and tfpod.models, and `gin/` as the data
folder tfpod/gin, so no generic top-level name lands in site-packages.
"""

from setuptools import setup

setup(
    name="tfpod",
    version="0.1.0",
    description="Multi-host, multi-accelerator training with TensorFlow DTensor",
    python_requires=">=3.10,<3.13",
    packages=["tfpod", "tfpod.keras", "tfpod.keras3", "tfpod.compat", "tfpod.partitioning", "tfpod.partitioning.presets", "tfpod.pipeline", "tfpod.convert", "tfpod.doctor", "tfpod.plan", "tfpod.embedding", "tfpod.input", "tfpod.models", "tfpod.gin"],
    package_dir={"tfpod": "tfpod", "tfpod.input": "input", "tfpod.models": "models", "tfpod.gin": "gin"},
    package_data={"tfpod.gin": ["*.gin", "*/*.gin"]},
    install_requires=[
        "tensorflow==2.20.*",
        "tensorflow-text==2.20.*",
        "tf-keras==2.20.*",
        "tf-models-official==2.20.0",
        "absl-py>=1.4",
        "gin-config>=0.5",
        "sentencepiece>=0.2",
        "numpy>=1.26",
        "sacrebleu>=2",
        "safetensors>=0.4",
    ],
    # tensorflow-serving-api: the tests build TF Serving PredictRequests (pinned to TF's minor version).
    # transformers 4.44 (the last with TF classes reading PyTorch-named safetensors, with safetensors 0.4):
    # the tests check imports and exports against its own TFGPT2LMHeadModel and TFBertForPreTraining.
    # kubernetes-validate: the Kubernetes manifests are validated against the Kubernetes API schema offline.
    # keras-hub 0.29 (Keras 3's Llama and Gemma, sharded by tfpod/keras3 in the tests): 0.30+ pins kagglesdk==0.1.28,
    # which tf-models-official's kaggle (kagglesdk>=0.1.38) refuses.
    extras_require={"test": ["pytest>=8", "pytest-xdist>=3", "tensorflow-serving-api==2.20.*", "transformers==4.44.*",
                             "safetensors==0.4.*", "kubernetes-validate>=1.30", "keras-hub==0.29.*",
                             "tensorflow-recommenders==0.7.7"]},
    entry_points={"console_scripts": ["tfpod=tfpod.main:console_main", "tfpod-launch=tfpod.launch:console_main",
                                      "tfpod-doctor=tfpod.doctor.__main__:console_main"]},
)
