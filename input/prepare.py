"""Prepare the default corpus: the Python standard library source -> TFRecord shards + vocabulary.

    python -m tfpod.input.prepare [--data_dir=DIR] [--vocab_size=2048] [--force]
    python -m tfpod.input.prepare --vocab_from='my/*.txt' --vocab_size=8000 --vocab_out=my.model

The second form trains a SentencePiece vocabulary on your own text files (each line a
sentence; TFRecord files of a `text` feature too) with tfpod's special ids, for
`lm_data.vocab_path`. (Megatron's pre-tokenized `.bin/.idx` datasets: `python -m tfpod.input.megatron`.)

Every `.py` file of the running interpreter's standard library (site-packages
excluded) is one document. Files go to the held-out eval split by a hash of their
path (about 5%), so no file is in both splits. Each split is written as many TFRecord
shards of `tf.train.Example`s with features `text` (the file's source, bytes) and `path`
(its path relative to the stdlib folder). A SentencePiece BPE vocabulary is trained on
a seeded sample of the train split's lines: `pad=0, unk=1, bos=2, eos=3`, then the user
symbols `[MASK]=4, [CLS]=5, [SEP]=6`; whitespace is kept as is and unknown characters
fall back to bytes, so decoding gives back the exact source.

The result is cached in `data_dir` (default `$TFPOD_DATA_DIR`, else
`~/.cache/tfpod/pystdlib-<python version>`) and reused; the trainer calls `ensure` on
first use. Several processes on one machine may call `ensure` at once: one prepares
under a lock, writing into a temporary folder that is renamed into place when complete.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import sys
import sysconfig

from tfpod import UserError
from tfpod.input.common import reads_as_tfrecord
from tfpod.input.demo import cache_lock, data_root, ensure_prepared, staged

log = logging.getLogger("tfpod")

TRAIN_SHARDS = 32
EVAL_SHARDS = 4
EVAL_PERCENT = 5
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
MASK_ID, CLS_ID, SEP_ID = 4, 5, 6
SPM_SAMPLE_LINES = 200_000
MANIFEST = "manifest.json"


def default_data_dir() -> str:
    """$TFPOD_DATA_DIR itself when set (the corpus predates the other demo sets), else a folder in the cache."""
    if os.environ.get("TFPOD_DATA_DIR"):
        return os.environ["TFPOD_DATA_DIR"]
    version = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    return os.path.join(data_root(), f"pystdlib-{version}")


def stdlib_files() -> list[tuple[str, str]]:
    """[(relative path, absolute path)] of the stdlib's .py files, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                out.append((os.path.relpath(path, root), path))
    return sorted(out)


def is_eval(rel_path: str) -> bool:
    """The held-out split, by file: a stable hash of the relative path."""
    return int(hashlib.sha256(rel_path.encode()).hexdigest(), 16) % 100 < EVAL_PERCENT


def split_paths(data_dir: str, split: str) -> str:
    """The glob pattern of a split's shards."""
    return os.path.join(data_dir, f"{split}-*.tfrecord")


def vocab_path(data_dir: str, vocab_size: int) -> str:
    return os.path.join(data_dir, f"spm{vocab_size}.model")


def _write_shards(docs, out_dir: str, split: str, num_shards: int) -> list[str]:
    import tensorflow as tf

    names = [os.path.join(out_dir, f"{split}-{i:05d}-of-{num_shards:05d}.tfrecord") for i in range(num_shards)]
    writers = [tf.io.TFRecordWriter(n) for n in names]
    try:
        for i, (rel, text) in enumerate(docs):
            example = tf.train.Example(features=tf.train.Features(feature={
                "text": tf.train.Feature(bytes_list=tf.train.BytesList(value=[text])),
                "path": tf.train.Feature(bytes_list=tf.train.BytesList(value=[rel.encode()])),
            }))
            writers[i % num_shards].write(example.SerializeToString())
    finally:
        for w in writers:
            w.close()
    return names


def train_vocab(lines: list[str], vocab_size: int, out_path: str, seed: int = 0) -> None:
    """Trains a SentencePiece BPE model on a seeded sample of lines (deterministic)."""
    import sentencepiece as spm

    rng = random.Random(seed)
    sample = rng.sample(lines, min(SPM_SAMPLE_LINES, len(lines)))
    try:
        with open(out_path, "wb") as f:
            _train_spm(spm, sample, f, vocab_size)
    except RuntimeError as e:  # e.g. fewer pieces than the corpus has characters
        if os.path.exists(out_path):
            os.remove(out_path)
        reason = str(e).split("]")[-1].strip() or str(e)
        raise UserError(f"cannot train a {vocab_size}-piece SentencePiece vocabulary on the corpus ({reason}): "
                        "use a larger vocab_size (2048 is the default)") from None


def _train_spm(spm, sample: list[str], f, vocab_size: int) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sample),
        model_writer=f,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        allow_whitespace_only_pieces=True,
        split_digits=True,
        pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
        user_defined_symbols=["[MASK]", "[CLS]", "[SEP]"],
        input_sentence_size=0,
        shuffle_input_sentence=False,
        num_threads=2,
        minloglevel=2,
    )


def _read_docs():
    docs = {"train": [], "eval": []}
    for rel, path in stdlib_files():
        with open(path, "rb") as f:
            text = f.read()
        if text.strip():
            docs["eval" if is_eval(rel) else "train"].append((rel, text))
    return docs


