"""COCO box AP for the SSD detector: detection on the mesh, detections to host 0, pycocotools there.

`detect` (eval and serving) is the MLPerf reference's post-processing, as tensor ops
every row of the batch runs at once (so it runs under DTensor with the batch sharded;
TensorFlow's CombinedNonMaxSuppression has no DTensor layout propagation): decode the
box offsets (tfpod.input.boxes.decode, clipped to the image), softmax over the classes,
then per class the `pre_nms_per_class` best boxes above `score_threshold`, greedy
non-maximum suppression at IoU `nms_iou` among them, and the `max_detections` best of
all classes. The greedy suppression is exact: with the candidates sorted by score,
keep_i = valid_i and no kept j < i overlaps i; that recursion is iterated from
keep = valid until nothing changes (after t rounds the first t entries are final, so it
ends within pre_nms_per_class rounds; usually a few).

`coco_metrics` (the task's host_eval_metrics): every host runs `detect` over its eval
rows through EvalContext.run_padded (the same number of calls on every host); the
rows' detections and image sizes (and, without an annotations file, their ground
truth) then go to every host in one EvalContext.host_sum (each host fills its own block
of a [hosts, most rows, ...] array; with one host nothing is exchanged). Host 0 turns
them into COCO results (pixel [x, y, w, h], COCO category ids through the label map)
and runs pycocotools' COCOeval (bbox) against the eval split's instances JSON
(`detection_data.eval_annotations`, or the demo set's), restricted to the evaluated
images, or against ground truth built from the eval batches when there is no JSON. Its
six summary numbers are shared with a last host_sum, so every host returns the same.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import time
import weakref

import numpy as np
import tensorflow as tf

from tfpod.input import boxes as boxes_lib

log = logging.getLogger("tfpod")

AP_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl")  # COCOeval.stats[0:6]
DETECTION_FIELDS = 6  # ymin, xmin, ymax, xmax (normalized), score, label (0: none)
GT_FIELDS = 7  # ymin, xmin, ymax, xmax, label, is_crowd, area
IMAGE_AXES = ("batch", None, None, None)

_DETECTORS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> compiled forward + detect


def pairwise_iou(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """IoU of every box of a with every box of b, batched.

    Args:
      a: float [..., n, 4] corners (ymin, xmin, ymax, xmax).
      b: float [..., m, 4] corners.

    Returns:
      [..., n, m]; 0 where the union is empty.
    """
    ay0, ax0, ay1, ax1 = tf.unstack(a[..., :, None, :], axis=-1)  # each [..., n, 1]
    by0, bx0, by1, bx1 = tf.unstack(b[..., None, :, :], axis=-1)  # each [..., 1, m]
    inter = (tf.maximum(tf.minimum(ay1, by1) - tf.maximum(ay0, by0), 0.0)
             * tf.maximum(tf.minimum(ax1, bx1) - tf.maximum(ax0, bx0), 0.0))  # [..., n, m]
    union = (ay1 - ay0) * (ax1 - ax0) + (by1 - by0) * (bx1 - bx0) - inter
    return tf.math.divide_no_nan(inter, union)


def detect(predictions: tf.Tensor, defaults: np.ndarray, config) -> tf.Tensor:
    """Detections of a batch of SSD predictions (the module docstring).

    Args:
      predictions: float32 [batch, boxes, 4 + classes] (offsets, then logits; class 0 is
        background).
      defaults: float32 [boxes, 4] default boxes, center form.
      config: the model config (score_threshold, nms_iou, pre_nms_per_class, max_detections).

    Returns:
      float32 [batch, max_detections, 6]: (ymin, xmin, ymax, xmax) normalized and
      clipped, score, label 1..classes-1, best first; rows past an image's detections
      are all 0 (label 0).
    """
    predictions = tf.cast(predictions, tf.float32)
    num_boxes, classes = predictions.shape[1], predictions.shape[2] - 5  # classes: without background
    corners = tf.clip_by_value(boxes_lib.decode(predictions[..., :4], defaults), 0.0, 1.0)  # [batch, boxes, 4]
    scores = tf.nn.softmax(predictions[..., 4:], axis=-1)[..., 1:]  # [batch, boxes, classes]
    k = min(config.pre_nms_per_class, num_boxes)
    top, index = tf.math.top_k(tf.transpose(scores, [0, 2, 1]), k)  # [batch, classes, k], best first
    candidates = tf.gather(corners, tf.reshape(index, [-1, classes * k]), batch_dims=1)  # [batch, classes * k, 4]
    candidates = tf.reshape(candidates, [-1, classes, k, 4])
    earlier = tf.constant(np.tril(np.ones((k, k), np.float32), -1))  # [i, j] = 1 where j < i
    overlaps = tf.cast(pairwise_iou(candidates, candidates) > config.nms_iou, tf.float32) * earlier  # [b, c, k, k]
    valid = tf.cast(top > config.score_threshold, tf.float32)  # [batch, classes, k]

    def suppress(keep, changed, rounds):
        del changed
        new = valid * (1.0 - tf.reduce_max(overlaps * keep[..., None, :], axis=-1))  # no kept earlier overlap
        return new, tf.reduce_any(tf.not_equal(new, keep)), rounds + 1

    keep, _, _ = tf.while_loop(lambda keep, changed, rounds: changed & (rounds < k), suppress,
                               (valid, tf.constant(True), tf.constant(0)))
    kept = tf.reshape(tf.where(keep > 0, top, -1.0), [-1, classes * k])  # [batch, classes * k]; -1: dropped
    d = min(config.max_detections, classes * k)
    best, which = tf.math.top_k(kept, d)  # [batch, d]
    found = tf.cast(best > 0, tf.float32)[..., None]  # [batch, d, 1]
    boxes = tf.gather(tf.reshape(candidates, [-1, classes * k, 4]), which, batch_dims=1)  # [batch, d, 4]
    labels = tf.cast(which // k + 1, tf.float32)[..., None]  # [batch, d, 1]
    out = tf.concat([boxes, best[..., None], labels], axis=-1) * found  # [batch, d, 6]
    if d < config.max_detections:
        out = tf.pad(out, [[0, 0], [0, config.max_detections - d], [0, 0]])
    return out


def _detector(model, defaults: np.ndarray, config):
    """The compiled forward pass and `detect` of `model` (one per model)."""
    fn = _DETECTORS.get(model)
    if fn is None:
        fn = tf.function(lambda images: detect(model({"images": images}, training=False), defaults, config))
        _DETECTORS[model] = fn
    return fn


# ---------------------------------------------------------------------------
# Host side


def _host_rows(host_batches, detections: list[np.ndarray], with_gt: bool) -> np.ndarray:
    """This host's real eval rows as one float64 table [rows, width]: source_id, height,
    width, the detections (max_detections * 6) and, with_gt, the ground truth
    (max_boxes * 7)."""
    tables = []
    for batch, found in zip(host_batches, detections):
        real = batch["weights"] > 0  # [rows]
        parts = [batch["source_id"][real, None], batch["image_height"][real, None], batch["image_width"][real, None],
                 found[real].reshape(int(real.sum()), -1)]
        if with_gt:
            gt = np.concatenate([batch["gt_boxes"], batch["gt_classes"][..., None], batch["gt_is_crowd"][..., None],
                                 batch["gt_area"][..., None]], -1)[real]  # [rows, max_boxes, 7]
            parts.append(gt.reshape(int(real.sum()), -1))
        tables.append(np.concatenate([np.asarray(p, np.float64) for p in parts], axis=1))
    return np.concatenate(tables) if tables else np.zeros((0, 0), np.float64)


def _all_rows(context, rows: np.ndarray, width: int) -> np.ndarray:
    """Every host's rows (in host order) on every host: two host_sums (row counts, then rows)."""
    if context.num_hosts == 1:
        return rows
    counts = context.host_sum(np.eye(context.num_hosts)[context.host_id] * len(rows)).round().astype(int)
    most = int(counts.max())
    block = np.zeros((context.num_hosts, most, width))
    block[context.host_id, : len(rows)] = rows.reshape(len(rows), width)
    total = context.host_sum(block).reshape(context.num_hosts, most, width)
    return np.concatenate([total[h, : counts[h]] for h in range(context.num_hosts)])


