"""Keras preprocessing layers that belong in the input pipeline, refused at compile with the line that moves them.

Some of tf_keras's preprocessing layers cannot run in a DTensor train step (probed
here, TF 2.20: string and integer lookups and TextVectorization use hash tables,
LookupTableFindV2 and StringLower; Discretization's Bucketize, CategoryEncoding's
DenseBincount, integer Hashing's AsString and the geometric augmentations'
ImageProjectiveTransformV3 have no layout; RandomFlip's ReverseV2 neither), and the
random image augmentations that do run would draw their randomness on the mesh, not
per example as on one device. Keras's own advice for accelerators is the same: run
them in `tf.data` (`dataset.map`), on the host's CPU, where they overlap the step.

`check(model)` (called by compile on the mesh) refuses such a layer in one line that
names it and gives the exact code: the layer re-made outside `tfpod.sharding` from its
arguments, and the `dataset.map` line that applies it. Rescaling, Resizing,
CenterCrop, Normalization and string Hashing train on the mesh and are left alone.
"""

from __future__ import annotations

import inspect

import tensorflow as tf
import tf_keras

from tfpod import UserError, compat

_LOOKUPS = ("StringLookup", "IntegerLookup", "TextVectorization", "CategoryEncoding", "Discretization",
            "HashedCrossing")  # not Hashing: it trains on strings; on integers its AsString op is found by the trace
_BASE_CONFIG = ("name", "trainable", "dtype", "batch_input_shape", "input_dim", "input_shape")


def is_preprocessing(layer) -> bool:
    """Whether `layer` is one of tf_keras's preprocessing layers (tf_keras.layers.Random*, *Lookup, ...)."""
    return ".layers.preprocessing." in type(layer).__module__


def runs_on_host(layer) -> bool:
    """Whether the layer is one that tfpod moves into the input pipeline: a random image augmentation,
    a lookup or an encoding (`_LOOKUPS`)."""
    return is_preprocessing(layer) and (isinstance(layer, tf_keras.__internal__.layers.BaseRandomLayer)
                                        or type(layer).__name__ in _LOOKUPS)


def constructor(layer) -> str:
    """Python that makes the layer again from its config: `tf_keras.layers.RandomFlip(mode='horizontal')`,
    a nested Sequential as `tf_keras.Sequential([...])`; an argument whose value is longer than 60
    characters is written `...` (fill in what you gave it)."""
    if isinstance(layer, tf_keras.Sequential):
        inner = [constructor(sub) for sub in layer.layers]
        return f"tf_keras.Sequential([{', '.join(inner)}])"
    config = layer.get_config()
    try:
        params = inspect.signature(type(layer).__init__).parameters
    except (TypeError, ValueError):
        params = {}
    args = []
    for key, value in config.items():
        if key in _BASE_CONFIG or key not in params:
            continue
        default = params[key].default
        if default is not inspect.Parameter.empty and _same(value, default):
            continue
        if hasattr(value, "tolist"):
            value = value.tolist()
        elif isinstance(value, (list, tuple)):  # also tf_keras's ListWrapper, whose repr is not Python
            value = list(value)
        text = repr(value)
        args.append(f"{key}={text if len(text) <= 60 else '...'}")
    return f"tf_keras.layers.{type(layer).__name__}({', '.join(args)})"


def _same(value, default) -> bool:
    try:
        return bool(value == default) or (isinstance(value, (list, tuple)) and isinstance(default, (list, tuple))
                                           and list(value) == list(default))
    except (TypeError, ValueError):  # arrays
        return False


def _inbound(layer) -> list:
    nodes = layer.inbound_nodes
    return list(tf.nest.flatten(nodes[0].inbound_layers)) if nodes else []


def _outer(model, layer):
    """The layer of `model.layers` that is or holds `layer` (a nested model's)."""
    for top in model.layers:
        if top is layer or (isinstance(top, tf_keras.Model)
                            and any(sub is layer for sub in compat.flatten_layers(top, include_self=False))):
            return top
    return layer


def _movable(layer) -> bool:
    """A layer that can go into the input pipeline whole: a host-only preprocessing layer, or a
    nested model of preprocessing layers only (a data-augmentation Sequential)."""
    if isinstance(layer, tf_keras.Model):
        subs = compat.flatten_layers(layer, include_self=False)
        return any(runs_on_host(s) for s in subs) and all(
            is_preprocessing(s) or isinstance(s, tf_keras.layers.InputLayer) for s in subs)
    return is_preprocessing(layer)


def refusal(model, layer, why: str) -> str:
    """The one-line refusal for preprocessing `layer` of `model`, with the code that moves it (and the
    preprocessing layers right after it) into `dataset.map`."""
    top = _outer(model, layer)
    chain = [top] if _movable(top) else [layer]
    while chain[0] is top and len(chain[-1].outbound_nodes) == 1:  # the preprocessing layers right after it
        nxt = [t for t in model.layers if _inbound(t) == [chain[-1]] and _movable(t)]
        if len(nxt) != 1:
            break
        chain.append(nxt[0])
    made = constructor(chain[0]) if len(chain) == 1 else (
        "tf_keras.Sequential([" + ", ".join(constructor(t) for t in chain) + "])")
    sources = _inbound(chain[0])
    inputs = [s for s in sources if isinstance(s, tf_keras.layers.InputLayer)]
    several = len(getattr(model, "inputs", None) or []) > 1
    if len(inputs) == 1 and len(sources) == 1 and several:
        key = inputs[0].name
        mapped = f'lambda x, y: ({{**x, "{key}": preprocess(x["{key}"], training=True)}}, y)'
    else:
        mapped = "lambda x, y: (preprocess(x, training=True), y)"
    before = "" if inputs and len(inputs) == len(sources) else ", with the layers before it,"
    what = f"layer {layer.name!r} ({type(layer).__name__})" + (
        f" in {top.name!r}" if top is not layer else "")
    return (f"model {model.name!r}: {what} {why}: run it in the input pipeline{before} (made outside "
            f"tfpod.sharding, and adapted there if you adapt it) and build the model on its output: "
            f"`preprocess = {made}; dataset = dataset.map({mapped}, num_parallel_calls=tf.data.AUTOTUNE)`")


def why(layer) -> str:
    if isinstance(layer, tf_keras.__internal__.layers.BaseRandomLayer):
        return "is a random augmentation (on the mesh it would not draw per example as on one device)"
    return "runs lookups or encodings (hash tables, bucketize, bincount) that DTensor cannot lay out"


def check(model) -> None:
    """Raises one UserError line, with the dataset.map code, for a layer that runs on the host only."""
    for layer in compat.flatten_layers(model, include_self=False):
        if runs_on_host(layer):
            raise UserError(refusal(model, layer, why(layer)))
