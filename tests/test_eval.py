"""Distributed evaluation: metric sums on literal inputs, and one eval set on 1 device,
8 devices and 2 hosts x 4 devices giving the same metrics and the exact example count."""

import json
import math
import os
import shutil
import subprocess

import numpy as np
import pytest
import tensorflow as tf

from conftest import ROOT, device_mesh, launch_command, main_py
from tfpod import UserError, evaluation
from tfpod.api import run
from tfpod.input import prepare


@pytest.mark.unit
def test_classification_top1_top5_ignore_padding():
    logits = tf.constant([[9.0, 1, 2, 3, 4, 5, 6], [0, 9, 8, 7, 6, 5, 4], [1, 2, 3, 4, 5, 6, 7], [5, 5, 5, 5, 5, 5, 9]])
    batch = {"labels": tf.constant([0, 6, 0, 1]), "weights": tf.constant([1.0, 1.0, 1.0, 0.0])}
    sums = {k: float(v) for k, v in evaluation.classification_update(logits, batch).items()}
    # row 0: label ranked 1st; row 1: label (score 4) ranked 6th; row 2: label (1) ranked 7th; row 3: padding
    assert sums == {"top1_correct": 1.0, "top5_correct": 1.0, "example_count": 3.0}
    res = evaluation.CLASSIFICATION.result(sums)
    assert res == {"top1_accuracy": pytest.approx(1 / 3), "top5_accuracy": pytest.approx(1 / 3)}


@pytest.mark.unit
def test_masked_lm_and_lm_sums():
    logits = tf.one_hot([[2, 3, 0], [1, 1, 1]], 4) * 5.0  # predictions: [2,3,0], [1,1,1]
    mlm = {"masked_lm_ids": tf.constant([[2, 1, 0], [1, 0, 0]]), "masked_lm_weights": tf.constant([[1.0, 1, 0], [1, 0, 0]])}
    sums = {k: float(v) for k, v in evaluation.masked_lm_update(logits, mlm).items()}
    assert sums == {"mlm_correct": 2.0, "mlm_count": 3.0, "example_count": 2.0}
    lm = {"targets": tf.constant([[2, 3, 1], [1, 2, 0]]), "weights": tf.constant([[1.0, 1, 1], [0, 0, 0]])}
    sums = {k: float(v) for k, v in evaluation.lm_update(logits, lm).items()}
    assert sums["token_count"] == 3 and sums["correct_tokens"] == 2 and sums["example_count"] == 1
    ce_right = math.log(3 + math.exp(5)) - 5  # softmax over [5,0,0,0]
    assert sums["loss_sum"] == pytest.approx(2 * ce_right + (math.log(3 + math.exp(5)) - 0), rel=1e-5)
    res = evaluation.LM.result(sums)
    assert res["perplexity"] == pytest.approx(math.exp(res["loss"]))


@pytest.mark.unit
def test_pad_rows_adds_weight_zero_rows():
    batch = {"inputs": np.ones((3, 4), np.int32), "weights": np.ones((3, 4), np.float32)}
    padded = evaluation.pad_rows(batch, 8)
    assert padded["inputs"].shape == (8, 4) and padded["weights"][3:].sum() == 0


SMALL = ["gpt.num_layers=1", "gpt.embed_dim=64", "gpt.mlp_dim=128", "train.global_batch_size=16",
         "train.steps_per_loop=2", "train.log_every=2", "train.checkpoint_every=2"]


