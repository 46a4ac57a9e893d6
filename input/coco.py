"""COCO images + an instances JSON -> Model Garden's detection TFRecords and a label map.

    python -m tfpod.input.coco --images=DIR --annotations=instances.json --output=PREFIX [--num_shards=N]

Input: a folder of images and a COCO instances JSON (`images` with id, file_name and
optionally height and width; `annotations` with image_id, category_id, bbox [x, y, w, h]
in pixels, area, iscrowd; `categories` with id and name). Category ids may be numbered
any way (COCO's 1..90 with gaps, or 7, 300, 12).

Output: `PREFIX-00000-of-0000N.tfrecord` shards (images spread round-robin in the
JSON's order) of `tf.train.Example`s in the format Model Garden's
`official.vision.dataloaders.tf_example_decoder.TfExampleDecoder` reads:
  image/encoded             bytes    the JPEG file's bytes as they are (other formats,
                                     e.g. PNG, re-encoded to JPEG at quality 95)
  image/format              bytes    b"jpeg"
  image/height, image/width int64    pixels
  image/source_id           bytes    the COCO image id as a decimal string
  image/object/bbox/{ymin,xmin,ymax,xmax}  float  the boxes / image size, clipped to [0, 1]
  image/object/class/label  int64    contiguous labels 1..K, in the order of category id
  image/object/is_crowd     int64    COCO's iscrowd
  image/object/area         float    COCO's area (pixels; w * h when absent)
and `PREFIX.labels.json` = {"categories": [{"label": 1, "id": <COCO id>, "name": ...}, ...]}
(label -> COCO category id and name; `load_label_map` reads it back).

Images without annotations are kept (no boxes). Boxes of zero width or height are
skipped, as Model Garden's create_coco_tf_record.py skips them, and counted. Boxes
may overhang the image by up to OVERHANG pixels (rounding) and are clipped; further out
is an error, as are a missing folder or file, a JSON without images, annotations or
categories, an annotation of an unknown image or category, and an image whose file
is not the JSON's size. Each error is one line naming the JSON entry and the fix.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import logging
import os
import sys

import tensorflow as tf

from tfpod import UserError

log = logging.getLogger("tfpod")

OVERHANG = 1.0  # pixels a box may pass the image edge (rounding); clipped
JPEG_QUALITY = 95  # re-encoded images (PNG, ...)
PROGRESS_EVERY = 1000  # images between progress lines
LABELS_SUFFIX = ".labels.json"


def shard_path(prefix: str, index: int, num_shards: int) -> str:
    """The name of shard `index` of `num_shards` under `prefix`."""
    return f"{prefix}-{index:05d}-of-{num_shards:05d}.tfrecord"


def label_map_path(prefix: str) -> str:
    """The label map written beside the shards of `prefix`."""
    return prefix + LABELS_SUFFIX


def load_label_map(path: str) -> list[dict]:
    """The categories of a PREFIX.labels.json: [{"label": 1, "id": <COCO id>, "name": str}, ...].

    Raises:
      UserError: the file is missing or not a label map with labels 1..K in order.
    """
    if not tf.io.gfile.exists(path):
        raise UserError(f"label map {path} does not exist: give the PREFIX.labels.json that python -m "
                        "tfpod.input.coco wrote beside the records")
    try:
        with tf.io.gfile.GFile(path) as f:
            categories = [{"label": int(c["label"]), "id": int(c["id"]), "name": str(c["name"])}
                          for c in json.load(f)["categories"]]
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"label map {path} is not a tfpod label map ({type(e).__name__}: {e}): write it with "
                        "python -m tfpod.input.coco") from None
    labels = [c["label"] for c in categories]
    if not labels or labels != list(range(1, len(labels) + 1)):
        raise UserError(f"label map {path} has labels {labels[:8]}{'...' if len(labels) > 8 else ''}, not 1..K in "
                        "order: write it with python -m tfpod.input.coco")
    return categories


def _load_json(path: str) -> dict:
    """The instances JSON, with its images, annotations and categories lists checked."""
    if not os.path.isfile(path):
        raise UserError(f"annotations file {path} does not exist: pass --annotations=a COCO instances JSON "
                        "(e.g. annotations/instances_val2017.json)")
    try:
        with open(path) as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"annotations file {path} is not JSON ({e}): give a COCO instances JSON") from None
    if not isinstance(data, dict):
        raise UserError(f"annotations file {path} holds a {type(data).__name__}, not a COCO object: give a COCO "
                        "instances JSON")
    for key in ("images", "annotations", "categories"):
        if not isinstance(data.get(key), list):
            raise UserError(f"annotations file {path} has no {key!r} list: give a COCO instances JSON with images, "
                            "annotations and categories (image_info_test JSONs have no boxes to train on)")
    return data


def _categories(data: dict, path: str) -> list[dict]:
    """The label map: categories sorted by id, labelled 1..K."""
    seen = {}
    for c in data["categories"]:
        if not isinstance(c, dict) or "id" not in c:
            raise UserError(f"annotations file {path}: category {c!r} has no 'id': give each category an id and name")
        if int(c["id"]) in seen:
            raise UserError(f"annotations file {path}: category id {c['id']} appears twice: give each category "
                            "a distinct id")
        seen[int(c["id"])] = str(c.get("name", c["id"]))
    if not seen:
        raise UserError(f"annotations file {path} has an empty 'categories' list: list the categories the boxes use")
    return [{"label": k + 1, "id": cid, "name": seen[cid]} for k, cid in enumerate(sorted(seen))]


def _image_bytes(path: str, image: dict, json_path: str) -> tuple[bytes, int, int]:
    """(JPEG bytes, height, width) of one image; other formats re-encoded to JPEG."""
    from PIL import Image, UnidentifiedImageError

    with open(path, "rb") as f:
        raw = f.read()
    try:
        with Image.open(io.BytesIO(raw)) as im:
            width, height = im.size
            if im.format != "JPEG":
                buf = io.BytesIO()
                im.convert("RGB").save(buf, "JPEG", quality=JPEG_QUALITY)
                raw = buf.getvalue()
    except (UnidentifiedImageError, OSError) as e:
        raise UserError(f"image file {path} (image id {image['id']} in {json_path}) is not a readable image ({e}): "
                        "replace the file or remove the image from the JSON") from None
    for key, actual in (("height", height), ("width", width)):
        if key in image and int(image[key]) != actual:
            raise UserError(f"image file {path} is {width}x{height} pixels but {json_path} says {key} "
                            f"{image[key]} (image id {image['id']}): fix the JSON's height and width or the file")
    return raw, height, width


def _unit(v: float) -> float:
    return min(max(v, 0.0), 1.0)


def _objects(annotations: list[dict], height: int, width: int, labels: dict[int, int], image: dict,
             json_path: str) -> tuple[dict, int]:
    """An image's annotations as feature lists, and the number of zero-size boxes skipped."""
    out = {k: [] for k in ("ymin", "xmin", "ymax", "xmax", "label", "is_crowd", "area")}
    skipped = 0
    for a in annotations:
        where = f"annotation {a.get('id', '?')} of image {image['id']} ({image['file_name']}) in {json_path}"
        if a.get("category_id") not in labels:
            raise UserError(f"{where} has category_id {a.get('category_id')!r}, which is not in the JSON's "
                            f"categories (ids {sorted(labels)[:10]}): fix the annotation or add the category")
        try:
            x, y, w, h = (float(v) for v in a["bbox"])
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{where} has no bbox [x, y, width, height]: give each annotation a pixel bbox") from None
        if w < 0 or h < 0 or x < -OVERHANG or y < -OVERHANG or x + w > width + OVERHANG or y + h > height + OVERHANG:
            raise UserError(f"{where}: bbox {a['bbox']} (x, y, width, height) lies outside the {width}x{height} "
                            "image: fix the box or remove the annotation")
        if w == 0 or h == 0:
            skipped += 1
            continue
        out["ymin"].append(_unit(y / height))
        out["xmin"].append(_unit(x / width))
        out["ymax"].append(_unit((y + h) / height))
        out["xmax"].append(_unit((x + w) / width))
        out["label"].append(labels[a["category_id"]])
        out["is_crowd"].append(int(a.get("iscrowd", 0)))
        out["area"].append(float(a.get("area", w * h)))
    return out, skipped


