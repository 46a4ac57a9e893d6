"""One host's input pipeline for the causal LM: its files -> tokens -> packed host batches.

    files (this host's part, input.files) -> records -> text -> SentencePiece ids (tensorflow-text,
    in the graph) -> packed rows [seq_len] (concat-and-split, or segments) -> shuffled ->
    host batches [host_rows, seq_len] -> prefetched

Each host builds only its rows of the global batch (global_batch / hosts); input.feed
packs them into batch-sharded DTensors. The pipeline is deterministic for a seed, and
its iterator is checkpointable (no Python in the graph), so the trainer saves each
host's position beside every checkpoint and a resumed run sees the same batches.

Optionally the preprocessing runs on tf.data service workers (`service_address`): the
host's own dataset is registered with the dispatcher and its elements come back from
the workers. A service-fed iterator cannot be checkpointed, so resume is not exact there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Callable

import tensorflow as tf

from tfpod import UserError
from tfpod.input import files as files_lib
from tfpod.input import prepare, text

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


def _check_files(files: tuple[str, ...]) -> None:
    for f in files:
        if tf.io.gfile.stat(f).length == 0:
            raise UserError(f"input file {f} is empty: remove it from the pattern or write data into it")


_TEXT_SAMPLE = 64 * 1024  # bytes read from the start of each text file
_TEXT_FILES = 256  # text files checked per host
NOT_UTF8_LIMIT = 0.05  # share of bytes that are not UTF-8 above which a text file is refused


def check_text_files(files, tfrecord_fix: str) -> None:
    """Refuses binary files read as text; warns of bytes that are not UTF-8.

    Reads the first 64 KiB of each of this host's first 256 files. A NUL byte in the
    first 8 KiB means a binary file (a TFRecord without its extension, an archive, an
    image); more than NOT_UTF8_LIMIT of the bytes not decoding as UTF-8 means binary or
    another encoding. Fewer undecodable bytes are trained on as SentencePiece byte
    pieces, with one warning giving their share.

    Args:
      files: this host's files, read as text.
      tfrecord_fix: how to read a TFRecord file as one (named when a file is one).
    """
    undecodable = total = 0
    worst = (0.0, "")
    for f in list(files)[:_TEXT_FILES]:
        with tf.io.gfile.GFile(f, "rb") as fh:
            head = fh.read(_TEXT_SAMPLE)
        if b"\x00" in head[:8192]:
            record = _reads_as_tfrecord(f)
            raise UserError(f"input file {f} is read as text but is binary (NUL bytes"
                            f"{'; it reads as a TFRecord file' if record else ''}): "
                            f"{tfrecord_fix if record else 'remove it from the pattern, or give text files'}")
        if len(head) == _TEXT_SAMPLE:
            head = head[:-3]  # a multi-byte character cut by the sample is not an error
        bad = len(head) - len(head.decode("utf-8", errors="ignore").encode("utf-8"))
        share = bad / max(len(head), 1)
        if share > NOT_UTF8_LIMIT:
            raise UserError(f"input file {f} is read as text but {share:.0%} of its first {len(head)} bytes are not "
                            "UTF-8 (binary, or another encoding): convert it to UTF-8, or remove it from the pattern")
        undecodable, total, worst = undecodable + bad, total + len(head), max(worst, (share, f))
    if undecodable:
        log.warning("input: %d of the %d bytes read from the start of %d text file(s) are not UTF-8 (%.2f%%; most in "
                    "%s): the tokenizer takes them as raw bytes; convert the files to UTF-8", undecodable, total,
                    min(len(files), _TEXT_FILES), 100 * undecodable / total, worst[1])


def _reads_as_tfrecord(path: str) -> bool:
    try:
        return any(True for _ in tf.data.TFRecordDataset(path).take(1))
    except tf.errors.OpError:
        return False


def documents(shard: files_lib.HostShard, cfg: LMDataConfig, seed: int, repeat: bool,
              tfrecord_fix: str = "set lm_data.format='tfrecord'") -> tf.data.Dataset:
    """Scalar tf.string documents of this host's files, files reshuffled each epoch (seeded).

    Files read as text are checked first (`check_text_files`); `tfrecord_fix` says how
    to read one that is a TFRecord file as one.
    """
    names = list(shard.files)
    tfrecord = _is_tfrecord(names[0], cfg.format)
    if not tfrecord:
        check_text_files(names, tfrecord_fix)
    ds = tf.data.Dataset.from_tensor_slices(names)
    if repeat:
        ds = ds.shuffle(len(names), seed=seed, reshuffle_each_iteration=True).repeat()
    if tfrecord:
        feature = {cfg.text_feature: tf.io.FixedLenFeature([], tf.string)}

        def read(path):
            records = tf.data.TFRecordDataset(path)
            if cfg.skip_corrupt:
                records = records.apply(tf.data.experimental.ignore_errors(log_warning=True))
            return records

        ds = ds.interleave(read, cycle_length=cfg.cycle_length, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if shard.record_shard:
            ds = ds.shard(shard.num_hosts, shard.host_id)
        ds = ds.map(lambda r: tf.io.parse_single_example(r, feature)[cfg.text_feature],
                    num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    else:
        ds = ds.map(tf.io.read_file, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if shard.record_shard:
            ds = ds.shard(shard.num_hosts, shard.host_id)
    return ds


def lm_dataset(
    cfg: LMDataConfig,
    pattern: str,
    vocab_path: str,
    seq_len: int,
    host_rows: int,
    num_hosts: int,
    host_id: int,
    seed: int,
    model_vocab_size: int | None = None,
    repeat: bool = True,
) -> tf.data.Dataset:
    """This host's dataset of LM batches {inputs, targets, weights[, segment_ids, positions]}.

    Args:
      cfg: LMDataConfig.
      pattern: file glob(s) of the split.
      vocab_path: SentencePiece model.
      seq_len: row length.
      host_rows: rows per host batch (global batch / hosts).
      num_hosts, host_id: this host's place.
      seed: file order and shuffling.
      model_vocab_size: the model's vocabulary; the tokenizer's must fit in it.
      repeat: cycle over the data forever (training), or read it once with each
        document packed on its own (evaluation: the same examples for any host count).

    Returns:
      A dataset of host batches [host_rows, seq_len] (when not repeating, the last
      batch may be shorter).
    """
    shard = files_lib.plan(pattern, num_hosts, host_id, seed)
    _check_files(shard.files)
    log.info("input: host %d of %d reads %d file(s): %s", host_id, num_hosts, len(shard.files),
             ",".join(os.path.basename(f) for f in shard.files))
    tokenizer = text.load_tokenizer(vocab_path)
    vocab = int(tokenizer.vocab_size())
    if model_vocab_size is not None and vocab > model_vocab_size:
        raise UserError(
            f"vocabulary {vocab_path} has {vocab} pieces but the model has gpt.vocab_size={model_vocab_size}: "
            f"set gpt.vocab_size >= {vocab} or use a smaller vocabulary"
        )
    ds = documents(shard, cfg, seed, repeat)
    ds = text.tokenize(ds, tokenizer, eos_id=prepare.EOS_ID)
    if not repeat:  # evaluation: rows independent of how files split over hosts
        ds = text.pack_documents(ds, seq_len, pad_id=prepare.PAD_ID)
    elif cfg.packing == "concat":
        ds = text.pack_concat(ds, seq_len)
    else:
        ds = text.pack_segments(ds, seq_len, pad_id=prepare.PAD_ID)
    if cfg.shuffle_buffer and repeat:
        ds = ds.shuffle(cfg.shuffle_buffer, seed=seed + 1)
    ds = ds.batch(host_rows, drop_remainder=repeat)  # evaluation keeps the short last batch (padded later)
    options = tf.data.Options()
    options.deterministic = True
    ds = ds.with_options(options)
    if cfg.service_address:
        ds = ds.apply(tf.data.experimental.service.distribute(
            processing_mode=tf.data.experimental.service.ShardingPolicy.OFF,
            service=cfg.service_address,
            job_name=f"tfpod-host{host_id}-seed{seed}",
        ))
    return ds.prefetch(tf.data.AUTOTUNE)


def first_example(path: str, corrupt_fix: str, format_fix: str) -> tf.train.Example:
    """The first record of a TFRecord file, parsed (to check names and shapes before training).

    Raises a one-line UserError when the file is corrupt (naming `corrupt_fix`), when its
    first record is not a tf.train.Example (`format_fix`), or when it holds no records.
    """
    try:
        for record in tf.data.TFRecordDataset(path).take(1):
            return tf.train.Example.FromString(record.numpy())
    except tf.errors.DataLossError:
        raise UserError(f"input file {path} is not a readable TFRecord file (corrupt, or another format): "
                        f"{corrupt_fix}") from None
    except Exception as e:  # a record that is not a tf.train.Example
        raise UserError(f"input file {path}: the first record is not a tf.train.Example ({type(e).__name__}): "
                        f"{format_fix}") from None
    raise UserError(f"input file {path} holds no records: remove it from the pattern or write data into it")


def find_corrupt(pattern_files: tuple[str, ...]) -> str | None:
    """The first file whose records cannot be read, or None (used to name it in errors)."""
    for f in pattern_files:
        try:
            for _ in tf.data.TFRecordDataset(f):
                pass
        except tf.errors.DataLossError:
            return f
    return None


@dataclasses.dataclass
class TaskInput:
    """One host's input of a task, as main.py and the trainer use it.

    Attributes:
      train: host_rows -> this host's repeating dataset of training host batches.
      eval: host_rows -> one pass over this host's part of the eval split (None: the
        task has no eval data).
      find_corrupt: () -> the first unreadable file of this host's training data, or
        None (to name it in errors).
      checkpointable: whether the training iterator can be checkpointed (not when fed
        by the tf.data service).
      source: what the training stream is built from (`stream_source`): a resumed run
        restores the saved input position only when it is the same.
    """

    train: Callable[[int], tf.data.Dataset]
    eval: Callable[[int], tf.data.Dataset] | None
    find_corrupt: Callable[[], str | None]
    checkpointable: bool = True
    source: dict = dataclasses.field(default_factory=dict)


_NOT_STREAM = ("data_dir", "service_address")  # where data is prepared or served, not what it is


def stream_source(cfg, name: str, pattern: str, num_hosts: int, host_id: int, seed: int, **derived) -> dict:
    """What one host's training stream is built from, as JSON-able values.

    Every field of the data config `cfg` (gin `name.*`) but the eval split's and
    `_NOT_STREAM`, this host's training files with their sizes, and `derived` values
    (the row length, the vocabulary file and its size, ...). The trainer saves it
    beside each input position; a different source at resume means the saved position
    describes other data (checkpoint.InputCheckpoint).
    """
    fields = {f"{name}.{f.name}": getattr(cfg, f.name) for f in dataclasses.fields(cfg)
              if "eval" not in f.name and f.name not in _NOT_STREAM}
    files = files_lib.plan(pattern, num_hosts, host_id, seed).files
    out = {**fields, "files": [[f, tf.io.gfile.stat(f).length] for f in files], **derived}
    return json.loads(json.dumps(out, default=str))  # tuples as lists, as they come back from JSON


def file_identity(path: str) -> list:
    """[path, size]: a vocabulary or other side file as a stream source records it."""
    return [path, tf.io.gfile.stat(path).length if tf.io.gfile.exists(path) else None]


def lm_input(cfg: LMDataConfig, model_config, num_hosts: int, host_id: int, seed: int) -> TaskInput:
    """The causal LM's input (gpt, moe): prepares the default corpus on first use."""
    seq_len = check_seq_len(cfg, model_config.seq_len)
    where = resolve(cfg)

    def dataset(files, repeat):
        return lambda host_rows: lm_dataset(cfg, files, where.vocab_path, seq_len, host_rows, num_hosts, host_id,
                                            seed, model_config.vocab_size, repeat=repeat)

    return TaskInput(
        train=dataset(where.train_files, True),
        eval=dataset(where.eval_files, False) if where.eval_files else None,
        find_corrupt=lambda: find_corrupt(files_lib.plan(where.train_files, num_hosts, host_id, seed).files),
        checkpointable=not cfg.service_address,
        source=stream_source(cfg, "lm_data", where.train_files, num_hosts, host_id, seed, seq_len=seq_len,
                             vocab=file_identity(where.vocab_path)),
    )
