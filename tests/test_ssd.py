"""SSD-ResNet34 task: the loss (hard negative mining), the reference shape (8732 boxes at
300x300, built lazily), detection against TensorFlow's NMS, COCO eval against the JSON,
and one train_and_eval of gin/ssd_tiny.gin on one of the 8 logical devices (tfpod's run
API, as main.py runs it) whose checkpoint is then evaluated on 2 hosts x 4 devices, and
exported.

Baseline for the AP test: the untrained tiny model scores AP 0.0000 (AP50 0.00003) on
the demo set's 128 val images; the tiny recipe reaches AP 0.22 (AP50 0.63) at step 300.
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from conftest import assert_golden_layouts
from tfpod import UserError, compat
from tfpod.input import boxes as boxes_lib, detection, detection_demo
from tfpod.input.common import ShardInfo
from tfpod.models import ssd, ssd_eval

TINY = dict(num_classes=4, image_size=64, depth_multiplier=0.25, block_repeats=(1, 1, 1), num_feature_maps=4)


def _cross_entropy(logits, labels):
    z = logits - logits.max(-1, keepdims=True)
    return np.log(np.exp(z).sum(-1)) - np.take_along_axis(z, labels[..., None], -1)[..., 0]


@pytest.mark.unit
def test_hard_negative_mining_keeps_three_hardest_negatives_per_positive():
    rng = np.random.default_rng(0)
    boxes, classes = 20, 3
    logits = rng.normal(0, 2, (3, boxes, classes)).astype(np.float32)
    targets = np.zeros((3, boxes), np.int32)
    targets[0, [3, 7]] = [1, 2]  # 2 positives: the 6 hardest of 18 negatives
    targets[2, :7] = 1  # 7 positives: 21 wanted, only 13 negatives
    offsets = rng.normal(0, 1, (3, boxes, 4)).astype(np.float32)
    box_targets = rng.normal(0, 1, (3, boxes, 4)).astype(np.float32)
    terms = ssd.detection_losses(tf.constant(np.concatenate([offsets, logits], -1)), tf.constant(box_targets),
                                 tf.constant(targets))
    terms = {k: v.numpy() for k, v in terms.items()}
    np.testing.assert_array_equal(terms["positives"], [2, 0, 7])
    np.testing.assert_array_equal(terms["negatives"], [6, 0, 13])  # 3:1, none without positives, capped
    ce = _cross_entropy(logits, targets)  # [3, boxes]
    negatives = np.sort(np.where(targets[0] > 0, -np.inf, ce[0]))[::-1][:6]
    np.testing.assert_allclose(terms["class"][0], ce[0, [3, 7]].sum() + negatives.sum(), rtol=1e-5)
    assert terms["class"][1] == 0 and terms["box"][1] == 0  # an image without objects adds nothing
    np.testing.assert_allclose(terms["class"][2], ce[2].sum(), rtol=1e-5)  # every box: 7 positives + 13 negatives
    d = np.abs(offsets[0, [3, 7]] - box_targets[0, [3, 7]])
    np.testing.assert_allclose(terms["box"][0], np.where(d < 1, 0.5 * d * d, d - 0.5).sum(), rtol=1e-5)

    # The batch loss: each image's terms over its positives, averaged over weighted images.
    batch = {"box_targets": tf.constant(box_targets), "class_targets": tf.constant(targets),
             "weights": tf.constant([1.0, 1.0, 0.0])}
    sums = ssd._loss_sums(tf.constant(np.concatenate([offsets, logits], -1)), batch, 3.0)
    expected = (terms["box"][0] + terms["class"][0]) / 2  # image 1 has no positives, image 2 no weight
    np.testing.assert_allclose(float(sums["loss_sum"] / sums["weight_sum"]), expected / 2, rtol=1e-5)


@pytest.mark.unit
def test_a_perfect_prediction_has_no_box_loss():
    targets = np.zeros((1, 12), np.int32)
    targets[0, [2, 5]] = [1, 3]
    box_targets = np.random.default_rng(1).normal(0, 1, (1, 12, 4)).astype(np.float32)
    logits = 30.0 * np.eye(4, dtype=np.float32)[targets]  # [1, 12, 4], the right class by far
    terms = ssd.detection_losses(tf.constant(np.concatenate([box_targets, logits], -1)), tf.constant(box_targets),
                                 tf.constant(targets))
    assert float(terms["box"][0]) < 1e-6 and float(terms["class"][0]) < 1e-6
    assert float(terms["negatives"][0]) == 6


@pytest.mark.unit
def test_reference_shape_has_mlperf_maps_and_8732_boxes():
    import tf_keras

    cfg = ssd.SSDConfig()
    assert ssd.feature_sizes(cfg) == (38, 19, 10, 5, 3, 1)
    assert ssd.box_spec(cfg) == boxes_lib.MLPERF_SPEC and len(ssd.default_boxes(cfg)) == 8732
    with compat.lazy_variable().lazy_init_scope():  # built symbolically: nothing allocated
        model = ssd.SSD(cfg)
        out = model(tf_keras.Input([300, 300, 3]))
    assert tuple(out.shape) == (None, 8732, 4 + 81)
    params = sum(int(np.prod(v.shape)) for v in model.weights if v.trainable)
    assert 19e6 < params < 21e6, params  # ResNet-34 to conv4_x 8.5M, extras 3.7M, heads 7.9M
    assert 15e9 < ssd.forward_macs(cfg) < 17e9

    tiny = ssd.SSDConfig(**TINY)
    spec = ssd.box_spec(tiny)
    assert spec.feature_sizes == (8, 4, 2, 1) and spec.steps == (8, 16, 32, 64)
    assert len(ssd.default_boxes(tiny)) == 8 * 8 * 4 + 4 * 4 * 6 + 2 * 2 * 4 + 4
    with pytest.raises(UserError, match=r"ssd.image_size=64 is too small for ssd.num_feature_maps=6: .* "
                                        r"use ssd.image_size >= 257 or ssd.num_feature_maps <= 4") as e:
        ssd.SSDConfig(image_size=64)
    assert "\n" not in str(e.value)


@pytest.mark.unit
def test_detect_is_per_class_nms_as_tensorflows():
    """With every box a candidate, `detect` (batched tensor ops that DTensor can run) gives
    tf.image.combined_non_max_suppression's detections."""
    rng = np.random.default_rng(2)
    boxes, classes = 60, 4
    defaults = np.concatenate([rng.uniform(0.2, 0.8, (boxes, 2)), rng.uniform(0.1, 0.4, (boxes, 2))], -1)
    predictions = rng.normal(0, 1, (3, boxes, 4 + classes)).astype(np.float32)
    cfg = ssd.SSDConfig(**{**TINY, "num_classes": classes, "pre_nms_per_class": boxes, "max_detections": 40})
    found = ssd_eval.detect(tf.constant(predictions), defaults.astype(np.float32), cfg).numpy()  # [3, 40, 6]
    corners = tf.clip_by_value(boxes_lib.decode(tf.constant(predictions[..., :4]), defaults), 0.0, 1.0)
    scores = tf.nn.softmax(predictions[..., 4:])[..., 1:]
    ref = tf.image.combined_non_max_suppression(corners[:, :, None], scores, boxes, 40, cfg.nms_iou,
                                                cfg.score_threshold, clip_boxes=False)
    for i in range(3):
        n = int(ref.valid_detections[i])
        assert n == int((found[i, :, 5] > 0).sum()) and n > 5
        np.testing.assert_allclose(found[i, :n, 4], ref.nmsed_scores[i, :n], rtol=1e-6)
        np.testing.assert_allclose(found[i, :n, :4], ref.nmsed_boxes[i, :n], atol=1e-6)
        np.testing.assert_array_equal(found[i, :n, 5], ref.nmsed_classes[i, :n] + 1)
        assert not found[i, n:].any()


