"""Image classification input: ImageNet-format TFRecords -> decoded, augmented host batches.

    python -m tfpod.input.images [--data_dir=DIR] [--force]     (writes the demo set)

Data contract (the ImageNet TFRecord format of Model Garden's and MLPerf's converters):
each record is a `tf.train.Example` with
  image/encoded      bytes   a JPEG (any size, RGB or grayscale)
  image/class/label  int64   the class; `image_data.label_offset` is subtracted, so the
                             model sees 0-based labels (Model Garden's ImageNet conversion
                             writes 1..1000 with 0 for "background": use label_offset=1)
  image/format, image/height, image/width are written by `prepare` and not read.

One host's pipeline:

    files (this host's part, input.files) -> records -> (train: shuffled) -> decode JPEG
    -> train: random-resized crop (sample_distorted_bounding_box, decoded with
       decode_and_crop_jpeg), random left-right flip, resize to image_size
       eval: central crop of eval_crop_fraction of the shorter side, resize
    -> normalized by the ImageNet mean/stddev (Model Garden's MEAN_RGB, STDDEV_RGB)
    -> host batches {images float32 [host_rows, H, W, 3], labels int32 [host_rows],
       weights float32 [host_rows] (1: a real image)}

The training stream repeats with static batch shapes (drop_remainder); evaluation reads
its split once and keeps the short last batch (the trainer pads it with weight-0 rows).
Randomness is stateless: each record's crop and flip are seeded by (seed, its index in
the stream), so the pipeline is deterministic for a seed and its iterator, which holds
no Python state, is checkpointable.

Demo data: `prepare` writes scikit-learn's digits (1797 8x8 grayscale images of 0-9,
bundled with scikit-learn, which tf-models-official already installs), upscaled to
32x32 RGB and JPEG-encoded, every 5th image in the eval split (360 images, 2 shards)
and the rest in train (1437 images, 8 shards). It is cached in
`$TFPOD_DATA_DIR/images-digits32` (else `~/.cache/tfpod/images-digits32`), prepared
once under a lock into a temporary folder renamed into place when complete.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from typing import ClassVar

import tensorflow as tf

from tfpod import UserError
from tfpod.input import records
from tfpod.input.common import DataConfig, ShardInfo, TaskInput, corrupt_finder, host_shard, stream_source
from tfpod.input.demo import data_root, demo_cli, ensure_prepared, staged

log = logging.getLogger("tfpod")

DEMO_SIZE = 32  # pixels per side of the demo JPEGs
TRAIN_SHARDS, EVAL_SHARDS = 8, 2
EVAL_EVERY = 5  # every 5th digit goes to the eval split
MANIFEST = "manifest.json"
# Model Garden's ImageNet normalization (official.vision.ops.preprocess_ops), on 0-255 pixels.
MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STDDEV_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)


@dataclasses.dataclass(frozen=True)
class ImageDataConfig(DataConfig):
    """The image data. Attributes map 1:1 to gin `image_data.<name>`.

    Attributes:
      train_files: glob(s) of ImageNet-format TFRecords (comma-separated); None: the
        digits demo set (prepared on first use).
      eval_files: the same for the eval split.
      label_offset: subtracted from `image/class/label` (1 for 1-based ImageNet labels).
      area_range: random-resized crop: the crop's fraction of the image area (MLPerf: 0.08-1).
      aspect_ratio_range: random-resized crop: width / height of the crop (MLPerf: 3/4-4/3).
      random_flip: flip training images left-right with probability 1/2.
      eval_crop_fraction: eval: the central crop's side as a fraction of the shorter
        side (MLPerf: 224 / (224 + 32) = 0.875).
      shuffle_buffer: records in the training shuffle buffer (0: no shuffling).
      cycle_length: files read at once per host.
      data_dir: where the demo set is prepared (None: see the module docstring).
    """

    gin_name: ClassVar[str] = "image_data"

    label_offset: int = 0
    area_range: tuple = (0.08, 1.0)
    aspect_ratio_range: tuple = (3.0 / 4.0, 4.0 / 3.0)
    random_flip: bool = True
    eval_crop_fraction: float = 0.875

    def __post_init__(self):
        super().__post_init__()
        lo, hi = self.area_range
        if not 0.0 < lo <= hi <= 1.0:
            raise UserError(f"image_data.area_range={tuple(self.area_range)}: use (low, high) with 0 < low <= high <= 1")
        lo, hi = self.aspect_ratio_range
        if not 0.0 < lo <= hi:
            raise UserError(f"image_data.aspect_ratio_range={tuple(self.aspect_ratio_range)}: use (low, high) with 0 < low <= high")
        if not 0.0 < self.eval_crop_fraction <= 1.0:
            raise UserError(f"image_data.eval_crop_fraction={self.eval_crop_fraction} must be in (0, 1]")
        if self.eval_files and not self.train_files:
            raise UserError("image_data.eval_files is set without image_data.train_files: set both, or neither "
                            "for the digits demo set")


# ---------------------------------------------------------------------------
# The demo set


def default_data_dir() -> str:
    return os.path.join(data_root(), f"images-digits{DEMO_SIZE}")


def split_paths(data_dir: str, split: str) -> str:
    """The glob pattern of a demo split's shards."""
    return os.path.join(data_dir, f"digits-{split}-*.tfrecord")


