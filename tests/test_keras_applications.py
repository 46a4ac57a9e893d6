"""Every tf_keras.applications family trains sharded with plain Keras's losses (docs/keras.md's table).

One model per family (`bench/keras_applications.py`'s FAMILIES), at its smallest input,
on data:8 and on data:4,model:2 of 8 devices, each in a process of its own: built plainly
and under `tfpod.sharding` from the same weights (float64, dropout off), fit 2 SGD steps;
losses, weights, evaluate, predict, get/set_weights, a Checkpoint resume and model.save's
SavedModel compared with plain Keras (the bench's `matrix` part says how).

These models take one to twelve minutes each to compile on a 2-core CPU, so the README's
test command leaves this file out (the suite checks their layers in test_keras_layers.py
and MobileNetV2 whole in test_keras.py). Run it, and regenerate the docs' table from its
results, with

    TFPOD_APPLICATIONS_RESULTS=/tmp/applications.jsonl python -m pytest -m applications tests/test_keras_applications.py
        [-k data8]
    python bench/keras_applications.py --results=/tmp/applications.jsonl --table=docs/keras_applications.md
"""

import os
import sys

import pytest

from conftest import ROOT, application_row

sys.path.insert(0, os.path.join(ROOT, "bench"))
from keras_applications import FAMILIES  # noqa: E402

pytestmark = pytest.mark.applications


@pytest.mark.parametrize("mesh", ["data:8", "data:4,model:2"], ids=["data8", "data4_model2"])
@pytest.mark.parametrize("name", FAMILIES)
def test_an_application_trains_sharded_as_plain_keras(name, mesh):
    row = application_row("keras_applications.py", "--parts=matrix", f"--one={name}", f"--mesh={mesh}",
                          "--cpu_devices=8", timeout=1800)
    assert row["result"] == "trains", row
