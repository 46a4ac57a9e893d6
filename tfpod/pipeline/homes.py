"""The one update (tfpod.optimizers.Update.step) over pipeline stages: each gradient on its stage.

`StageHomes` answers what `Update.step` asks of where gradients live: the global norm sums
every stage's squares on the first stage, the finiteness check and the clipping scale are
computed there and copied to each stage, and each stage applies its own weights' update
(all stages or none) with the step's coefficients computed once on the first stage, where
the step counter lives; the counter advances once. How each weight is updated is
`Update.apply`'s, as on one mesh.

What DTensor needed: a branch of a `tf.cond` must stay on one mesh, so each stage applies
its update under its own condition, with the shared scalars (step counter,
hyperparameters) copied in before it (`stages.prefetched`).
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import optimizers
from tfpod.partitioning import Placement, stages


class StageHomes(optimizers.GradientHomes):
    """Each gradient on its pipeline stage.

    Args:
      placement: the stages.
      homes: per variable (in the update's order), its stage.
    """

    def __init__(self, placement: Placement, homes: Sequence[int]):
        self.placement, self.homes = placement, list(homes)
        self.num_stages = placement.num_stages

    def _on(self, x: tf.Tensor, source: int, s: int) -> tf.Tensor:
        """A scalar on stage `source` copied to stage s."""
        return stages.scalar_to(x, self.placement.stage(source).mesh, self.placement.stage(s).mesh)

    def global_norm(self, grads: Sequence[tf.Tensor]) -> tf.Tensor:
        """Every stage's sum of squares, on the first stage: the norm there."""
        squares = []
        for s in range(self.num_stages):
            with self.placement.stage_activations(s):
                mine = [tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g, h in zip(grads, self.homes) if h == s]
                if mine:
                    squares.append(self._on(tf.add_n(mine), s, 0))
        return tf.sqrt(tf.add_n(squares))

    def clip_scales(self, grads: Sequence[tf.Tensor], norm: tf.Tensor, clip_norm: float) -> list[tf.Tensor]:
        """The clipping factor, computed on the first stage, copied to each gradient's stage."""
        scale = clip_norm / tf.maximum(norm, clip_norm)
        scales = [self._on(scale, 0, s) for s in range(self.num_stages)]
        return [scales[h] for h in self.homes]

    def all_finite(self, loss: tf.Tensor, norm: tf.Tensor) -> tf.Tensor:
        """Whether the loss (on the last stage) and the norm are finite, on the first stage."""
        return tf.math.is_finite(self._on(loss, self.num_stages - 1, 0)) & tf.math.is_finite(norm)

    def apply(self, update: optimizers.Update, grads: Sequence[tf.Tensor], finite: tf.Tensor) -> None:
        """Each stage updates its own weights, all or none; the step counter advances once.

        Args:
          update: the update (how each weight is updated: `Update.apply`).
          grads: per variable, its gradient (on its stage).
          finite: the step's loss and gradient norm are finite (a scalar on the first stage):
            else no stage applies its update (the step counter still advances).
        """
        placement = self.placement
        scalars = update.scalars()
        with placement.stage_activations(0):  # the step's coefficients, computed where the step counter lives
            coefficients = update.coefficients()
        for s in range(self.num_stages):
            mine = [j for j, h in enumerate(self.homes) if h == s]
            if not mine:
                continue
            mesh = placement.stage(s).mesh
            with placement.stage_activations(s), stages.prefetched(scalars, mesh):
                ok = stages.scalar_to(finite, placement.mesh, mesh)
                local = tf.nest.map_structure(
                    lambda t: stages.to_mesh(t, placement.mesh, dtensor.Layout.replicated(mesh, t.shape.rank))
                    if isinstance(t, tf.Tensor) else t, coefficients)
                tf.cond(ok, lambda mine=mine, local=local: update.apply(grads, mine, local), lambda: None)
        update.advance()
