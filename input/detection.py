"""SSD detection input: Model Garden detection TFRecords -> augmented images + SSD targets.

    python -m tfpod.input.detection [--data_dir=DIR] [--force]     (writes the demo set)

Data contract (Model Garden's detection TFRecords, as `python -m tfpod.input.coco`
writes them from COCO data; Model Garden's TfExampleDecoder reads the same): each record
is a `tf.train.Example` with
  image/encoded             bytes   a JPEG or PNG (any size, RGB or grayscale)
  image/source_id           bytes   the COCO image id as a decimal string (eval only)
  image/object/bbox/{ymin,xmin,ymax,xmax}  float  normalized box corners
  image/object/class/label  int64   contiguous labels 1..K (0 is background)
  image/object/is_crowd     int64   optional; crowd boxes are not trained on
  image/object/area         float   optional (eval ground truth; box area otherwise)
and the labels' COCO category ids and names are in PREFIX.labels.json beside the shards
(`label_map`).

One host's pipeline:

    files (this host's part, input.files) -> records -> (train: shuffled) -> decode
    -> train: crowd and zero-size boxes dropped; SSD random crop (`ssd_crop`); resize to
       image_size; random left-right flip (boxes mirrored); photometric jitter
       (brightness x[0.875, 1.125], contrast and saturation x[0.5, 1.5], hue +-0.05,
       in that fixed order: the reference's ColorJitter(0.125, 0.5, 0.5, 0.05), whose
       order is random; TensorFlow's contrast scales about each channel's mean)
       eval: resize to image_size (no crop, flip or jitter)
    -> normalized by the ImageNet mean/stddev (input.images.MEAN_RGB, STDDEV_RGB)
    -> SSD targets of the model's default boxes (input.boxes.encode)
    -> host batches (B = host rows; S = image_size; N = default boxes):
       images         float32 [B, S, S, 3]
       box_targets    float32 [B, N, 4]  (ty, tx, th, tw); zeros where unmatched
       class_targets  int32   [B, N]     0 = background, else the label 1..K
       weights        float32 [B]        1 = a real image (the trainer's eval padding is 0)
    eval batches add (train batches do not carry them):
       source_id      int64   [B]        the COCO image id
       image_height, image_width  int32 [B]  the original image's pixels
       gt_boxes       float32 [B, max_boxes, 4]  normalized corners (ymin, xmin, ymax, xmax)
       gt_classes     int32   [B, max_boxes]     labels 1..K, 0 = no box
       gt_is_crowd    int32   [B, max_boxes]
       gt_area        float32 [B, max_boxes]     pixels
       (an image's first max_boxes boxes, crowd boxes included; its targets come from its
       non-crowd boxes, all of them)

SSD random crop (`ssd_crop`, the MLPerf SSD reference's SSDCropping as Google's TF
MLPerf submission vectorized it, CROP_PASSES = 8 passes): each pass draws one option of seven, uniformly: the
whole image, a minimum IoU of 0.1, 0.3, 0.5, 0.7 or 0.9, or no IoU constraint; and 50
candidate windows with width and height uniform in [0.3, 1] of the image's, width /
height in [0.5, 2], placed uniformly. A candidate is valid when every box overlaps it
at IoU > the minimum and some box's center lies strictly inside it; a pass succeeds on
"whole image" or its first valid candidate. The first of CROP_PASSES passes that
succeeds decides (none: the whole image, as for images without boxes, where the
reference also ends on "whole image"). Boxes whose centers fall outside the window are
dropped; the rest are clipped to it. The window is cut at whole pixels and the boxes are
taken relative to those pixels.

The training stream repeats with static batch shapes (drop_remainder); evaluation reads
its split once (every image on exactly one host) and keeps the short last batch (the
trainer pads it with weight-0 rows), at most `max_eval_examples` images split evenly
over hosts (then score COCO eval on the evaluated source_ids only). Randomness is
stateless: each image's crop, flip and jitter are seeded by (seed, its index in the
stream), so the pipeline is deterministic for a seed and its iterator is checkpointable.

Demo data: input/detection_demo.py (coloured shapes, COCO category ids 3, 17, 42).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import sys
from typing import ClassVar

import numpy as np
import tensorflow as tf

from tfpod import UserError
from tfpod.input import boxes as boxes_lib, coco, detection_demo as demo_set, files as files_lib, records
from tfpod.input.common import (DataConfig, ShardInfo, TaskInput, corrupt_finder, file_identity, first_example,
                                host_shard, stream_source)
from tfpod.input.demo import demo_cli
from tfpod.input.images import MEAN_RGB, STDDEV_RGB

CROP_PASSES = 8  # crop passes tried per image (the reference loops until one succeeds)
CROP_CANDIDATES = 50  # candidate windows per pass (Google's NUM_CROP_PASSES)
# The reference's options: 0 = the whole image, then minimum IoUs; -1: no constraint.
CROP_MIN_IOU = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, -1.0)
BRIGHTNESS, CONTRAST, SATURATION, HUE = 0.125, 0.5, 0.5, 0.05  # ColorJitter(0.125, 0.5, 0.5, 0.05)
SHARD_SUFFIX = re.compile(r"-\d{5}-of-\d{5}\.tfrecord$")
OBJECT_FEATURES = ("image/object/bbox/ymin", "image/object/bbox/xmin", "image/object/bbox/ymax",
                   "image/object/bbox/xmax", "image/object/class/label")


@dataclasses.dataclass(frozen=True)
class DetectionDataConfig(DataConfig):
    """The detection data. Attributes map 1:1 to gin `detection_data.<name>`.

    Attributes:
      train_files: glob(s) of detection TFRecords (comma-separated); None: the shapes
        demo set (prepared on first use).
      eval_files: the same for the eval split.
      eval_annotations: the eval split's COCO instances JSON (COCO eval ground truth);
        None: the demo set's with the demo set, else none (`eval_annotations`).
      label_map: PREFIX.labels.json of the labels' COCO categories; None: the one beside
        the first train file (its name less -NNNNN-of-NNNNN.tfrecord), if there is one.
      max_boxes: ground-truth boxes kept per eval image (gt_* rows).
      random_crop: train with the SSD random crop (else the whole image).
      random_flip: flip training images left-right with probability 1/2.
      photometric: jitter training images' brightness, contrast, saturation and hue.
      shuffle_buffer: records in the training shuffle buffer (0: no shuffling).
      cycle_length: files read at once per host.
      data_dir: where the demo set is prepared (None: see input/detection_demo.py).
    """

    gin_name: ClassVar[str] = "detection_data"

    eval_annotations: str | None = None
    label_map: str | None = None
    max_boxes: int = 100
    random_crop: bool = True
    random_flip: bool = True
    photometric: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.max_boxes < 1:
            raise UserError(f"detection_data.max_boxes={self.max_boxes} must be at least 1 (COCO images have up to 93 "
                            "boxes; 100 is usual)")
        if self.eval_files and not self.train_files:
            raise UserError("detection_data.eval_files is set without detection_data.train_files: set both, or "
                            "neither for the shapes demo set")
        if self.eval_annotations and not self.eval_files:
            raise UserError("detection_data.eval_annotations is set without detection_data.eval_files: set the eval "
                            "records too (the demo set brings its own annotations)")


# ---------------------------------------------------------------------------
# Files, label map, checks


def _splits(cfg: DetectionDataConfig) -> tuple[str, str | None]:
    """(train glob, eval glob or None), preparing the demo set when no files are given."""
    if cfg.train_files:
        return cfg.train_files, cfg.eval_files
    data_dir = demo_set.ensure(cfg.data_dir)
    return demo_set.split_files(data_dir, "train"), demo_set.split_files(data_dir, "val")


def _beside(pattern: str) -> str | None:
    """The label map beside the first file of `pattern`, if the file is a named shard and it exists."""
    first = files_lib.expand(pattern)[0]
    if not SHARD_SUFFIX.search(first):
        return None
    path = coco.label_map_path(SHARD_SUFFIX.sub("", first))
    return path if tf.io.gfile.exists(path) else None


def label_map_path(cfg: DetectionDataConfig) -> str | None:
    """The label map's path: detection_data.label_map, else the one beside the train files, else None."""
    if cfg.label_map:
        if not tf.io.gfile.exists(cfg.label_map):
            raise UserError(f"detection_data.label_map={cfg.label_map} does not exist: give the PREFIX.labels.json "
                            "written by python -m tfpod.input.coco, or None")
        return cfg.label_map
    return _beside(_splits(cfg)[0])


