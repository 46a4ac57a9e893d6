"""One host's BERT pretraining input: pre-masked records, or text masked online.

Two sources, one batch contract (models/bert.py; feature names, shapes and dtypes of
tf-models-official's `official/nlp/data/create_pretraining_data.py`):

  records  TFRecords of tf.train.Example written by create_pretraining_data.py
           (MLPerf BERT's data): input_ids, input_mask, segment_ids [seq_len] int64;
           masked_lm_positions, masked_lm_ids [max_predictions] int64;
           masked_lm_weights [max_predictions] float; next_sentence_labels [1] int64.
           Its `--use_v2_feature_names` spelling (input_word_ids, input_type_ids) is
           read too. Masks are the ones in the file (static masking, --dupe_factor copies).

             this host's files -> records (interleaved) -> shuffled -> parsed, int32
             -> host batches [host_rows, ...]

  text     documents (TFRecords of tf.train.Example with a bytes feature `text_feature`,
           or text files, one document each; the default: the Python stdlib corpus that
           tfpod.input.prepare prepares) masked online (dynamic masking, fresh masks
           every epoch), MLM only (no sentence pairs, so no next_sentence_labels):

             this host's files -> documents -> ids + EOS (in the graph: SentencePiece,
             or a WordPiece vocab.txt with [SEP] as EOS) -> one stream cut into
             segments of seq_len - 2 tokens -> shuffled
             -> text.mask_for_mlm ([CLS] segment [SEP], 15%: 80% [MASK] / 10% random /
                10% kept) -> host batches

           Evaluation cuts each document on its own (its last segment shorter and
           padded), so every token of the eval split is in exactly one example, and masks
           it once with a fixed seed: every evaluation of a run sees the same examples.

Files are split over hosts with tfpod.input.files.plan (every host its own files).
Training datasets repeat and drop the remainder (static shapes); evaluation datasets
are one pass, the last batch short (evaluation pads it with weight-0 rows).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import ClassVar

import tensorflow as tf

from tfpod import UserError
from tfpod.input import files as files_lib, lm_data, prepare, records, text
from tfpod.input.common import (DataConfig, ShardInfo, TaskInput, corrupt_finder, file_identity, first_example,
                                host_shard, stream_source)

log = logging.getLogger("tfpod")

FORMATS = ("auto", "records", "text")
# Special ids of the prepared default vocabulary (a vocabulary of your own is looked up by piece).
CLS_ID, SEP_ID, MASK_ID = prepare.CLS_ID, prepare.SEP_ID, prepare.MASK_ID
FIRST_PIECE = 7  # ids below are special tokens in the prepared vocabulary
EVAL_MASK_SEED = 12345  # online-masked eval examples are the same in every run (create_pretraining_data.py's seed)
# create_pretraining_data.py's feature names -> ours; its --use_v2_feature_names spelling.
V2_NAMES = {"input_ids": "input_word_ids", "segment_ids": "input_type_ids"}


@dataclasses.dataclass(frozen=True)
class BertDataConfig(DataConfig):
    """BERT's data. Attributes map 1:1 to gin `bert_data.<name>`.

    Attributes:
      train_files: glob(s) of the training data (comma-separated); None: the prepared
        Python stdlib corpus (prepared on first use), masked online.
      eval_files: the same for the held-out split (None with train_files: no eval data).
      format: records (create_pretraining_data.py TFRecords), text (documents masked
        online), or auto (records when train_files are given, else text).
      text_feature: the TFRecord feature holding a document (format text).
      vocab_path: the vocabulary for format text: a SentencePiece model, or a WordPiece
        `vocab.txt` (a path ending in .txt: one piece per line, as published with Google
        BERT and on the Hugging Face Hub); None: the prepared corpus's SentencePiece model,
        of `vocab_size`. It must have the pieces [MASK], [CLS] and [SEP]; a vocab.txt also
        [UNK], and [PAD] on its first line (id 0, the padding).
      vocab_size: vocabulary size to train when preparing the default corpus.
      lower_case: a WordPiece vocab.txt's text is lower-cased and stripped of accents
        first (uncased BERT; set False for a cased vocab.txt); a SentencePiece model
        normalizes as it was trained.
      mask_rate: fraction of a segment's tokens predicted (format text).
      shuffle_buffer: examples in the shuffle buffer (0: no shuffling).
      cycle_length: files read at once per host.
      skip_corrupt: skip unreadable TFRecord data (TensorFlow logs each skip) instead of stopping.
      data_dir: where the default corpus is prepared (None: $TFPOD_DATA_DIR or the user cache).
    """

    gin_name: ClassVar[str] = "bert_data"

    format: str = "auto"
    text_feature: str = "text"
    vocab_path: str | None = None
    vocab_size: int = 2048
    lower_case: bool = True
    mask_rate: float = 0.15
    skip_corrupt: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.format not in FORMATS:
            raise UserError(f"bert_data.format={self.format!r}: use one of {', '.join(FORMATS)}")
        if not 0.0 < self.mask_rate <= 1.0:
            raise UserError(f"bert_data.mask_rate={self.mask_rate} must be in (0, 1] (BERT: 0.15)")

    @property
    def masked_online(self) -> bool:
        return self.format == "text" or (self.format == "auto" and self.train_files is None)


# ---------------------------------------------------------------------------
# create_pretraining_data.py records


def _first_example(path: str) -> tf.train.Example:
    """The first record of a file, parsed (to check names and shapes before training)."""
    return first_example(path, "replace it, or set bert_data.format='text' for documents",
                                  "write the data with create_pretraining_data.py")


def record_features(path: str, seq_len: int, max_predictions: int, vocab_size: int) -> dict[str, str]:
    """Checks a records file against the model; returns {our feature name: its name in the file}.

    The first record must have every create_pretraining_data.py feature (either
    spelling), input_ids of length seq_len, masked_lm_* of length max_predictions, and
    ids below vocab_size.

    Raises:
      UserError: naming the file, the feature and the model setting to change.
    """
    feature = _first_example(path).features.feature
    v2 = "input_word_ids" in feature
    names = {k: (V2_NAMES.get(k, k) if v2 else k) for k in
             ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids", "masked_lm_weights",
              "next_sentence_labels")}
    missing = [name for name in names.values() if name not in feature]
    if missing:
        raise UserError(
            f"records in {path} lack feature(s) {', '.join(missing)} (found: {', '.join(sorted(feature))}): "
            "bert_data.format='records' reads create_pretraining_data.py output; "
            "set bert_data.format='text' for documents"
        )

    def values(name):
        f = feature[names[name]]
        return list(f.int64_list.value) if name != "masked_lm_weights" else list(f.float_list.value)

    length, predictions = len(values("input_ids")), len(values("masked_lm_ids"))
    if length != seq_len or predictions != max_predictions:
        raise UserError(
            f"records in {path} have input_ids of length {length} and masked_lm_ids of length {predictions}, but the "
            f"model has bert.seq_len={seq_len} and bert.max_predictions={max_predictions}: set bert.seq_len={length} "
            f"and bert.max_predictions={predictions} (create_pretraining_data.py's --max_seq_length and "
            f"--max_predictions_per_seq)"
        )
    largest = max(values("input_ids") + values("masked_lm_ids"))
    if largest >= vocab_size:
        raise UserError(f"records in {path} hold token id {largest} but bert.vocab_size={vocab_size}: set "
                        f"bert.vocab_size to the size of the vocab.txt the records were written with")
    return names


def _record_spec(names: dict[str, str], seq_len: int, max_predictions: int) -> dict:
    spec = {}
    for ours, theirs in names.items():
        shape = [seq_len] if ours in ("input_ids", "input_mask", "segment_ids") else [max_predictions]
        if ours == "next_sentence_labels":
            shape = [1]
        dtype = tf.float32 if ours == "masked_lm_weights" else tf.int64
        spec[theirs] = tf.io.FixedLenFeature(shape, dtype)
    return spec


def records_dataset(cfg: BertDataConfig, pattern: str, model_config, host_rows: int, shard: ShardInfo, seed: int,
                    repeat: bool) -> tf.data.Dataset:
    """This host's batches of create_pretraining_data.py records.

    Returns:
      {input_ids, input_mask, segment_ids: [rows, seq_len] int32; masked_lm_positions,
      masked_lm_ids: [rows, max_predictions] int32; masked_lm_weights: [rows,
      max_predictions] float32; next_sentence_labels: [rows] int32}, rows = host_rows
      (when not repeating, the last batch may be shorter).
    """
    plan = host_shard(pattern, shard, seed)
    names = record_features(plan.files[0], model_config.seq_len, model_config.max_predictions,
                            model_config.vocab_size)
    spec = _record_spec(names, model_config.seq_len, model_config.max_predictions)

    def parse(record):
        example = tf.io.parse_single_example(record, spec)
        out = {ours: example[theirs] for ours, theirs in names.items()}
        out = {k: (v if v.dtype == tf.float32 else tf.cast(v, tf.int32)) for k, v in out.items()}
        out["next_sentence_labels"] = tf.reshape(out["next_sentence_labels"], [])
        return out

    ds = records.read(plan, seed, repeat, cfg.cycle_length, cfg.skip_corrupt)
    if repeat:
        ds = records.shuffled(ds, cfg.shuffle_buffer, seed)
    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return _finish(ds, cfg, host_rows, shard, repeat)


# ---------------------------------------------------------------------------
# text masked online


def special_ids(tokenizer, vocab_path: str) -> dict[str, int]:
    """{"mask", "cls", "sep"} ids of the vocabulary's [MASK], [CLS] and [SEP] pieces.

    Args:
      tokenizer: from text.load_tokenizer: a SentencePiece model's, or a WordPiece
        vocab.txt's (text.WordPieceTokenizer, whose [PAD] must be id 0: the padding).
      vocab_path: its file (named in errors).

    Raises:
      UserError: the vocabulary lacks one of them (or a vocab.txt's [PAD] is not id 0).
    """
    pieces = {"mask": "[MASK]", "cls": "[CLS]", "sep": "[SEP]"}
    if isinstance(tokenizer, text.WordPieceTokenizer):
        missing = [p for p in pieces.values() if p not in tokenizer.ids]
        if missing:
            raise UserError(f"WordPiece vocabulary {vocab_path} has no line(s) {', '.join(missing)}: BERT needs "
                            "[PAD] [UNK] [CLS] [SEP] [MASK]; use the vocab.txt published with the model")
        if tokenizer.ids.get("[PAD]") != prepare.PAD_ID:
            raise UserError(f"WordPiece vocabulary {vocab_path} has [PAD] as id {tokenizer.ids.get('[PAD]')}, but "
                            f"BERT pads with id {prepare.PAD_ID}: put [PAD] on the first line (as BERT's vocab.txt "
                            "has it)")
        return {k: tokenizer.ids[p] for k, p in pieces.items()}
    ids = {k: int(tokenizer.string_to_id(tf.constant(p)).numpy()) for k, p in pieces.items()}
    unk = int(tokenizer.string_to_id(tf.constant("\u2047 not a piece \u2047")).numpy())  # the unknown id
    missing = [pieces[k] for k, i in ids.items() if i == unk]
    if missing:
        raise UserError(
            f"SentencePiece vocabulary {vocab_path} has no piece(s) {', '.join(missing)}: train it with "
            "user_defined_symbols=['[MASK]', '[CLS]', '[SEP]'] (as tfpod.input.prepare does)"
        )
    return ids


def _segments(docs: tf.data.Dataset, length: int) -> tf.data.Dataset:
    """Token stream (documents concatenated) -> consecutive segments of `length` tokens.

    text.pack_concat cuts rows of seq_len + 1 stream tokens (inputs and their next
    tokens); with seq_len = length - 1 a row's inputs plus its last target are exactly
    `length` consecutive tokens, and rows do not overlap.
    """
    rows = text.pack_concat(docs, length - 1)
    return rows.map(lambda r: tf.concat([r["inputs"], r["targets"][-1:]], axis=0),
                    num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def _document_segments(docs: tf.data.Dataset, length: int) -> tf.data.Dataset:
    """Each document cut on its own into segments of `length` tokens (the last shorter)."""

    def cut(doc):
        n = (tf.size(doc) + length - 1) // length
        padded = tf.pad(doc, [[0, n * length - tf.size(doc)]], constant_values=-1)
        return tf.data.Dataset.from_tensor_slices(tf.reshape(padded, [n, length]))  # [n, length]

    return docs.flat_map(cut).map(lambda s: tf.boolean_mask(s, s >= 0))


def text_dataset(cfg: BertDataConfig, pattern: str, vocab_path: str, model_config, host_rows: int, shard: ShardInfo,
                 seed: int, repeat: bool) -> tf.data.Dataset:
    """This host's batches of documents masked online (the batch contract, without
    next_sentence_labels); see the module docstring."""
    seq_len = model_config.seq_len
    if seq_len < 4:
        raise UserError(f"bert.seq_len={seq_len} is too short for online masking: [CLS] and [SEP] leave "
                        f"{seq_len - 2} token(s); use at least 4")
    plan = host_shard(pattern, shard, seed)
    tokenizer = text.load_tokenizer(vocab_path, lower_case=cfg.lower_case)
    vocab = int(tokenizer.vocab_size())
    if vocab > model_config.vocab_size:
        raise UserError(
            f"vocabulary {vocab_path} has {vocab} pieces but the model has bert.vocab_size={model_config.vocab_size}: "
            f"set bert.vocab_size >= {vocab} or use a smaller vocabulary"
        )
    ids = special_ids(tokenizer, vocab_path)
    doc_cfg = lm_data.LMDataConfig(format="auto", text_feature=cfg.text_feature, cycle_length=cfg.cycle_length,
                                    skip_corrupt=cfg.skip_corrupt)
    documents = lm_data.documents(plan, doc_cfg, seed, repeat, tfrecord_fix="name TFRecord files *.tfrecord*")
    # Documents end with EOS (a WordPiece vocabulary has none: [SEP], BERT's boundary).
    wordpiece = isinstance(tokenizer, text.WordPieceTokenizer)
    docs = text.tokenize(documents, tokenizer, eos_id=ids["sep"] if wordpiece else prepare.EOS_ID)
    if repeat:
        segments = _segments(docs, seq_len - 2)
        segments = records.shuffled(segments, cfg.shuffle_buffer, seed)
    else:
        segments = _document_segments(docs, seq_len - 2)
    ds = text.mask_for_mlm(
        segments, seq_len, vocab_size=vocab, mask_id=ids["mask"], cls_id=ids["cls"], sep_id=ids["sep"],
        pad_id=prepare.PAD_ID, max_predictions=model_config.max_predictions, mask_rate=cfg.mask_rate,
        seed=seed + 2 if repeat else EVAL_MASK_SEED,
    )
    return _finish(ds, cfg, host_rows, shard, repeat)


# ---------------------------------------------------------------------------
# common


def _finish(ds: tf.data.Dataset, cfg: BertDataConfig, host_rows: int, shard: ShardInfo, repeat: bool) -> tf.data.Dataset:
    """Eval cap, then host batches (records.batched)."""
    if not repeat:
        ds = records.host_share(ds, cfg.max_eval_examples, shard)
    return records.batched(ds, host_rows, repeat)


def bert_input(cfg: BertDataConfig, model_config, shard: ShardInfo, seed: int) -> TaskInput:
    """BERT's input (see the module docstring): prepares the default corpus on first use."""
    if cfg.masked_online:
        if model_config.next_sentence:
            raise UserError("bert.next_sentence=True needs next_sentence_labels, which online-masked text has not: "
                            "set bert.next_sentence=False, or read create_pretraining_data.py records "
                            "(bert_data.train_files, bert_data.format='records')")
        where = lm_data.resolve(lm_data.LMDataConfig(train_files=cfg.train_files, eval_files=cfg.eval_files,
                                                       vocab_path=cfg.vocab_path, vocab_size=cfg.vocab_size,
                                                       data_dir=cfg.data_dir))
        train, evals = where.train_files, where.eval_files

        def dataset(files, repeat):
            return lambda host_rows: text_dataset(cfg, files, where.vocab_path, model_config, host_rows, shard, seed,
                                                  repeat)
    else:
        train, evals = cfg.train_files, cfg.eval_files
        for pattern in (train, evals):  # names and shapes checked before the model is built
            if pattern:
                record_features(files_lib.host_files(pattern, shard.num_shards, shard.index, seed)[0], model_config.seq_len,
                                model_config.max_predictions, model_config.vocab_size)

        def dataset(files, repeat):
            return lambda host_rows: records_dataset(cfg, files, model_config, host_rows, shard, seed,
                                                     repeat)

    derived = dict(seq_len=model_config.seq_len, max_predictions=model_config.max_predictions)
    if cfg.masked_online:
        derived["vocab"] = file_identity(where.vocab_path)
    return TaskInput(
        train=dataset(train, True),
        eval=dataset(evals, False) if evals else None,
        find_corrupt=corrupt_finder(train, shard, seed),
        source=stream_source(cfg, "bert_data", train, shard, seed, **derived),
    )
