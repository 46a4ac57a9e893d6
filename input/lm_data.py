"""The causal LM's input (gin `lm_data.*`): one host's files -> tokens -> packed host batches.

    this host's files (records.read) -> documents -> SentencePiece ids (tensorflow-text,
    in the graph) -> packed rows [seq_len] (concat-and-split, or segments: the data
    contract in input.text) -> shuffled -> host batches [host_rows, seq_len] -> prefetched

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

import tensorflow as tf

from tfpod import UserError
from tfpod.input import files as files_lib
from tfpod.input import prepare, records, text
from tfpod.input.common import (ShardInfo, TaskInput, check_text_files, corrupt_finder, file_identity, host_shard,
                                stream_source)

log = logging.getLogger("tfpod")

FORMATS = ("auto", "tfrecord", "text")
PACKINGS = ("concat", "segments")


@dataclasses.dataclass
class LMDataConfig:
    """The LM's data. Attributes map 1:1 to gin `lm_data.<name>`.

    Attributes:
      train_files: glob(s) of the training data (comma-separated); None: the prepared
        Python stdlib corpus (prepared on first use).
      eval_files: the same for the held-out split.
      format: tfrecord (tf.train.Example with a bytes feature `text_feature`), text
        (each file is one document), or auto (by extension: .tfrecord* is tfrecord).
      text_feature: the TFRecord feature holding the document.
      vocab_path: SentencePiece model; None: the prepared corpus's, of `vocab_size`.
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

    train_files: str | None = None
    eval_files: str | None = None
    format: str = "auto"
    text_feature: str = "text"
    vocab_path: str | None = None
    vocab_size: int = 2048
    seq_len: int | None = None
    packing: str = "concat"
    shuffle_buffer: int = 1024
    cycle_length: int = 4
    skip_corrupt: bool = False
    data_dir: str | None = None
    service_address: str | None = None

    def __post_init__(self):
        if self.format not in FORMATS:
            raise UserError(f"lm_data.format={self.format!r}: use one of {', '.join(FORMATS)}")
        if self.packing not in PACKINGS:
            raise UserError(f"lm_data.packing={self.packing!r}: use one of {', '.join(PACKINGS)}")


@dataclasses.dataclass(frozen=True)
class Resolved:
    """Where the data and vocabulary are, once the default corpus is prepared if needed."""

    train_files: str
    eval_files: str | None
    vocab_path: str


def resolve(cfg: LMDataConfig) -> Resolved:
    """Prepares the default corpus when it is used (cached), and checks the vocabulary file."""
    data_dir = None
    if cfg.train_files is None or cfg.vocab_path is None:
        data_dir = prepare.ensure(cfg.data_dir, cfg.vocab_size)
    train = cfg.train_files or prepare.split_paths(data_dir, "train")
    evals = cfg.eval_files or (prepare.split_paths(data_dir, "eval") if cfg.train_files is None else None)
    vocab = cfg.vocab_path or prepare.vocab_path(data_dir, cfg.vocab_size)
    return Resolved(train, evals, vocab)


def check_seq_len(cfg: LMDataConfig, model_seq_len: int) -> int:
    """The row length: lm_data.seq_len if set (at most the model's maximum), else the model's."""
    if cfg.seq_len is None:
        return model_seq_len
    if cfg.seq_len < 1 or cfg.seq_len > model_seq_len:
        raise UserError(
            f"lm_data.seq_len={cfg.seq_len} is outside [1, {model_seq_len}], the model's maximum length "
            f"(gpt.seq_len): lower lm_data.seq_len or raise gpt.seq_len"
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


def lm_dataset(cfg: LMDataConfig, pattern: str, vocab_path: str, seq_len: int, host_rows: int, shard: ShardInfo,
               seed: int, model_vocab_size: int | None = None, repeat: bool = True) -> tf.data.Dataset:
    """This host's dataset of LM batches {inputs, targets, weights[, segment_ids, positions]}.

    Args:
      cfg: LMDataConfig.
      pattern: file glob(s) of the split.
      vocab_path: SentencePiece model.
      seq_len: row length.
      host_rows: rows per host batch (global batch / hosts).
      shard: this host's place.
      seed: file order and shuffling.
      model_vocab_size: the model's vocabulary; the tokenizer's must fit in it.
      repeat: cycle over the data forever (training), or read it once with each
        document packed on its own (evaluation: the same examples for any host count).

    Returns:
      A dataset of host batches [host_rows, seq_len] (when not repeating, the last
      batch may be shorter).
    """
    plan = host_shard(pattern, shard, seed)
    tokenizer = text.load_tokenizer(vocab_path)
    vocab = int(tokenizer.vocab_size())
    if model_vocab_size is not None and vocab > model_vocab_size:
        raise UserError(
            f"vocabulary {vocab_path} has {vocab} pieces but the model has gpt.vocab_size={model_vocab_size}: "
            f"set gpt.vocab_size >= {vocab} or use a smaller vocabulary"
        )
    ds = text.tokenize(documents(plan, cfg, seed, repeat), tokenizer, eos_id=prepare.EOS_ID)
    if not repeat:  # evaluation: rows independent of how files split over hosts
        ds = text.pack_documents(ds, seq_len, pad_id=prepare.PAD_ID)
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


def lm_input(cfg: LMDataConfig, model_config, shard: ShardInfo, seed: int) -> TaskInput:
    """The causal LM's input (gpt, moe): prepares the default corpus on first use."""
    seq_len = check_seq_len(cfg, model_config.seq_len)
    where = resolve(cfg)

    def dataset(files, repeat):
        return lambda host_rows: lm_dataset(cfg, files, where.vocab_path, seq_len, host_rows, shard, seed,
                                            model_config.vocab_size, repeat=repeat)

    return TaskInput(
        train=dataset(where.train_files, True),
        eval=dataset(where.eval_files, False) if where.eval_files else None,
        find_corrupt=corrupt_finder(where.train_files, shard, seed),
        checkpointable=not cfg.service_address,
        source=stream_source(cfg, "lm_data", where.train_files, shard, seed, seq_len=seq_len,
                             vocab=file_identity(where.vocab_path)),
    )
