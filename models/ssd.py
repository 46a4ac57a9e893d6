"""SSD-ResNet34 object detector (the MLPerf v0.7 single-stage detection benchmark).

The network (`SSD`), as the MLPerf reference's SSD300 (single_stage_detector/ssd/ssd300.py):

  backbone  ResNet-34 up to conv4_x: a 7x7/2 stem convolution, batch norm and ReLU, a
            3x3/2 max pool, then basic blocks (3, 4, 6) of 64, 128 and 256 filters, the
            conv3_x group at stride 2 and conv4_x at stride 1 (the reference sets the
            stride of conv4_x's first block to 1), so a 300x300 image gives a 38x38 map.
            The blocks are Model Garden's `official.vision.modeling.layers.nn_blocks.
            ResidualBlock` (two 3x3 convolutions with batch norm; a 1x1 projection
            shortcut with batch norm where the stride or width changes, as torchvision's
            ResNet-34 has one); the stem is plain tf_keras layers as Model Garden's
            ResNet stem.
  extras    per further feature map a 1x1 convolution then a 3x3 convolution, both with
            bias and ReLU and no batch norm (as the reference): the first three 3x3
            ones at stride 2 (SAME), the later ones 3x3 VALID; widths 256->512,
            256->512, 128->256, 128->256, 128->256. At 300x300 the six maps are
            38, 19, 10, 5, 3 and 1 cells wide.
  heads     per map a 3x3 convolution to k * num_classes class logits and one to k * 4
            box offsets (k = 4 or 6 default boxes per cell), reshaped NHWC to [batch,
            H * W * k, ...] and concatenated over the maps: 8732 boxes at 300x300.

The model returns one float32 tensor [batch, boxes, 4 + num_classes]: the encoded box
offsets (ty, tx, th, tw; tfpod.input.boxes.encode's form) then the class logits.

Every convolution and pooling is a tf_keras Conv2D / MaxPool2D layer and batch norm
trains through `tfpod.fused` (what spatial partitioning swaps); every weight is
replicated (DTensor's convolution expander requires replicated filters), so `data`
is the preset. `depth_multiplier` scales every width (the tiny models),
`block_repeats` the blocks per group and `num_feature_maps` how many maps carry
heads (fewer for small images: a 3x3 VALID layer needs a 3x3 map).

Loss (`loss_terms`, the reference's `Loss`): per image, smooth L1 (beta 1) on the
offsets of the default boxes matched to an object, plus softmax cross entropy over the
matched boxes and the 3 x positives unmatched boxes of highest cross entropy (hard
negative mining, ranked per image), divided by the image's positives; images without
positives add 0; averaged over weighted images. Weight decay is an L2 term in the loss
(`weight_decay` / 2 * sum of squares of every weight but batch norm's), as the TF
reference adds it: SGD then applies weight_decay * w as PyTorch's SGD does.

Evaluation: the on-device metric is that loss (without weight decay); COCO AP comes
from `models.ssd_eval` (decode, per-class NMS on the mesh, pycocotools on host 0).

Batch contract (tfpod.input.detection produces it):
  images         float32 [batch, S, S, 3]  normalized RGB
  box_targets    float32 [batch, boxes, 4]  encoded offsets of the matched default boxes
  class_targets  int32 [batch, boxes]  0 background, 1..num_classes-1
  weights        float32 [batch]  1 for real images, 0 for padding
and eval batches also source_id int64, image_height/image_width int32 [batch],
gt_boxes float32 [batch, max_boxes, 4] (normalized corners), gt_classes,
gt_is_crowd int32 and gt_area float32 [batch, max_boxes].
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import tensorflow as tf
import tf_keras

from tfpod import UserError, evaluation, fused
from tfpod.input import boxes as boxes_lib
from tfpod.input import detection, images as images_lib
from tfpod.models import ssd_eval
from tfpod.partitioning import AxisRule, shard, spatial
from tfpod.models import plan_profiles
from tfpod.task import EvalContext, LossTerms, Task


def _nn_blocks():
    """Model Garden's vision blocks, imported on first use (`official.vision` costs most of a
    second in every process that imports the model registry)."""
    from official.vision.modeling.layers import nn_blocks as blocks

    return blocks


BACKBONE_FILTERS = (64, 128, 256)  # conv2_x, conv3_x, conv4_x (ResNet-34)
BACKBONE_STRIDES = (1, 2, 1)  # conv4_x at stride 1: the reference's 38x38 map at 300x300
EXTRA_LAYERS = ((256, 512), (256, 512), (128, 256), (128, 256), (128, 256))  # (1x1 width, 3x3 width)
STRIDED_EXTRAS = 3  # the first three extra 3x3 convolutions stride 2 (SAME); the others are VALID
MAX_FEATURE_MAPS = 1 + len(EXTRA_LAYERS)
# MLPerf's default-box scales as fractions of the image (21..315 pixels at 300) and aspect ratios.
MLPERF_SCALE_FRACTIONS = tuple(s / 300 for s in boxes_lib.MLPERF_SPEC.scales)
MLPERF_RATIOS = boxes_lib.MLPERF_SPEC.aspect_ratios


@dataclasses.dataclass(frozen=True)
class SSDConfig:
    """Shape and loss of the detector. Attributes map 1:1 to gin `ssd.<name>`.

    Attributes:
      num_classes: classes including background (COCO: 81); the data's label map has
        num_classes - 1 categories.
      image_size: side of the square input images.
      depth_multiplier: scales every layer's width (1.0: the reference's).
      block_repeats: basic blocks of conv2_x, conv3_x, conv4_x ((3, 4, 6): ResNet-34).
      num_feature_maps: maps with heads, 1 to 6: conv4_x's and the first
        num_feature_maps - 1 extra layers' (6 at 300x300: 38, 19, 10, 5, 3, 1).
      norm_momentum, norm_epsilon: the backbone's batch normalization.
      negative_ratio: hard negatives kept per positive box (3).
      weight_decay: L2 on every weight but batch norm's, added to the training loss.
      score_threshold, nms_iou, pre_nms_per_class, max_detections: detection (eval and
        serving): per class the pre_nms_per_class best boxes above score_threshold,
        greedy NMS at IoU nms_iou, then the max_detections best of all classes (MLPerf:
        0.05, 0.5, 200, 200).
    """

    num_classes: int = 81
    image_size: int = 300
    depth_multiplier: float = 1.0
    block_repeats: tuple[int, int, int] = (3, 4, 6)
    num_feature_maps: int = 6
    norm_momentum: float = 0.9
    norm_epsilon: float = 1e-5
    negative_ratio: float = 3.0
    weight_decay: float = 5e-4
    score_threshold: float = 0.05
    nms_iou: float = 0.5
    pre_nms_per_class: int = 200
    max_detections: int = 200

    def __post_init__(self):
        if self.num_classes < 2:
            raise UserError(f"ssd.num_classes={self.num_classes} must be at least 2 (background and one class)")
        if self.image_size < 1:
            raise UserError(f"ssd.image_size={self.image_size} must be positive (the MLPerf model: 300)")
        if self.depth_multiplier <= 0:
            raise UserError(f"ssd.depth_multiplier={self.depth_multiplier} must be positive")
        if len(self.block_repeats) != 3 or min(self.block_repeats) < 1:
            raise UserError(f"ssd.block_repeats={tuple(self.block_repeats)} must be 3 counts >= 1 (conv2_x, "
                            "conv3_x, conv4_x; ResNet-34: (3, 4, 6))")
        if not 1 <= self.num_feature_maps <= MAX_FEATURE_MAPS:
            raise UserError(f"ssd.num_feature_maps={self.num_feature_maps} must be in 1..{MAX_FEATURE_MAPS}")
        if self.negative_ratio < 0 or self.weight_decay < 0:
            raise UserError(f"ssd.negative_ratio={self.negative_ratio} and ssd.weight_decay={self.weight_decay} "
                            "must be >= 0")
        if not 0 <= self.score_threshold < 1 or not 0 < self.nms_iou <= 1:
            raise UserError(f"ssd.score_threshold={self.score_threshold} must be in [0, 1) and ssd.nms_iou="
                            f"{self.nms_iou} in (0, 1]")
        if self.pre_nms_per_class < 1 or self.max_detections < 1:
            raise UserError(f"ssd.pre_nms_per_class={self.pre_nms_per_class} and ssd.max_detections="
                            f"{self.max_detections} must be at least 1")
        feature_sizes(self)  # the image is large enough for the maps

    def width(self, filters: int) -> int:
        """A layer's width scaled by depth_multiplier (at least 8)."""
        return max(8, int(round(filters * self.depth_multiplier)))


