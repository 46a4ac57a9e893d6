"""Exact AUC on device (tfpod.auc): equal to sklearn.metrics.roc_auc_score, ties as sklearn
counts them, every eval example once on 1 and 8 devices (2 hosts: tests/test_dlrm.py)."""

import numpy as np
import pytest
import tensorflow as tf
from sklearn.metrics import roc_auc_score
from tensorflow.experimental import dtensor

from conftest import device_mesh
from tfpod import auc, evaluation

pytestmark = pytest.mark.unit


def test_exact_auc_equals_sklearn_with_ties_and_weights():
    rng = np.random.default_rng(0)
    for n, levels in ((50, 5), (1000, 30), (4000, None)):
        scores = rng.random(n).astype(np.float32)
        if levels:  # many tied scores, tied across classes
            scores = (np.floor(scores * levels) / levels).astype(np.float32)
        labels = (rng.random(n) < 0.3).astype(np.float32)
        weights = (rng.random(n) < 0.9).astype(np.float32)  # some rows are padding
        got = auc.exact_auc(scores, auc.signed_weights(labels, weights)).numpy()
        keep = weights > 0
        assert got == pytest.approx(roc_auc_score(labels[keep], scores[keep]), abs=1e-12)
        fractional = rng.random(n).astype(np.float32) + 0.1
        got = auc.exact_auc(scores, auc.signed_weights(labels, fractional)).numpy()
        assert got == pytest.approx(roc_auc_score(labels, scores, sample_weight=fractional), abs=1e-9)


@pytest.mark.parametrize("spec", ["data:1", "data:8"])
def test_auc_over_an_eval_set_on_the_mesh_counts_every_example_once(spec):
    """The eval loop's padded last batch and gathers of every device's examples: the AUC, log loss and count of
    the real examples, equal to sklearn's on the same probabilities."""
    mesh = device_mesh(spec)
    rng = np.random.default_rng(1)
    n, rows = 203, 32  # 7 batches, the last one short and padded
    logits = np.round(rng.normal(size=n), 1).astype(np.float32)  # ties
    labels = (rng.random(n) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    data = {"logits": logits, "labels": labels, "weights": np.ones(n, np.float32)}
    host_batches = [{k: v[i:i + rows] for k, v in data.items()} for i in range(0, n, rows)]
    layout = lambda x: dtensor.Layout(["data"] + [dtensor.UNSHARDED] * (x.ndim - 1), mesh)
    to_device = lambda b: {k: dtensor.pack([tf.constant(p) for p in np.split(v, mesh.dim_size("data"))], layout(v))
                           for k, v in b.items()}
    step = evaluation.make_eval_step(lambda b: (b["logits"], b), auc.BINARY)
    result = evaluation.evaluate(step, host_batches, rows, to_device, mesh, auc.BINARY)
    # the step's own probabilities (its sigmoid kernel may round differently from an eager one)
    outputs = evaluation.run_padded(step, host_batches, rows, to_device, mesh)
    probabilities = np.concatenate([s.numpy() for out in outputs for s in dtensor.unpack(out[1]["score"])])[:n]
    assert result["num_examples"] == n
    assert result["auc"] == pytest.approx(roc_auc_score(labels, probabilities), abs=1e-12)
    bce = -np.mean(labels * np.log(probabilities) + (1 - labels) * np.log(1 - probabilities))
    assert result["loss"] == pytest.approx(bce, rel=1e-5)