def label_map(cfg: DetectionDataConfig) -> list[dict] | None:
    """The labels' categories [{"label": 1..K, "id": COCO category id, "name": str}], or None
    when there is no label map (the model then cannot check num_classes or name categories)."""
    path = label_map_path(cfg)
    return coco.load_label_map(path) if path else None


def eval_annotations(cfg: DetectionDataConfig) -> str | None:
    """The eval split's COCO instances JSON (for pycocotools): detection_data.eval_annotations,
    the demo set's with the demo set, else None."""
    if cfg.eval_annotations:
        if not tf.io.gfile.exists(cfg.eval_annotations):
            raise UserError(f"detection_data.eval_annotations={cfg.eval_annotations} does not exist: give the eval "
                            "split's COCO instances JSON (e.g. instances_val2017.json), or None")
        return cfg.eval_annotations
    if cfg.train_files:
        return None
    return demo_set.annotations_path(demo_set.ensure(cfg.data_dir), "val")


def check_features(path: str) -> None:
    """The first record of `path` must be a detection record (image/encoded and the object features).

    Raises:
      UserError: naming the file, what is missing and how to write such records.
    """
    feature = first_example(path, "replace it with detection TFRecords (python -m tfpod.input.coco)",
                            "convert the data with python -m tfpod.input.coco").features.feature
    missing = [k for k in ("image/encoded",) + OBJECT_FEATURES if k not in feature]
    if missing:
        raise UserError(f"records in {path} lack {', '.join(missing)} (found: {', '.join(sorted(feature)) or 'none'}): "
                        "they are not detection records; convert COCO data with python -m tfpod.input.coco")
    for k in OBJECT_FEATURES:
        kind = "int64_list" if k.endswith("label") else "float_list"
        if feature[k].WhichOneof("kind") != kind:
            raise UserError(f"records in {path}: feature {k} holds {feature[k].WhichOneof('kind')}, not {kind}: "
                            "convert the data with python -m tfpod.input.coco")


