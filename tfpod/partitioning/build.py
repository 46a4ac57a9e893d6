"""Materializing a tf_keras model as DVariables laid out by the rules; weights gathered where used.

The model is first built with lazily initialized variables (nothing allocated), every
variable is validated against the rules (`rules.resolve`), and only then are the
DVariables created. Under the `2d` preset a weight stays sharded in memory and is
gathered where a layer reads it (`gather_when_used`); under weight-update sharding its
optimizer state takes `update_layout`.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import compat
from tfpod.partitioning import submesh
from tfpod.partitioning.step_context import active_context, within
from tfpod.partitioning.rules import AxisRule, VarSpec, resolve

# Materializing a Keras model as sharded DVariables


def _is_lazy(o) -> bool:
    return isinstance(compat.inner_variable(o), compat.lazy_variable().LazyInitVariable)


def _lazy_variables(model):
    """[(object_path, variable)] of a lazily built tf_keras model, one entry per path.

    `variable` is a LazyInitVariable, or (under a mixed-precision policy) an
    AutoCastVariable wrapping one.
    """
    return [(".".join(str(p) for p in path), v) for path, v in compat.flatten(model, _is_lazy, with_path=True)]


_unwrap = compat.inner_variable


def var_name(v) -> str:
    return v.name[:-2] if v.name.endswith(":0") else v.name


def _lazy_build(model_fn, input_signature):
    """Builds the model symbolically with lazily initialized variables (nothing allocated)."""
    import tf_keras

    tf_keras.backend.experimental.enable_tf_random_generator()  # DTensor needs tf.random.Generator
    with compat.lazy_variable().lazy_init_scope(), compat.no_autograph():
        model = model_fn()
        inputs = tf.nest.map_structure(
            lambda s: tf_keras.Input(shape=s.shape[1:], dtype=s.dtype, name=getattr(s, "name", None)),
            input_signature,
        )
        model(inputs)
    return model


def _specs(model, variables) -> list[VarSpec]:
    """The VarSpecs of `variables` (each once, in the order of the model's attribute walk)."""
    # A layer set trainable=False leaves its variables' own flag alone: ask the model.
    trains = {id(_unwrap(v)) for v in model.trainable_weights}
    return [VarSpec(var_name(v), tuple(v.shape.as_list()), _unwrap(v).dtype, id(_unwrap(v)) in trains)
            for v in variables]


def variable_specs(model_fn, input_signature) -> list[VarSpec]:
    """The model's variables (name, global shape, dtype) without allocating any."""
    return lazy_model(model_fn, input_signature)[1]


def lazy_model(model_fn, input_signature):
    """(model, specs): the model built with lazily initialized variables (nothing
    allocated: a 175B-parameter model builds on a laptop) and its VarSpecs."""
    model = _lazy_build(model_fn, input_signature)
    return model, _specs(model, [v for _, v in compat.first_paths(model, _is_lazy).values()])


def build_sharded(
    model_fn,
    input_signature,
    mesh: dtensor.Mesh,
    axis_rules: Sequence[AxisRule],
    table: Mapping[str, str | None],
    stage_meshes: Sequence[dtensor.Mesh] = (),
    stage_of=None,
    placed=None,
):
    """Builds a tf_keras model whose variables are DVariables laid out by the rules.

    The model is first built symbolically with lazily initialized variables (nothing is
    allocated), every variable is validated against the rules, and only then are the
    DVariables created with their layouts. Initial values are computed replicated and
    then relaid out, so they are the same on every mesh for the same seed.

    Args:
      model_fn: () -> tf_keras.Model (a subclassed model).
      input_signature: nest of tf.TensorSpec (batch dimension None) to build it with.
      mesh: the mesh.
      axis_rules: variable-path rules giving logical axes.
      table: logical axis -> mesh axis.
      stage_meshes: pipeline stages' meshes (`mesh` is the first's); with them,
      stage_of: lazy model -> {id of each variable: its stage} (tfpod.pipeline): each
        variable is laid out by the rules on its stage's mesh.
      placed: (lazy model, {name: layout by the rules}) -> {name: layout} of the variables
        an executor places elsewhere (embedding tables whole on sub-meshes:
        tfpod.embedding.whole); None: none.

    Returns:
      (model, specs, layouts): the built model, its VarSpecs and {name: Layout}.

    Raises:
      UserError: any rules-validation error (see `resolve`), before allocation.
    """
    model = _lazy_build(model_fn, input_signature)
    pairs = _lazy_variables(model)
    by_id = {}
    for path, v in pairs:
        by_id.setdefault(id(v), (path, v))
    specs = _specs(model, [v for _, v in by_id.values()])
    layouts = resolve(specs, axis_rules, table, mesh)
    if stage_meshes:
        owner = stage_of(model)
        for _, v in by_id.values():
            if id(_unwrap(v)) not in owner:
                raise ValueError(f"variable {var_name(v)} belongs to no pipeline stage (StagedModel's layers)")
            layouts[var_name(v)] = dtensor.Layout(list(layouts[var_name(v)].sharding_specs),
                                                   stage_meshes[owner[id(_unwrap(v))]])
    if placed is not None:
        moved = placed(model, layouts)
        for _, v in by_id.values():
            name, init = var_name(v), compat.lazy_initial_value(_unwrap(v))
            if name in moved and callable(init):
                compat.set_lazy_initial_value(_unwrap(v), _moved_initial_value(init, layouts[name], moved[name]))
        layouts.update(moved)
    path_layouts = {path: layouts[var_name(v)] for path, v in pairs}

    class _Exact(compat.layout_map_lib().LayoutMap):
        def __getitem__(self, key):
            return path_layouts.get(key)

    exact = _Exact(mesh=mesh)
    # Mixed precision: every reference shares the AutoCastVariable, so swapping the
    # variable inside it places them all; tf_keras maps the plain lazy variables.
    for path, v in by_id.values():
        if v is not _unwrap(v):
            compat.set_inner_variable(v, compat.create_dvariable(exact, path, _unwrap(v)))
    compat.place_model_variables(model, exact)
    compat.set_layout_map(model, exact)  # Keras-created counters become replicated DVariables
    return model, specs, layouts


def _moved_initial_value(init, source: dtensor.Layout, target: dtensor.Layout):
    """`init` for a variable on `target` (a sub-mesh at one position of the axis `source`
    splits its rows over): computed on the rules' layout `source`, so with the values a run
    without the move draws, then copied to the sub-mesh by pieces (submesh.copy)."""

    def value():
        with dtensor.default_mesh(source.mesh):
            x = dtensor.relayout(init(), source)
        return submesh.copy(x, source.mesh, target, source.sharding_specs[0])

    return value


def rows_split(variable) -> bool:
    """Whether a (D)Variable's first dimension is split over a mesh axis (False without a mesh)."""
    layout = getattr(_unwrap(variable), "layout", None)  # AutoCastVariable wraps it
    return layout is not None and layout.sharding_specs[0] != dtensor.UNSHARDED


def update_layout(layout: dtensor.Layout, shape: Sequence[int], axis: str | None) -> dtensor.Layout:
    """The layout of a weight's optimizer state when the update is sharded over `axis`.

    The first dimension that is unsharded and divisible by the axis size is split over
    it; a weight already sharded over `axis`, with no such dimension, or on a mesh
    without the axis keeps its own layout.
    """
    mesh = layout.mesh
    specs = list(layout.sharding_specs)
    if axis is None or axis not in mesh.dim_names or axis in specs:
        return layout
    n = mesh.dim_size(axis)
    for dim, (size, spec) in enumerate(zip(shape, specs)):
        if spec == dtensor.UNSHARDED and size % n == 0:
            specs[dim] = axis
            return dtensor.Layout(specs, mesh)
    return layout


def gathered_weights(gathered: bool = True):
    """Within this block of a step's trace, weights installed by `gather_when_used` read
    gathered (a forward pass; the optimizer's update outside it reads the stored shards);
    with gathered=False they read their stored shards (an embedding table's read, which
    never gathers the table).

    Raises:
      RuntimeError: no step is being traced.
    """
    return within("gathered_weights()" if gathered else "gathered_weights(False)", gathered=gathered)


def compute_layout(layout: dtensor.Layout, axis: str) -> dtensor.Layout:
    """`layout` with the dimension sharded over `axis` (if any) unsharded."""
    return dtensor.Layout([dtensor.UNSHARDED if s == axis else s for s in layout.sharding_specs], layout.mesh)


def gather_when_used(variables, axis: str | None) -> list[str]:
    """Makes weights stored sharded over `axis` read gathered over it inside `gathered_weights`.

    This is the `2d` preset's "gathered per layer when used" (FSDP / ZeRO-3): the
    weight stays sharded in memory and in the optimizer; where a layer reads it in the
    forward pass, the read is relaid out to the weight's layout without `axis` (an
    all-gather), and its gradient flows back through the relayout (reduce-scattered
    to the stored layout). Reads outside the context (the optimizer, checkpoints) see
    the stored shards.

    Returns:
      The names of the variables that gather.
    """
    names = []
    if axis is None:
        return names
    for v in variables:
        inner = _unwrap(v)
        layout = dtensor.fetch_layout(inner)
        if axis not in layout.sharding_specs:
            continue
        target = compute_layout(layout, axis)

        def gathered(value, _target=target):
            context = active_context()
            return dtensor.relayout(value, _target) if context is not None and context.gathered else value

        compat.wrap_variable_reads(inner, gathered)
        names.append(var_name(inner))
    return names
