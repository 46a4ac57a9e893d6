"""A sharded Keras model, saved as an ordinary one: `model.save` and `tfpod.keras.unsharded`.

A model built under `tfpod.sharding` holds DVariables and, after compile, tfpod's
stand-in layers. Saved as it is, a SavedModel serves (DTensor writes each shard) but
names the stand-ins (`tfpod>Normalization`), which `tf_keras.models.load_model` cannot
find without tfpod, and the `.keras` / `.h5` formats stop on a split weight ("Trying to
copy a non-single-device and non-replicated DTensor"). So `model.save` of a sharded
model (the hook in `tfpod.keras.hooks`) saves `unsharded(model)`: the same model made
again from its config with Keras's own classes, outside the mesh, holding the trained
weights gathered to the host. What it writes loads and serves anywhere, in any of
Keras's formats, with no tfpod and no mesh: TF Serving, `tf.saved_model.load`,
`tf_keras.models.load_model`.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf
import tf_keras

from tfpod import UserError, compat
from tfpod.keras import support
from tfpod.keras.layout_map import in_scope


def _keras_class(layer) -> type:
    """The tf_keras class a (possibly swapped-in) tfpod stand-in layer stands for."""
    for cls in type(layer).__mro__:
        if cls.__module__.startswith("tf_keras."):
            return cls
    return type(layer)


@contextlib.contextmanager
def _keras_classes(model):
    """Every stand-in layer inside `model` back in its tf_keras class while the block runs."""
    swapped = []
    for layer in compat.flatten_layers(model):
        if type(layer).__module__.startswith("tfpod."):
            swapped.append((layer, type(layer)))
            layer.__class__ = _keras_class(layer)
    try:
        yield
    finally:
        for layer, cls in swapped:
            layer.__class__ = cls


def _copy(layer):
    """A new layer (or model) made like `layer`: a functional or Sequential model cloned layer by layer
    (each layer from its own class and config, so a custom layer of an application, as ConvNeXt's
    LayerScale, needs no registration: Keras's `Model.from_config` of ConvNeXt itself fails); any
    other from its config."""
    if compat.is_functional(layer) or isinstance(layer, tf_keras.Sequential):
        return tf_keras.models.clone_model(layer, clone_function=_copy)
    return type(layer).from_config(layer.get_config())


def unsharded(model) -> tf_keras.Model:
    """An ordinary tf_keras model (no mesh, Keras's own layer classes) with `model`'s weights.

    Made again layer by layer (a functional or Sequential model), or from `get_config` (a
    subclassed one that has it), built on the shapes the sharded one was built on, and given its
    weights through `get_weights` (gathered from every device). Raises UserError in one line
    when the model cannot be made again from its config.
    """
    support.refuse_keras3(model, "tfpod.keras.unsharded")
    if in_scope():
        raise UserError(f"model {model.name!r}: make its unsharded copy outside `with tfpod.sharding(...)` (inside "
                        "it, the copy's variables would be placed on the mesh again)")
    try:
        with _keras_classes(model):
            plain = _copy(model)
    except (NotImplementedError, TypeError, ValueError) as e:
        raise UserError(
            f"model {model.name!r} ({type(model).__name__}) cannot be made again from its config ({str(e).splitlines()[0]}): "
            "give it get_config (and from_config), or build an unsharded instance yourself and copy the weights: "
            "plain = MyModel(...); plain(batch); plain.set_weights(model.get_weights()); plain.save(path)"
        ) from None
    if not plain.built:  # a subclassed model: built on the inputs the sharded one saw
        spec = support.input_spec(model)
        if spec is None:
            raise UserError(f"model {model.name!r}: its input shapes are not known, so its unsharded copy cannot be "
                            "built: call the model on a batch first")
        plain(tf.nest.map_structure(lambda s: tf.zeros([1] + s.shape.as_list()[1:], s.dtype), spec))
    plain.set_weights(model.get_weights())
    return plain


def save(model, filepath, *args, **kwargs):
    """`model.save` of a sharded model: its unsharded copy saved with the same arguments."""
    return unsharded(model).save(filepath, *args, **kwargs)