def image_example(jpeg: bytes, label: int, height: int, width: int) -> tf.train.Example:
    """One record in the ImageNet TFRecord format."""
    def b(v):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[v]))

    def i(v):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[v]))

    return tf.train.Example(features=tf.train.Features(feature={
        "image/encoded": b(jpeg), "image/format": b(b"jpeg"), "image/class/label": i(label),
        "image/height": i(height), "image/width": i(width),
    }))


def prepare(data_dir: str, force: bool = False) -> dict:
    """Writes the digits demo set into data_dir (atomically); returns its manifest."""
    manifest_path = os.path.join(data_dir, MANIFEST)
    if os.path.exists(manifest_path) and not force:
        with open(manifest_path) as f:
            return json.load(f)
    from sklearn.datasets import load_digits

    digits = load_digits()  # images float [1797, 8, 8] in 0..16, target int [1797]
    pixels = tf.constant(digits.images[..., None] * (255.0 / 16.0), tf.float32)  # [n, 8, 8, 1]
    big = tf.image.resize(pixels, [DEMO_SIZE, DEMO_SIZE], method="bicubic")  # [n, 32, 32, 1]
    rgb = tf.cast(tf.clip_by_value(tf.round(tf.tile(big, [1, 1, 1, 3])), 0, 255), tf.uint8)  # [n, 32, 32, 3]
    with staged(data_dir, ".images-") as tmp:
        counts = {"train": 0, "eval": 0}
        writers = {split: [tf.io.TFRecordWriter(os.path.join(tmp, f"digits-{split}-{i:05d}-of-{n:05d}.tfrecord"))
                           for i in range(n)] for split, n in (("train", TRAIN_SHARDS), ("eval", EVAL_SHARDS))}
        try:
            for k in range(rgb.shape[0]):
                split = "eval" if k % EVAL_EVERY == 0 else "train"
                jpeg = tf.io.encode_jpeg(rgb[k], quality=95).numpy()
                example = image_example(jpeg, int(digits.target[k]), DEMO_SIZE, DEMO_SIZE)
                shards = writers[split]
                shards[counts[split] % len(shards)].write(example.SerializeToString())
                counts[split] += 1
        finally:
            for shards in writers.values():
                for w in shards:
                    w.close()
        manifest = {"source": "sklearn.datasets.load_digits", "image_size": DEMO_SIZE, "num_classes": 10,
                    "label_base": 0, "train_images": counts["train"], "eval_images": counts["eval"],
                    "train_shards": TRAIN_SHARDS, "eval_shards": EVAL_SHARDS}
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
    log.info("prepared the digits demo set: %d train and %d eval images -> %s", counts["train"], counts["eval"], data_dir)
    return manifest


def ensure(data_dir: str | None = None) -> str:
    """The demo set's folder, preparing it first if needed (cached, process-safe)."""
    data_dir = data_dir or default_data_dir()
    return ensure_prepared(data_dir, os.path.exists(os.path.join(data_dir, MANIFEST)), prepare)


# ---------------------------------------------------------------------------
# The host pipeline

FEATURES = {
    "image/encoded": tf.io.FixedLenFeature([], tf.string),
    "image/class/label": tf.io.FixedLenFeature([], tf.int64),
}


def _normalize(image: tf.Tensor) -> tf.Tensor:
    """uint8/float [H, W, 3] 0-255 -> float32 with the ImageNet mean and stddev."""
    return (tf.cast(image, tf.float32) - tf.constant(MEAN_RGB)) / tf.constant(STDDEV_RGB)


def train_image(jpeg: tf.Tensor, seed: tf.Tensor, cfg: ImageDataConfig, size: int) -> tf.Tensor:
    """Random-resized crop and flip: JPEG bytes -> float32 [size, size, 3].

    Args:
      jpeg: scalar tf.string.
      seed: int32 [2], the stateless seed of this image.
    """
    shape = tf.image.extract_jpeg_shape(jpeg)  # [height, width, channels]
    begin, crop_size, _ = tf.image.stateless_sample_distorted_bounding_box(
        shape, bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), seed=seed, min_object_covered=0.1,
        aspect_ratio_range=tuple(cfg.aspect_ratio_range), area_range=tuple(cfg.area_range), max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    window = tf.stack([begin[0], begin[1], crop_size[0], crop_size[1]])  # y, x, height, width
    image = tf.io.decode_and_crop_jpeg(jpeg, window, channels=3)  # uint8 [h, w, 3]
    image = tf.image.resize(image, [size, size], method="bilinear")  # float32 [size, size, 3]
    if cfg.random_flip:
        image = tf.image.stateless_random_flip_left_right(image, seed=seed[::-1])
    return _normalize(image)