def detection_example(jpeg: bytes, height: int, width: int, source_id: int, objects: dict) -> tf.train.Example:
    """One record in Model Garden's detection format (the module docstring)."""
    def b(v):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=v))

    def i(v):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=v))

    def f(v):
        return tf.train.Feature(float_list=tf.train.FloatList(value=v))

    feature = {
        "image/encoded": b([jpeg]), "image/format": b([b"jpeg"]), "image/height": i([height]),
        "image/width": i([width]), "image/source_id": b([str(source_id).encode()]),
        "image/object/class/label": i(objects["label"]), "image/object/is_crowd": i(objects["is_crowd"]),
        "image/object/area": f(objects["area"]),
    }
    for k in ("ymin", "xmin", "ymax", "xmax"):
        feature[f"image/object/bbox/{k}"] = f(objects[k])
    return tf.train.Example(features=tf.train.Features(feature=feature))


def _check_output(prefix: str, num_shards: int) -> None:
    """Refuses an output prefix holding shards of another count (one glob would read both)."""
    five = "[0-9]" * 5
    others = [p for p in glob.glob(f"{glob.escape(prefix)}-{five}-of-{five}.tfrecord")
              if not p.endswith(f"-of-{num_shards:05d}.tfrecord")]
    if others:
        raise UserError(f"output {prefix} already has shards of another count ({os.path.basename(sorted(others)[0])}): "
                        "remove them or choose another --output, so one glob reads one data set")