@pytest.mark.unit
def test_coco_eval_from_batches_agrees_with_the_annotations_json():
    """Ground truth rebuilt from eval batches (no JSON) scores detections as the COCO JSON
    does: 1.0 for the ground truth itself, the same AP for shifted boxes."""
    cfg = detection.DetectionDataConfig()
    model = ssd.SSDConfig(**TINY, max_detections=8)
    task_input = ssd.make_input(cfg, model, ShardInfo(0, 1), 0)
    batches = [{k: v.numpy() for k, v in b.items()} for b in task_input.eval(64)]
    ids = ssd_eval._category_ids(detection.label_map(cfg), model.num_classes)
    assert list(ids) == [0, 3, 17, 42]  # the demo set's non-contiguous COCO ids
    annotations = detection.eval_annotations(cfg)
    for shift in (0.0, 0.03):
        found = []
        for b in batches:
            f = np.zeros((len(b["weights"]), 8, 6), np.float32)
            f[:, :, :4] = np.clip(b["gt_boxes"][:, :8] + shift, 0, 1)
            f[:, :, 4] = 0.9
            f[:, :, 5] = b["gt_classes"][:, :8]
            found.append(f * (b["gt_classes"][:, :8, None] > 0))
        rows = ssd_eval._host_rows(batches, found, with_gt=True)
        results = ssd_eval.coco_results(rows, 8, ids)
        images = [int(i) for i in rows[:, 0]]
        from_json = ssd_eval.coco_eval(results, images, annotations)
        built = ssd_eval.coco_eval(results, images, ssd_eval.coco_ground_truth(rows, 8, ids, detection.label_map(cfg)))
        np.testing.assert_allclose(built, from_json, atol=1e-9)
        assert (from_json[0] > 0.99) == (shift == 0.0) and from_json[0] > 0.1