def prepare(data_dir: str, vocab_sizes: tuple[int, ...] = (2048,), force: bool = False) -> dict:
    """Writes the corpus and vocabularies into data_dir (atomically); returns the manifest."""
    manifest_path = os.path.join(data_dir, MANIFEST)
    if os.path.exists(manifest_path) and not force:
        manifest = json.load(open(manifest_path))
        missing = [v for v in vocab_sizes if not os.path.exists(vocab_path(data_dir, v))]
        if not missing:
            return manifest
        lines = _train_lines(data_dir)
        for v in missing:  # a new vocabulary size for an existing corpus
            tmp = vocab_path(data_dir, v) + ".tmp"
            train_vocab(lines, v, tmp)
            os.replace(tmp, vocab_path(data_dir, v))
        manifest["vocab_sizes"] = sorted(set(manifest["vocab_sizes"]) | set(vocab_sizes))
        _write_json(manifest_path, manifest)
        return manifest
    with staged(data_dir, ".prepare-") as tmp:
        docs = _read_docs()
        log.info("preparing the stdlib corpus: %d train and %d eval files -> %s",
                 len(docs["train"]), len(docs["eval"]), data_dir)
        _write_shards(docs["train"], tmp, "train", TRAIN_SHARDS)
        _write_shards(docs["eval"], tmp, "eval", EVAL_SHARDS)
        lines = [l for _, text in docs["train"] for l in text.decode("utf-8", "replace").splitlines() if l.strip()]
        for v in vocab_sizes:
            train_vocab(lines, v, vocab_path(tmp, v))
        manifest = {
            "python": sys.version.split()[0],
            "train_files": len(docs["train"]), "eval_files": len(docs["eval"]),
            "train_bytes": sum(len(t) for _, t in docs["train"]), "eval_bytes": sum(len(t) for _, t in docs["eval"]),
            "train_shards": TRAIN_SHARDS, "eval_shards": EVAL_SHARDS, "vocab_sizes": sorted(vocab_sizes),
            "special_ids": {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID,
                            "mask": MASK_ID, "cls": CLS_ID, "sep": SEP_ID},
        }
        _write_json(os.path.join(tmp, MANIFEST), manifest)
    return manifest


def _train_lines(data_dir: str) -> list[str]:
    import tensorflow as tf

    lines = []
    for rec in tf.data.TFRecordDataset(sorted(tf.io.gfile.glob(split_paths(data_dir, "train")))):
        ex = tf.train.Example.FromString(rec.numpy())
        text = ex.features.feature["text"].bytes_list.value[0].decode("utf-8", "replace")
        lines.extend(l for l in text.splitlines() if l.strip())
    return lines


def _write_json(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def vocab_from_files(pattern: str, vocab_size: int, out_path: str, text_feature: str = "text") -> int:
    """Trains a vocabulary like the default corpus's (tfpod's special ids) on the lines of the
    files `pattern` names (comma-separated globs; TFRecord files: their `text_feature`).

    Returns:
      How many lines the sample drew from.

    Raises:
      UserError: no file matches, or out_path exists (nothing is overwritten).
    """
    import tensorflow as tf

    paths = sorted({p for glob in pattern.split(",") for p in tf.io.gfile.glob(glob.strip())})
    if not paths:
        raise UserError(f"--vocab_from={pattern!r} matches no file: pass a glob of your text files")
    if os.path.exists(out_path):
        raise UserError(f"--vocab_out={out_path} exists: write the vocabulary to a new file (nothing is overwritten)")
    lines = []
    for path in paths:
        if reads_as_tfrecord(path):
            feature = {text_feature: tf.io.FixedLenFeature([], tf.string)}
            for record in tf.data.TFRecordDataset(path):
                lines += tf.io.parse_single_example(record, feature)[text_feature].numpy().decode().splitlines()
        else:
            with tf.io.gfile.GFile(path) as f:
                lines += f.read().splitlines()
    lines = [line for line in lines if line.strip()]
    train_vocab(lines, vocab_size, out_path)
    return min(len(lines), SPM_SAMPLE_LINES)


def ensure(data_dir: str | None = None, vocab_size: int = 2048) -> str:
    """The prepared corpus folder, preparing it first if needed (cached, process-safe)."""
    data_dir = data_dir or default_data_dir()
    ready = os.path.exists(os.path.join(data_dir, MANIFEST)) and os.path.exists(vocab_path(data_dir, vocab_size))
    return ensure_prepared(data_dir, ready, lambda d: prepare(d, (vocab_size,)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfpod.input.prepare", description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=None, help="output folder (default: $TFPOD_DATA_DIR or the user cache)")
    parser.add_argument("--vocab_size", type=int, action="append", help="SentencePiece vocabulary size(s); default 2048")
    parser.add_argument("--force", action="store_true", help="rebuild even if a prepared corpus is there")
    parser.add_argument("--vocab_from", help="train a vocabulary on these files (comma-separated globs) instead")
    parser.add_argument("--vocab_out", help="with --vocab_from: the SentencePiece .model file to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.vocab_from or args.vocab_out:
        if not (args.vocab_from and args.vocab_out):
            print("error: --vocab_from and --vocab_out go together: the files to learn from and the .model to write",
                  file=sys.stderr)
            return 1
        size = (args.vocab_size or [2048])[0]
        try:
            lines = vocab_from_files(args.vocab_from, size, args.vocab_out)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(json.dumps({"vocab_path": args.vocab_out, "vocab_size": size, "sample_lines": lines,
                          "special_ids": {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID,
                                          "[MASK]": MASK_ID, "[CLS]": CLS_ID, "[SEP]": SEP_ID}}))
        return 0
    data_dir = args.data_dir or default_data_dir()
    sizes = tuple(args.vocab_size or [2048])
    if any(v < 16 for v in sizes):
        print(f"error: --vocab_size={min(sizes)} is too small: use at least 16", file=sys.stderr)
        return 1
    try:
        with cache_lock(data_dir):
            manifest = prepare(data_dir, sizes, force=args.force)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"data_dir": data_dir, **manifest}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
