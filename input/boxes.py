"""SSD default boxes, box overlap, and the target encoding of MLPerf's SSD reference.

Pure numpy and TensorFlow (no tfpod.models import): the input pipeline encodes targets
with it inside tf.data, and the model decodes its predictions with it on device.

Box conventions (every function here):
  corners  (ymin, xmin, ymax, xmax), normalized to [0, 1] by the image's height and width
           (Model Garden's detection order; ground truth and decoded predictions)
  center   (cy, cx, h, w), normalized (the default boxes)

Default boxes (`default_boxes`): the MLPerf v0.7 SSD reference's DefaultBoxes
(single_stage_detector/ssd/utils.py) in the order an NHWC convolutional head gives when
reshaped to [batch, H * W * k, 4]: feature map, then row i, column j, then box kind.
Per location the kinds are the small square (side scale_k), the big square
(sqrt(scale_k * scale_k+1)), then for each aspect ratio r the pair (w = s*sqrt(r),
h = s/sqrt(r)) and (w = s/sqrt(r), h = s*sqrt(r)) with s = scale_k; the centers are
((j + 0.5) / f_k, (i + 0.5) / f_k) with f_k = image_size / step_k, and every center-form
value is clipped to [0, 1] as the reference clamps its tensor. (The reference lists a
feature map's boxes kind-major; only the order differs.) MLPERF_SPEC gives 8732 boxes.

Targets (`encode`), MLPerf matching: every default box takes the ground-truth box it
overlaps most when that IoU >= iou_threshold; then every ground-truth box takes its own
best default box whatever the IoU (a later ground-truth box wins a shared one, as the
reference's scatter does). Matched boxes get
    ty = (cy - dcy) / (dh * scale_xy)      tx = (cx - dcx) / (dw * scale_xy)
    th = log(h / dh) / scale_wh            tw = log(w / dw) / scale_wh
and their class label (1..K); unmatched ones get zeros and class 0 (background).
`decode` inverts the box part.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import tensorflow as tf

from tfpod import UserError

MIN_SIDE = 1e-6  # ground-truth sides are floored here before the log (degenerate boxes)


@dataclasses.dataclass(frozen=True)
class DefaultBoxSpec:
    """Where SSD's default boxes are: one entry per feature map, scales in pixels.

    Attributes:
      image_size: side of the square input image in pixels.
      feature_sizes: side of each feature map (e.g. 38, 19, ...).
      steps: pixels per feature-map cell (image_size / step is the center grid).
      scales: box sides in pixels, one more than feature maps (map k uses k and k+1).
      aspect_ratios: per feature map, the ratios r > 1 of its extra box pairs.
    """

    image_size: int
    feature_sizes: tuple[int, ...]
    steps: tuple[int, ...]
    scales: tuple[float, ...]
    aspect_ratios: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        n = len(self.feature_sizes)
        if not n or len(self.steps) != n or len(self.aspect_ratios) != n or len(self.scales) != n + 1:
            raise UserError(f"DefaultBoxSpec: {n} feature_sizes need as many steps ({len(self.steps)}) and "
                            f"aspect_ratios ({len(self.aspect_ratios)}) and one more scale ({len(self.scales)}): "
                            "give one entry per feature map and feature maps + 1 scales")
        if self.image_size < 1 or min(self.feature_sizes) < 1 or min(self.steps) < 1 or min(self.scales) <= 0:
            raise UserError(f"DefaultBoxSpec: image_size, feature_sizes, steps and scales must be positive; got "
                            f"{self.image_size}, {self.feature_sizes}, {self.steps}, {self.scales}")
        if any(r <= 0 for ratios in self.aspect_ratios for r in ratios):
            raise UserError(f"DefaultBoxSpec: aspect_ratios {self.aspect_ratios} must be positive")


# The MLPerf v0.7 SSD reference's dboxes300_coco().
MLPERF_SPEC = DefaultBoxSpec(
    image_size=300,
    feature_sizes=(38, 19, 10, 5, 3, 1),
    steps=(8, 16, 32, 64, 100, 300),
    scales=(21, 45, 99, 153, 207, 261, 315),
    aspect_ratios=((2,), (2, 3), (2, 3), (2, 3), (2,), (2,)),
)


def boxes_per_location(spec: DefaultBoxSpec) -> tuple[int, ...]:
    """Default boxes per feature-map location: 2 squares + 2 per aspect ratio (4 or 6)."""
    return tuple(2 + 2 * len(ratios) for ratios in spec.aspect_ratios)


def default_boxes(spec: DefaultBoxSpec) -> np.ndarray:
    """The default boxes, float32 [N, 4] center form (cy, cx, h, w), normalized and clipped.

    Ordered by feature map, row, column, box kind (the module docstring), N =
    sum(f_k^2 * boxes_per_location_k) (8732 for MLPERF_SPEC).
    """
    out = []
    for k, (size, step) in enumerate(zip(spec.feature_sizes, spec.steps)):
        fk = spec.image_size / step
        s1 = spec.scales[k] / spec.image_size
        s2 = math.sqrt(s1 * spec.scales[k + 1] / spec.image_size)
        shapes = [(s1, s1), (s2, s2)]  # (h, w)
        for r in spec.aspect_ratios[k]:
            shapes += [(s1 / math.sqrt(r), s1 * math.sqrt(r)), (s1 * math.sqrt(r), s1 / math.sqrt(r))]
        kinds = np.array(shapes, np.float64)  # [k, 2] (h, w)
        centers = (np.arange(size, dtype=np.float64) + 0.5) / fk  # [f]
        cy, cx = np.meshgrid(centers, centers, indexing="ij")  # [f, f] each: row i, column j
        grid = np.broadcast_to(np.stack([cy, cx], -1)[:, :, None, :], (size, size, len(kinds), 2))  # [f, f, k, 2]
        sides = np.broadcast_to(kinds, (size, size, len(kinds), 2))  # [f, f, k, 2]
        out.append(np.concatenate([grid, sides], -1).reshape(-1, 4))  # [f * f * k, 4]
    return np.clip(np.concatenate(out, 0), 0.0, 1.0).astype(np.float32)  # [N, 4]


def center_to_corners(boxes: tf.Tensor) -> tf.Tensor:
    """[..., 4] (cy, cx, h, w) -> [..., 4] (ymin, xmin, ymax, xmax)."""
    cy, cx, h, w = tf.unstack(boxes, axis=-1)
    return tf.stack([cy - 0.5 * h, cx - 0.5 * w, cy + 0.5 * h, cx + 0.5 * w], axis=-1)


def corners_to_center(boxes: tf.Tensor) -> tf.Tensor:
    """[..., 4] (ymin, xmin, ymax, xmax) -> [..., 4] (cy, cx, h, w)."""
    ymin, xmin, ymax, xmax = tf.unstack(boxes, axis=-1)
    return tf.stack([0.5 * (ymin + ymax), 0.5 * (xmin + xmax), ymax - ymin, xmax - xmin], axis=-1)


def iou(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """Intersection over union of corner boxes.

    Args:
      a: float [M, 4] (ymin, xmin, ymax, xmax).
      b: float [N, 4], the same form.

    Returns:
      float32 [M, N]; 0 where the union is empty.
    """
    a = tf.cast(tf.reshape(a, [-1, 4]), tf.float32)
    b = tf.cast(tf.reshape(b, [-1, 4]), tf.float32)
    a_ymin, a_xmin, a_ymax, a_xmax = tf.unstack(a[:, None, :], axis=-1)  # each [M, 1]
    b_ymin, b_xmin, b_ymax, b_xmax = tf.unstack(b[None, :, :], axis=-1)  # each [1, N]
    inter_h = tf.maximum(tf.minimum(a_ymax, b_ymax) - tf.maximum(a_ymin, b_ymin), 0.0)  # [M, N]
    inter_w = tf.maximum(tf.minimum(a_xmax, b_xmax) - tf.maximum(a_xmin, b_xmin), 0.0)
    inter = inter_h * inter_w
    area_a = tf.maximum(a_ymax - a_ymin, 0.0) * tf.maximum(a_xmax - a_xmin, 0.0)  # [M, 1]
    area_b = tf.maximum(b_ymax - b_ymin, 0.0) * tf.maximum(b_xmax - b_xmin, 0.0)  # [1, N]
    return tf.math.divide_no_nan(inter, area_a + area_b - inter)


def encode(gt_boxes: tf.Tensor, gt_labels: tf.Tensor, defaults, iou_threshold: float = 0.5, scale_xy: float = 0.1,
           scale_wh: float = 0.2) -> tuple[tf.Tensor, tf.Tensor]:
    """SSD training targets of one image (MLPerf matching; pure TF, runs in tf.data).

    Args:
      gt_boxes: float [M, 4] normalized corners of the real boxes (M may be 0).
      gt_labels: int [M] their classes, 1..K.
      defaults: float32 [N, 4] default boxes, center form (`default_boxes`).
      iou_threshold: a default box takes its best ground truth at this IoU or more.
      scale_xy, scale_wh: the reference's center and size variances.

    Returns:
      box_targets: float32 [N, 4] (ty, tx, th, tw), zeros where unmatched.
      class_targets: int32 [N], 0 = background.
    """
    gt_boxes = tf.reshape(tf.cast(gt_boxes, tf.float32), [-1, 4])  # [M, 4]
    gt_labels = tf.reshape(tf.cast(gt_labels, tf.int32), [-1])  # [M]
    defaults = tf.cast(defaults, tf.float32)  # [N, 4] center form
    num_gt = tf.shape(gt_boxes)[0]
    num_defaults = tf.shape(defaults)[0]
    overlaps = iou(gt_boxes, center_to_corners(defaults))  # [M, N]

    # Each default box's best ground truth; a row of -1 keeps argmax defined when M = 0
    # (its index M points at the padding row appended below).
    padded = tf.concat([overlaps, -tf.ones([1, num_defaults])], axis=0)  # [M + 1, N]
    best_gt = tf.argmax(padded, axis=0, output_type=tf.int32)  # [N]
    matched = tf.reduce_max(padded, axis=0) >= iou_threshold  # [N]

    # Each ground truth's best default box is forced to it; the last one wins a shared box.
    best_default = tf.argmax(overlaps, axis=1, output_type=tf.int32)  # [M]
    hit = tf.equal(best_default[:, None], tf.range(num_defaults)[None, :])  # [M, N]
    forced_gt = tf.reduce_max(tf.where(hit, tf.range(num_gt)[:, None], -1), axis=0)  # [N]; < 0: none (M = 0: min int)
    forced = forced_gt >= 0
    gt_index = tf.where(forced, forced_gt, best_gt)  # [N]
    matched = tf.logical_or(matched, forced)
    gt_index = tf.where(matched, gt_index, num_gt)  # unmatched -> the padding row

    boxes = tf.gather(tf.concat([gt_boxes, tf.constant([[0.0, 0.0, 1.0, 1.0]])], 0), gt_index)  # [N, 4]
    labels = tf.gather(tf.concat([gt_labels, [0]], 0), gt_index)  # [N]
    cy, cx, h, w = tf.unstack(corners_to_center(boxes), axis=-1)  # each [N]
    dcy, dcx, dh, dw = tf.unstack(defaults, axis=-1)
    targets = tf.stack([
        (cy - dcy) / (dh * scale_xy),
        (cx - dcx) / (dw * scale_xy),
        tf.math.log(tf.maximum(h, MIN_SIDE) / dh) / scale_wh,
        tf.math.log(tf.maximum(w, MIN_SIDE) / dw) / scale_wh,
    ], axis=-1)  # [N, 4]
    box_targets = tf.where(matched[:, None], targets, 0.0)
    class_targets = tf.where(matched, labels, 0)
    return box_targets, class_targets


def decode(box_predictions: tf.Tensor, defaults, scale_xy: float = 0.1, scale_wh: float = 0.2) -> tf.Tensor:
    """Box offsets -> normalized corners (the inverse of `encode`; not clipped to the image).

    Args:
      box_predictions: float [..., N, 4] (ty, tx, th, tw).
      defaults: float [N, 4] default boxes, center form.
      scale_xy, scale_wh: as given to `encode`.

    Returns:
      [..., N, 4] (ymin, xmin, ymax, xmax) in the predictions' dtype.
    """
    dtype = box_predictions.dtype
    defaults = tf.cast(defaults, dtype)  # [N, 4]
    ty, tx, th, tw = tf.unstack(box_predictions, axis=-1)  # each [..., N]
    dcy, dcx, dh, dw = tf.unstack(defaults, axis=-1)  # each [N], broadcast over the leading axes
    cy = ty * tf.cast(scale_xy, dtype) * dh + dcy
    cx = tx * tf.cast(scale_xy, dtype) * dw + dcx
    h = tf.exp(th * tf.cast(scale_wh, dtype)) * dh
    w = tf.exp(tw * tf.cast(scale_wh, dtype)) * dw
    return center_to_corners(tf.stack([cy, cx, h, w], axis=-1))
