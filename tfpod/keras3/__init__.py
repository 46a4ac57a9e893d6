"""Keras 3's own distribution API (`keras.distribution`) on TensorFlow, backed by DTensor.

    import tfpod, keras
    devices = keras.distribution.list_devices()                  # every device of the job
    mesh = keras.distribution.DeviceMesh((4, 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense.*kernel"] = (None, "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    model = build_model()                                         # DVariables in the map's layouts
    model.compile(optimizer="adam", loss="mse")                   # slots laid out like their weights
    model.fit(dataset, epochs=3)                                  # one SPMD program per step

On TensorFlow, Keras 3's `keras.distribution` is a prototype (its backend module says "DO
NOT USE"); with tfpod imported it is real (`install`, run when `keras` is imported after
`tfpod`, or at `import tfpod` when it was imported before). Nothing changes in Keras until a
distribution is set. The modules:

  backend    the TensorFlow backend's distribution functions: devices (tfpod's runtime,
             several hosts with `keras.distribution.initialize`), DeviceMesh -> dtensor.Mesh,
             TensorLayout -> dtensor.Layout, `distribute_tensor`
  variables  a Keras variable made under a distribution is a DVariable in its layout
             (`distribution.get_variable_layout`: the LayoutMap, else replicated); assign
             places host values, numpy() gathers
  data       batches from Keras's own data adapters packed onto the mesh, split over the
             batch axis
  steps      Keras's train / test / predict steps compiled as one SPMD program each
  random     random draws in a step (dropout masks) made as one device makes them
  ops        what DTensor cannot lay out in Keras's layers (split convolution kernels,
             depthwise convolutions, average pooling, a row-split Embedding), done another way
  model      the distribution a model runs under, checked at compile / fit / evaluate /
             predict (never silently on one device); `model.export` from an unsharded view
  internals  the private parts of Keras 3 the above replace (the only module that touches them)

tf_keras models keep tfpod's own front end (`tfpod.sharding`, tfpod.keras); docs/keras.md
says which path serves which Keras.
"""

from __future__ import annotations

_INSTALLED = False


def install() -> bool:
    """Backs Keras 3's distribution API on TensorFlow with tfpod (once).

    Returns:
      Whether it is installed: False when Keras's backend is not TensorFlow (nothing is
      changed then).
    """
    global _INSTALLED
    if _INSTALLED:
        return True
    from tfpod.keras3 import internals

    if internals.backend_name() != "tensorflow":
        return False
    internals.check_version()
    from tfpod.keras3 import backend, data, model, ops, random, steps, variables

    backend.install()
    variables.install()
    data.install()
    steps.install()
    random.install()
    ops.install()
    model.install()
    _INSTALLED = True
    return True


def installed() -> bool:
    return _INSTALLED


__all__ = ["install", "installed"]