# ---------------------------------------------------------------------------
# Parsing and augmentation

FEATURES = {
    "image/encoded": tf.io.FixedLenFeature([], tf.string),
    "image/source_id": tf.io.FixedLenFeature([], tf.string, default_value=""),
    **{k: tf.io.VarLenFeature(tf.float32) for k in OBJECT_FEATURES[:4]},
    "image/object/class/label": tf.io.VarLenFeature(tf.int64),
    "image/object/is_crowd": tf.io.VarLenFeature(tf.int64),
    "image/object/area": tf.io.VarLenFeature(tf.float32),
}


def parse(record: tf.Tensor, num_classes: int | None) -> dict:
    """A serialized record -> {image uint8 [h, w, 3], boxes float32 [M, 4] corners, labels int32 [M],
    is_crowd int32 [M], area float32 [M] (pixels), source_id string []}; labels checked 1..num_classes."""
    ex = tf.io.parse_single_example(record, FEATURES)
    dense = {k: tf.sparse.to_dense(v) for k, v in ex.items() if isinstance(v, tf.SparseTensor)}
    image = tf.io.decode_image(ex["image/encoded"], channels=3, expand_animations=False)  # uint8 [h, w, 3]
    boxes = tf.stack([dense[k] for k in OBJECT_FEATURES[:4]], axis=-1)  # [M, 4] ymin, xmin, ymax, xmax
    labels = tf.cast(dense["image/object/class/label"], tf.int32)  # [M]
    m = tf.shape(labels)[0]
    checks = [tf.debugging.assert_equal(tf.shape(boxes)[0], m, message=(
        "a record's image/object/bbox/* and image/object/class/label differ in length: convert the data with "
        "python -m tfpod.input.coco")),
        tf.debugging.assert_positive(labels, message=(
            "image/object/class/label holds 0 or less: labels are 1..K (0 is background); convert the data with "
            "python -m tfpod.input.coco"))]
    if num_classes is not None:
        checks.append(tf.debugging.assert_less_equal(labels, num_classes, message=(
            f"image/object/class/label is above {num_classes}, the number of categories in the label map: give the "
            "label map written with these records (detection_data.label_map)")))
    with tf.control_dependencies(checks):
        labels = tf.identity(labels)
    hw = tf.cast(tf.shape(image)[:2], tf.float32)  # [2]
    crowd, area = dense["image/object/is_crowd"], dense["image/object/area"]
    box_area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) * hw[0] * hw[1]  # [M] pixels
    return {
        "image": image, "boxes": boxes, "labels": labels, "source_id": ex["image/source_id"],
        "is_crowd": tf.cond(tf.shape(crowd)[0] == m, lambda: tf.cast(crowd, tf.int32), lambda: tf.zeros_like(labels)),
        "area": tf.cond(tf.shape(area)[0] == m, lambda: area, lambda: box_area),
    }


