"""The run's numeric precision: the names `train.precision` takes and tf_keras's policy for one.

    float32         every variable and computation in float32
    mixed_bfloat16  variables (and the optimizer's state) in float32, layers compute in
                    bfloat16 (tf_keras's mixed precision policy of that name)
"""

from __future__ import annotations

import contextlib

import tf_keras

PRECISIONS = ("float32", "mixed_bfloat16")


@contextlib.contextmanager
def precision_policy(name: str):
    """tf_keras's global mixed-precision policy set to `name` inside, restored after."""
    previous = tf_keras.mixed_precision.global_policy()
    tf_keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        tf_keras.mixed_precision.set_global_policy(previous)
