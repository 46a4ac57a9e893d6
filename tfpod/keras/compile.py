"""What `model.compile` does to a model built under `tfpod.sharding`.

It checks the model (built, every weight on the mesh, every rule used), swaps layers
whose TensorFlow kernels DTensor cannot lay out for equivalent ones, moves metric
objects onto the mesh, and converts the optimizer (`mesh_optimizer`).
"""

from __future__ import annotations

import logging

import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from tfpod import UserError, attention_layers, compat
from tfpod.keras import layers, preprocessing, support
from tfpod.keras.layout_map import KerasSharding, is_dvariable as _is_dvariable

log = logging.getLogger("tfpod")


def prepare_compile(model, layout_map: KerasSharding, optimizer, steps_per_execution):
    """Checks a sharded model before compile and returns its optimizer on the mesh."""
    if not model.built:
        raise UserError(
            f"model {model.name!r} has no variables yet: build it before compile (call it on a batch, "
            "or model.build(input_shape)); its variables are placed on the mesh when it is built"
        )
    preprocessing.check(model)  # lookups and random augmentation: refused with the dataset.map line that moves them
    off_mesh = [w.name for w in model.weights if not _is_dvariable(compat.inner_variable(w))]
    adapted = [layer for layer in compat.flatten_layers(model, include_self=False)
               if isinstance(layer, tf_keras.layers.Normalization) and layer.weights
               and not _is_dvariable(compat.inner_variable(layer.weights[0]))]
    if adapted:
        name = adapted[0].name
        raise UserError(
            f"layer {name!r} (Normalization) of model {model.name!r} was made outside tfpod.sharding, so its "
            f"statistics are not on the mesh: make it inside `with tfpod.sharding(...)` and adapt it there (before "
            f"or after building the model), or make it there from the adapted layer's numbers: "
            f"tf_keras.layers.Normalization(mean=adapted.mean.numpy(), variance=adapted.variance.numpy())"
        )
    if off_mesh:
        raise UserError(
            f"weight {off_mesh[0]} of model {model.name!r} is not on the mesh (a mixed-precision variable, "
            "one created outside the model's layers or outside tfpod.sharding, or a subclassed model called "
            "on tf_keras.Input tensors without a functional model around it): use a float32 policy, create "
            "every variable in the model's layers inside `with tfpod.sharding(...)`, and build a subclassed "
            "model by calling it on a batch"
        )
    layout_map.check_rules_used()
    layers.use_mesh_layers(model)
    blockwise = attention_layers.use_blockwise(model)  # MultiHeadAttention through tfpod.attention's kernel
    if blockwise:
        log.info("%s: %d MultiHeadAttention layers attend blockwise where their masks allow", model.name, len(blockwise))
    support.check(model)  # ops DTensor cannot lay out: one line now, not an MLIR dump at the first step
    if steps_per_execution == "auto":
        raise UserError("steps_per_execution='auto' is not supported with tfpod.sharding: give a number")
    log.info("layouts:\n%s", layout_map.report(f"{model.name} variables"))
    return mesh_optimizer(optimizer, model, layout_map.mesh)


def mesh_metrics(metrics, mesh: dtensor.Mesh):
    """Metric objects with their state as replicated DVariables on the mesh.

    Metrics given by name are created by Keras on the model's mesh; a metric object
    made by the user has ordinary (or, made inside `tfpod.sharding`, lazy) variables,
    which a DTensor train step silently updates wrongly, so it is re-created from its
    config with the mesh set before its variables are made (how tf_keras's own
    `mesh=` argument of metrics works).
    """
    def place(m):
        if not isinstance(m, tf_keras.metrics.Metric):
            return m
        if m.variables and all(_is_dvariable(v) for v in m.variables):
            return m
        try:
            return compat.new_on_mesh(type(m), m.get_config(), mesh)
        except (TypeError, ValueError, NotImplementedError) as e:
            raise UserError(
                f"metric {m.name!r} ({type(m).__name__}) cannot be re-created on the mesh from its config ({e}): "
                f"pass it by name, or create it with mesh=<the model's mesh>"
            ) from None

    if isinstance(metrics, dict):
        return {k: mesh_metrics(v, mesh) for k, v in metrics.items()}
    if isinstance(metrics, (list, tuple)):
        return type(metrics)(mesh_metrics(m, mesh) for m in metrics)
    return place(metrics)


