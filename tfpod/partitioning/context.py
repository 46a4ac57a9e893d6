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

from tfpod.partitioning.activations import active_context
from tfpod.partitioning.rules import CONTEXT_AXIS


def zigzag(length: int, chunks: int) -> np.ndarray:
    """The token order of a sequence of `length` split over `chunks` devices: the true
    positions, device after device ([0, 2C-1, 1, 2C-2, ...] in chunks of length / 2C)."""
    if chunks <= 1:
        return np.arange(length)
    if length % (2 * chunks):
        raise ValueError(f"a sequence of {length} tokens does not split into {2 * chunks} equal chunks "
                         f"(2 x the context axis's {chunks} devices)")
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
