"""The detection demo set: coloured shapes on noise, written as COCO data and converted.

    python -m tfpod.input.detection [--data_dir=DIR] [--force]     (writes it)

Each 64x64 JPEG holds 1-4 objects of three categories at random sizes (sides 10-40
pixels) and places, drawn in order (a later object may cover part of an earlier one;
placements overlapping an earlier box at IoU > MAX_OVERLAP are redrawn): a filled
rectangle (COCO category id 3), a filled ellipse (17) and a filled triangle pointing
up (42), each in its category's colour, shifted per object and with pixel noise, on
a background of one random grey with noise. The category ids are deliberately not
contiguous: the converter's labels 1..3 map back to them through the label map. A box
is the tight pixel extent of its shape; its area is the shape's pixel count. Seeded
numpy (train seed 0, val seed 1): the same set on every machine.

It is written the way a user's data is, then converted by `coco.convert`:

    detection-shapes64/
      train/000000000001.jpg ...                  1024 images (ids 1..1024)
      val/000000100001.jpg ...                    128 images (ids 100001..100128)
      annotations/instances_{train,val}.json      COCO instances JSON
      shapes-train-0000K-of-00008.tfrecord, shapes-train.labels.json
      shapes-val-0000K-of-00002.tfrecord, shapes-val.labels.json
      manifest.json                               counts; written last

cached in `$TFPOD_DATA_DIR/detection-shapes64` (else `~/.cache/tfpod/detection-shapes64`),
prepared once under a lock into a temporary folder renamed into place when complete.
"""

from __future__ import annotations

import io
import json
import logging
import os

import numpy as np

from tfpod.input import coco
from tfpod.input.demo import data_root, ensure_prepared, staged

log = logging.getLogger("tfpod")

DEMO_SIZE = 64  # pixels per side
SPLITS = {"train": (1024, 8, 1, 0), "val": (128, 2, 100001, 1)}  # images, shards, first image id, seed
CATEGORIES = ((3, "rectangle", (220, 60, 60)), (17, "ellipse", (60, 200, 80)), (42, "triangle", (60, 90, 230)))
MAX_OBJECTS = 4
SIDES = (10, 40)  # object width and height in pixels, inclusive
MAX_OVERLAP = 0.3  # IoU with an earlier box above which a placement is redrawn
JPEG_QUALITY = 90
MANIFEST = "manifest.json"


def default_data_dir() -> str:
    return os.path.join(data_root(), f"detection-shapes{DEMO_SIZE}")


def split_files(data_dir: str, split: str) -> str:
    """The glob of a demo split's TFRecord shards ('train' or 'val')."""
    return os.path.join(data_dir, f"shapes-{split}-*.tfrecord")


def annotations_path(data_dir: str, split: str) -> str:
    """The COCO instances JSON of a demo split."""
    return os.path.join(data_dir, "annotations", f"instances_{split}.json")


def _box_iou(a: tuple, b: tuple) -> float:
    """IoU of two (x, y, w, h) pixel boxes."""
    iw = max(0, min(a[0] + a[2], b[0] + b[2]) - max(a[0], b[0]))
    ih = max(0, min(a[1] + a[3], b[1] + b[3]) - max(a[1], b[1]))
    inter = iw * ih
    return inter / (a[2] * a[3] + b[2] * b[3] - inter)


def _mask(kind: int, x: int, y: int, w: int, h: int) -> np.ndarray:
    """bool [64, 64]: the pixels of a shape of `kind` (0 rectangle, 1 ellipse, 2 triangle) in its box."""
    rows = np.arange(DEMO_SIZE, dtype=np.float32)[:, None] + 0.5  # [64, 1] pixel centers
    cols = np.arange(DEMO_SIZE, dtype=np.float32)[None, :] + 0.5  # [1, 64]
    inside = (rows >= y) & (rows < y + h) & (cols >= x) & (cols < x + w)  # [64, 64]
    if kind == 1:
        inside &= ((rows - y - h / 2) / (h / 2)) ** 2 + ((cols - x - w / 2) / (w / 2)) ** 2 <= 1.0
    elif kind == 2:
        inside &= np.abs(cols - x - w / 2) <= (rows - y) / h * (w / 2)  # apex at the top center
    return inside