def _category_ids(label_map, num_classes: int) -> np.ndarray:
    """int64 [num_classes]: label -> COCO category id (index 0, background, maps to 0)."""
    ids = np.arange(num_classes, dtype=np.int64)
    for c in label_map or ():
        ids[int(c["label"])] = int(c["id"])
    return ids


def coco_results(rows: np.ndarray, max_detections: int, category_ids: np.ndarray) -> np.ndarray:
    """COCO detection results [n, 7] (image id, x, y, w, h in pixels, score, category id) of the rows' detections."""
    found = rows[:, 3: 3 + max_detections * DETECTION_FIELDS].reshape(len(rows), max_detections, DETECTION_FIELDS)
    image_id = np.broadcast_to(rows[:, None, 0], found.shape[:2])
    height, width = rows[:, None, 1], rows[:, None, 2]
    real = found[..., 5] > 0  # [rows, max_detections]
    x, y = found[..., 1] * width, found[..., 0] * height
    w, h = (found[..., 3] - found[..., 1]) * width, (found[..., 2] - found[..., 0]) * height
    labels = found[..., 5].round().astype(np.int64)
    out = np.stack([image_id, x, y, w, h, found[..., 4], category_ids[labels]], -1)  # [rows, max_detections, 7]
    return out[real]


def coco_ground_truth(rows: np.ndarray, max_detections: int, category_ids: np.ndarray, label_map) -> dict:
    """A COCO instances dataset of the rows' ground truth (when there is no annotations JSON)."""
    start = 3 + max_detections * DETECTION_FIELDS
    gt = rows[:, start:].reshape(len(rows), -1, GT_FIELDS)  # [rows, max_boxes, 7]
    images, annotations = [], []
    for row, boxes in zip(rows, gt):
        image_id, height, width = int(row[0]), float(row[1]), float(row[2])
        images.append({"id": image_id, "height": height, "width": width})
        for ymin, xmin, ymax, xmax, label, crowd, area in boxes[boxes[:, 4] > 0]:
            w, h = (xmax - xmin) * width, (ymax - ymin) * height
            annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                "category_id": int(category_ids[int(round(label))]),
                                "bbox": [xmin * width, ymin * height, w, h], "area": float(area) or w * h,
                                "iscrowd": int(crowd)})
    names = {int(c["id"]): c["name"] for c in label_map or ()}
    categories = [{"id": int(i), "name": names.get(int(i), str(i))} for i in category_ids[1:]]
    return {"images": images, "annotations": annotations, "categories": categories}


