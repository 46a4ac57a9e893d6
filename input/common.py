"""What every task's input shares: a host's shard, the TaskInput the trainer reads, and checks.

  ShardInfo       which host this is (seqio's ShardInfo: index, num_shards)
  TaskInput       one host's input of a task, as the run uses it
  stream_source   what a host's training stream is built from (restored positions must match)
  host_shard      this host's files (input.files.plan), each checked non-empty, logged
  check_text_files  files read as text: binary refused, bytes that are not UTF-8 counted
  first_example   a TFRecord file's first record, parsed (features checked before a model is built)
  find_corrupt    the first unreadable file (named in errors; corrupt_finder for a TaskInput)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Callable, ClassVar

import tensorflow as tf

from tfpod import UserError
from tfpod.input import files as files_lib

log = logging.getLogger("tfpod")


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """Which part of the data this host reads: host `index` of `num_shards` (seqio's ShardInfo)."""

    index: int
    num_shards: int


def host_shard(pattern: str, shard: ShardInfo, seed: int, what: str = "file(s)") -> files_lib.HostShard:
    """This host's files of `pattern` (input.files.plan), each checked non-empty, and logged.

    Raises:
      UserError: a pattern matches nothing, or a file is empty.
    """
    plan = files_lib.plan(pattern, shard.num_shards, shard.index, seed)
    for f in plan.files:
        if tf.io.gfile.stat(f).length == 0:
            raise UserError(f"input file {f} is empty: remove it from the pattern or write data into it")
    log.info("input: host %d of %d reads %d %s: %s", shard.index, shard.num_shards, len(plan.files), what,
             ",".join(os.path.basename(f) for f in plan.files))
    return plan


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
            record = reads_as_tfrecord(f)
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


def reads_as_tfrecord(path: str) -> bool:
    """Whether the file's first record reads as TFRecord (else: a text file)."""
    try:
        return any(True for _ in tf.data.TFRecordDataset(path).take(1))
    except tf.errors.OpError:
        return False


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


def corrupt_finder(pattern: str, shard: ShardInfo, seed: int) -> Callable[[], str | None]:
    """() -> the first unreadable file of this host's part of `pattern` (TaskInput.find_corrupt)."""
    return lambda: find_corrupt(files_lib.plan(pattern, shard.num_shards, shard.index, seed).files)


def find_corrupt(pattern_files: tuple[str, ...]) -> str | None:
    """The first file whose records cannot be read, or None (used to name it in errors)."""
    for f in pattern_files:
        try:
            for _ in tf.data.TFRecordDataset(f):
                pass
        except tf.errors.DataLossError:
            return f
    return None


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The fields every task's data config has (lm_data, bert_data, translation_data,
    image_data, detection_data subclass it; each says what its files hold).

    Attributes:
      train_files: training files (comma-separated globs); None: the demo data, prepared
        on first use.
      eval_files: evaluation files; None: the demo data's eval split (or none).
      shuffle_buffer: training examples in the shuffle buffer (0: no shuffling).
      cycle_length: files read at once per host.
      data_dir: where the demo data is prepared (None: tfpod's cache folder).
      max_eval_examples: evaluate at most this many examples (split evenly over hosts: the
        first ones of each host's share); None: the whole eval split.
    """

    gin_name: ClassVar[str] = "data"  # its gin name, for messages (a subclass's own)

    train_files: str | None = None
    eval_files: str | None = None
    shuffle_buffer: int = 1024
    cycle_length: int = 4
    data_dir: str | None = None
    max_eval_examples: int | None = None

    def __post_init__(self):
        if self.max_eval_examples is not None and self.max_eval_examples < 1:
            raise UserError(f"{self.gin_name}.max_eval_examples={self.max_eval_examples} must be at least 1 (or None: "
                            "the whole eval split)")
        if self.shuffle_buffer < 0:
            raise UserError(f"{self.gin_name}.shuffle_buffer={self.shuffle_buffer} must be >= 0 (0: no shuffling)")
        if self.cycle_length < 1:
            raise UserError(f"{self.gin_name}.cycle_length={self.cycle_length} must be at least 1")


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


def stream_source(cfg, name: str, pattern: str, shard: ShardInfo, seed: int, **derived) -> dict:
    """What one host's training stream is built from, as JSON-able values.

    Every field of the data config `cfg` (gin `name.*`) but the eval split's and
    `_NOT_STREAM`, this host's training files with their sizes, and `derived` values
    (the row length, the vocabulary file and its size, ...). The trainer saves it
    beside each input position; a different source at resume means the saved position
    describes other data (tfpod.input_position.InputCheckpoint).
    """
    fields = {f"{name}.{f.name}": getattr(cfg, f.name) for f in dataclasses.fields(cfg)
              if "eval" not in f.name and f.name not in _NOT_STREAM}
    files = files_lib.plan(pattern, shard.num_shards, shard.index, seed).files
    out = {**fields, "files": [[f, tf.io.gfile.stat(f).length] for f in files], **derived}
    return json.loads(json.dumps(out, default=str))  # tuples as lists, as they come back from JSON


def file_identity(path: str) -> list:
    """[path, size]: a vocabulary or other side file as a stream source records it."""
    return [path, tf.io.gfile.stat(path).length if tf.io.gfile.exists(path) else None]
