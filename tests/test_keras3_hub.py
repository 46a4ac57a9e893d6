"""KerasHub's Llama and Gemma causal LMs (small random configurations) under ModelParallel on a
(2, 4) batch x model mesh with KerasHub's own layout maps (`get_layout_map`: every kernel and
the embedding split over both axes), against the same models on one device (tfpod/keras3/).

The optimizer is Adam with its gradients made dense on both sides: Keras's own Adam on one
device updates an embedding table sparsely (IndexedSlices: the squares of repeated ids'
gradients summed, rows absent from a batch left alone), which DTensor cannot lay out, so
under a distribution every update is dense; against dense Adam the runs agree to float32
rounding that Adam's normalisation raises (losses 2e-5 relative, weights 1e-5 absolute).
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfpod  # noqa: F401  (backs keras.distribution once keras is imported)

keras = pytest.importorskip("keras")
keras_hub = pytest.importorskip("keras_hub")


pytestmark = pytest.mark.usefixtures("no_keras3_distribution")


class DenseAdam(keras.optimizers.Adam):
    """Adam with every gradient dense (what an update on the mesh is)."""

    def apply(self, grads, trainable_variables=None):
        return super().apply([tf.convert_to_tensor(g) for g in grads], trainable_variables)


# Sizes that divide over KerasHub's layouts on (batch:2, model:4): hidden over both axes,
# query heads over model, Gemma's key/value heads over model, the vocabulary over model.
MODELS = {
    "llama": (lambda: keras_hub.models.LlamaBackbone(
        vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=16), lambda b: keras_hub.models.LlamaCausalLM(b, preprocessor=None),
        "transformer_layer_0/self_attention/query/kernel"),
    "gemma": (lambda: keras_hub.models.GemmaBackbone(
        vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=4, hidden_dim=16,
        intermediate_dim=64, head_dim=4), lambda b: keras_hub.models.GemmaCausalLM(b, preprocessor=None),
        "decoder_block_0/attention/query/kernel"),
}


def _fit(name):
    backbone_fn, causal_lm, _ = MODELS[name]
    keras.utils.set_random_seed(0)
    backbone = backbone_fn()
    model = causal_lm(backbone)
    model.compile(optimizer=DenseAdam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=["accuracy"])
    tokens = np.random.RandomState(0).randint(1, 64, size=(16, 9)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((16, 8), "int32")}
    history = model.fit(x, tokens[:, 1:], sample_weight=np.ones((16, 8), "float32"), batch_size=8, epochs=2,
                        shuffle=False, verbose=0).history
    return model, backbone, history


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_kerashub_causal_lm_trains_with_its_layout_map_and_one_devices_losses(name):
    plain, _, want = _fit(name)
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices())
    layout_map = type(plain.backbone).get_layout_map(mesh)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                         batch_dim_name="batch"))
    model, backbone, got = _fit(name)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5, err_msg=key)
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    layout = lambda path: dtensor.fetch_layout(  # noqa: E731
        next(v for v in backbone.weights if v.path == path).value).sharding_specs
    assert layout("token_embedding/embeddings") == ["model", "batch"]
    assert layout(MODELS[name][2])[:2] in (["model", "batch"], ["batch", "model"])