def eval_image(jpeg: tf.Tensor, cfg: ImageDataConfig, size: int) -> tf.Tensor:
    """Central crop of eval_crop_fraction of the shorter side, resized: float32 [size, size, 3]."""
    shape = tf.image.extract_jpeg_shape(jpeg)
    height, width = shape[0], shape[1]
    side = tf.cast(tf.cast(tf.minimum(height, width), tf.float32) * cfg.eval_crop_fraction, tf.int32)
    side = tf.maximum(side, 1)
    window = tf.stack([(height - side + 1) // 2, (width - side + 1) // 2, side, side])
    image = tf.io.decode_and_crop_jpeg(jpeg, window, channels=3)
    return _normalize(tf.image.resize(image, [size, size], method="bilinear"))


def image_dataset(cfg: ImageDataConfig, pattern: str, image_size: int, num_classes: int, host_rows: int,
                  shard: ShardInfo, seed: int, training: bool) -> tf.data.Dataset:
    """This host's dataset of image batches {images, labels, weights}.

    Args:
      cfg: ImageDataConfig.
      pattern: file glob(s) of the split.
      image_size: side of the model's square input.
      num_classes: labels (after label_offset) must be in [0, num_classes).
      host_rows: rows per host batch (global batch / hosts).
      shard: this host's place.
      seed: file order, shuffling and augmentation.
      training: repeat, shuffle and augment (else one pass, central crops).

    Returns:
      Host batches: images float32 [host_rows, image_size, image_size, 3], labels int32
      [host_rows], weights float32 [host_rows] (evaluation: the last batch may be shorter).
    """
    plan = host_shard(pattern, shard, seed, what="image file(s)")
    ds = records.read(plan, seed, training, cfg.cycle_length)
    if training:
        ds = records.shuffled(ds, cfg.shuffle_buffer, seed)
    offset = cfg.label_offset

    def parse(index, record):
        ex = tf.io.parse_single_example(record, FEATURES)
        label = tf.cast(ex["image/class/label"], tf.int32) - offset
        checks = [
            tf.debugging.assert_less(label, num_classes, message=(
                f"image/class/label - image_data.label_offset ({offset}) >= num_classes ({num_classes}): set "
                "image_data.label_offset (1 for 1-based ImageNet labels) or the model's num_classes")),
            tf.debugging.assert_non_negative(label, message=(
                f"image/class/label - image_data.label_offset ({offset}) < 0: lower image_data.label_offset")),
        ]
        with tf.control_dependencies(checks):
            label = tf.identity(label)
        if training:
            image_seed = tf.stack([tf.cast(seed, tf.int32), tf.cast(index, tf.int32)])  # [2]
            image = train_image(ex["image/encoded"], image_seed, cfg, image_size)
        else:
            image = eval_image(ex["image/encoded"], cfg, image_size)
        return {"images": image, "labels": label, "weights": tf.constant(1.0)}

    ds = ds.enumerate().map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    if not training:
        ds = records.host_share(ds, cfg.max_eval_examples, shard)
    return records.batched(ds, host_rows, training)


def image_input(cfg: ImageDataConfig, model_config, shard: ShardInfo, seed: int) -> TaskInput:
    """The image classifier's TaskInput: prepares the digits demo set on first use."""

    if cfg.train_files:
        train, evals = cfg.train_files, cfg.eval_files
    else:
        data_dir = ensure(cfg.data_dir)
        train, evals = split_paths(data_dir, "train"), split_paths(data_dir, "eval")

    def dataset(pattern, training):
        return lambda host_rows: image_dataset(cfg, pattern, model_config.image_size, model_config.num_classes,
                                               host_rows, shard, seed, training)

    return TaskInput(
        train=dataset(train, True),
        eval=dataset(evals, False) if evals else None,
        find_corrupt=corrupt_finder(train, shard, seed),
        source=stream_source(cfg, "image_data", train, shard, seed, image_size=model_config.image_size,
                             num_classes=model_config.num_classes),
    )


def main(argv=None) -> int:
    return demo_cli("python -m tfpod.input.images", __doc__, default_data_dir(),
                    lambda data_dir, force: prepare(data_dir, force=force), argv)


if __name__ == "__main__":
    sys.exit(main())
