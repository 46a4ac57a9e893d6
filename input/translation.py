"""Translation input: WMT-format TFRecords -> SentencePiece ids -> fixed-length host batches.

    python -m tfpod.input.translation [--data_dir=DIR] [--force]     (writes the demo set)

Data contract (the TFRecord format tf-models-official's WMT loader reads,
official/nlp/data/wmt_dataloader.py): each record is a `tf.train.Example` with two
bytes features named by `translation_data.src_lang` and `translation_data.tgt_lang`
holding the raw source and target sentence; other features are ignored. Both sides are
tokenized in the graph with one SentencePiece model and EOS appended (the loader's
`add_eos=True`). One host's pipeline:

    files (this host's part, input.files) -> records -> (train: shuffled) -> parse the
    two features -> SentencePiece ids + EOS -> too-long pairs: train filters them out
    (long_pairs='filter', the WMT loader's training behaviour) or truncates them
    (long_pairs='truncate'); eval always truncates (the loader's _maybe_truncate: the
    first length - 1 ids, then EOS) -> padded with 0 to fixed lengths
    -> host batches {inputs int32 [host_rows, src_len], targets int32 [host_rows,
       tgt_len], weights float32 [host_rows, tgt_len] (1 for real target ids, EOS included)}

src_len and tgt_len are the model's (transformer.src_len, transformer.tgt_len; for
evaluation `eval_max_length` may set both, as the model reads any length). The
training stream repeats with static shapes (drop_remainder); evaluation reads its split
once and keeps the short last batch (the trainer pads it with weight-0 rows), at most
`max_eval_examples` examples split evenly over hosts.

Demo data (`prepare`): pairs from the Python standard library of the running
interpreter, test code excluded (test/, tests/ and idle_test/ folders, test_*.py
files). Every function (def and async def) whose docstring has a non-empty first
line gives one pair: source = the function's source text (decorators excluded, the
docstring's lines removed, dedented by the def's indentation), target = the docstring's first line, stripped.
Functions whose body is only the docstring, whose docstring starts on the `def` line
or shares a line with code, and first lines under 3 characters are skipped. Files go to
the eval split by tfpod.input.prepare.is_eval (the LM corpus's split, a hash of the
path), and eval pairs whose source also occurs in the train split are dropped, so the
splits share no function. Features: `code` (source) and `doc` (target), plus `path`
("<file>:<line>"). Written as 8 train and 2 eval shards with a manifest.json of the
counts, cached in `$TFPOD_DATA_DIR/docstrings-<python version>` (else
`~/.cache/tfpod/docstrings-<python version>`), prepared once under a lock into a
temporary folder renamed into place. The tokenizer is the default corpus's SentencePiece
model (tfpod.input.prepare, trained on the same stdlib source, so it covers code and
English; ids pad=0, unk=1, bos=2, eos=3).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import logging
import os
import sys
from typing import ClassVar

import tensorflow as tf

from tfpod import UserError
from tfpod.input import demo, files as files_lib, prepare, records, text
from tfpod.input.common import (DataConfig, ShardInfo, TaskInput, corrupt_finder, file_identity, first_example,
                                host_shard, stream_source)

log = logging.getLogger("tfpod")

PAD_ID, EOS_ID = prepare.PAD_ID, prepare.EOS_ID  # of the prepared vocabulary
FIRST_PIECE = 7  # ids below are special pieces in the prepared vocabulary
DEMO_SRC, DEMO_TGT = "code", "doc"
TRAIN_SHARDS, EVAL_SHARDS = 8, 2
MIN_TARGET_CHARS = 3
MANIFEST = "manifest.json"
LONG_PAIRS = ("filter", "truncate")


@dataclasses.dataclass(frozen=True)
class TranslationDataConfig(DataConfig):
    """The translation data. Attributes map 1:1 to gin `translation_data.<name>`.

    Attributes:
      train_files: glob(s) of WMT-format TFRecords (comma-separated); None: the demo
        set (stdlib function source -> docstring first line, prepared on first use).
      eval_files: the same for the eval split (e.g. newstest2014).
      src_lang, tgt_lang: the bytes features holding source and target text (the WMT
        loader's src_lang / tgt_lang, e.g. 'en' and 'de'; the demo set's 'code', 'doc').
      vocab_path: SentencePiece model of both sides, with pad_id 0 and an EOS piece (as
        Model Garden's train_sentencepiece.py writes); None: transformer.vocab_path, else
        the default corpus's, of `vocab_size` (tfpod.input.prepare).
      vocab_size: vocabulary size to train when preparing the default corpus.
      long_pairs: training pairs longer than transformer.src_len / tgt_len (EOS
        included) are dropped ('filter', the WMT loader) or cut to length, EOS kept
        last ('truncate'). Eval pairs are always truncated.
      eval_max_length: eval pairs are cut to this many tokens per side (Model Garden
        evaluates WMT at 100 while training at 64); None: the model's src_len / tgt_len.
      shuffle_buffer: training pairs in the shuffle buffer (0: no shuffling).
      cycle_length: files read at once per host.
      skip_corrupt: skip unreadable TFRecord data (TensorFlow logs each skip) instead of stopping.
      data_dir: where the demo set is prepared (None: see the module docstring).
    """

    gin_name: ClassVar[str] = "translation_data"

    src_lang: str = DEMO_SRC
    tgt_lang: str = DEMO_TGT
    vocab_path: str | None = None
    vocab_size: int = 2048
    long_pairs: str = "filter"
    eval_max_length: int | None = None
    shuffle_buffer: int = 4096
    skip_corrupt: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.long_pairs not in LONG_PAIRS:
            raise UserError(f"translation_data.long_pairs={self.long_pairs!r}: use one of {', '.join(LONG_PAIRS)}")
        if not self.src_lang or not self.tgt_lang or self.src_lang == self.tgt_lang:
            raise UserError(f"translation_data.src_lang={self.src_lang!r} and tgt_lang={self.tgt_lang!r} must name "
                            "two different features")
        if self.eval_max_length is not None and self.eval_max_length < 2:
            raise UserError(f"translation_data.eval_max_length={self.eval_max_length} must be at least 2 (a token "
                            "and EOS), or None: the model's lengths")
        if self.shuffle_buffer < 0 or self.cycle_length < 1:
            raise UserError(f"translation_data.shuffle_buffer={self.shuffle_buffer} must be >= 0 and "
                            f"translation_data.cycle_length={self.cycle_length} >= 1")
        if self.eval_files and not self.train_files:
            raise UserError("translation_data.eval_files is set without translation_data.train_files: set both, or "
                            "neither for the demo set")


# ---------------------------------------------------------------------------
# The demo set


def default_data_dir() -> str:
    version = ".".join(str(v) for v in sys.version_info[:3])
    return os.path.join(demo.data_root(), f"docstrings-{version}")


def split_paths(data_dir: str, split: str) -> str:
    """The glob pattern of a demo split's shards."""
    return os.path.join(data_dir, f"docstrings-{split}-*.tfrecord")


def is_test_code(rel_path: str) -> bool:
    """Whether a stdlib file is test code (test/, tests/, idle_test/ folders, test_*.py):
    skipped, which leaves the library's own functions and halves the parsing."""
    *folders, name = rel_path.split(os.sep)
    return name.startswith("test_") or any(f in ("test", "tests", "idle_test") for f in folders)


def function_pairs(source: str) -> list[tuple[str, str, int]]:
    """(code without its docstring, docstring's first line, line number) of every
    function with a docstring in one module's source (see the module docstring for
    what is skipped). Raises SyntaxError/ValueError for source `ast` cannot parse."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    pairs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node, clean=True)
        if not doc or not doc.strip() or len(node.body) < 2:
            continue  # no docstring, or nothing but the docstring
        first = doc.strip().splitlines()[0].strip()
        docstring = node.body[0]
        if len(first) < MIN_TARGET_CHARS or docstring.lineno == node.lineno or \
                node.body[1].lineno == docstring.end_lineno:
            continue
        code = lines[node.lineno - 1:docstring.lineno - 1] + lines[docstring.end_lineno:node.end_lineno]
        # Dedent by the def's own indentation (textwrap.dedent would stop at a multi-line
        # string that starts in column 0), so a method's source parses on its own.
        indent = node.col_offset
        code = [line[indent:] if not line[:indent].strip() else line for line in code]
        pairs.append(("".join(code), first, node.lineno))
    return pairs


def _example(code: str, doc: str, where: str) -> tf.train.Example:
    def b(v: str):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[v.encode("utf-8")]))

    return tf.train.Example(features=tf.train.Features(feature={DEMO_SRC: b(code), DEMO_TGT: b(doc), "path": b(where)}))


def prepare_demo(data_dir: str, force: bool = False) -> dict:
    """Writes the demo pairs into data_dir (atomically); returns its manifest."""
    manifest_path = os.path.join(data_dir, MANIFEST)
    if os.path.exists(manifest_path) and not force:
        with open(manifest_path) as f:
            return json.load(f)
    pairs = {"train": [], "eval": []}
    files = {"train": 0, "eval": 0}
    unparsable = 0
    for rel, path in prepare.stdlib_files():
        if is_test_code(rel):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                found = function_pairs(f.read())
        except (SyntaxError, ValueError, UnicodeDecodeError):
            unparsable += 1  # e.g. test files with deliberate syntax errors
            continue
        split = "eval" if prepare.is_eval(rel) else "train"
        files[split] += 1
        pairs[split].extend((code, doc, f"{rel}:{line}") for code, doc, line in found)
    train_code = {code for code, _, _ in pairs["train"]}
    shared = [p for p in pairs["eval"] if p[0] in train_code]  # the same function in two files
    pairs["eval"] = [p for p in pairs["eval"] if p[0] not in train_code]
    with demo.staged(data_dir, ".docstrings-") as tmp:
        for split, n in (("train", TRAIN_SHARDS), ("eval", EVAL_SHARDS)):
            names = [os.path.join(tmp, f"docstrings-{split}-{i:05d}-of-{n:05d}.tfrecord") for i in range(n)]
            writers = [tf.io.TFRecordWriter(name) for name in names]
            try:
                for i, (code, doc, where) in enumerate(pairs[split]):
                    writers[i % n].write(_example(code, doc, where).SerializeToString())
            finally:
                for w in writers:
                    w.close()
        manifest = {
            "source": f"Python {sys.version.split()[0]} standard library: function source -> docstring first line",
            "src_lang": DEMO_SRC, "tgt_lang": DEMO_TGT,
            "train_pairs": len(pairs["train"]), "eval_pairs": len(pairs["eval"]),
            "eval_pairs_dropped_as_in_train": len(shared),
            "train_files": files["train"], "eval_files": files["eval"], "unparsable_files": unparsable,
            "test_code": "excluded",
            "train_shards": TRAIN_SHARDS, "eval_shards": EVAL_SHARDS,
        }
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
    log.info("prepared the docstring demo set: %d train and %d eval pairs -> %s", manifest["train_pairs"],
             manifest["eval_pairs"], data_dir)
    return manifest


def ensure(data_dir: str | None = None) -> str:
    """The demo set's folder, preparing it first if needed (cached, process-safe)."""
    data_dir = data_dir or default_data_dir()
    return demo.ensure_prepared(data_dir, os.path.exists(os.path.join(data_dir, MANIFEST)), prepare_demo)


# ---------------------------------------------------------------------------
# Records and tokenizer


@functools.lru_cache(maxsize=8)
def sentencepiece(vocab_path: str):
    """The SentencePiece model as a host-side processor (detokenization, special ids).

    Raises:
      UserError: the file cannot be loaded, or the model has no EOS piece.
    """
    import sentencepiece as spm

    if vocab_path.endswith(".txt"):
        raise UserError(f"translation_data.vocab_path={vocab_path} looks like a WordPiece vocab.txt: translation "
                        "needs a SentencePiece .model (with EOS and pad_id=0), e.g. from python -m tfpod.input.prepare")
    text.load_tokenizer(vocab_path)  # one-line errors for missing or broken files
    with tf.io.gfile.GFile(vocab_path, "rb") as f:
        processor = spm.SentencePieceProcessor(model_proto=f.read())
    if processor.eos_id() < 0 or processor.pad_id() != PAD_ID:
        raise UserError(f"SentencePiece vocabulary {vocab_path} has eos_id={processor.eos_id()} and pad_id="
                        f"{processor.pad_id()}: translation appends EOS to both sides and pads with id 0 (the "
                        "model masks id 0), so train it with pad_id=0 and an eos_id, as tfpod.input.prepare and "
                        "Model Garden's train_sentencepiece do")
    return processor


def _first_example(path: str) -> tf.train.Example:
    return first_example(path, "replace it with WMT-format TFRecords",
                                  "write tf.train.Examples with the source and target text as bytes features")


def check_features(path: str, src_lang: str, tgt_lang: str) -> None:
    """The first record of `path` must hold bytes features src_lang and tgt_lang.

    Raises:
      UserError: naming the file, the missing feature and the settings to change.
    """
    feature = _first_example(path).features.feature
    for setting, name in (("src_lang", src_lang), ("tgt_lang", tgt_lang)):
        if name not in feature:
            raise UserError(
                f"records in {path} lack feature {name!r} (translation_data.{setting}; found: "
                f"{', '.join(sorted(feature)) or 'none'}): set translation_data.src_lang and "
                "translation_data.tgt_lang to the features holding the source and target text"
            )
        if feature[name].WhichOneof("kind") != "bytes_list":
            raise UserError(f"records in {path}: feature {name!r} (translation_data.{setting}) holds "
                            f"{feature[name].WhichOneof('kind')}, not text: write the sentence as a bytes feature")


def _fit(ids: tf.Tensor, length: int, eos: int) -> tf.Tensor:
    """ids [n] (EOS last) -> [length]: cut to length - 1 ids plus EOS if longer, 0-padded."""
    n = tf.size(ids)
    ids = tf.cond(n > length, lambda: tf.concat([ids[:length - 1], [eos]], axis=0), lambda: ids)
    return tf.pad(ids, [[0, length - tf.size(ids)]], constant_values=PAD_ID)


def translation_dataset(cfg: TranslationDataConfig, pattern: str, vocab_path: str, src_len: int, tgt_len: int,
                        host_rows: int, shard: ShardInfo, seed: int, training: bool) -> tf.data.Dataset:
    """This host's batches of translation pairs (see the module docstring).

    Args:
      cfg: TranslationDataConfig.
      pattern: file glob(s) of the split.
      vocab_path: SentencePiece model of both sides.
      src_len, tgt_len: fixed lengths of inputs and targets (EOS included).
      host_rows: rows per host batch (global batch / hosts).
      shard: this host's place.
      seed: file order and shuffling.
      training: repeat, shuffle and drop/cut long pairs by cfg.long_pairs (else one
        pass, long pairs truncated, at most this host's share of max_eval_examples).

    Returns:
      Host batches {inputs int32 [rows, src_len], targets int32 [rows, tgt_len],
      weights float32 [rows, tgt_len]}; rows = host_rows (evaluation: the last may be shorter).
    """
    plan = host_shard(pattern, shard, seed)
    check_features(plan.files[0], cfg.src_lang, cfg.tgt_lang)
    tokenizer = text.load_tokenizer(vocab_path)
    eos = sentencepiece(vocab_path).eos_id()
    spec = {cfg.src_lang: tf.io.FixedLenFeature([], tf.string), cfg.tgt_lang: tf.io.FixedLenFeature([], tf.string)}
    # At most one reader per file: with the file list repeated, a longer cycle would read
    # copies of one file side by side and yield each record several times in a row.
    ds = records.read(plan, seed, training, min(cfg.cycle_length, len(plan.files)), cfg.skip_corrupt)
    ds = records.shuffled(ds, cfg.shuffle_buffer, seed) if training else records.host_share(
        ds, cfg.max_eval_examples, shard)

    def tokenize(record):
        example = tf.io.parse_single_example(record, spec)
        ids = tokenizer.tokenize(tf.stack([example[cfg.src_lang], example[cfg.tgt_lang]]))  # ragged [2, None]
        source = tf.concat([ids[0], [eos]], axis=0)  # [n + 1] int32
        target = tf.concat([ids[1], [eos]], axis=0)
        return source, target

    ds = ds.map(tokenize, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    if training and cfg.long_pairs == "filter":
        ds = ds.filter(lambda s, t: tf.logical_and(tf.size(s) <= src_len, tf.size(t) <= tgt_len))

    def fixed(source, target):
        target = _fit(target, tgt_len, eos)
        return {"inputs": tf.ensure_shape(_fit(source, src_len, eos), [src_len]),
                "targets": tf.ensure_shape(target, [tgt_len]),
                "weights": tf.ensure_shape(tf.cast(target != PAD_ID, tf.float32), [tgt_len])}

    ds = ds.map(fixed, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return records.batched(ds, host_rows, training)


def vocabulary(cfg: TranslationDataConfig, model_vocab_path: str | None = None) -> str:
    """The SentencePiece model: translation_data.vocab_path, else the model's (transformer.vocab_path),
    else the prepared corpus's of translation_data.vocab_size (prepared on first use)."""
    return cfg.vocab_path or model_vocab_path or prepare.vocab_path(prepare.ensure(None, cfg.vocab_size),
                                                                    cfg.vocab_size)


def translation_input(cfg: TranslationDataConfig, model_config, shard: ShardInfo, seed: int) -> TaskInput:
    """The Transformer's TaskInput: prepares the demo set (and the default vocabulary) on
    first use, and checks the records' features and the vocabulary against the model
    (`vocabulary`; the model's BLEU and serving find the same one)."""
    if cfg.train_files:
        train, evals = cfg.train_files, cfg.eval_files
    else:
        data_dir = ensure(cfg.data_dir)
        train, evals = split_paths(data_dir, "train"), split_paths(data_dir, "eval")
    vocab_path = vocabulary(cfg, model_config.vocab_path)
    pieces = sentencepiece(vocab_path).get_piece_size()
    if pieces > model_config.vocab_size:
        raise UserError(f"vocabulary {vocab_path} has {pieces} pieces but the model has transformer.vocab_size="
                        f"{model_config.vocab_size}: set transformer.vocab_size >= {pieces} or use a smaller "
                        "vocabulary")
    for pattern in (train, evals):  # feature names checked before the model is built
        if pattern:
            check_features(files_lib.host_files(pattern, shard.num_shards, shard.index, seed)[0], cfg.src_lang,
                           cfg.tgt_lang)

    def dataset(pattern, training):
        src_len, tgt_len = model_config.src_len, model_config.tgt_len
        if not training and cfg.eval_max_length:
            src_len = tgt_len = cfg.eval_max_length
        return lambda host_rows: translation_dataset(cfg, pattern, vocab_path, src_len, tgt_len, host_rows, shard,
                                                     seed, training)

    return TaskInput(
        train=dataset(train, True),
        eval=dataset(evals, False) if evals else None,
        find_corrupt=corrupt_finder(train, shard, seed),
        source=stream_source(cfg, "translation_data", train, shard, seed, src_len=model_config.src_len,
                             tgt_len=model_config.tgt_len, vocab=file_identity(vocab_path)),
    )


def main(argv=None) -> int:
    return demo.demo_cli("python -m tfpod.input.translation", __doc__, default_data_dir(),
                            lambda data_dir, force: prepare_demo(data_dir, force=force), argv)


if __name__ == "__main__":
    sys.exit(main())
