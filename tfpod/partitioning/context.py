"""Context parallelism's token order: sequences split over the `context` mesh axis in balanced chunks.

On a mesh with a `context` axis of C devices the activations' sequence axes are split
over it (rules.CONTEXT_AXIS). A causal mask gives the sequence's last tokens the most
keys to attend, so a plain split would leave the device holding the last chunk with the
most work. Instead every sequence is cut into 2C chunks and device c holds chunks c and
2C-1-c (one from each end): the features are packed in that order (`zigzag`, applied by
Placement.to_global to every feature dimension split over `context`) and the model reads
each token's true position from `token_positions` (or the `positions` feature). Every
per-token computation is order-free (norms, MLPs, the loss's sum); attention masks by
positions, not by index (tfpod.attention.context_attention).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfpod import UserError
from tfpod.partitioning.step_context import active_context
from tfpod.partitioning.rules import CONTEXT_AXIS


def zigzag(length: int, chunks: int) -> np.ndarray:
    """The token order of a sequence of `length` split over `chunks` devices: the true
    positions, device after device ([0, 2C-1, 1, 2C-2, ...] in chunks of length / 2C)."""
    if chunks <= 1:
        return np.arange(length)
    if length % (2 * chunks):
        raise UserError(f"a sequence of {length} tokens does not split into {2 * chunks} equal chunks (2 x the "
                        f"`context` axis's {chunks} devices): use a length divisible by {2 * chunks} or a smaller "
                        "`context` axis")
    n = length // (2 * chunks)
    order = [c for d in range(chunks) for c in (d, 2 * chunks - 1 - d)]
    return np.concatenate([np.arange(c * n, (c + 1) * n) for c in order])


def context_chunks(mesh=None, table=None) -> int:
    """How many devices the sequence is split over in the step being traced (1: none), or
    on `mesh` with `table` when given."""
    if mesh is None:
        active = active_context()
        if active is None:
            return 1
        mesh, table = active.mesh, active.table
    if table.get("length") != CONTEXT_AXIS or CONTEXT_AXIS not in mesh.dim_names:
        return 1
    return mesh.dim_size(CONTEXT_AXIS)


def token_positions(length: int) -> tf.Tensor:
    """[length] int32: each token's position in the step being traced (0..length-1, or the
    zigzag order under context parallelism)."""
    return tf.constant(zigzag(length, context_chunks()), tf.int32)


def flat_tokens(x: tf.Tensor, features: int) -> tf.Tensor:
    """x [batch, length, ...] as the [tokens, features] rows a 2-D matmul takes (oneDNN runs
    its gradients fastest), or [batch, length, features] when the sequence is split over a
    `context` mesh axis: one dimension cannot be split over the batch's mesh axis and the
    sequence's, so DTensor would gather the sequence to flatten it."""
    if context_chunks() > 1 and x.shape.rank >= 3:
        return tf.reshape(x, x.shape.as_list()[:2] + [features])
    return tf.reshape(x, [-1, features])


def token_matmul(x: tf.Tensor, w: tf.Tensor, transpose_b: bool = False) -> tf.Tensor:
    """x [..., i] @ w [i, o] (w [o, i] with transpose_b) for `flat_tokens`' rows."""
    if x.shape.rank == 2:
        return tf.matmul(x, w, transpose_b=transpose_b)
    lead = "abcdefg"[:x.shape.rank - 1]
    return tf.einsum(f"{lead}i,{'oi' if transpose_b else 'io'}->{lead}o", x, w)


def token_outer(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """sum over tokens of a [..., i]^T b [..., o]: [i, o] (a weight's gradient)."""
    if a.shape.rank == 2:
        return tf.matmul(a, b, transpose_a=True)
    lead = "abcdefg"[:a.shape.rank - 1]
    return tf.einsum(f"{lead}i,{lead}o->io", a, b)
