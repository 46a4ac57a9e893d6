"""Pre-packed training rows with per-token labels (`lm_data.format='rows'`), and their
conversion from the parquet files Hugging Face `datasets` writes.

A row is what a Hugging Face causal-LM Trainer consumes: `input_ids` [seq_len] and
`labels` [seq_len], labels -100 where no loss is taken (a prompt, padding). MLPerf's Llama 2
70B LoRA reference prepares GovReport (SCROLLS) so (mlcommons/training
llama2_70b_lora/scripts/utils.py `create_datasets`): each example is
"### Summarize the following text:\\n {input}\\n ### Summary:\\n {output}</s>", tokenized,
packed into 8,192-token rows (`group_texts`); training rows' labels are their ids, eval
rows' labels are -100 over each prompt and its last token. The reference reads those rows
from parquet (`train*.parquet`, `validation*.parquet`).

    python -m tfpod.input.rows --from='DIR/train*.parquet' --out=DIR/rows/train --shards=8
    python -m tfpod.input.rows --from='DIR/validation*.parquet' --out=DIR/rows/validation

writes them in order as TFRecords of int64 lists `ids` and `labels` (a missing labels column:
the ids, as `group_texts` makes them). Read with `lm_data.format='rows'`, a row becomes a
batch row the way the Trainer's loss reads it (position t predicts labels[t + 1]):

    inputs = ids, targets[t] = labels[t + 1], weights[t] = 1 where labels[t + 1] != -100
    (the last position: weight 0)

so tfpod's loss, the weighted mean over the batch's scored tokens, is the Trainer's.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import numpy as np
import tensorflow as tf

from tfpod import UserError
from tfpod.input import records
from tfpod.input.common import first_example

IGNORED = -100  # Hugging Face's label of a token no loss is taken on
_FIX = "write rows with tfpod.input.rows (from parquet) or set lm_data.format"


def check_rows_file(path: str, cfg, seq_len: int, vocab_size: int, model: str) -> None:
    """Checks a format-rows file's first record: `ids_feature` and `labels_feature` int64 lists
    of seq_len values, ids in [0, vocab_size), labels there or -100.

    Raises:
      UserError: naming the file, what is wrong and the setting to change.
    """
    feature = first_example(path, "replace it", _FIX).features.feature
    for name in (cfg.ids_feature, cfg.labels_feature):
        if name not in feature or feature[name].WhichOneof("kind") != "int64_list":
            found = ", ".join(f"{k} ({v.WhichOneof('kind')})" for k, v in sorted(feature.items())) or "none"
            raise UserError(f"records in {path} have no int64 list feature {name!r} (found: {found}): {_FIX}")
        values = np.array(feature[name].int64_list.value)
        if len(values) != seq_len:
            raise UserError(f"rows in {path} have {len(values)} {name}, not {model}.seq_len={seq_len}: rows are "
                            f"packed to one length; set {model}.seq_len (or lm_data.seq_len) to {len(values)}")
        low = (values < 0) & (values != IGNORED) if name == cfg.labels_feature else values < 0
        bad = values[low | (values >= vocab_size)]
        if len(bad):
            raise UserError(f"rows in {path} hold {name} value {bad[0]}, outside [0, {model}.vocab_size={vocab_size})"
                            f"{' (or -100)' if name == cfg.labels_feature else ''}: set {model}.vocab_size to the "
                            "vocabulary the rows were written with")


def labeled_rows(plan, cfg, seed: int, repeat: bool, seq_len: int, vocab_size: int, model: str = "gpt",
                 batch_size: int = 64) -> tf.data.Dataset:
    """{inputs, targets, weights} [seq_len] of each row of this host's format-rows files."""
    check_rows_file(plan.files[0], cfg, seq_len, vocab_size, model)
    spec = {name: tf.io.FixedLenFeature([seq_len], tf.int64) for name in (cfg.ids_feature, cfg.labels_feature)}

    def parse(batch: tf.Tensor) -> dict:
        parsed = tf.io.parse_example(batch, spec)
        ids, labels = (tf.cast(parsed[n], tf.int32) for n in (cfg.ids_feature, cfg.labels_feature))
        bad = (ids < 0) | (ids >= vocab_size) | (((labels < 0) & (labels != IGNORED)) | (labels >= vocab_size))
        check = tf.debugging.Assert(~tf.reduce_any(bad), [
            f"rows hold a token id or label outside [0, {model}.vocab_size={vocab_size}) (labels: or -100): set "
            f"{model}.vocab_size to the vocabulary the rows were written with"])
        with tf.control_dependencies([check]):
            following = tf.concat([labels[:, 1:], tf.fill([tf.shape(labels)[0], 1], IGNORED)], axis=1)
        scored = tf.not_equal(following, IGNORED)
        return {"inputs": ids, "targets": tf.where(scored, following, 0), "weights": tf.cast(scored, tf.float32)}

    ds = records.read(plan, seed, repeat, cfg.cycle_length, cfg.skip_corrupt)
    return ds.batch(batch_size).map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).unbatch()


PROMPT = "### Summarize the following text:\n {input}\n ### Summary:\n"  # the reference's, before " {output}"