def _feature_sizes(image_size: int, maps: int) -> list[int]:
    """Map sides by the layer arithmetic (SAME: ceil(n / stride); 3x3 VALID: n - 2); may hold values < 1."""
    side = math.ceil(math.ceil(math.ceil(image_size / 2) / 2) / 2)  # stem conv /2, max pool /2, conv3_x /2
    sizes = [side]
    for i in range(maps - 1):
        side = math.ceil(side / 2) if i < STRIDED_EXTRAS else side - 2
        sizes.append(side)
    return sizes


def feature_sizes(config: SSDConfig) -> tuple[int, ...]:
    """The side of each feature map with heads (38, 19, 10, 5, 3, 1 at 300x300).

    Raises:
      UserError: image_size too small for num_feature_maps (a 3x3 VALID layer needs a
        map of at least 3x3).
    """
    sizes = _feature_sizes(config.image_size, config.num_feature_maps)
    if min(sizes) >= 1:
        return tuple(sizes)
    smallest = next(s for s in range(config.image_size, 100000) if min(_feature_sizes(s, config.num_feature_maps)) >= 1)
    most = max(n for n in range(1, MAX_FEATURE_MAPS + 1) if min(_feature_sizes(config.image_size, n)) >= 1)
    shown = ", ".join(str(s) for s in sizes if s >= 1)
    raise UserError(f"ssd.image_size={config.image_size} is too small for ssd.num_feature_maps="
                    f"{config.num_feature_maps}: its maps are {shown} cells wide and the next extra layer (3x3 VALID) "
                    f"needs at least 3; use ssd.image_size >= {smallest} or ssd.num_feature_maps <= {most}")


