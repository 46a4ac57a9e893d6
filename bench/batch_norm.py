"""Batch norm's training step (forward and backward) on one CPU device: tfpod's
`fused.batch_norm` (the stand-in every Keras BatchNormalization runs under DTensor) beside
Keras's unfused form (autodiff of tf.nn.batch_normalization) and TensorFlow's fused kernel,
and each one's float32 error against float64 on inputs whose channel mean is large against
their spread (the mean of raw 0-255 pixels).

    python bench/batch_norm.py [--shape=32,56,56,64] [--steps=20] [--mean=100]

The last line is JSON: per form, milliseconds per forward + backward (median of --steps)
and the largest error of y, d x and d gamma relative to float64's largest value.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import tfpod  # noqa: E402,F401  (selects tf_keras before TensorFlow loads)

flags.DEFINE_string("shape", "32,56,56,64", "input shape [batch, height, width, channels]")
flags.DEFINE_integer("steps", 20, "timed calls (after one warm-up call)")
flags.DEFINE_float("mean", 100.0, "mean of the inputs for the error figures (their spread is 1)")
FLAGS = flags.FLAGS
EPSILON = 1e-3


def forms():
    import tensorflow as tf

    from tfpod import fused

    def keras_unfused(x, gamma, beta):
        mean, variance = tf.nn.moments(x, [0, 1, 2])
        return tf.nn.batch_normalization(x, mean, variance, beta, gamma, EPSILON)

    def tf_fused(x, gamma, beta):
        return tf.compat.v1.nn.fused_batch_norm(x, gamma, beta, epsilon=EPSILON, is_training=True)[0]

    return {"tfpod": lambda x, g, b: fused.batch_norm(x, g, b, EPSILON)[0], "keras_unfused": keras_unfused,
            "tf_fused_kernel": tf_fused}


def step(fn):
    import tensorflow as tf

    def run(x, gamma, beta, w):
        with tf.GradientTape() as tape:
            tape.watch([x, gamma, beta])
            total = tf.reduce_sum(fn(x, gamma, beta) * w)
        return [fn(x, gamma, beta)] + tape.gradient(total, [x, gamma, beta])

    return tf.function(run)


def main(argv):
    del argv
    import tensorflow as tf

    shape = [int(d) for d in FLAGS.shape.split(",")]
    rng = np.random.default_rng(0)
    channels = shape[-1]
    inputs = [rng.normal(FLAGS.mean, 1.0, size=shape), np.linspace(0.5, 1.5, channels), np.linspace(-1, 1, channels),
              rng.normal(size=shape)]
    inputs = [a.astype(np.float32) for a in inputs]  # float64's reference starts from the same float32 values
    reference = [t.numpy() for t in step(forms()["keras_unfused"])(*[tf.constant(a, tf.float64) for a in inputs])]
    result = {"shape": shape, "mean": FLAGS.mean, "date": time.strftime("%Y-%m-%d")}
    for name, fn in forms().items():
        run = step(fn)
        args = [tf.constant(a) for a in inputs]
        got = [t.numpy() for t in run(*args)]
        errors = {k: float(np.abs(g - r).max() / np.abs(r).max())
                  for k, g, r in zip(["y", "dx", "dgamma"], got, reference)}
        times = []
        for _ in range(FLAGS.steps):
            start = time.perf_counter()
            for t in run(*args):
                t.numpy()
            times.append(time.perf_counter() - start)
        result[name] = {"ms": round(1e3 * float(np.median(times)), 2), **{k: float(f"{v:.2e}") for k, v in errors.items()}}
        print(f"{name:16s} {result[name]}")
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