def summary_rows(examples, tokenize, eos_id: int, length: int, scored_prompt: bool, bos_id: int | None = None):
    """(ids rows, labels rows) of summarization examples ({"input", "output"}: SCROLLS's
    columns) as MLPerf's LoRA reference makes them: each example PROMPT + " {output}" + EOS
    (after BOS when the tokenizer adds one), tokenized; eval examples (`scored_prompt` False)
    label -100 over the prompt and the last token; then every example concatenated and cut
    into rows of `length`, the rest dropped (group_texts)."""
    ids, labels = [], []
    start = [] if bos_id is None else [bos_id]
    for example in examples:
        prompt = start + tokenize(PROMPT.format(input=example["input"]))
        full = start + tokenize(PROMPT.format(input=example["input"]) + " " + example["output"]) + [eos_id]
        ids += full
        labels += full if scored_prompt else [IGNORED] * len(prompt) + full[len(prompt):-1] + [IGNORED]
    cut = len(ids) // length * length
    return ([ids[i:i + length] for i in range(0, cut, length)], [labels[i:i + length] for i in range(0, cut, length)])


def parquet_rows(paths: list[str]):
    """(ids, labels) int64 arrays of every row of the parquet files, in order (read a record
    batch at a time: an 8,192-token GovReport split never sits whole in memory)."""
    import pyarrow.parquet as pq

    for path in paths:
        names = pq.ParquetFile(path).schema_arrow.names
        if "input_ids" not in names:
            raise UserError(f"{path} has no input_ids column (columns: {', '.join(names)}): pass the parquet files "
                            "of tokenized rows (Hugging Face datasets' to_parquet)")
        columns = ["input_ids"] + (["labels"] if "labels" in names else [])
        for batch in pq.ParquetFile(path).iter_batches(batch_size=256, columns=columns):
            ids = batch.column("input_ids").to_pylist()
            labels = batch.column("labels").to_pylist() if "labels" in columns else ids
            for row_ids, row_labels in zip(ids, labels):
                if len(row_ids) != len(row_labels):
                    raise UserError(f"{path}: a row has {len(row_ids)} input_ids and {len(row_labels)} labels: "
                                    "rows must pair one label with each id")
                yield np.asarray(row_ids, np.int64), np.asarray(row_labels, np.int64)


def convert(patterns: str, out: str, shards: int = 1) -> dict:
    """Parquet rows (comma-separated globs, in sorted order) -> `shards` TFRecord files
    `out-<i>-of-<n>.tfrecord` of contiguous rows; returns what was written."""
    paths = sorted({p for pattern in patterns.split(",") for p in glob.glob(pattern)})
    if not paths:
        raise UserError(f"--from={patterns} matches no file: pass the parquet files' glob(s)")
    import pyarrow.parquet as pq

    count = sum(pq.ParquetFile(p).metadata.num_rows for p in paths)
    return write(parquet_rows(paths), count, out, shards, f"--from={patterns}")


def write(rows, count: int, out: str, shards: int, source: str) -> dict:
    """`count` (ids, labels) rows (an iterable) -> `shards` TFRecord files
    `out-<i>-of-<n>.tfrecord` of contiguous rows."""
    if shards < 1:
        raise UserError(f"--shards={shards} must be at least 1")
    if not count:
        raise UserError(f"{source}: no rows (fewer tokens than one row?)")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    files, bounds, rows = [], np.linspace(0, count, shards + 1).astype(int), iter(rows)
    length = None
    for i in range(shards):
        path = f"{out}-{i:05d}-of-{shards:05d}.tfrecord"
        with tf.io.TFRecordWriter(path) as writer:
            for _ in range(bounds[i + 1] - bounds[i]):
                ids, labels = next(rows)
                length = length or len(ids)
                feature = {"ids": tf.train.Feature(int64_list=tf.train.Int64List(value=ids)),
                           "labels": tf.train.Feature(int64_list=tf.train.Int64List(value=labels))}
                writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
        files.append(path)
    return {"rows": count, "files": files, "length": int(length)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="rows (input_ids, labels) -> lm_data.format='rows' records")
    parser.add_argument("--from", dest="patterns", help="parquet file glob(s) of tokenized rows, comma-separated")
    parser.add_argument("--summaries", help="or a JSON-lines file of {input, output} examples (SCROLLS' columns), "
                                            "made into rows as MLPerf's LoRA reference makes them")
    parser.add_argument("--vocab", help="--summaries: the SentencePiece model to tokenize with")
    parser.add_argument("--eos_id", type=int, help="--summaries: the EOS id ending each example")
    parser.add_argument("--bos_id", type=int, help="--summaries: a BOS id starting each example (Llama 2: 1)")
    parser.add_argument("--length", type=int, help="--summaries: tokens per row (the reference: 8192)")
    parser.add_argument("--eval", action="store_true", help="--summaries: label only the summaries (eval rows)")
    parser.add_argument("--out", required=True, help="output path prefix")
    parser.add_argument("--shards", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        if bool(args.patterns) == bool(args.summaries):
            raise UserError("pass one of --from (parquet rows) or --summaries (JSON lines of {input, output})")
        if args.patterns:
            print(json.dumps(convert(args.patterns, args.out, args.shards)))
            return
        if not (args.vocab and args.eos_id is not None and args.length):
            raise UserError("--summaries needs --vocab, --eos_id and --length")
        from tfpod.input import text

        tokenizer = text.load_tokenizer(args.vocab)
        tokenize = lambda s: tokenizer.tokenize(s).numpy().tolist()
        with open(args.summaries) as f:
            examples = [json.loads(line) for line in f if line.strip()]
        ids, labels = summary_rows(examples, tokenize, args.eos_id, args.length, not args.eval, args.bos_id)
        print(json.dumps(write(zip(ids, labels), len(ids), args.out, args.shards, f"--summaries={args.summaries}")))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