def _seed(seed: tf.Tensor, k: int) -> tf.Tensor:
    """Sub-seed k of an image's seed int32 [2]."""
    return tf.random.experimental.stateless_fold_in(seed, k)


def ssd_crop(boxes: tf.Tensor, seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """The SSD random crop's window (the module docstring).

    Args:
      boxes: float32 [M, 4] normalized corners (M may be 0).
      seed: int32 [2].

    Returns:
      window: float32 [4] normalized (ymin, xmin, ymax, xmax) ([0, 0, 1, 1]: no crop).
      keep: bool [M], the boxes whose centers lie inside the window.
    """
    p, k = CROP_PASSES, CROP_CANDIDATES
    option = tf.random.stateless_uniform([p], _seed(seed, 0), 0, len(CROP_MIN_IOU), dtype=tf.int32)  # [P]
    min_iou = tf.gather(tf.constant(CROP_MIN_IOU), option)  # [P]
    u = tf.random.stateless_uniform([4, p, k], _seed(seed, 1))  # [4, P, K]
    h, w = 0.3 + 0.7 * u[0], 0.3 + 0.7 * u[1]  # [P, K] each
    top, left = u[2] * (1.0 - h), u[3] * (1.0 - w)
    windows = tf.stack([top, left, top + h, left + w], axis=-1)  # [P, K, 4]
    ious = tf.reshape(boxes_lib.iou(tf.reshape(windows, [-1, 4]), boxes), [p, k, -1])  # [P, K, M]
    cy = 0.5 * (boxes[:, 0] + boxes[:, 2])  # [M]
    cx = 0.5 * (boxes[:, 1] + boxes[:, 3])
    inside = ((cy > top[..., None]) & (cy < (top + h)[..., None]) & (cx > left[..., None])
              & (cx < (left + w)[..., None]))  # [P, K, M]
    aspect = (w / h >= 0.5) & (w / h <= 2.0)  # [P, K]
    valid = (aspect & tf.reduce_all(ious > min_iou[:, None, None], axis=-1)
             & tf.reduce_any(inside, axis=-1))  # [P, K]
    whole = tf.equal(option, 0)  # [P]
    done = whole | tf.reduce_any(valid, axis=-1)  # [P]
    first = tf.argmax(tf.cast(done, tf.int32), output_type=tf.int32)  # first passing pass (0 if none)
    use = done[first] & ~whole[first]
    pick = tf.argmax(tf.cast(valid[first], tf.int32), output_type=tf.int32)  # its first valid candidate
    window = tf.where(use, windows[first, pick], tf.constant([0.0, 0.0, 1.0, 1.0]))  # [4]
    keep = tf.where(use, inside[first, pick], tf.ones_like(cy, tf.bool))  # [M]
    return window, keep


def crop(image: tf.Tensor, boxes: tf.Tensor, labels: tf.Tensor,
         seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """`ssd_crop` applied: (image uint8 [h', w', 3], boxes [M', 4] in the crop, labels [M'])."""
    window, keep = ssd_crop(boxes, seed)
    hw = tf.cast(tf.shape(image)[:2], tf.float32)  # [2]
    y0, x0 = tf.floor(window[0] * hw[0]), tf.floor(window[1] * hw[1])  # pixels
    y1 = tf.maximum(tf.floor(window[2] * hw[0]), y0 + 1.0)
    x1 = tf.maximum(tf.floor(window[3] * hw[1]), x0 + 1.0)
    image = image[tf.cast(y0, tf.int32):tf.cast(y1, tf.int32), tf.cast(x0, tf.int32):tf.cast(x1, tf.int32)]
    lo = tf.stack([y0 / hw[0], x0 / hw[1]] * 2)  # [4] the pixel window, normalized
    span = tf.stack([(y1 - y0) / hw[0], (x1 - x0) / hw[1]] * 2)  # [4]
    boxes = tf.clip_by_value((tf.boolean_mask(boxes, keep) - lo) / span, 0.0, 1.0)  # [M', 4]
    return image, boxes, tf.boolean_mask(labels, keep)


def flip(image: tf.Tensor, boxes: tf.Tensor, seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Left-right flip with probability 1/2: image [S, S, 3], boxes [M, 4] mirrored."""
    do = tf.random.stateless_uniform([], seed) < 0.5
    mirrored = tf.stack([boxes[:, 0], 1.0 - boxes[:, 3], boxes[:, 2], 1.0 - boxes[:, 1]], axis=-1)  # [M, 4]
    return tf.where(do, tf.reverse(image, [1]), image), tf.where(do, mirrored, boxes)


def jitter(image: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    """Photometric jitter of float32 [S, S, 3] in [0, 1] (the module docstring), clipped to [0, 1]."""
    image = image * tf.random.stateless_uniform([], _seed(seed, 0), 1.0 - BRIGHTNESS, 1.0 + BRIGHTNESS)
    image = tf.clip_by_value(image, 0.0, 1.0)
    image = tf.image.stateless_random_contrast(image, 1.0 - CONTRAST, 1.0 + CONTRAST, _seed(seed, 1))
    image = tf.clip_by_value(image, 0.0, 1.0)
    image = tf.image.stateless_random_saturation(image, 1.0 - SATURATION, 1.0 + SATURATION, _seed(seed, 2))
    image = tf.image.stateless_random_hue(image, HUE, _seed(seed, 3))
    return tf.clip_by_value(image, 0.0, 1.0)


def _normalize(image: tf.Tensor) -> tf.Tensor:
    """float [S, S, 3] 0-255 -> float32 with the ImageNet mean and stddev."""
    return (tf.cast(image, tf.float32) - tf.constant(MEAN_RGB)) / tf.constant(STDDEV_RGB)


def _trainable(ex: dict) -> tuple[tf.Tensor, tf.Tensor]:
    """(boxes [M', 4], labels [M']): the non-crowd boxes of positive width and height."""
    b = ex["boxes"]
    keep = (ex["is_crowd"] == 0) & (b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1])  # [M]
    return tf.boolean_mask(b, keep), tf.boolean_mask(ex["labels"], keep)


def train_example(ex: dict, seed: tf.Tensor, cfg: DetectionDataConfig, size: int, defaults: tf.Tensor) -> dict:
    """A parsed record -> augmented {images, box_targets, class_targets, weights} (seed int32 [2])."""
    image = ex["image"]
    boxes, labels = _trainable(ex)
    if cfg.random_crop:
        image, boxes, labels = crop(image, boxes, labels, _seed(seed, 0))
    image = tf.image.resize(image, [size, size], method="bilinear") / 255.0  # float32 [S, S, 3] in [0, 1]
    if cfg.random_flip:
        image, boxes = flip(image, boxes, _seed(seed, 1))
    if cfg.photometric:
        image = jitter(image, _seed(seed, 2))
    box_targets, class_targets = boxes_lib.encode(boxes, labels, defaults)
    return {"images": _normalize(image * 255.0), "box_targets": box_targets, "class_targets": class_targets,
            "weights": tf.constant(1.0)}


def _fit(x: tf.Tensor, rows: int) -> tf.Tensor:
    """The first `rows` rows of x [M, ...], zero-padded to [rows, ...]."""
    x = x[:rows]
    pad = [[0, rows - tf.shape(x)[0]]] + [[0, 0]] * (len(x.shape) - 1)
    return tf.ensure_shape(tf.pad(x, pad), [rows] + x.shape[1:].as_list())


def eval_example(ex: dict, cfg: DetectionDataConfig, size: int, defaults: tf.Tensor) -> dict:
    """A parsed record -> {images, box_targets, class_targets, weights} and the eval keys."""
    image = ex["image"]
    shape = tf.shape(image)
    boxes, labels = _trainable(ex)
    box_targets, class_targets = boxes_lib.encode(boxes, labels, defaults)
    source = ex["source_id"]
    with tf.control_dependencies([tf.debugging.Assert(tf.strings.regex_full_match(source, "[0-9]+"), [
            "image/source_id is not a decimal COCO image id (convert the data with python -m tfpod.input.coco):",
            source])]):
        source_id = tf.strings.to_number(source, tf.int64)
    return {
        "images": _normalize(tf.image.resize(image, [size, size], method="bilinear")),
        "box_targets": box_targets, "class_targets": class_targets, "weights": tf.constant(1.0),
        "source_id": source_id, "image_height": shape[0], "image_width": shape[1],
        "gt_boxes": _fit(ex["boxes"], cfg.max_boxes), "gt_classes": _fit(ex["labels"], cfg.max_boxes),
        "gt_is_crowd": _fit(ex["is_crowd"], cfg.max_boxes), "gt_area": _fit(ex["area"], cfg.max_boxes),
    }


# ---------------------------------------------------------------------------
# The host pipeline


def detection_dataset(cfg: DetectionDataConfig, pattern: str, image_size: int, defaults: np.ndarray, host_rows: int,
                      shard: ShardInfo, seed: int, training: bool, num_classes: int | None = None) -> tf.data.Dataset:
    """This host's dataset of detection batches (the module docstring's contract).

    Args:
      cfg: DetectionDataConfig.
      pattern: file glob(s) of the split.
      image_size: S, the side of the model's square input.
      defaults: float32 [N, 4] default boxes, center form (input.boxes.default_boxes).
      host_rows: rows per host batch (global batch / hosts).
      shard: this host's place.
      seed: file order, shuffling and augmentation.
      training: repeat, shuffle and augment (else one pass, eval keys added).
      num_classes: labels above it are an error (None: unchecked).

    Returns:
      Host batches (evaluation: the last batch may be shorter).
    """
    n = defaults.shape[0]
    plan = host_shard(pattern, shard, seed, what="detection file(s)")
    ds = records.read(plan, seed, training, cfg.cycle_length)
    ds = records.shuffled(ds, cfg.shuffle_buffer, seed) if training else records.host_share(
        ds, cfg.max_eval_examples, shard)

    def element(index, record):
        defaults_t = tf.constant(defaults, tf.float32)  # [N, 4]
        ex = parse(record, num_classes)
        if training:
            image_seed = tf.stack([tf.cast(seed, tf.int32), tf.cast(index, tf.int32)])  # [2]
            out = train_example(ex, image_seed, cfg, image_size, defaults_t)
        else:
            out = eval_example(ex, cfg, image_size, defaults_t)
        out["images"] = tf.ensure_shape(out["images"], [image_size, image_size, 3])
        out["box_targets"] = tf.ensure_shape(out["box_targets"], [n, 4])
        out["class_targets"] = tf.ensure_shape(out["class_targets"], [n])
        return out

    ds = ds.enumerate().map(element, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return records.batched(ds, host_rows, training)


def detection_input(cfg: DetectionDataConfig, image_size: int, defaults: np.ndarray, shard: ShardInfo,
                    seed: int) -> TaskInput:
    """The SSD model's TaskInput: prepares the demo set on first use and checks the records.

    Args:
      cfg: DetectionDataConfig.
      image_size: S, the model's input side.
      defaults: float32 [N, 4] the model's default boxes, center form (input.boxes.default_boxes).
      shard: this host's place.
      seed: the run's seed.

    Returns:
      TaskInput whose train / eval give the module docstring's batches.
    """
    defaults = np.asarray(defaults, np.float32)
    if defaults.ndim != 2 or defaults.shape[1] != 4 or not len(defaults):
        raise ValueError(f"detection_input: defaults must be float [N, 4] center-form boxes, got {defaults.shape}")
    train, evals = _splits(cfg)
    categories = label_map(cfg)
    if evals and categories is not None and not cfg.label_map:
        beside = _beside(evals)
        if beside and coco.load_label_map(beside) != categories:
            raise UserError(f"the eval split's label map {beside} differs from the train split's: convert both "
                            "splits from JSONs with the same categories, or set detection_data.label_map")
    if cfg.eval_annotations:
        eval_annotations(cfg)  # exists
    for pattern in (train, evals):  # features checked before the model is built
        if pattern:
            check_features(files_lib.host_files(pattern, shard.num_shards, shard.index, seed)[0])
    num_classes = len(categories) if categories is not None else None

    def dataset(pattern, training):
        return lambda host_rows: detection_dataset(cfg, pattern, image_size, defaults, host_rows, shard, seed,
                                                   training, num_classes)

    path = label_map_path(cfg)
    source = stream_source(cfg, "detection_data", train, shard, seed, image_size=image_size,
                           default_boxes=[len(defaults), hashlib.sha1(defaults.tobytes()).hexdigest()[:16]],
                           label_map=file_identity(path) if path else None)
    source.pop("detection_data.max_boxes", None)  # eval-only
    return TaskInput(train=dataset(train, True), eval=dataset(evals, False) if evals else None,
                     find_corrupt=corrupt_finder(train, shard, seed), source=source)


def main(argv=None) -> int:
    return demo_cli("python -m tfpod.input.detection", demo_set.__doc__, demo_set.default_data_dir(),
                    lambda data_dir, force: demo_set.prepare(data_dir, force=force), argv)


if __name__ == "__main__":
    sys.exit(main())