def expected_examples(files, seq_len=64):
    """The eval set's size counted without tfpod: each document's ceil(pairs / seq_len) rows."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=prepare.vocab_path(prepare.ensure(), 2048))
    n = 0
    for rec in tf.data.TFRecordDataset(files):
        text = tf.train.Example.FromString(rec.numpy()).features.feature["text"].bytes_list.value[0]
        pairs = len(sp.encode(text.decode("utf-8"))) + 1 - 1  # + EOS, then pairs
        n += -(-pairs // seq_len) if pairs > 0 else 0
    return n


def eval_subset(path, source, records):
    """Writes records `records` (indices) of eval file `source` to `path`: a small eval set of real documents."""
    with tf.io.TFRecordWriter(str(path)) as writer:
        for i, record in enumerate(tf.data.TFRecordDataset(source)):
            if i in records:
                writer.write(record.numpy())
    return str(path)


def eval_record(model_dir):
    return [json.loads(l) for l in open(os.path.join(model_dir, "metrics.jsonl")) if '"eval"' in l][-1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """train_and_eval on one of the 8 devices, 4 steps, an eval of 167 rows at steps 2 and 4
    (checkpoints at both): (its model_dir, its result). Its checkpoints are evaluated on other
    meshes below."""
    base = tmp_path_factory.mktemp("trained")
    corpus = prepare.ensure()
    source = sorted(tf.io.gfile.glob(prepare.split_paths(corpus, "eval")))[0]
    one_file = "lm_data.eval_files='%s'" % eval_subset(base / "eval.tfrecord", source, range(1, 5))  # 167 rows
    params = SMALL + [one_file, "train.eval_every=2", "train.steps=4"]
    out = run(["gin/lm_tiny.gin"], params, str(base / "a"), mode="train_and_eval", mesh=device_mesh())
    return base / "a", params, out


def test_same_metrics_and_exact_count_on_1_device_8_devices_and_2_hosts(tmp_path, trained):
    """The eval set: two files of the corpus's eval documents (72 and 133 rows), one per host:
    the hosts run different numbers of batches, one of them ending in a short batch. (The
    checkpoint: the trained run's step 4, in a copy of its folder.)"""
    corpus = prepare.ensure()
    source = sorted(tf.io.gfile.glob(prepare.split_paths(corpus, "eval")))
    files = [eval_subset(tmp_path / "eval-00000-of-00002.tfrecord", source[0], range(1, 4)),
             eval_subset(tmp_path / "eval-00001-of-00002.tfrecord", source[1], range(3))]
    eval_param = "lm_data.eval_files='%s'" % ",".join(files)
    d = tmp_path / "run"
    shutil.copytree(trained[0], d)

    eight = run(["gin/lm_tiny.gin"], SMALL + [eval_param], str(d), mode="eval", mesh_spec="data:2,model:4")
    truth = expected_examples(files)
    assert eight["num_examples"] == truth and eight["step"] == 4
    assert truth % 16 and truth % 2  # the set divides neither the batch nor the host count
    assert sorted(expected_examples([f]) for f in files) == [72, 133]  # one host's share ends in a short batch

    base = ["--gin_file=gin/lm_tiny.gin", f"--model_dir={d}", "--mode=eval",
            *[f"--gin_param={p}" for p in SMALL + [eval_param]]]
    # A process with one CPU device (the suite's other 1-device runs use one of this process's 8).
    one = main_py(*base, "--cpu_devices=1", "--mesh=data:1")
    assert one.returncode == 0, one.stderr[-2000:]
    one_rec = eval_record(d)
    two = subprocess.run(launch_command(2, 4, *base, "--mesh=data:4,model:2"), cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert two.returncode == 0, (two.stdout + two.stderr)[-2000:]
    two_rec = eval_record(d)
    for rec in (one_rec, two_rec):
        assert rec["num_examples"] == truth and rec["step"] == 4, (one_rec, two_rec)
        for key in ("loss", "perplexity", "token_accuracy"):
            assert rec[key] == pytest.approx(eight[key], rel=1e-5), (key, rec, eight)


def test_train_and_eval_alternates_and_stops_at_the_target(tmp_path, trained):
    a, params, out = trained
    evals = [json.loads(l) for l in open(a / "metrics.jsonl") if '"eval"' in l]
    assert [e["step"] for e in evals[:2]] == [2, 4] and out["step"] == 4
    assert evals[0]["num_examples"] == evals[1]["num_examples"] > 0
    shutil.copytree(a, tmp_path / "a")  # (the trained folder stays as it was)
    given = run(["gin/lm_tiny.gin"], params, str(tmp_path / "a"), mode="eval", mesh=device_mesh(),
                checkpoint=str(tmp_path / "a" / "checkpoints" / "ckpt-2"))  # a given, older checkpoint
    assert given["step"] == 2 and given["loss"] == pytest.approx(evals[0]["loss"], rel=1e-5)
    with pytest.raises(UserError, match="no such checkpoint"):
        run(["gin/lm_tiny.gin"], params, str(tmp_path / "a"), mode="eval", checkpoint=str(tmp_path / "nope"))

    target = ["train.target_metric='token_accuracy'", "train.target_value=0.0"]
    out = run(["gin/lm_tiny.gin"], params + target, str(tmp_path / "b"), mode="train_and_eval", mesh=device_mesh())
    evals = [json.loads(l) for l in open(tmp_path / "b" / "metrics.jsonl") if '"eval"' in l]
    assert out["step"] == 2 and evals[-1]["target_reached"] is True and evals[-1]["train_seconds"] > 0
    assert os.path.exists(tmp_path / "b" / "checkpoints" / "ckpt-2.index")
