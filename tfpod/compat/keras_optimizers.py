"""tf_keras's optimizer internals (legacy OptimizerV2, which Model Garden's subclass; the new
optimizers' mesh) and its metrics' mesh.
"""

from __future__ import annotations

from tfpod.compat.keras_layers import tf_keras


def decayed_lr(optimizer):
    """A legacy (Model Garden) optimizer's learning rate at its current step (a tensor)."""
    import tensorflow as tf

    return optimizer._decayed_lr(tf.float32)


def legacy_optimizer_class():
    """tf_keras's legacy OptimizerV2 (Model Garden's optimizers subclass it)."""
    return tf_keras().optimizers.legacy.Optimizer


def create_optimizer_weights(optimizer) -> None:
    """A legacy optimizer's step counter and hyperparameters, created now."""
    optimizer._create_all_weights([])


def create_slots(optimizer, variable) -> None:
    """A legacy optimizer's slots of `variable`, created now."""
    optimizer._create_slots([variable])


def prepare_updates(optimizer, variables) -> dict:
    """A legacy optimizer's per-step coefficients (learning rate, beta powers, ...) for these
    variables: its `apply_state`."""
    return optimizer._prepare(list(variables))


def apply_updates(optimizer, grads_and_vars, apply_state: dict):
    """A legacy optimizer's dense updates of (gradient, variable) pairs with coefficients from
    `prepare_updates`, its step counter not advanced: OptimizerV2._distributed_apply without
    the increment (the caller advances it once after updating every pipeline stage's weights)."""
    import tensorflow as tf

    kwargs = {"apply_state": apply_state} if "apply_state" in optimizer._dense_apply_args else {}
    return tf.group([optimizer._resource_apply_dense(g, v, **kwargs) for g, v in grads_and_vars])


def optimizer_scalars(optimizer) -> list:
    """A legacy optimizer's step counter and hyperparameter variables (its state other than slots)."""
    import tensorflow as tf

    return [optimizer.iterations] + [h for h in optimizer._hyper.values() if isinstance(h, tf.Variable)]


def slot_table(optimizer) -> dict:
    """A legacy optimizer's {variable key: {slot name: slot}} (mutable: it is the optimizer's own)."""
    return optimizer._slots


def var_key(variable) -> str:
    """The key a legacy optimizer files `variable`'s slots under."""
    return tf_keras(private="optimizers.legacy.optimizer_v2")._var_key(variable)


def adam_coefficients(optimizer, variable, apply_state):
    """(learning rate, {beta_1_t, beta_2_t, beta_1_power, beta_2_power, epsilon, weight_decay_rate})
    of Model Garden's AdamWeightDecay for one variable's update at the current step."""
    key = (variable.device, variable.dtype.base_dtype)
    lr, _ = optimizer._get_lr(variable.device, variable.dtype.base_dtype, apply_state)
    return lr, (apply_state or {}).get(key) or optimizer._fallback_apply_state(*key)


def uses_weight_decay(optimizer, name: str) -> bool:
    """Whether Model Garden's AdamWeightDecay decays the variable named `name`."""
    return optimizer._do_use_weight_decay(name)


def legacy_has_state(optimizer) -> bool:
    return bool(optimizer._slots or optimizer._hypers_created)


def optimizer_built(optimizer) -> bool:
    """Whether a tf_keras (new) optimizer has made its slots."""
    return getattr(optimizer, "_built", False)


def optimizer_mesh(optimizer):
    """The mesh a tf_keras (new) optimizer was made for (None: none)."""
    return getattr(optimizer, "_mesh", None)


def new_on_mesh(cls, config: dict, mesh):
    """An object of a tf_keras class that takes `mesh=` only through its private attribute
    (metrics), made from `config` with the mesh set before its variables."""
    obj = cls.__new__(cls)
    object.__setattr__(obj, "_mesh", mesh)
    obj.__init__(**config)
    return obj
