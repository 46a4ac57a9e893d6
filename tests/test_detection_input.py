"""Detection input: default boxes and SSD targets, the COCO converter (checked against Model
Garden's decoder), the shapes demo set, and the SSD pipeline's contract, determinism,
crop and host split. Everything is real: JPEGs and PNGs written with PIL, TFRecords,
Model Garden's TfExampleDecoder."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from conftest import ROOT
from tfpod import UserError
from tfpod.input import boxes, coco, detection, detection_demo
from tfpod.input.common import ShardInfo

# A small SSD layout for 64-pixel images: 4 feature maps, 372 default boxes.
SPEC64 = boxes.DefaultBoxSpec(64, (8, 4, 2, 1), (8, 16, 32, 64), (6, 14, 26, 40, 64), ((2,), (2, 3), (2,), (2,)))
DEFAULTS64 = boxes.default_boxes(SPEC64)


# ---------------------------------------------------------------------------
# Default boxes, IoU, encode / decode


@pytest.mark.unit
def test_mlperf_default_boxes_are_the_references_8732_in_head_order():
    d = boxes.default_boxes(boxes.MLPERF_SPEC)
    assert d.shape == (8732, 4) and d.dtype == np.float32
    assert boxes.boxes_per_location(boxes.MLPERF_SPEC) == (4, 6, 6, 6, 4, 4)
    assert d.min() >= 0.0 and d.max() <= 1.0
    s1, s2 = 21 / 300, np.sqrt(21 * 45) / 300
    c = 0.5 / (300 / 8)
    np.testing.assert_allclose(d[:4], [[c, c, s1, s1], [c, c, s2, s2], [c, c, s1 / np.sqrt(2), s1 * np.sqrt(2)],
                                       [c, c, s1 * np.sqrt(2), s1 / np.sqrt(2)]], rtol=1e-6)
    np.testing.assert_allclose(d[4, :2], [c, 3 * c], rtol=1e-6)  # next column, same row (j varies first)
    np.testing.assert_allclose(d[38 * 4, :2], [3 * c, c], rtol=1e-6)  # next row
    # The last map (1x1, 4 kinds): the wide 2:1 box is clipped to 1, as the reference clamps.
    big = np.sqrt(261 * 315) / 300
    np.testing.assert_allclose(d[-4:], [[0.5, 0.5, 0.87, 0.87], [0.5, 0.5, big, big],
                                        [0.5, 0.5, 0.87 / np.sqrt(2), 1.0], [0.5, 0.5, 1.0, 0.87 / np.sqrt(2)]],
                               rtol=1e-6)
    with pytest.raises(UserError, match="one more scale"):
        boxes.DefaultBoxSpec(300, (38, 19), (8, 16), (21, 45), ((2,), (2,)))


@pytest.mark.unit
def test_iou_of_corner_boxes():
    a = tf.constant([[0.0, 0.0, 0.5, 0.5], [0.0, 0.0, 1.0, 1.0]])
    b = tf.constant([[0.0, 0.0, 0.5, 0.5], [0.25, 0.25, 0.75, 0.75], [0.6, 0.6, 0.9, 0.9], [0.2, 0.2, 0.2, 0.2]])
    np.testing.assert_allclose(boxes.iou(a, b).numpy(), [[1.0, 1 / 7, 0.0, 0.0], [0.25, 0.25, 0.09, 0.0]],
                               rtol=1e-5, atol=1e-7)


@pytest.mark.unit
def test_encode_decode_round_trip_and_mlperf_matching():
    d = boxes.default_boxes(boxes.MLPERF_SPEC)
    gt = np.array([[0.1, 0.1, 0.5, 0.4], [0.55, 0.5, 0.95, 0.9], [0.3, 0.3, 0.315, 0.312]], np.float32)
    box_t, cls_t = (t.numpy() for t in boxes.encode(gt, [4, 2, 7], d))
    assert box_t.shape == (8732, 4) and box_t.dtype == np.float32 and cls_t.dtype == np.int32
    overlaps = boxes.iou(gt, boxes.center_to_corners(d)).numpy()  # [3, 8732]
    by_threshold = (overlaps.max(0) >= 0.5)
    assert cls_t[by_threshold].tolist() == [[4, 2, 7][g] for g in overlaps.argmax(0)[by_threshold]]
    # The tiny box overlaps no default box at 0.5: only its forced best default box takes it.
    assert overlaps[2].max() < 0.5 and np.flatnonzero(cls_t == 7).tolist() == [overlaps[2].argmax()]
    decoded = boxes.decode(tf.constant(box_t), d).numpy()
    for label, box in zip([4, 2, 7], gt):
        np.testing.assert_allclose(decoded[cls_t == label], np.broadcast_to(box, decoded[cls_t == label].shape),
                                   atol=2e-6)
    assert np.all(box_t[cls_t == 0] == 0.0)
    # Batched decode broadcasts over leading axes.
    assert boxes.decode(tf.zeros([2, 3, 8732, 4]), d).shape == (2, 3, 8732, 4)


@pytest.mark.unit
def test_a_shared_best_default_box_goes_to_the_last_ground_truth_and_no_boxes_is_background():
    d = boxes.default_boxes(boxes.MLPERF_SPEC)
    same = np.array([[0.40, 0.40, 0.41, 0.41], [0.401, 0.401, 0.409, 0.409]], np.float32)  # one best default box
    _, cls_t = boxes.encode(same, [1, 2], d)
    assert np.flatnonzero(cls_t.numpy()).size == 1 and int(tf.reduce_max(cls_t)) == 2
    box_t, cls_t = boxes.encode(tf.zeros([0, 4]), tf.zeros([0], tf.int32), d)
    assert not np.any(cls_t.numpy()) and not np.any(box_t.numpy())


@pytest.mark.unit
def test_encode_runs_inside_tf_data():
    ds = tf.data.Dataset.from_tensor_slices(tf.constant([[[0.1, 0.1, 0.6, 0.6]], [[0.2, 0.3, 0.9, 0.5]]]))
    ds = ds.map(lambda b: boxes.encode(b, tf.constant([1]), DEFAULTS64))
    assert [int((c > 0).numpy().sum()) > 0 for _, c in ds] == [True, True]


# ---------------------------------------------------------------------------
# The COCO converter


def write_coco(root, categories=((7, "cat"), (300, "dog"), (12, "bird"))):
    """Another program's COCO data: odd category ids, a JPEG, a grey JPEG, a PNG, an image
    without boxes, a crowd box, a box overhanging the edge by rounding, a zero-size box."""
    images_dir = root / "imgs"
    images_dir.mkdir()
    rng = np.random.default_rng(1)
    specs = [(11, "a.jpg", 40, 60, "JPEG", "RGB"), (5, "b.png", 30, 50, "PNG", "RGB"),
             (900, "c.jpg", 32, 32, "JPEG", "L"), (42, "d.jpg", 24, 20, "JPEG", "RGB")]
    images = []
    for image_id, name, h, w, fmt, mode in specs:
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels).convert(mode).save(images_dir / name, fmt)
        images.append({"id": image_id, "file_name": name, "height": h, "width": w})
    annotations = [
        {"id": 1, "image_id": 11, "category_id": 300, "bbox": [6.0, 4.0, 30.0, 20.0], "area": 500.0, "iscrowd": 0},
        {"id": 2, "image_id": 11, "category_id": 7, "bbox": [30.0, 20.0, 30.4, 20.0], "area": 300.0, "iscrowd": 1},
        {"id": 3, "image_id": 5, "category_id": 12, "bbox": [0.0, 0.0, 50.0, 30.0], "area": 1500.0, "iscrowd": 0},
        {"id": 4, "image_id": 5, "category_id": 7, "bbox": [10.0, 10.0, 0.0, 5.0], "area": 0.0, "iscrowd": 0},
        {"id": 5, "image_id": 900, "category_id": 7, "bbox": [8.0, 8.0, 16.0, 8.0], "iscrowd": 0},
    ]
    data = {"images": images, "annotations": annotations,
            "categories": [{"id": i, "name": n, "supercategory": "x"} for i, n in categories]}
    path = root / "instances.json"
    path.write_text(json.dumps(data))
    return images_dir, path, data


@pytest.mark.unit
def test_converter_writes_records_model_gardens_decoder_reads(tmp_path):
    from official.vision.dataloaders.tf_example_decoder import TfExampleDecoder

    images_dir, path, _ = write_coco(tmp_path)
    prefix = str(tmp_path / "out" / "odd")
    summary = coco.convert(str(images_dir), str(path), prefix, num_shards=2)
    assert summary["images"] == 4 and summary["boxes"] == 4 and summary["images_without_boxes"] == 1
    assert summary["skipped_empty_boxes"] == 1 and summary["categories"] == 3
    assert sorted(os.listdir(tmp_path / "out")) == ["odd-00000-of-00002.tfrecord", "odd-00001-of-00002.tfrecord",
                                                    "odd.labels.json"]
    # Labels are contiguous in the order of category id: 7 -> 1, 12 -> 2, 300 -> 3.
    assert coco.load_label_map(prefix + ".labels.json") == [
        {"label": 1, "id": 7, "name": "cat"}, {"label": 2, "id": 12, "name": "bird"},
        {"label": 3, "id": 300, "name": "dog"}]

    decoder = TfExampleDecoder()
    decoded = {}
    for shard in (0, 1):
        for record in tf.data.TFRecordDataset(coco.shard_path(prefix, shard, 2)):
            out = decoder.decode(record)
            decoded[int(out["source_id"].numpy())] = (shard, out)
    assert {k: v[0] for k, v in decoded.items()} == {11: 0, 5: 1, 900: 0, 42: 1}  # round-robin in JSON order
    a = decoded[11][1]
    np.testing.assert_allclose(a["groundtruth_boxes"].numpy(), [[4 / 40, 6 / 60, 24 / 40, 36 / 60],
                                                                [20 / 40, 30 / 60, 1.0, 1.0]], rtol=1e-6)
    assert a["groundtruth_classes"].numpy().tolist() == [3, 1]
    assert a["groundtruth_is_crowd"].numpy().tolist() == [False, True]
    assert a["groundtruth_area"].numpy().tolist() == [500.0, 300.0]
    assert (int(a["height"]), int(a["width"]), a["image"].shape) == (40, 60, (40, 60, 3))
    with open(images_dir / "a.jpg", "rb") as f:  # JPEG bytes kept as they are
        first = next(iter(tf.data.TFRecordDataset(coco.shard_path(prefix, 0, 2))))
        assert tf.io.parse_single_example(first, {"image/encoded": tf.io.FixedLenFeature([], tf.string)})[
            "image/encoded"].numpy() == f.read()
    png = decoded[5][1]  # re-encoded to JPEG; the zero-size box skipped
    assert png["image"].shape == (30, 50, 3) and png["groundtruth_classes"].numpy().tolist() == [2]
    np.testing.assert_allclose(decoded[900][1]["groundtruth_area"].numpy(), [128.0])  # w * h when area is absent
    assert decoded[900][1]["image"].shape == (32, 32, 3)  # grey JPEG decoded as RGB
    assert decoded[42][1]["groundtruth_boxes"].shape == (0, 4)  # kept without boxes


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


@pytest.mark.unit
@pytest.mark.parametrize("breakage, needle", [
    ("no_images_dir", r"images folder .*missing does not exist: pass --images"),
    ("missing_file", r"image file b.png \(image id 5 in .*\) is not in .*: pass the right --images"),
    ("no_categories", r"has no 'categories' list: give a COCO instances JSON"),
    ("unknown_category", r"annotation 3 of image 5 \(b.png\) in .* has category_id 13, which is not in the JSON's "
                         r"categories \(ids \[7, 12, 300\]\): fix the annotation"),
    ("box_outside", r"annotation 1 of image 11 \(a.jpg\) in .*: bbox \[50.0, 4.0, 30.0, 20.0\] .* lies outside the "
                    r"60x40 image: fix the box"),
    ("not_json", r"is not JSON .*: give a COCO instances JSON"),
    ("unknown_image", r"annotation 1 in .* names image_id 77, which is not in its images"),
    ("wrong_size", r"image file .*a.jpg is 60x40 pixels but .* says height 41 \(image id 11\)"),
    ("too_many_shards", r"--num_shards=5 is more than the 4 images of .*: use at most 4 shards"),
])
def test_bad_coco_input_is_one_clear_line(tmp_path, breakage, needle):
    images_dir, path, data = write_coco(tmp_path)
    if breakage == "no_images_dir":
        images_dir = tmp_path / "missing"
    elif breakage == "missing_file":
        os.remove(images_dir / "b.png")
    elif breakage == "no_categories":
        del data["categories"]
    elif breakage == "unknown_category":
        data["annotations"][2]["category_id"] = 13
    elif breakage == "box_outside":
        data["annotations"][0]["bbox"][0] = 50.0
    elif breakage == "unknown_image":
        data["annotations"][0]["image_id"] = 77
    elif breakage == "wrong_size":
        data["images"][0]["height"] = 41
    path.write_text("{not json" if breakage == "not_json" else json.dumps(data))
    with pytest.raises(UserError) as e:
        coco.convert(str(images_dir), str(path), str(tmp_path / "out" / "x"), 5 if breakage == "too_many_shards" else 1)
    assert re.search(needle, _one_line(e)), _one_line(e)
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")  # nothing half-written


def test_coco_command_line_converts_and_fails_with_one_line(tmp_path, capsys):
    images_dir, path, _ = write_coco(tmp_path)
    command = [sys.executable, "-m", "tfpod.input.coco", f"--images={images_dir}", f"--annotations={path}"]
    done = subprocess.run(command + [f"--output={tmp_path / 'cli' / 'c'}", "--num_shards=3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["images"] == 4
    assert "coco: wrote 4 images" in done.stderr
    assert len(tf.io.gfile.glob(str(tmp_path / "cli" / "c-*-of-00003.tfrecord"))) == 3
    capsys.readouterr()
    assert coco.main([f"--images={images_dir}", f"--annotations={path}", f"--output={tmp_path / 'cli' / 'c'}",
                      "--num_shards=2"]) == 1  # in this process: the same main
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"error: output {tmp_path / 'cli' / 'c'} already has shards of another count")


# ---------------------------------------------------------------------------
# The demo set and the pipeline


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return detection_demo.ensure(str(tmp_path_factory.mktemp("data") / "detection-shapes64"))


def demo_config(demo_dir, **kw):
    return detection.DetectionDataConfig(data_dir=demo_dir, **kw)


@pytest.mark.unit
def test_demo_set_is_coco_data_converted(demo_dir, capsys):
    with open(os.path.join(demo_dir, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["train_images"] == 1024 and manifest["val_images"] == 128
    with open(detection_demo.annotations_path(demo_dir, "val")) as f:
        val = json.load(f)
    assert [c["id"] for c in val["categories"]] == [3, 17, 42]
    per_image = np.bincount([a["image_id"] - 100001 for a in val["annotations"]], minlength=128)
    assert per_image.min() >= 1 and per_image.max() <= 4 and len(set(per_image)) > 2
    assert len(tf.io.gfile.glob(detection_demo.split_files(demo_dir, "train"))) == 8
    assert len(tf.io.gfile.glob(detection_demo.split_files(demo_dir, "val"))) == 2
    cfg = demo_config(demo_dir)
    assert detection.label_map(cfg) == [{"label": 1, "id": 3, "name": "rectangle"},
                                        {"label": 2, "id": 17, "name": "ellipse"},
                                        {"label": 3, "id": 42, "name": "triangle"}]
    assert detection.eval_annotations(cfg) == detection_demo.annotations_path(demo_dir, "val")
    # The pixels of a box are its category's colour (red rectangles, green ellipses, blue triangles).
    first = val["annotations"][0]
    image = np.asarray(Image.open(os.path.join(demo_dir, "val", f"{first['image_id']:012d}.jpg")), np.float32)
    x, y, w, h = (int(v) for v in first["bbox"])
    centre = image[y + h // 2 - 1:y + h // 2 + 2, x + w // 2 - 1:x + w // 2 + 2].mean((0, 1))
    assert int(np.argmax(centre)) == {3: 0, 17: 1, 42: 2}[first["category_id"]]
    assert detection.main(["--data_dir", demo_dir]) == 0  # the command line: cached, prints the manifest
    assert json.loads(capsys.readouterr().out)["data_dir"] == demo_dir


def test_pipeline_batches_follow_the_contract_and_are_deterministic(demo_dir):
    task_input = detection.detection_input(demo_config(demo_dir, shuffle_buffer=64), 64, DEFAULTS64, ShardInfo(0, 1),
                                           seed=5)
    train = next(iter(task_input.train(8)))
    n = len(DEFAULTS64)
    assert {k: (v.dtype.name, tuple(v.shape)) for k, v in train.items()} == {
        "images": ("float32", (8, 64, 64, 3)), "box_targets": ("float32", (8, n, 4)),
        "class_targets": ("int32", (8, n)), "weights": ("float32", (8,))}
    assert np.all(train["weights"].numpy() == 1.0) and abs(float(train["images"].numpy().mean())) < 3.0
    assert set(np.unique(train["class_targets"].numpy())) <= {0, 1, 2, 3}
    assert np.all((train["class_targets"].numpy() > 0).sum(1) >= 1)  # every image keeps a box through the crop
    again = next(iter(detection.detection_input(demo_config(demo_dir, shuffle_buffer=64), 64, DEFAULTS64,
                                                ShardInfo(0, 1), seed=5).train(8)))
    for k in train:
        np.testing.assert_array_equal(again[k].numpy(), train[k].numpy())
    other = next(iter(detection.detection_input(demo_config(demo_dir, shuffle_buffer=64), 64, DEFAULTS64,
                                                ShardInfo(0, 1), seed=6).train(8)))
    assert not np.array_equal(other["images"].numpy(), train["images"].numpy())

    evals = list(task_input.eval(48))
    assert [int(b["weights"].shape[0]) for b in evals] == [48, 48, 32]  # one pass, short last batch kept
    b = evals[0]
    assert {k: (v.dtype.name, tuple(v.shape)) for k, v in b.items() if k not in train} == {
        "source_id": ("int64", (48,)), "image_height": ("int32", (48,)), "image_width": ("int32", (48,)),
        "gt_boxes": ("float32", (48, 100, 4)), "gt_classes": ("int32", (48, 100)),
        "gt_is_crowd": ("int32", (48, 100)), "gt_area": ("float32", (48, 100))}
    ids = np.concatenate([e["source_id"].numpy() for e in evals])
    assert sorted(ids) == list(range(100001, 100129))
    assert np.all(b["image_height"].numpy() == 64) and np.all(b["image_width"].numpy() == 64)


@pytest.mark.unit
def test_targets_decode_back_to_the_ground_truth_without_augmentation(demo_dir):
    cfg = demo_config(demo_dir, random_crop=False, random_flip=False, photometric=False, shuffle_buffer=0)
    task_input = detection.detection_input(cfg, 64, DEFAULTS64, ShardInfo(0, 1), seed=0)
    b = next(iter(task_input.eval(16)))
    decoded = boxes.decode(b["box_targets"], DEFAULTS64).numpy()  # [16, N, 4]
    cls_t, gt_boxes, gt_classes = b["class_targets"].numpy(), b["gt_boxes"].numpy(), b["gt_classes"].numpy()
    with open(detection_demo.annotations_path(demo_dir, "val")) as f:
        val = json.load(f)
    for row in range(16):
        real = gt_classes[row] > 0
        image_id = int(b["source_id"][row])
        coco_boxes = [a["bbox"] for a in val["annotations"] if a["image_id"] == image_id]
        assert real.sum() == len(coco_boxes)
        np.testing.assert_allclose(gt_boxes[row][real], [[y / 64, x / 64, (y + h) / 64, (x + w) / 64]
                                                         for x, y, w, h in coco_boxes], rtol=1e-6)
        taken = set()
        for k in np.flatnonzero(cls_t[row]):  # every matched default box decodes to a box of its class
            distance = np.abs(gt_boxes[row][real] - decoded[row, k]).max(1)
            assert distance.min() < 1e-5 and gt_classes[row][real][distance.argmin()] == cls_t[row, k]
            taken.add(int(distance.argmin()))
        # Every box has a default box (the forced match), unless a later box took its only one.
        best = boxes.iou(gt_boxes[row][real], boxes.center_to_corners(DEFAULTS64)).numpy().argmax(1)  # [M]
        for g in set(range(len(coco_boxes))) - taken:
            assert best[g] in best[g + 1:], (image_id, g)
    # Training without augmentation gives an image the same pixels and targets as evaluation.
    evals = list(task_input.eval(128))[0]
    train = next(iter(detection.detection_dataset(cfg, detection_demo.split_files(demo_dir, "val"), 64, DEFAULTS64,
                                                  4, ShardInfo(0, 1), 0, training=True)))
    for row in range(4):
        gap = np.abs(evals["images"].numpy() - train["images"].numpy()[row]).max((1, 2, 3))  # [128]
        assert gap.min() < 1e-4
        np.testing.assert_array_equal(evals["class_targets"].numpy()[gap.argmin()], train["class_targets"][row])
        np.testing.assert_allclose(evals["box_targets"].numpy()[gap.argmin()], train["box_targets"][row], atol=1e-5)


@pytest.mark.unit
def test_ssd_crop_keeps_boxes_on_their_pixels():
    """A red rectangle on black: after any crop its returned box still frames red pixels."""
    image = np.zeros((120, 160, 3), np.uint8)
    image[30:90, 40:100, 0] = 255  # rows 30-89, columns 40-99
    box = tf.constant([[30 / 120, 40 / 160, 90 / 120, 100 / 160]])
    cropped_any = 0
    for s in range(24):
        crop, out, labels = detection.crop(tf.constant(image), box, tf.constant([1]), tf.constant([s, 7]))
        crop, out = crop.numpy(), out.numpy()
        if crop.shape[:2] != (120, 160):
            cropped_any += 1
        assert labels.numpy().tolist() == [1] and out.min() >= 0.0 and out.max() <= 1.0  # centre always inside
        h, w = crop.shape[:2]
        y0, x0, y1, x1 = np.round(out[0] * [h, w, h, w]).astype(int)
        red = np.argwhere(crop[..., 0] > 0)
        assert (red.min(0).tolist(), (red.max(0) + 1).tolist()) == ([y0, x0], [y1, x1])
    assert cropped_any > 10
    window, keep = detection.ssd_crop(tf.zeros([0, 4]), tf.constant([1, 2]))  # no boxes: the whole image
    assert window.numpy().tolist() == [0.0, 0.0, 1.0, 1.0] and keep.shape == (0,)


@pytest.mark.unit
def test_flip_mirrors_boxes_with_the_image():
    image = np.zeros((8, 8, 3), np.float32)
    image[1:3, 0:2] = 1.0
    box = tf.constant([[1 / 8, 0.0, 3 / 8, 2 / 8]])
    flips = 0
    for s in range(8):
        out, b = detection.flip(tf.constant(image), box, tf.constant([s, 0]))
        ones = np.argwhere(out.numpy()[..., 0] > 0)
        np.testing.assert_allclose(b.numpy()[0] * 8, [ones[:, 0].min(), ones[:, 1].min(), ones[:, 0].max() + 1,
                                                      ones[:, 1].max() + 1])
        flips += ones[:, 1].min() == 6
    assert 0 < flips < 8


@pytest.mark.unit
@pytest.mark.parametrize("eval_files", ["both", "one"])
def test_two_hosts_read_every_eval_image_once(demo_dir, tmp_path, eval_files):
    pattern = detection_demo.split_files(demo_dir, "val")
    if eval_files == "one":  # fewer files than hosts: every host keeps every 2nd record
        pattern = tf.io.gfile.glob(pattern)[0]
    cfg = detection.DetectionDataConfig(train_files=detection_demo.split_files(demo_dir, "train"),
                                        eval_files=pattern)
    seen = []
    for host in (0, 1):
        evals = detection.detection_input(cfg, 64, DEFAULTS64, ShardInfo(host, 2), seed=1).eval(32)
        seen.append(np.concatenate([b["source_id"].numpy() for b in evals]))
    assert len(seen[0]) and len(seen[1]) and not set(seen[0]) & set(seen[1])
    everything = {int(tf.io.parse_single_example(r, {"image/source_id": tf.io.FixedLenFeature([], tf.string)})[
        "image/source_id"]) for r in tf.data.TFRecordDataset(tf.io.gfile.glob(pattern))}
    assert sorted(np.concatenate(seen)) == sorted(everything)


@pytest.mark.unit
def test_config_label_map_and_record_checks_are_one_line(demo_dir, tmp_path):
    for kw, needle in [({"max_boxes": 0}, "detection_data.max_boxes=0 must be at least 1"),
                       ({"eval_files": "x"}, "eval_files is set without detection_data.train_files"),
                       ({"max_eval_examples": 0}, "max_eval_examples=0 must be at least 1"),
                       ({"cycle_length": 0}, "detection_data.cycle_length=0 must be at least 1")]:
        with pytest.raises(UserError, match=needle):
            detection.DetectionDataConfig(**kw)
    train = detection_demo.split_files(demo_dir, "train")
    # The label map is found beside the train shards, or given, or absent.
    found = detection.label_map_path(detection.DetectionDataConfig(train_files=train))
    assert found == os.path.join(demo_dir, "shapes-train.labels.json")
    with pytest.raises(UserError, match=r"detection_data.label_map=.*nope.json does not exist"):
        detection.label_map(detection.DetectionDataConfig(train_files=train, label_map=str(tmp_path / "nope.json")))
    lonely = tmp_path / "mine.tfrecord"
    tf.io.gfile.copy(tf.io.gfile.glob(train)[0], str(lonely))
    assert detection.label_map(detection.DetectionDataConfig(train_files=str(lonely))) is None
    bad_map = tmp_path / "bad.labels.json"
    bad_map.write_text(json.dumps({"categories": [{"label": 2, "id": 1, "name": "a"}]}))
    with pytest.raises(UserError, match="has labels \\[2\\], not 1..K in order"):
        coco.load_label_map(str(bad_map))
    # Classification records are refused before a model is built, with the converter named.
    classification = tmp_path / "cls.tfrecord"
    with tf.io.TFRecordWriter(str(classification)) as w:
        w.write(tf.train.Example(features=tf.train.Features(feature={
            "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"x"])),
            "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[1]))})).SerializeToString())
    with pytest.raises(UserError) as e:
        detection.detection_input(detection.DetectionDataConfig(train_files=str(classification)), 64, DEFAULTS64,
                                  ShardInfo(0, 1), 0)
    assert _one_line(e).startswith(f"records in {classification} lack image/object/bbox/ymin") and \
        "python -m tfpod.input.coco" in str(e.value)


@pytest.mark.unit
def test_labels_beyond_the_label_map_stop_the_pipeline(tmp_path):
    images_dir, path, _ = write_coco(tmp_path)
    prefix = str(tmp_path / "odd")
    coco.convert(str(images_dir), str(path), prefix, 1)
    two = tmp_path / "two.labels.json"  # a label map of 2 categories for records with label 3
    two.write_text(json.dumps({"categories": coco.load_label_map(prefix + ".labels.json")[:2]}))
    cfg = detection.DetectionDataConfig(train_files=prefix + "-*", eval_files=prefix + "-*", label_map=str(two))
    task_input = detection.detection_input(cfg, 64, DEFAULTS64, ShardInfo(0, 1), 0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="label is above 2, the number of categories in the label"):
        list(task_input.eval(4))
    # With the right label map, every image (PNG, grey, crowd, none) reads, at its own size.
    cfg = detection.DetectionDataConfig(train_files=prefix + "-*", eval_files=prefix + "-*")
    (b,) = list(detection.detection_input(cfg, 64, DEFAULTS64, ShardInfo(0, 1), 0).eval(4))
    assert b["image_height"].numpy().tolist() == [40, 30, 32, 24]
    assert b["gt_is_crowd"].numpy()[0, :2].tolist() == [0, 1] and b["gt_classes"].numpy()[0, :3].tolist() == [3, 1, 0]
    assert (b["class_targets"].numpy()[0] == 1).sum() == 0  # the crowd box is not a target


@pytest.mark.unit
def test_eval_batches_map_back_to_coco_ground_truth_for_pycocotools(demo_dir):
    """Detections made from the eval batches' gt rows (label -> COCO id through the label map,
    normalized corners -> pixel [x, y, w, h] by the original size) score AP 1.0 against
    the demo set's instances JSON: source_id, sizes and the label map line up."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    cfg = demo_config(demo_dir)
    to_coco = {c["label"]: c["id"] for c in detection.label_map(cfg)}
    detections = []
    for b in detection.detection_input(cfg, 64, DEFAULTS64, ShardInfo(0, 1), 0).eval(64):
        b = {k: v.numpy() for k, v in b.items()}
        for row in range(len(b["weights"])):
            h, w = b["image_height"][row], b["image_width"][row]
            for (ymin, xmin, ymax, xmax), label in zip(b["gt_boxes"][row], b["gt_classes"][row]):
                if label:
                    detections.append({"image_id": int(b["source_id"][row]), "category_id": to_coco[int(label)],
                                       "bbox": [xmin * w, ymin * h, (xmax - xmin) * w, (ymax - ymin) * h],
                                       "score": 1.0})
    truth = COCO(detection.eval_annotations(cfg))
    evaluation = COCOeval(truth, truth.loadRes(detections), "bbox")
    evaluation.evaluate()
    evaluation.accumulate()
    evaluation.summarize()
    assert evaluation.stats[0] == pytest.approx(1.0)