@pytest.mark.unit
def test_config_errors_are_one_line(tmp_path):
    from tfpod.api import run

    for param, needle in [("ssd.num_classes=5", "ssd.num_classes=5 but the detection data has 3 categories"),
                          ("ssd.block_repeats=(3, 4)", "ssd.block_repeats"),
                          ("optimizer.piecewise_boundaries=[10]", "piecewise"),
                          ("optimizer.weight_decay=0.01", "optimizer.name='sgd' applies no weight decay")]:
        with pytest.raises(UserError, match=needle) as e:
            run(["gin/ssd_tiny.gin"], [param], str(tmp_path / "bad"), mode="train_and_eval", mesh_spec="data:8")
        assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """gin/ssd_tiny.gin trained and evaluated as main.py runs it, on one of this process's
    devices (about 30 s; 8 devices: a minute): its checkpoint is evaluated on 2 hosts x 4
    devices below, and the 8-device layouts are test_spatial_equals_data's."""
    from conftest import device_mesh
    from tfpod.api import run

    model_dir = str(tmp_path_factory.mktemp("ssd") / "run")
    run(["gin/ssd_tiny.gin"], [], model_dir, mode="train_and_eval", mesh=device_mesh())
    return model_dir


def test_tiny_recipe_reaches_a_coco_ap_far_above_the_untrained_model(trained):
    records = [json.loads(line) for line in open(os.path.join(trained, "metrics.jsonl"))]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [150, 300]
    final = evals[-1]
    assert final["num_examples"] == 128 and final["coco_images"] == 128
    assert set(ssd_eval.AP_NAMES) <= set(final)
    # untrained: AP 0.0000; this recipe: 0.22 (AP50 0.63)
    assert final["AP"] > 0.15 and final["AP50"] > 0.45 and final["AP"] > evals[0]["AP"], final
    train = [r for r in records if r["kind"] == "train"]
    assert train[-1]["loss"] < 0.5 * train[0]["loss"] and train[-1]["examples_per_sec"] > 0


def test_export_detects_the_demo_shapes_from_jpeg_bytes(trained):
    from tfpod import export

    result = export.saved_model(trained)
    assert set(result["signatures"]["serving_default"]["outputs"]) == {"boxes", "classes", "scores",
                                                                       "num_detections"}
    data_dir = detection_demo.ensure()
    truth = json.load(open(detection_demo.annotations_path(data_dir, "val")))
    images = truth["images"][:8]
    jpegs = [open(os.path.join(data_dir, "val", im["file_name"]), "rb").read() for im in images]
    out = tf.saved_model.load(result["export_dir"]).signatures["serving_default"](image_bytes=tf.constant(jpegs))
    out = {k: v.numpy() for k, v in out.items()}
    assert out["boxes"].shape == (8, 100, 4) and out["classes"].shape == out["scores"].shape == (8, 100)
    hits = 0
    for i, im in enumerate(images):
        n = int(out["num_detections"][i])
        assert n > 0 and set(out["classes"][i, :n]) <= {3, 17, 42} and not out["classes"][i, n:].any()
        assert np.all(np.diff(out["scores"][i, :n]) <= 0) and np.all((out["boxes"] >= 0) & (out["boxes"] <= 1))
        ymin, xmin, ymax, xmax = out["boxes"][i, 0] * 64  # the best detection, in pixels
        for a in (a for a in truth["annotations"] if a["image_id"] == im["id"]):
            x, y, w, h = a["bbox"]
            inter = max(0, min(xmax, x + w) - max(xmin, x)) * max(0, min(ymax, y + h) - max(ymin, y))
            iou = inter / ((xmax - xmin) * (ymax - ymin) + w * h - inter)
            hits += iou > 0.5 and a["category_id"] == out["classes"][i, 0]
    assert hits >= 5, hits  # the best detection is a right one in most images


