"""Host batches for the training loop: synthetic ones seeded by the step, or this host's dataset.

A feed gives this host's rows of each global batch, in order from a step on, as
numpy arrays; the controller stacks a loop call's batches (`stack`) and the placement
packs them onto the mesh. A dataset feed saves its position beside every checkpoint
(input_position.InputCheckpoint) and restores it on resume when the input is the same.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Iterator, Mapping

import numpy as np
import tensorflow as tf

from tfpod import UserError, input_position
from tfpod.checkpoint import first_line
from tfpod.input.common import TaskInput

log = logging.getLogger("tfpod")


class SyntheticFeed:
    """This host's rows of synthetic global batches (train.synthetic_data=True).

    Global batch s depends only on (seed, s), so it is the same for any number of hosts
    and devices, and a resumed run continues exactly; each host keeps the rows of its
    own batch shards (`rows`, from Placement.host_row_indices).
    """

    def __init__(self, make_batch: Callable[[np.random.Generator], dict], seed: int, rows: np.ndarray):
        self.make_batch, self.seed, self.rows = make_batch, seed, rows

    def start(self, step: int, resumed: int | None, position: str | None = None) -> Iterator[dict]:
        del resumed, position
        while True:
            batch = self.make_batch(np.random.default_rng([self.seed, step]))
            yield {k: v[self.rows] for k, v in batch.items()}
            step += 1

    def save(self, step: int) -> None:
        """Nothing to save: the step is the position."""

    def write_to(self, directory: str, step: int) -> None:
        """Nothing to write: the step is the position."""


@dataclasses.dataclass
class DatasetFeed:
    """This host's training dataset, its position checkpointed with the model.

    Attributes:
      task_input: the task's input (its `train` dataset, corrupt-file finder, source).
      host_rows: rows of this host's batches.
      model_dir, host_id, keep: where and how many input positions are kept.
      seed, num_hosts: recorded with the input's source.
      strict: train.strict_resume (a changed input stops the run instead of starting over).
      data_name, skip_corrupt_knob: the data config's gin name, and whether it has
        `skip_corrupt` (named in the corrupt-data error).
    """

    task_input: TaskInput
    host_rows: int
    model_dir: str
    host_id: int
    num_hosts: int
    seed: int
    keep: int
    strict: bool = False
    data_name: str = "data"
    skip_corrupt_knob: bool = False
    _input_ckpt: input_position.InputCheckpoint | None = dataclasses.field(default=None, init=False)

    def start(self, step: int, resumed: int | None, position: str | None = None) -> Iterator[dict]:
        """Host batches from the resumed position (or the input's beginning); `position`: the
        folder it was saved in, if not this host's folder of positions (an in-memory snapshot's)."""
        del step
        iterator = iter(self.task_input.train(self.host_rows))
        if self.task_input.checkpointable:
            source = {**self.task_input.source, "host_rows": self.host_rows, "seed": self.seed,
                      "hosts": self.num_hosts, "host": self.host_id}
            make = lambda it: input_position.InputCheckpoint(self.model_dir, self.host_id, it, self.keep, source)
            self._input_ckpt = make(iterator)
            # (a step-0 checkpoint, e.g. an imported model's, starts the input at its beginning: exact)
            if resumed and self._input_ckpt.restore(resumed, strict=self.strict, directory=position) == "failed":
                iterator = iter(self.task_input.train(self.host_rows))  # a new dataset: the failed restore may have left it half set
                self._input_ckpt = make(iterator)
        elif resumed:
            if self.strict:
                raise UserError("input read through the tf.data service cannot resume where it left off: unset its "
                                "service_address, or set train.strict_resume=False to start it over")
            log.warning("input read through the tf.data service cannot resume exactly: it restarts at step %d", resumed)
        return self._batches(iterator)

    def _batches(self, iterator) -> Iterator[dict]:
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                raise UserError(
                    "the input produced no (more) batches: the data holds fewer tokens than one host batch "
                    "(global_batch / hosts rows of seq_len + 1 tokens); add data or lower train.global_batch_size"
                ) from None
            except tf.errors.DataLossError as e:
                raise UserError(f"corrupt input data ({first_line(e)}): {self._corrupt_hint()}") from None
            except tf.errors.InvalidArgumentError as e:  # an input pipeline's own check (e.g. an id past the vocab)
                text = str(e)
                if "assertion failed: [" not in text:
                    raise
                raise UserError(text.split("assertion failed: [", 1)[1].split("]", 1)[0]) from None
            yield {k: v.numpy() for k, v in batch.items()}

    def _corrupt_hint(self) -> str:
        bad = self.task_input.find_corrupt()
        where = f"file {bad} is corrupt" if bad else "one of this host's files is corrupt"
        if self.skip_corrupt_knob:
            return f"{where}; replace it, or set {self.data_name}.skip_corrupt=True to skip unreadable records"
        return f"{where}; replace it"

    def save(self, step: int) -> None:
        """Saves the position (first, so the model checkpoint of `step` always has it)."""
        if self._input_ckpt is not None:
            self._input_ckpt.save(step)

    def write_to(self, directory: str, step: int) -> None:
        """Writes the position of `step` to `directory` (an in-memory snapshot's)."""
        if self._input_ckpt is not None:
            self._input_ckpt.write_to(directory, step)


def stack(batches: list[Mapping[str, np.ndarray]], steps: int) -> dict[str, np.ndarray]:
    """[steps, rows, ...] arrays of a loop call's batches; calls shorter than `steps` are padded
    with zeros (the compiled loop runs only the real ones)."""
    stacked = {}
    for k in batches[0]:
        arr = np.stack([b[k] for b in batches])
        if len(batches) < steps:
            arr = np.concatenate([arr, np.zeros((steps - len(batches),) + arr.shape[1:], arr.dtype)])
        stacked[k] = arr
    return stacked