def box_spec(config: SSDConfig) -> boxes_lib.DefaultBoxSpec:
    """The default boxes of the model's maps: MLPerf's dboxes300_coco at 300x300 with 6 maps.

    Otherwise derived the same way: centers on each map's grid (step = image_size /
    side), scales from MLPerf's fractions of the image when there are 6 maps, else the
    smallest fraction (0.07) then the others spread evenly from 0.15 to 1.05 (the
    spacing MLPerf's follow), and aspect ratios (2, 3) except (2,) on the first and the
    last two maps.
    """
    sizes = feature_sizes(config)
    n, size = len(sizes), config.image_size
    if size == boxes_lib.MLPERF_SPEC.image_size and n == len(boxes_lib.MLPERF_SPEC.feature_sizes):
        return boxes_lib.MLPERF_SPEC
    fractions = MLPERF_SCALE_FRACTIONS if n == MAX_FEATURE_MAPS else (0.07, *np.linspace(0.15, 1.05, n).tolist())
    ratios = tuple(MLPERF_RATIOS[0] if i == 0 or i >= n - 2 else MLPERF_RATIOS[1] for i in range(n))
    steps = tuple(size // s if size % s == 0 else size / s for s in sizes)  # pixels per cell
    return boxes_lib.DefaultBoxSpec(image_size=size, feature_sizes=sizes, steps=steps,
                                    scales=tuple(f * size for f in fractions), aspect_ratios=ratios)


def default_boxes(config: SSDConfig) -> np.ndarray:
    """float32 [boxes, 4] default boxes (cy, cx, h, w) in the heads' order."""
    return boxes_lib.default_boxes(box_spec(config))


# Every weight is replicated (DTensor requires replicated convolution filters). The
# names: <layer>/<weight>, with Model Garden's blocks' inner layers auto-named
# (conv2d_N, batch_normalization_N) under the block's name.
AXIS_RULES = (
    AxisRule(r".*/kernel", (None, None, None, None)),  # [kh, kw, in, out]
    AxisRule(r".*/bias", (None,)),
    AxisRule(r".*(norm|batch_normalization(_\d+)?)/(gamma|beta|moving_mean|moving_variance)", (None,)),
)


class SSD(tf_keras.Model):
    """images [batch, S, S, 3] -> predictions [batch, boxes, 4 + num_classes] (float32)."""

    def __init__(self, config: SSDConfig, name: str = "ssd"):
        super().__init__(name=name)
        self.config = config
        c = config
        self.boxes_per_location = boxes_lib.boxes_per_location(box_spec(c))
        conv = tf_keras.layers.Conv2D
        self.stem_conv = conv(c.width(64), 7, strides=2, padding="same", use_bias=False,
                              kernel_initializer="VarianceScaling", name="stem_conv")
        self.stem_norm = tf_keras.layers.BatchNormalization(momentum=c.norm_momentum, epsilon=c.norm_epsilon,
                                                            name="stem_norm")
        self.stem_pool = tf_keras.layers.MaxPool2D(3, strides=2, padding="same", name="stem_pool")
        self.blocks = []
        channels = c.width(64)
        for group, (filters, stride, repeats) in enumerate(zip(BACKBONE_FILTERS, BACKBONE_STRIDES, c.block_repeats)):
            width = c.width(filters)
            for r in range(repeats):
                s = stride if r == 0 else 1
                self.blocks.append(_nn_blocks().ResidualBlock(
                    filters=width, strides=s, use_projection=s != 1 or channels != width,
                    norm_momentum=c.norm_momentum, norm_epsilon=c.norm_epsilon, name=f"conv{group + 2}_{r + 1}"))
                channels = width
        self.extras = []
        for i, (mid, out) in enumerate(EXTRA_LAYERS[: c.num_feature_maps - 1]):
            strided = i < STRIDED_EXTRAS
            self.extras.append((
                conv(c.width(mid), 1, activation="relu", name=f"extra{i + 1}_1x1"),
                conv(c.width(out), 3, strides=2 if strided else 1, padding="same" if strided else "valid",
                     activation="relu", name=f"extra{i + 1}_3x3"),
            ))
        self.box_heads = [conv(k * 4, 3, padding="same", name=f"box_head{i + 1}")
                          for i, k in enumerate(self.boxes_per_location)]
        self.class_heads = [conv(k * c.num_classes, 3, padding="same", name=f"class_head{i + 1}")
                            for i, k in enumerate(self.boxes_per_location)]
        # DTensor has no layout propagation for FusedBatchNormV3 (see models/resnet.py):
        # batch norm trains through fused.batch_norm. Model Garden's blocks make their
        # batch norms when first called, so `call` swaps those after the first (symbolic)
        # call that builds the model, before any step is traced.
        fused.use_batch_norm(self)
        spatial.use_spatial_layers(self)  # convolutions and pooling split image rows (`spatial` preset)

    def features(self, images: tf.Tensor, training=None) -> list[tf.Tensor]:
        """The maps with heads: [batch, side_k, side_k, channels_k] for each map k."""
        x = tf.nn.relu(self.stem_norm(self.stem_conv(images), training=training))  # [batch, S/2, S/2, c]
        x = self.stem_pool(x)  # [batch, S/4, S/4, c]
        for block in self.blocks:
            x = block(x, training=training)  # conv4_x ends at [batch, S/8, S/8, 256 * dm]
        maps = [x]
        for reduce, expand in self.extras:
            x = expand(reduce(x))
            maps.append(x)
        return maps

    def call(self, inputs, training=None):
        images = inputs["images"] if isinstance(inputs, dict) else inputs
        x = spatial.split_rows(images)  # [batch, H, W, 3]: rows over `height` under the spatial preset
        boxes, logits = [], []
        for x, box_head, class_head in zip(self.features(x, training), self.box_heads, self.class_heads):
            side = x.shape[1] * x.shape[2]
            box = shard(box_head(x), ("batch", None, None, None))  # [batch, H, W, k * 4], whole rows
            cls = shard(class_head(x), ("batch", None, None, None))  # [batch, H, W, k * classes]
            boxes.append(tf.reshape(box, [-1, side * box.shape[-1] // 4, 4]))  # [batch, H * W * k, 4]
            logits.append(tf.reshape(cls, [-1, side * cls.shape[-1] // self.config.num_classes,
                                           self.config.num_classes]))  # [batch, H * W * k, classes]
        out = tf.concat([tf.concat(boxes, 1), tf.concat(logits, 1)], -1)  # [batch, boxes, 4 + classes]
        fused.use_batch_norm(self)  # the blocks' batch norms and convolutions, made by this call (see __init__)
        spatial.use_spatial_layers(self)
        return shard(tf.cast(out, tf.float32), ("batch", None, None))


# ---------------------------------------------------------------------------
# The loss


def detection_losses(predictions: tf.Tensor, box_targets: tf.Tensor, class_targets: tf.Tensor,
                     negative_ratio: float = 3.0) -> dict:
    """Per-image SSD loss terms (the MLPerf reference's Loss, before the mean over images).

    Args:
      predictions: float32 [batch, boxes, 4 + classes] (offsets, then logits).
      box_targets: float32 [batch, boxes, 4] encoded offsets of the matched boxes.
      class_targets: int32 [batch, boxes], 0 = background.
      negative_ratio: negatives kept per positive.

    Returns:
      {"box": smooth L1 over positives [batch], "class": cross entropy over positives and
      mined negatives [batch], "positives": [batch], "negatives": mined negatives [batch]}.
    """
    offsets, logits = predictions[..., :4], predictions[..., 4:]  # [batch, boxes, 4], [batch, boxes, classes]
    positive = tf.cast(class_targets > 0, tf.float32)  # [batch, boxes]
    num_pos = tf.reduce_sum(positive, axis=1)  # [batch]
    diff = tf.abs(offsets - tf.cast(box_targets, offsets.dtype))
    smooth_l1 = tf.reduce_sum(tf.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5), axis=-1)  # [batch, boxes]
    box = tf.reduce_sum(smooth_l1 * positive, axis=1)  # [batch]
    target_logit = tf.reduce_sum(logits * tf.one_hot(class_targets, logits.shape[-1], dtype=logits.dtype), -1)
    cross_entropy = tf.reduce_logsumexp(logits, axis=-1) - target_logit  # [batch, boxes]
    # Hard negatives: each image's unmatched boxes ranked by cross entropy (positives last).
    ranked = tf.stop_gradient(tf.where(positive > 0, -1.0, cross_entropy))  # [batch, boxes]
    order = tf.argsort(ranked, axis=1, direction="DESCENDING")
    rank = tf.argsort(order, axis=1)  # [batch, boxes]: 0 = the hardest negative
    boxes = tf.cast(tf.shape(positive)[1], tf.float32)
    num_neg = tf.minimum(negative_ratio * num_pos, boxes - num_pos)  # [batch]
    negative = tf.cast(tf.cast(rank, tf.float32) < num_neg[:, None], tf.float32) * (1.0 - positive)
    cls = tf.reduce_sum(cross_entropy * (positive + negative), axis=1)  # [batch]
    return {"box": box, "class": cls, "positives": num_pos, "negatives": tf.reduce_sum(negative, axis=1)}


def _loss_sums(predictions: tf.Tensor, batch, negative_ratio: float) -> dict:
    """Weighted sums over the batch of the per-image losses (each divided by its positives)."""
    terms = detection_losses(predictions, batch["box_targets"], batch["class_targets"], negative_ratio)
    weights = tf.cast(batch["weights"], tf.float32)  # [batch]
    pos = terms["positives"]
    scale = weights * tf.cast(pos > 0, tf.float32) / tf.maximum(pos, 1.0)  # images without positives add 0
    return {
        "loss_sum": tf.reduce_sum((terms["box"] + terms["class"]) * scale),
        "box_loss_sum": tf.reduce_sum(terms["box"] * scale),
        "class_loss_sum": tf.reduce_sum(terms["class"] * scale),
        "positives_sum": tf.reduce_sum(pos * weights),
        "weight_sum": tf.reduce_sum(weights),
    }


def l2_penalty(model: tf_keras.Model) -> tf.Tensor:
    """sum(w^2) / 2 over the trainable weights except batch norm's (gamma, beta)."""
    weights = [tf.cast(v, tf.float32) for v in model.trainable_variables
               if v.name.split("/")[-1].split(":")[0] not in ("gamma", "beta")]
    return tf.add_n([tf.nn.l2_loss(w) for w in weights])


def loss_terms(model: SSD, batch, training: bool) -> LossTerms:
    """SSD loss: [its sum over weighted images], averaged over `loss_counts`; weight decay
    the aux term when training.

    Returns:
      LossTerms with metrics {"loss_sum", "box_loss_sum", "class_loss_sum", "positives_sum", "weight_sum"}.
    """
    predictions = model(model_inputs(batch), training=training)  # [batch, boxes, 4 + classes]
    sums = _loss_sums(predictions, batch, model.config.negative_ratio)
    aux = model.config.weight_decay * l2_penalty(model) if training and model.config.weight_decay else None
    return LossTerms([sums["loss_sum"]], aux=aux, metrics=sums)


def loss_counts(batch) -> list:
    """The weighted images: what the image losses' sum is averaged over."""
    return [tf.reduce_sum(tf.cast(batch["weights"], tf.float32))]


def _metric_update(predictions: tf.Tensor, batch) -> dict:
    sums = _loss_sums(predictions, batch, EVAL_NEGATIVE_RATIO)
    sums["example_count"] = sums.pop("weight_sum")
    return sums


def _metric_result(sums) -> dict:
    n = max(sums["example_count"], 1.0)
    return {"loss": sums["loss_sum"] / n, "box_loss": sums["box_loss_sum"] / n,
            "class_loss": sums["class_loss_sum"] / n, "positives_per_image": sums["positives_sum"] / n}


EVAL_NEGATIVE_RATIO = 3.0  # the eval loss mines negatives as MLPerf trains (ssd.negative_ratio's default)
# The training loss (without weight decay) over the eval set; COCO AP is host_eval_metrics'.
EVAL_METRIC = evaluation.Metric("ssd", _metric_update, _metric_result)


# ---------------------------------------------------------------------------
# Batches, FLOPs, input


def input_signature(config: SSDConfig) -> dict:
    return {"images": tf.TensorSpec([None, config.image_size, config.image_size, 3], tf.float32, name="images")}


def model_inputs(batch) -> dict:
    """The features the model reads."""
    return {"images": batch["images"]}


def batch_axes() -> dict:
    """Logical axes of each batch feature (train and eval), the batch first."""
    return {
        "images": ("batch", None, None, None),
        "box_targets": ("batch", None, None),
        "class_targets": ("batch", None),
        "weights": ("batch",),
        "source_id": ("batch",),
        "image_height": ("batch",),
        "image_width": ("batch",),
        "gt_boxes": ("batch", None, None),
        "gt_classes": ("batch", None),
        "gt_is_crowd": ("batch", None),
        "gt_area": ("batch", None),
    }


def synthetic_batch(config: SSDConfig, rows: int, rng: np.random.Generator) -> dict:
    """Random images and targets of the experiment's shapes (train.synthetic_data=True).

    Each image has 1 to 4 random positive default boxes (random class, small random
    offsets) and its pixels are brighter inside them, so the loss has something to learn.
    """
    size, defaults = config.image_size, default_boxes(config)
    n = len(defaults)
    images = rng.standard_normal((rows, size, size, 3)).astype(np.float32)
    box_targets = np.zeros((rows, n, 4), np.float32)
    class_targets = np.zeros((rows, n), np.int32)
    for r in range(rows):
        for index in rng.choice(n, size=int(rng.integers(1, 5)), replace=False):
            class_targets[r, index] = rng.integers(1, config.num_classes)
            box_targets[r, index] = rng.normal(0.0, 0.5, 4)
            cy, cx, h, w = defaults[index] * size
            y0, y1 = int(max(cy - h / 2, 0)), int(min(cy + h / 2, size))
            x0, x1 = int(max(cx - w / 2, 0)), int(min(cx + w / 2, size))
            images[r, y0:y1 + 1, x0:x1 + 1] += 1.0 + class_targets[r, index] % 3
    return {"images": images, "box_targets": box_targets, "class_targets": class_targets,
            "weights": np.ones(rows, np.float32)}


def forward_macs(config: SSDConfig) -> float:
    """Multiply-adds of one image's forward pass: every convolution (batch norm, ReLU,
    pooling and additions left out), walking the layers as `SSD` builds them."""
    c = config
    side = math.ceil(c.image_size / 2)
    macs = 49 * 3 * c.width(64) * side * side  # stem
    side = math.ceil(side / 2)  # max pool
    channels = c.width(64)
    for filters, stride, repeats in zip(BACKBONE_FILTERS, BACKBONE_STRIDES, c.block_repeats):
        width = c.width(filters)
        for r in range(repeats):
            s = stride if r == 0 else 1
            out = math.ceil(side / s)
            macs += 9 * channels * width * out * out + 9 * width * width * out * out
            if s != 1 or channels != width:
                macs += channels * width * out * out  # projection shortcut
            channels, side = width, out
    sizes = feature_sizes(c)
    widths = [channels]
    for i, (mid, out) in enumerate(EXTRA_LAYERS[: c.num_feature_maps - 1]):
        macs += channels * c.width(mid) * sizes[i] ** 2 + 9 * c.width(mid) * c.width(out) * sizes[i + 1] ** 2
        channels = c.width(out)
        widths.append(channels)
    for side, width, k in zip(sizes, widths, boxes_lib.boxes_per_location(box_spec(c))):
        macs += 9 * width * k * (4 + c.num_classes) * side * side  # box and class heads
    return float(macs)


def flops_per_token(config: SSDConfig) -> float:
    """Training FLOPs per image: 3 x forward, 2 FLOPs per multiply-add."""
    return 3.0 * 2.0 * forward_macs(config)


def make_input(data_config, model_config: SSDConfig, shard, seed: int):
    """This host's detection input, its targets matched to the model's default boxes.

    Raises:
      UserError: the data's label map has another number of categories than
        ssd.num_classes - 1.
    """
    labels = detection.label_map(data_config)
    if labels is not None and len(labels) != model_config.num_classes - 1:
        raise UserError(f"ssd.num_classes={model_config.num_classes} but the detection data has {len(labels)} "
                        f"categories: set ssd.num_classes={len(labels) + 1} (the categories plus background)")
    return detection.detection_input(data_config, model_config.image_size, default_boxes(model_config), shard, seed)


def coco_metrics(context: EvalContext, host_batches) -> dict:
    """COCO box AP of the eval set (models.ssd_eval.coco_metrics with this model's boxes)."""
    return ssd_eval.coco_metrics(context, host_batches, default_boxes(context.model_config))


def serving_image(jpeg: tf.Tensor, size: int) -> tf.Tensor:
    """JPEG (or PNG) bytes -> float32 [size, size, 3], as the eval input makes images
    (tfpod.input.detection.eval_example: resized bilinear, ImageNet mean and stddev)."""
    image = tf.io.decode_image(jpeg, channels=3, expand_animations=False)  # uint8 [h, w, 3]
    image = tf.image.resize(image, [size, size], method="bilinear")  # float32
    return (image - tf.constant(images_lib.MEAN_RGB)) / tf.constant(images_lib.STDDEV_RGB)


def serving(model: SSD, config: SSDConfig, data_config) -> tuple[tf.Module, dict]:
    """The detector's SavedModel signature (tfpod.export), on JPEG bytes.

    Each image is decoded and resized to image_size x image_size and normalized as the
    eval input does; detection as in evaluation (ssd_eval.detect).

      serving_default(image_bytes string [batch]) ->
        boxes float32 [batch, max_detections, 4]  (ymin, xmin, ymax, xmax) normalized
        classes int32 [batch, max_detections]  COCO category ids (the label map's; the
          label 1..K itself without one), 0 past num_detections
        scores float32 [batch, max_detections], best first, 0 past num_detections
        num_detections int32 [batch]
    """
    labels = detection.label_map(data_config)
    ids = [0] + ([int(c["id"]) for c in sorted(labels, key=lambda c: c["label"])] if labels
                 else list(range(1, config.num_classes)))
    defaults = default_boxes(config)
    module = tf.Module()
    module.model = model
    size = config.image_size

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="image_bytes")])
    def serving_default(jpegs):
        images = tf.map_fn(lambda jpeg: serving_image(jpeg, size), jpegs,
                           fn_output_signature=tf.TensorSpec([size, size, 3], tf.float32))
        predictions = model({"images": images}, training=False)  # [batch, boxes, 4 + classes]
        found = ssd_eval.detect(predictions, defaults, config)  # [batch, max_detections, 6]
        labels_ = tf.cast(found[..., 5], tf.int32)
        return {"boxes": found[..., :4], "classes": tf.gather(tf.constant(ids, tf.int32), labels_),
                "scores": found[..., 4], "num_detections": tf.reduce_sum(tf.cast(labels_ > 0, tf.int32), axis=1)}

    return module, {"serving_default": serving_default.get_concrete_function()}


class SSDTask(Task):
    """Object detection with SSD-ResNet34 (MLPerf): gin `ssd.*`, data `detection_data.*`.

    Besides the on-device loss, evaluation reports COCO box AP (`host_eval_metrics`).
    """

    name = "ssd"
    config_class = SSDConfig
    data_name = "detection_data"
    data_config_class = detection.DetectionDataConfig
    default_preset = "data"
    axis_rules = AXIS_RULES
    eval_metric = EVAL_METRIC
    splits_image_rows = True

    build = staticmethod(SSD)
    input_signature = staticmethod(input_signature)
    flops_per_token = staticmethod(flops_per_token)
    batch_axes = staticmethod(batch_axes)
    model_inputs = staticmethod(model_inputs)
    synthetic_batch = staticmethod(synthetic_batch)
    make_input = staticmethod(make_input)
    loss_terms = staticmethod(loss_terms)
    loss_counts = staticmethod(loss_counts)
    host_eval_metrics = staticmethod(coco_metrics)
    serving = staticmethod(serving)
    serves = True
    plan_profile = staticmethod(plan_profiles.conv)


TASK = SSDTask()