def draw_image(rng: np.random.Generator) -> tuple[np.ndarray, list[dict]]:
    """One demo image and its objects.

    Returns:
      uint8 [64, 64, 3], and per object {"kind": 0..2, "bbox": [x, y, w, h] (tight pixel
      extent), "area": pixels of the shape}.
    """
    image = rng.normal(rng.uniform(70, 160), 12.0, (DEMO_SIZE, DEMO_SIZE, 3))  # [64, 64, 3] grey + noise
    objects, boxes = [], []
    for _ in range(int(rng.integers(1, MAX_OBJECTS + 1))):
        for _ in range(20):  # placements overlapping an earlier box too much are redrawn
            w, h = (int(v) for v in rng.integers(SIDES[0], SIDES[1] + 1, 2))
            x, y = int(rng.integers(0, DEMO_SIZE - w + 1)), int(rng.integers(0, DEMO_SIZE - h + 1))
            if all(_box_iou((x, y, w, h), b) <= MAX_OVERLAP for b in boxes):
                break
        else:
            continue
        kind = int(rng.integers(0, len(CATEGORIES)))
        mask = _mask(kind, x, y, w, h)  # [64, 64]
        colour = np.array(CATEGORIES[kind][2], np.float64) + rng.uniform(-20, 20, 3)  # [3]
        image[mask] = colour + rng.normal(0.0, 12.0, (int(mask.sum()), 3))
        ys, xs = np.nonzero(mask)
        box = (int(xs.min()), int(ys.min()), int(xs.max() + 1 - xs.min()), int(ys.max() + 1 - ys.min()))
        boxes.append(box)
        objects.append({"kind": kind, "bbox": [float(v) for v in box], "area": float(mask.sum())})
    return np.clip(np.round(image), 0, 255).astype(np.uint8), objects


def write_split(root: str, split: str) -> str:
    """Writes a split's JPEGs into root/split and its instances JSON; returns the JSON's path."""
    from PIL import Image

    count, _, first_id, seed = SPLITS[split]
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(root, split), exist_ok=True)
    images, annotations = [], []
    for k in range(count):
        image_id = first_id + k
        pixels, objects = draw_image(rng)
        name = f"{image_id:012d}.jpg"
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=JPEG_QUALITY)
        with open(os.path.join(root, split, name), "wb") as f:
            f.write(buf.getvalue())
        images.append({"id": image_id, "file_name": name, "height": DEMO_SIZE, "width": DEMO_SIZE})
        for obj in objects:
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id":
                                CATEGORIES[obj["kind"]][0], "bbox": obj["bbox"], "area": obj["area"], "iscrowd": 0})
    path = annotations_path(root, split)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"info": {"description": "tfpod detection demo: shapes on noise"}, "images": images,
                   "annotations": annotations,
                   "categories": [{"id": cid, "name": name, "supercategory": "shape"} for cid, name, _ in CATEGORIES]},
                  f)
    return path


def prepare(data_dir: str, force: bool = False) -> dict:
    """Writes the demo set into data_dir (atomically); returns its manifest."""
    manifest_path = os.path.join(data_dir, MANIFEST)
    if os.path.exists(manifest_path) and not force:
        with open(manifest_path) as f:
            return json.load(f)
    with staged(data_dir, ".detection-") as tmp:
        manifest = {"source": "tfpod.input.detection_demo", "image_size": DEMO_SIZE,
                    "categories": {cid: name for cid, name, _ in CATEGORIES}}
        for split, (_, shards, _, _) in SPLITS.items():
            summary = coco.convert(os.path.join(tmp, split), write_split(tmp, split),
                                   os.path.join(tmp, f"shapes-{split}"), shards)
            manifest[f"{split}_images"], manifest[f"{split}_boxes"] = summary["images"], summary["boxes"]
            manifest[f"{split}_shards"] = shards
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
    log.info("prepared the detection demo set: %d train and %d val images -> %s", manifest["train_images"],
             manifest["val_images"], data_dir)
    return manifest


def ensure(data_dir: str | None = None) -> str:
    """The demo set's folder, preparing it first if needed (cached, process-safe)."""
    data_dir = data_dir or default_data_dir()
    return ensure_prepared(data_dir, os.path.exists(os.path.join(data_dir, MANIFEST)), prepare)