def _last_eval(model_dir) -> dict:
    """The newest eval record in model_dir's metrics.jsonl."""
    return [json.loads(line) for line in open(os.path.join(model_dir, "metrics.jsonl")) if '"eval"' in line][-1]


def _eval_ap(trained, tmp_path, name, evaluate):
    """The eval record of `evaluate(folder)` run on a copy of the trained run."""
    import shutil

    copy = tmp_path / name
    shutil.copytree(trained, copy)
    evaluate(copy)
    return _last_eval(copy)


def test_the_same_ap_on_1_device_and_8_devices_on_2_hosts(trained, tmp_path):
    """The checkpoint trained on 1 device evaluated on 2 local hosts x 4 devices (data:8):
    every eval image counted once, the detections gathered to host 0, the same COCO AP.
    (8 devices in one process, once checked here too, run the same gather with one host.)"""
    import subprocess

    from conftest import ROOT, launch_command

    def two_hosts(folder):
        command = launch_command(2, 4, "--gin_file=gin/ssd_tiny.gin", f"--model_dir={folder}", "--mode=eval",
                                 "--mesh=data:8")
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]

    ref = _last_eval(trained)
    got = _eval_ap(trained, tmp_path, "hosts", two_hosts)
    assert got["step"] == ref["step"] and got["coco_images"] == ref["coco_images"] == 128
    for name in ssd_eval.AP_NAMES:
        assert abs(got[name] - ref[name]) <= 1e-6, (name, got[name], ref[name])


def test_spatial_equals_data(tmp_path):
    """The `spatial` preset (image rows over `model`, tfpod's halo exchange; the 2x2 and
    smaller maps run with whole rows): the same losses as the data-parallel run."""
    from conftest import make_run
    from tfpod import optimizers
    from tfpod.controller import TrainConfig

    def losses(name, spec, preset):  # the tiny recipe's model and optimizer (gin/ssd_tiny.gin)
        train = TrainConfig(steps=3, global_batch_size=8, steps_per_loop=3, log_every=3, checkpoint_every=3,
                            synthetic_data=True, seed=1)
        opt = optimizers.OptimizerConfig(name="sgd", learning_rate=0.05, momentum=0.9, warmup_steps=0,
                                         weight_decay=0.0, clip_norm=0)
        run = make_run(ssd.TASK, ssd.SSDConfig(**TINY), train, opt, spec, tmp_path / name, preset=preset)
        return np.array(run.train()["losses"])

    ref = losses("data", "data:8", "data")
    assert_golden_layouts(open(tmp_path / "data" / "layouts.txt").read(), "ssd_data_data8")
    rows = losses("spatial", "data:2,model:4", "spatial")
    assert np.max(np.abs(rows - ref) / np.abs(ref)) < 1e-4, (rows, ref)


def test_another_programs_coco_data_converts_and_trains(tmp_path):
    """COCO images and an instances JSON written by another program (PIL, odd category ids,
    a PNG, a grey JPEG, an image without boxes) converted by the command line, then trained
    and scored by COCOeval against that JSON."""
    import subprocess
    import sys

    from conftest import ROOT
    from test_detection_input import write_coco
    from tfpod.api import run

    images_dir, annotations, _ = write_coco(tmp_path)
    prefix = tmp_path / "data" / "coco"
    convert = subprocess.run([sys.executable, "-m", "tfpod.input.coco", f"--images={images_dir}",
                              f"--annotations={annotations}", f"--output={prefix}", "--num_shards=2"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert convert.returncode == 0, convert.stderr[-2000:]
    model_dir = tmp_path / "run"
    files = f"'{prefix}-*-of-00002.tfrecord'"
    run(["gin/ssd_tiny.gin"], [f"detection_data.train_files={files}", f"detection_data.eval_files={files}",
                               f"detection_data.eval_annotations='{annotations}'", "train.steps=4",
                               "train.steps_per_loop=2", "train.eval_every=4", "train.global_batch_size=8",
                               "detection_data.shuffle_buffer=4", "optimizer.warmup_steps=0",
                               "optimizer.piecewise_boundaries=[2, 3]"], str(model_dir), mode="train_and_eval")
    records = [json.loads(line) for line in open(model_dir / "metrics.jsonl")]
    final = [r for r in records if r["kind"] == "eval"][-1]
    assert final["step"] == 4 and final["num_examples"] == 4 and final["coco_images"] == 4
    assert all(-1.0 <= final[name] <= 1.0 for name in ssd_eval.AP_NAMES), final