def coco_eval(results: np.ndarray, image_ids: list[int], annotations: str | dict) -> np.ndarray:
    """pycocotools COCOeval (bbox) of `results` on `image_ids`; its prints silenced.

    Args:
      results: [n, 7] (image id, x, y, w, h, score, category id).
      image_ids: the evaluated images.
      annotations: an instances JSON path, or an instances dataset dict.

    Returns:
      float64 [6]: AP, AP50, AP75, APs, APm, APl (-1 where the ground truth has no box
      of that size); zeros when there are no detections.
    """
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    if not len(results):
        return np.zeros(len(AP_NAMES))
    if isinstance(annotations, str):
        with open(annotations) as f:
            annotations = json.load(f)
    # COCOeval reads every annotation's `area` and `iscrowd`, which COCO files written by
    # other programs may leave out: the box's area and 0, as the converter takes them.
    annotations = {**annotations, "annotations": [
        {"area": a["bbox"][2] * a["bbox"][3], "iscrowd": 0, **a} for a in annotations.get("annotations", [])]}
    with contextlib.redirect_stdout(io.StringIO()):
        truth = COCO()
        truth.dataset = annotations
        truth.createIndex()
        evaluator = COCOeval(truth, truth.loadRes(results), "bbox")
        evaluator.params.imgIds = sorted(image_ids)
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return np.asarray(evaluator.stats[: len(AP_NAMES)], np.float64)


def coco_metrics(context, host_batches, defaults: np.ndarray) -> dict:
    """COCO box AP over the eval set (the module docstring); every host returns the same.

    Args:
      context: tfpod.task.EvalContext (its data_config a DetectionDataConfig, or None:
        no label map and ground truth from the batches).
      host_batches: this host's eval batches (the batch contract of models/ssd.py).
      defaults: float32 [boxes, 4] the model's default boxes.

    Returns:
      {"AP", "AP50", "AP75", "APs", "APm", "APl": COCOeval's summary, "coco_images": images
      evaluated}.
    """
    from tfpod.input import detection

    cfg, started = context.model_config, time.time()
    data = context.data_config
    annotations = detection.eval_annotations(data) if data is not None else None
    label_map = detection.label_map(data) if data is not None else None
    size = cfg.image_size
    run = _detector(context.model, defaults, cfg)
    padding = {"images": np.zeros((context.host_rows, size, size, 3), np.float32)}
    outputs = context.run_padded(lambda b: run(b["images"]), [{"images": b["images"]} for b in host_batches],
                                 {"images": IMAGE_AXES}, padding)  # per batch [rows, max_detections, 6]
    rows = _host_rows(host_batches, outputs, with_gt=annotations is None)
    width = 3 + cfg.max_detections * DETECTION_FIELDS
    if annotations is None:  # a host without batches takes the configured max_boxes
        default = (data or detection.DetectionDataConfig()).max_boxes
        width += (host_batches[0]["gt_boxes"].shape[1] if host_batches else default) * GT_FIELDS
    rows = _all_rows(context, rows.reshape(-1, width), width)
    stats = np.zeros(len(AP_NAMES))
    if context.is_chief:
        ids = _category_ids(label_map, cfg.num_classes)
        results = coco_results(rows, cfg.max_detections, ids)
        truth = annotations or coco_ground_truth(rows, cfg.max_detections, ids, label_map)
        stats = coco_eval(results, [int(i) for i in rows[:, 0]], truth)
        log.info("COCO eval of %d images, %d detections (%.1f s): %s", len(rows), len(results), time.time() - started,
                 ", ".join(f"{name} {value:.4f}" for name, value in zip(AP_NAMES, stats)))
    if context.num_hosts > 1:
        stats = context.host_sum(stats)  # host 0's numbers on every host (the others add zeros)
    return {**{name: float(v) for name, v in zip(AP_NAMES, stats)}, "coco_images": float(len(rows))}
