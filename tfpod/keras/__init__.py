"""Keras `fit` on the mesh: a user's own tf_keras model, trained sharded.

    mesh = tfpod.make_mesh("data:-1,model:2")
    with tfpod.sharding(mesh, rules={r"d1\\.kernel": (None, "mlp"), r"d2\\.kernel": ("mlp", None)}):
        model = build_my_model()                   # functional, or subclassed and called once
    model.compile(optimizer="adam", loss=..., metrics=[...], steps_per_execution=4)
    model.fit(tfpod.input.to_mesh(train_ds, mesh), epochs=3,
              validation_data=tfpod.input.to_mesh(eval_ds, mesh),
              callbacks=[tfpod.keras.Checkpoint(model_dir), tf_keras.callbacks.EarlyStopping()])

The modules, and who calls whom:

  layout_map  `KerasSharding` (a tf_keras LayoutMap): tf_keras creates every variable
              of a model built under it lazily, and once the model's object paths are
              final (the end of a functional model's constructor, a subclassed model's
              first call) re-creates each one as a DVariable with the layout its path
              maps to. The layouts come from tfpod's rules engine: a rule gives a path
              regex (`re.fullmatch` on `d1.kernel`, `blocks.0.ffn.kernel`) logical axes
              (mapped to mesh axes by the preset's table, as in main.py) or mesh axes.
              Each variable is validated as it is placed, before it is allocated, so a
              rank mismatch, a dimension that does not divide over its mesh axis or a
              variable matched by two rules stop with one UserError line. A variable no
              rule matches is replicated (`cover_all=True`: an error). Initial values
              are computed replicated and then relaid out, so they do not depend on
              the mesh.
  hooks       a few tf_keras `Model` methods, wrapped once when this package is
              imported; each acts only on a model built under a KerasSharding:
              `compile` (see compile), `__call__` / `build` of an unbuilt subclassed
              model (host inputs become replicated DTensors; `build` calls the model
              on zeros, since tf_keras's `build` never places the variables),
              `get_weights` / `set_weights` (gathered to / scattered from host arrays),
              `evaluate` / `predict` (one step per host call).
  compile     what `model.compile` does on the mesh: checks that the model is built,
              that every weight is on the mesh and every rule matched a variable;
              swaps layers whose kernels DTensor cannot lay out for equivalent ones
              (batch normalization through `tfpod.fused.batch_norm`); puts metric
              objects' state on the mesh; converts the optimizer (`mesh_optimizer`):
              tf_keras's training loop already runs on DTensor when the model has a
              layout map, but its optimizer must be a DTensor one.
  callbacks   `Checkpoint`: tfpod's checkpoint layout for fit, and resume.
  export      `unsharded(model)` and what `model.save` saves: an ordinary tf_keras model.
  to_mesh     (tfpod.input.mesh_dataset) a tf.data.Dataset of global batches as
              batch-sharded DTensors, a plain dataset to Keras (fit re-iterates it
              every epoch and reads its length from its cardinality).

Not supported: mixed-precision policies (AutoCastVariables are not placed),
`steps_per_execution='auto'`, `class_weight` with a MeshDataset, sparse or ragged
inputs. `model.save` saves the unsharded copy (`unsharded(model)`: Keras's own
classes, the weights gathered), which loads and serves without tfpod.
"""

from tfpod.input.mesh_dataset import MeshDataset, to_mesh
from tfpod.keras import hooks as _hooks
from tfpod.keras.callbacks import Checkpoint
from tfpod.keras.compile import mesh_optimizer
from tfpod.keras.export import unsharded
from tfpod.keras.layout_map import KerasSharding, get_values, layout_of, set_values, sharding

_hooks.install()

__all__ = ["KerasSharding", "sharding", "to_mesh", "MeshDataset", "Checkpoint", "layout_of", "get_values",
           "set_values", "mesh_optimizer", "unsharded"]