def convert(images_dir: str, annotations_path: str, output_prefix: str, num_shards: int = 1) -> dict:
    """Converts COCO images + instances JSON into detection TFRecord shards and a label map.

    The JSON and the files' presence are checked first; an error in an image or its
    annotations stops the conversion with nothing written (shards are written under
    temporary names and renamed, and the label map written, when all are complete).

    Args:
      images_dir: the folder holding the JSON's images[].file_name.
      annotations_path: the COCO instances JSON.
      output_prefix: shards go to PREFIX-00000-of-0000N.tfrecord, the label map to
        PREFIX.labels.json (the folder is created).
      num_shards: N, at least 1.

    Returns:
      Summary: images, boxes, images_without_boxes, skipped_empty_boxes, categories,
      num_shards, files (the shards' glob), label_map (its path).

    Raises:
      UserError: bad input (the module docstring), one line.
    """
    if num_shards < 1:
        raise UserError(f"--num_shards={num_shards} must be at least 1")
    if not os.path.isdir(images_dir):
        raise UserError(f"images folder {images_dir} does not exist: pass --images=the folder holding the files "
                        "named in the JSON's images[].file_name")
    data = _load_json(annotations_path)
    categories = _categories(data, annotations_path)
    labels = {c["id"]: c["label"] for c in categories}
    images = data["images"]
    if not images:
        raise UserError(f"annotations file {annotations_path} has an empty 'images' list: give the images to convert")
    if num_shards > len(images):
        raise UserError(f"--num_shards={num_shards} is more than the {len(images)} images of {annotations_path}: use "
                        f"at most {len(images)} shards (an empty shard is refused when read)")
    by_image: dict[int, list[dict]] = {}
    ids = set()
    for image in images:
        if not isinstance(image, dict) or "id" not in image or "file_name" not in image:
            raise UserError(f"annotations file {annotations_path}: image entry {str(image)[:80]} lacks id or "
                            "file_name: give each image an id and file_name")
        try:
            int(image["id"])
        except (TypeError, ValueError):
            raise UserError(f"annotations file {annotations_path}: image id {image['id']!r} is not an integer: COCO "
                            "image ids are integers (they become image/source_id)") from None
        if image["id"] in ids:
            raise UserError(f"annotations file {annotations_path}: image id {image['id']} appears twice: give each "
                            "image a distinct id")
        ids.add(image["id"])
        by_image[image["id"]] = []
        if not os.path.isfile(os.path.join(images_dir, image["file_name"])):
            raise UserError(f"image file {image['file_name']} (image id {image['id']} in {annotations_path}) is not "
                            f"in {images_dir}: pass the right --images folder or remove the image from the JSON")
    for a in data["annotations"]:
        a = a if isinstance(a, dict) else {"id": repr(a)[:40]}
        if a.get("image_id") not in ids:
            raise UserError(f"annotation {a.get('id', '?')} in {annotations_path} names image_id "
                            f"{a.get('image_id')!r}, which is not in its images: fix the annotation or add the image")
        by_image[a["image_id"]].append(a)
    _check_output(output_prefix, num_shards)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)

    paths = [shard_path(output_prefix, k, num_shards) for k in range(num_shards)]
    writers = [tf.io.TFRecordWriter(p + ".tmp") for p in paths]
    summary = {"images": 0, "boxes": 0, "images_without_boxes": 0, "skipped_empty_boxes": 0}
    try:
        for n, image in enumerate(images):
            jpeg, height, width = _image_bytes(os.path.join(images_dir, image["file_name"]), image, annotations_path)
            objects, skipped = _objects(by_image[image["id"]], height, width, labels, image, annotations_path)
            writers[n % num_shards].write(
                detection_example(jpeg, height, width, int(image["id"]), objects).SerializeToString())
            summary["images"] += 1
            summary["boxes"] += len(objects["label"])
            summary["images_without_boxes"] += not objects["label"]
            summary["skipped_empty_boxes"] += skipped
            if (n + 1) % PROGRESS_EVERY == 0:
                log.info("coco: %d of %d images converted", n + 1, len(images))
    except BaseException:
        for w, p in zip(writers, paths):
            w.close()
            if os.path.exists(p + ".tmp"):
                os.remove(p + ".tmp")
        raise
    for w, p in zip(writers, paths):
        w.close()
        os.replace(p + ".tmp", p)
    labels_path = label_map_path(output_prefix)
    with open(labels_path, "w") as f:
        json.dump({"categories": categories}, f, indent=1)
    summary.update(categories=len(categories), num_shards=num_shards,
                   files=f"{output_prefix}-*-of-{num_shards:05d}.tfrecord", label_map=labels_path)
    log.info("coco: wrote %d images (%d boxes, %d images without boxes, %d zero-size boxes skipped) of %d "
             "categories to %s and %s", summary["images"], summary["boxes"], summary["images_without_boxes"],
             summary["skipped_empty_boxes"], len(categories), summary["files"], labels_path)
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfpod.input.coco", description=__doc__.splitlines()[0])
    parser.add_argument("--images", required=True, help="folder of the images named in the JSON")
    parser.add_argument("--annotations", required=True, help="COCO instances JSON (e.g. instances_train2017.json)")
    parser.add_argument("--output", required=True, help="output prefix: PREFIX-00000-of-0000N.tfrecord, "
                        "PREFIX.labels.json")
    parser.add_argument("--num_shards", type=int, default=1, help="TFRecord shards (default 1; e.g. 256 for "
                        "COCO train2017, at least the number of hosts)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        summary = convert(args.images, args.annotations, args.output, args.num_shards)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
