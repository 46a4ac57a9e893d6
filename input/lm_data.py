"""The causal LM's input (gin `lm_data.*`): one host's files -> tokens -> packed host batches.

    this host's files (records.read) -> documents -> SentencePiece ids (tensorflow-text,
    in the graph) + EOS -> packed rows [seq_len] (concat-and-split, or segments: the
    data contract in input.text) -> shuffled -> host batches [host_rows, seq_len] -> prefetched

Pre-tokenized data (`format='ids'`, for a tokenizer tfpod does not run in the graph,
e.g. GPT-2's byte-level BPE) replaces the first two stages: TFRecord files of
tf.train.Example, one document each, with an int64 list feature `ids_feature` holding
its token ids (`write_ids_records` writes them); each document gets `eos_id` appended
and is packed as text is. No vocabulary is read: every id must be below the model's
vocab_size, checked on the first record before training and on every record as it is
read (an InvalidArgumentError naming the file, the id and the fix).

Each host builds only its rows of the global batch (global_batch / hosts); the trainer
packs them into batch-sharded DTensors (partitioning.Placement.to_global). The pipeline is deterministic for a seed, and
its iterator is checkpointable (no Python in the graph), so the trainer saves each
host's position beside every checkpoint and a resumed run sees the same batches.

Optionally the preprocessing runs on tf.data service workers (`service_address`): the
host's own dataset is registered with the dispatcher and its elements come back from
the workers. A service-fed iterator cannot be checkpointed, so resume is not exact there.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import ClassVar, Iterable, Sequence

import tensorflow as tf

from tfpod import UserError
from tfpod.input import files as files_lib
from tfpod.input import prepare, records, rows, text
from tfpod.input.common import (DataConfig, ShardInfo, TaskInput, check_text_files, corrupt_finder, file_identity,
                                first_example, host_shard, stream_source)

log = logging.getLogger("tfpod")

FORMATS = ("auto", "tfrecord", "text", "ids", "rows")
PACKINGS = ("concat", "segments")


@dataclasses.dataclass(frozen=True)
class LMDataConfig(DataConfig):
    """The LM's data. Attributes map 1:1 to gin `lm_data.<name>`.

    Attributes:
      train_files: glob(s) of the training data (comma-separated); None: the prepared
        Python stdlib corpus (prepared on first use).
      eval_files: the same for the held-out split.
      format: tfrecord (tf.train.Example with a bytes feature `text_feature`), text
        (each file is one document), auto (by extension: .tfrecord* is tfrecord), or ids
        (pre-tokenized: tf.train.Example with an int64 list feature `ids_feature`, one
        document per record; no vocabulary, no default corpus: set train_files and eos_id),
        or rows (rows packed to seq_len with per-token labels, -100 where no loss is taken:
        what a Hugging Face Trainer reads, e.g. MLPerf's GovReport; tfpod.input.rows).
      text_feature: the TFRecord feature holding the document.
      ids_feature: the TFRecord feature holding a document's token ids (format ids, rows).
      labels_feature: the TFRecord feature holding a row's labels (format rows).
      eos_id: the id appended to every document (the boundary the LM learns; GPT-2's
        <|endoftext|> is 50256); None: the prepared vocabulary's EOS (3). Format ids needs it.
      bos_id: the id put before every document and every served prompt, as the model's
        tokenizer does (Llama 2 and Mistral: 1, Llama 3: 128000; set by the Hub import);
        None: none, and served prompts start after an EOS (the boundary documents follow).
      append_eos: False: documents are concatenated with nothing between them (what
        Megatron data prepared without --append-eod trains on: MLPerf's Llama 3.1 C4).
      vocab_path: SentencePiece model; None: the prepared corpus's, of `vocab_size`
        (not read with format ids).
      vocab_size: vocabulary size to train when preparing the default corpus.
      seq_len: tokens per row; None: the model's maximum length.
      packing: concat (concatenate documents, cut rows; the LM default) or segments
        (whole documents packed with segment ids and positions).
      shuffle_buffer: rows in the shuffle buffer (0: no shuffling).
      cycle_length: files read at once per host.
      skip_corrupt: skip unreadable TFRecord data (TensorFlow logs each skip) instead of stopping.
      data_dir: where the default corpus is prepared (None: $TFPOD_DATA_DIR or the user cache).
      service_address: tf.data service dispatcher, e.g. "grpc://host:5000"; None: in process.
    """

    gin_name: ClassVar[str] = "lm_data"

    format: str = "auto"
    text_feature: str = "text"
    ids_feature: str = "ids"
    labels_feature: str = "labels"
    eos_id: int | None = None
    bos_id: int | None = None
    append_eos: bool = True
    vocab_path: str | None = None
    vocab_size: int = 2048
    seq_len: int | None = None
    packing: str = "concat"
    skip_corrupt: bool = False
    service_address: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.format not in FORMATS:
            raise UserError(f"lm_data.format={self.format!r}: use one of {', '.join(FORMATS)}")
        if self.packing not in PACKINGS:
            raise UserError(f"lm_data.packing={self.packing!r}: use one of {', '.join(PACKINGS)}")
        if self.eos_id is not None and self.eos_id < 0:
            raise UserError(f"lm_data.eos_id={self.eos_id} must be a token id >= 0 (or None: the prepared EOS)")
        if self.bos_id is not None and self.bos_id < 0:
            raise UserError(f"lm_data.bos_id={self.bos_id} must be a token id >= 0 (or None: no BOS)")
        if self.format in ("ids", "rows") and self.eos_id is None:
            raise UserError(f"lm_data.format={self.format!r} needs lm_data.eos_id, the document boundary id of the "
                            "tokenizer that wrote the ids: set it (GPT-2: 50256, Llama 2: 2)")

    @property
    def eos(self) -> int:
        """The end-of-document id (generation stops at it)."""
        return prepare.EOS_ID if self.eos_id is None else self.eos_id

    @property
    def appended(self) -> int | None:
        """The id appended to every document, None for none (`append_eos=False`)."""
        return self.eos if self.append_eos else None

    @property
    def prompt_start(self) -> int | None:
        """The id a served prompt starts with: BOS, else the EOS documents follow, else none."""
        return self.bos_id if self.bos_id is not None else self.appended


@dataclasses.dataclass(frozen=True)
class Resolved:
    """Where the data and vocabulary are, once the default corpus is prepared if needed."""

    train_files: str
    eval_files: str | None
    vocab_path: str | None  # None: format ids reads no vocabulary


def resolve(cfg: LMDataConfig) -> Resolved:
    """Prepares the default corpus when it is used (cached; never for format ids)."""
    if cfg.format in ("ids", "rows"):
        if cfg.train_files is None:
            raise UserError(f"lm_data.format={cfg.format!r} reads pre-tokenized TFRecords and has no default corpus: "
                            "set lm_data.train_files (write them with tfpod.input.lm_data.write_ids_records, or "
                            "tfpod.input.rows from parquet)")
        return Resolved(cfg.train_files, cfg.eval_files, None)
    data_dir = None
    if cfg.train_files is not None and cfg.vocab_path is None:
        log.warning("lm_data.train_files is your own text but lm_data.vocab_path is unset: it is tokenized with the "
                    "default corpus's vocabulary (learned from Python source); make one from your files with python -m "
                    "tfpod.input.prepare --vocab_from=%r --vocab_size=N --vocab_out=FILE.model and set "
                    "lm_data.vocab_path", cfg.train_files)
    elif cfg.vocab_path is not None and not cfg.vocab_path.endswith(".txt"):
        check_special_ids(cfg.vocab_path, cfg.eos)
    if cfg.train_files is None or cfg.vocab_path is None:
        data_dir = prepare.ensure(cfg.data_dir, cfg.vocab_size)
    train = cfg.train_files or prepare.split_paths(data_dir, "train")
    evals = cfg.eval_files or (prepare.split_paths(data_dir, "eval") if cfg.train_files is None else None)
    vocab = cfg.vocab_path or prepare.vocab_path(data_dir, cfg.vocab_size)
    return Resolved(train, evals, vocab)


def check_special_ids(vocab_path: str, eos: int) -> None:
    """One UserError when a SentencePiece model's end-of-document id is not the one tfpod
    appends to every document (`lm_data.eos_id`, else 3): sentencepiece's own defaults
    (unk 0, bos 1, eos 2) put a normal piece at 3, which the LM would learn as the boundary."""
    import sentencepiece as spm

    try:
        model = spm.SentencePieceProcessor(model_file=vocab_path)
    except (OSError, RuntimeError):
        return  # not readable here: load_tokenizer names the problem where the pipeline reads it
    if model.eos_id() != eos:
        at = model.id_to_piece(eos) if 0 <= eos < model.get_piece_size() else None
        raise UserError(
            f"lm_data.vocab_path={vocab_path}: its end-of-document piece is id {model.eos_id()} (pad {model.pad_id()}, "
            f"unk {model.unk_id()}, bos {model.bos_id()}), but tfpod ends every document with id {eos}"
            + (f", which is {at!r} there" if at is not None else "") + ": train it with tfpod's ids (python -m "
            f"tfpod.input.prepare --vocab_from=FILES --vocab_out=FILE.model) or set lm_data.eos_id={model.eos_id()}")


def check_seq_len(cfg: LMDataConfig, model_seq_len: int, model: str = "gpt") -> int:
    """The row length: lm_data.seq_len if set (at most the model's maximum), else the model's
    (`model`: the task's gin name, for the message)."""
    if cfg.seq_len is None:
        return model_seq_len
    if cfg.seq_len < 1 or cfg.seq_len > model_seq_len:
        raise UserError(
            f"lm_data.seq_len={cfg.seq_len} is outside [1, {model_seq_len}], the model's maximum length "
            f"({model}.seq_len): lower lm_data.seq_len or raise {model}.seq_len"
        )
    return cfg.seq_len


def _is_tfrecord(path: str, fmt: str) -> bool:
    return fmt == "tfrecord" or (fmt == "auto" and ".tfrecord" in os.path.basename(path))


def documents(plan: files_lib.HostShard, cfg: LMDataConfig, seed: int, repeat: bool,
              tfrecord_fix: str = "set lm_data.format='tfrecord'") -> tf.data.Dataset:
    """Scalar tf.string documents of this host's files, files reshuffled each epoch (seeded).

    A TFRecord file's documents are its records' `text_feature`; any other file is one
    document, checked first (`common.check_text_files`; `tfrecord_fix` says how to read
    one that is a TFRecord file as one).
    """
    tfrecord = _is_tfrecord(plan.files[0], cfg.format)
    if not tfrecord:
        check_text_files(plan.files, tfrecord_fix)
    ds = records.read(plan, seed, repeat, cfg.cycle_length, cfg.skip_corrupt, whole_files=not tfrecord)
    if tfrecord:
        feature = {cfg.text_feature: tf.io.FixedLenFeature([], tf.string)}
        ds = ds.map(lambda r: tf.io.parse_single_example(r, feature)[cfg.text_feature],
                    num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds


_IDS_FIX = "write the ids with tfpod.input.lm_data.write_ids_records"


def write_ids_records(path: str, documents: Iterable[Sequence[int]], feature: str = "ids") -> int:
    """Writes pre-tokenized documents as one TFRecord file that `lm_data.format='ids'` reads.

    Each document becomes one tf.train.Example with an int64 list feature `feature` (its
    token ids, without a boundary token: the reader appends `lm_data.eos_id`). Give each
    host at least one file (tfpod.input.host_files splits files over hosts).

    Args:
      path: the file to write (any tf.io.gfile filesystem).
      documents: each document's token ids (e.g. a Hugging Face tokenizer's input_ids).
      feature: the feature name (lm_data.ids_feature).

    Returns:
      The number of documents written.

    Raises:
      UserError: a document holds a negative id.
    """
    count = 0
    with tf.io.TFRecordWriter(path) as writer:
        for count, ids in enumerate(documents, 1):
            ids = [int(i) for i in ids]
            if ids and min(ids) < 0:
                raise UserError(f"document {count - 1} for {path} holds token id {min(ids)}: token ids are >= 0")
            example = tf.train.Example(features=tf.train.Features(feature={
                feature: tf.train.Feature(int64_list=tf.train.Int64List(value=ids))}))
            writer.write(example.SerializeToString())
    return count


def check_ids_file(path: str, cfg: LMDataConfig, vocab_size: int, model: str = "gpt") -> None:
    """Checks a format-ids file's first record: an int64 list `ids_feature` of ids in [0, vocab_size).

    Raises:
      UserError: naming the file, what is wrong and the setting to change.
    """
    try:
        feature = first_example(path, "replace it, or set lm_data.skip_corrupt=True", _IDS_FIX).features.feature
    except UserError:
        if cfg.skip_corrupt:
            return  # unreadable records are skipped as they are read; the ids are checked there
        raise
    if cfg.ids_feature not in feature or feature[cfg.ids_feature].WhichOneof("kind") != "int64_list":
        found = ", ".join(f"{k} ({v.WhichOneof('kind')})" for k, v in sorted(feature.items())) or "none"
        raise UserError(f"records in {path} have no int64 list feature {cfg.ids_feature!r} (found: {found}): set "
                        f"lm_data.ids_feature to the feature holding the token ids, or {_IDS_FIX}")
    ids = feature[cfg.ids_feature].int64_list.value
    if cfg.bos_id is not None and ids and ids[0] == cfg.bos_id:
        raise UserError(f"records in {path} already start with lm_data.bos_id={cfg.bos_id}, which the reader puts "
                        "before every document: write the ids without it (Hugging Face tokenizers: "
                        "add_special_tokens=False) or set lm_data.bos_id=None")
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise UserError(f"records in {path} hold token id {outside[0]}, outside [0, {model}.vocab_size={vocab_size}): "
                        f"set {model}.vocab_size to the vocabulary the ids were written with (GPT-2: 50257)")


def id_documents(plan: files_lib.HostShard, cfg: LMDataConfig, seed: int, repeat: bool, vocab_size: int,
                 model: str = "gpt",
                 batch_size: int = 64) -> tf.data.Dataset:
    """[None] int32 token ids of each record of this host's format-ids files, framed by `cfg.bos_id` and `cfg.eos`.

    The first file's first record is checked before anything is read (`check_ids_file`);
    every record's ids are checked as they are read: an id outside [0, vocab_size) stops
    the input with an InvalidArgumentError whose message names the file, the id and the fix.

    Args:
      plan: this host's files.
      cfg: LMDataConfig (ids_feature, eos_id, cycle_length, skip_corrupt).
      seed: the file order's shuffle.
      repeat: shuffle the files each epoch and repeat forever (training).
      vocab_size: the model's vocabulary: every id must be below it.
      batch_size: records parsed per call (speed only; the output is the same).
    """
    check_ids_file(plan.files[0], cfg, vocab_size, model)
    spec = {cfg.ids_feature: tf.io.RaggedFeature(tf.int64)}

    def parse(paths: tf.Tensor, batch: tf.Tensor) -> tf.RaggedTensor:
        ids = tf.io.parse_example(batch, spec)[cfg.ids_feature]  # [B, (n)] int64
        flat = ids.flat_values
        outside = (flat < 0) | (flat >= vocab_size)  # [ids]
        ok = ~tf.reduce_any(outside)

        def message():  # built only when an id is outside (as check_ids_file words it)
            first = tf.argmax(tf.cast(outside, tf.int32))
            return tf.strings.join([
                "records in ", paths[ids.value_rowids()[first]], " hold token id ", tf.strings.as_string(flat[first]),
                f", outside [0, {model}.vocab_size={vocab_size}): set {model}.vocab_size to the vocabulary the ids were "
                "written with (GPT-2: 50257)"])

        check = tf.debugging.Assert(ok, [tf.cond(ok, lambda: tf.constant(""), message)])
        with tf.control_dependencies([check]):
            ids = tf.cast(ids, tf.int32)
        return text.frame(ids, cfg.appended, cfg.bos_id)  # [B, ([bos] n [eos])]

    ds = records.read(plan, seed, repeat, cfg.cycle_length, cfg.skip_corrupt, with_paths=True)
    ds = ds.batch(batch_size).map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.unbatch().map(tf.identity)  # rows of a ragged batch restated as TensorSpec([None], tf.int32)


def lm_dataset(cfg: LMDataConfig, pattern: str, vocab_path: str | None, seq_len: int, host_rows: int,
               shard: ShardInfo, seed: int, model_vocab_size: int | None = None,
               repeat: bool = True, model: str = "gpt") -> tf.data.Dataset:
    """This host's dataset of LM batches {inputs, targets, weights[, segment_ids, positions]}.

    Args:
      cfg: LMDataConfig.
      pattern: file glob(s) of the split.
      vocab_path: SentencePiece model (None with format ids: no vocabulary is read).
      seq_len: row length.
      host_rows: rows per host batch (global batch / hosts).
      shard: this host's place.
      seed: file order and shuffling.
      model_vocab_size: the model's vocabulary; the tokenizer's (format ids: every id) and
        the EOS id must fit in it (required with format ids).
      repeat: cycle over the data forever (training), or read it once with each
        document packed on its own (evaluation: the same examples for any host count).
      model: the task's gin name (gpt, moe), for the messages.

    Returns:
      A dataset of host batches [host_rows, seq_len] (when not repeating, the last
      batch may be shorter).
    """
    for name, token in (("eos_id", cfg.eos), ("bos_id", cfg.bos_id)):
        if model_vocab_size is not None and token is not None and token >= model_vocab_size:
            raise UserError(f"lm_data.{name}={token} is not below {model}.vocab_size={model_vocab_size}: set "
                            f"lm_data.{name} to the tokenizer's id, or {model}.vocab_size to its vocabulary's size")
    plan = host_shard(pattern, shard, seed)
    if cfg.format == "rows":  # packed already: no framing or packing
        if model_vocab_size is None:
            raise UserError("lm_data.format='rows' checks every id against the model's vocabulary: pass "
                            "lm_dataset its model_vocab_size")
        ds = rows.labeled_rows(plan, cfg, seed, repeat, seq_len, model_vocab_size, model)
        ds = records.shuffled(ds, cfg.shuffle_buffer, seed) if repeat else records.host_share(
            ds, cfg.max_eval_examples, shard)
        return records.batched(ds, host_rows, repeat)
    if cfg.format == "ids":
        if model_vocab_size is None:
            raise UserError("lm_data.format='ids' checks every id against the model's vocabulary: pass "
                            "lm_dataset its model_vocab_size")
        ds = id_documents(plan, cfg, seed, repeat, model_vocab_size, model)
    else:
        tokenizer = text.load_tokenizer(vocab_path)
        vocab = int(tokenizer.vocab_size())
        if model_vocab_size is not None and vocab > model_vocab_size:
            raise UserError(
                f"vocabulary {vocab_path} has {vocab} pieces but the model has {model}.vocab_size={model_vocab_size}: "
                f"set {model}.vocab_size >= {vocab} or use a smaller vocabulary"
            )
        ds = text.tokenize(documents(plan, cfg, seed, repeat), tokenizer, eos_id=cfg.appended, bos_id=cfg.bos_id)
    if not repeat:  # evaluation: rows independent of how files split over hosts
        ds = records.host_share(text.pack_documents(ds, seq_len, pad_id=prepare.PAD_ID), cfg.max_eval_examples, shard)
    elif cfg.packing == "concat":
        ds = text.pack_concat(ds, seq_len)
    else:
        ds = text.pack_segments(ds, seq_len, pad_id=prepare.PAD_ID)
    if repeat:
        ds = records.shuffled(ds, cfg.shuffle_buffer, seed)
    distribute = None
    if cfg.service_address:
        distribute = tf.data.experimental.service.distribute(
            processing_mode=tf.data.experimental.service.ShardingPolicy.OFF,
            service=cfg.service_address,
            job_name=f"tfpod-host{shard.index}-seed{seed}",
        )
    return records.batched(ds, host_rows, repeat, distribute)


def lm_input(cfg: LMDataConfig, model_config, shard: ShardInfo, seed: int, model: str = "gpt") -> TaskInput:
    """The causal LM's input (gpt, moe; `model`: the task's gin name, which the messages
    use): prepares the default corpus on first use."""
    seq_len = check_seq_len(cfg, model_config.seq_len, model)
    where = resolve(cfg)

    def dataset(files, repeat):
        return lambda host_rows: lm_dataset(cfg, files, where.vocab_path, seq_len, host_rows, shard, seed,
                                            model_config.vocab_size, repeat=repeat, model=model)

    vocab = {"vocab": file_identity(where.vocab_path)} if where.vocab_path else {}
    return TaskInput(
        train=dataset(where.train_files, True),
        eval=dataset(where.eval_files, False) if where.eval_files else None,
        find_corrupt=corrupt_finder(where.train_files, shard, seed),
        checkpointable=not cfg.service_address,
        source=stream_source(cfg, "lm_data", where.train_files, shard, seed, seq_len=seq_len, **vocab),
    )