def mesh_optimizer(optimizer, model, mesh: dtensor.Mesh):
    """The optimizer, on the mesh: tf_keras's DTensor optimizer, or a legacy one with DVariable state.

    Its sparse gradients (an Embedding's IndexedSlices) are made dense before the
    update (`densify`, applied by the `apply_gradients` hook): DTensor has no layout
    propagation for the scatter ops of a sparse update (ResourceScatterAdd).

    Args:
      optimizer: a name ('adam'), a config dict, a tf_keras optimizer instance
        (re-created from its config with `mesh=` unless it already has it), or a
        legacy optimizer (tf_keras.optimizers.legacy, tf-models-official's) whose
        step counter, hyperparameters and slots are created now as DVariables.
      model: the built model (its trainable variables get the slots).
      mesh: the mesh.
    """
    support.refuse_keras3([optimizer, model], "tfpod.keras.mesh_optimizer")
    optimizer = _on_mesh(optimizer, model, mesh)
    optimizer._tfpod_dense_gradients = True
    return optimizer


def densify(grads_and_vars) -> list:
    """(gradient, variable) pairs with IndexedSlices gradients made dense tensors."""
    return [(tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g, v) for g, v in grads_and_vars]


def _on_mesh(optimizer, model, mesh: dtensor.Mesh):
    if isinstance(optimizer, (str, dict)):
        optimizer = tf_keras.optimizers.get(optimizer)
    if isinstance(optimizer, tf_keras.optimizers.Optimizer):
        if compat.optimizer_mesh(optimizer) is not None:
            if compat.optimizer_mesh(optimizer) != mesh:
                raise UserError(
                    f"optimizer {optimizer.name!r} was made for another mesh than the model's: make it with "
                    "the model's mesh, or pass it by name"
                )
            return optimizer
        if any(v is not optimizer.iterations for v in optimizer.variables):
            raise UserError(
                f"optimizer {optimizer.name!r} already has state (slots), so it cannot be moved onto the mesh: "
                "pass a fresh optimizer (or its name) to compile"
            )
        config = optimizer.get_config()
        config.pop("is_legacy_optimizer", None)
        return _from_config(optimizer, config, mesh)
    if isinstance(optimizer, compat.legacy_optimizer_class()):
        from tfpod import optimizers as tfpod_optimizers

        if compat.legacy_has_state(optimizer):
            inner = [v for v in optimizer.variables()]
            if inner and not all(_is_dvariable(v) for v in inner):
                raise UserError(
                    f"optimizer {optimizer.name!r} already has state outside the mesh: pass a fresh optimizer"
                )
        tfpod_optimizers.create_state(optimizer, model.trainable_variables, mesh)
        return optimizer
    raise UserError(
        f"optimizer {optimizer!r} is not a tf_keras optimizer: pass a name such as 'adam', a "
        "tf_keras.optimizers optimizer, or a legacy one (tf_keras.optimizers.legacy, tf-models-official)"
    )


def _from_config(optimizer, config: dict, mesh: dtensor.Mesh):
    if isinstance(config.get("learning_rate"), dict):
        config["learning_rate"] = tf_keras.optimizers.schedules.deserialize(config["learning_rate"])
    try:
        return type(optimizer)(**config, mesh=mesh)
    except TypeError as e:
        raise UserError(
            f"optimizer {type(optimizer).__name__} cannot be re-created on the mesh ({e}): create it with "
            f"mesh=<the model's mesh> yourself"
        ) from None
