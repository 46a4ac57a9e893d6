"""Every family of Keras 3's keras.applications trains under keras.distribution on TensorFlow
(tfpod/keras3) with plain Keras 3's losses: docs/keras3_applications.md is the table.

One model per family (`bench/keras3_applications.py`'s FAMILIES), at its smallest input, on
data:8 (DataParallel) and batch:4,model:2 (ModelParallel, every kernel whose output channels
divide split over `model`), each in a process of its own, float64, dropout on: losses,
weights, evaluate, predict, the .keras file loaded by plain Keras 3 and the exported
SavedModel within 1e-6 of plain Keras (the bench's docstring says how).

These models take minutes each to compile on a 2-core CPU, so the README's test command
leaves this file out (its marker, `applications`, must be named); the suite checks the
layers they are built from (tests/test_keras3_layers.py). Run it, and regenerate the table:

    TFPOD_APPLICATIONS_RESULTS=rows.jsonl python -m pytest -m applications tests/test_keras3_applications.py
    python bench/keras3_applications.py --results=rows.jsonl --table=docs/keras3_applications.md
"""

import os
import sys

import pytest

from conftest import ROOT, application_row

sys.path.insert(0, os.path.join(ROOT, "bench"))
from keras3_applications import FAMILIES  # noqa: E402

pytestmark = pytest.mark.applications


@pytest.mark.parametrize("mesh", ["data:8", "batch:4,model:2"], ids=["data8", "batch4_model2"])
@pytest.mark.parametrize("name", FAMILIES)
def test_a_keras3_application_trains_under_a_distribution_as_plain_keras(name, mesh):
    row = application_row("keras3_applications.py", f"--one={name}", f"--mesh={mesh}", timeout=3600)
    assert row["result"] == "trains", row
