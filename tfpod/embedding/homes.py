"""The one update (tfpod.optimizers.Update.step) with embedding tables: the dense weights
updated in the step, the tables' rows handed out of it.

`TableHomes` answers what `Update.step` asks when some of a step's gradients are tables'
rows (`sparse.Rows`, gathered replicated and de-duplicated by the executor,
tfpod.embedding.executor):

  global_norm   the squares of every dense gradient and of each table's de-duplicated
                rows: the norm of the table's gradient as a dense tensor, the value a dense
                update would clip by (tf.clip_by_global_norm on IndexedSlices would count a
                repeated id's rows one by one);
  clip_scales, all_finite   the base's: `Update.scaled` scales the rows' values as it
                scales any gradient;
  apply         the dense weights' update when the step is finite (else only the step
                counter advances), and the scaled rows with [lr, finite, step] recorded for
                the executor's compiled step to return: its host loop applies them to the
                shards (`Tables.apply`, nothing when not finite).
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tfpod import compat, optimizers
from tfpod.embedding.sparse import Rows, squared_norm


class TableHomes(optimizers.GradientHomes):
    """The dense gradients on the step's one mesh; the tables' rows leave the step.

    Args:
      tables: the positions of the tables among the update's variables.
    """

    def __init__(self, tables: Sequence[int]):
        self.tables = list(tables)
        self._handed_out = None

    def global_norm(self, grads: Sequence) -> tf.Tensor:
        """The dense gradients' squares and each table's de-duplicated rows' squares, summed."""
        squares = [tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in grads if not isinstance(g, Rows)]
        squares += [squared_norm(grads[j]) for j in self.tables]
        return tf.sqrt(tf.add_n(squares))

    def apply(self, update: optimizers.Update, grads: Sequence, finite: tf.Tensor) -> None:
        """The dense weights' update when `finite` (else the step counter alone advances); the
        tables' rows and [lr, finite, step] recorded for `take`."""
        optimizer = update.optimizer
        lr = tf.cast(compat.decayed_lr(optimizer), tf.float32)  # at this step, before the counter advances
        step = tf.cast(optimizer.iterations + 1, tf.float32)
        hyper = tf.stack([lr, tf.cast(finite, tf.float32), step])
        dense = [j for j, g in enumerate(grads) if not isinstance(g, Rows)]
        with tf.control_dependencies([hyper]):
            tf.cond(finite, lambda: update.apply(grads, dense), update.skip)
        self._handed_out = ([(grads[j].ids, grads[j].values) for j in self.tables], hyper)

    def take(self) -> tuple[list, tf.Tensor]:
        """(per table, in `tables`' order, its (ids, values) scaled; hyper [lr, finite, step]),
        as the step being traced recorded them in `apply`."""
        if self._handed_out is None:
            raise RuntimeError("TableHomes.take before the step's update was traced (Update.step with these homes)")
        out, self._handed_out = self._handed_out, None
        return out
