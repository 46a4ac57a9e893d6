"""Which TensorFlow ops DTensor cannot lay out, found at compile rather than mid-fit.

DTensor expands a train step op by op; an op without an SPMD expander stops the
first `fit` step with an MLIR dump ("'tf.X' op does not implement layout
propagation"). `check(model)` (called by compile on the mesh, after the layer
stand-ins of `tfpod.keras.layers` are in) traces the model's forward and backward
pass once as a plain graph, nothing executed, walks every op (inside loops and
conditionals too), and stops with one line naming the layer, the op and what to do
when it finds one of `UNSUPPORTED`. An op missing from that table still fails at the
first step, where `translate` turns DTensor's error into one line naming the op.

`UNSUPPORTED` holds what probes found here (TF 2.20, tf_keras 2.20): Keras's
recurrent layers without `unroll=True` (a while loop over TensorLists), tf.reverse,
and kernels tfpod swaps out of Keras's own layers but that a custom layer may call
directly. `EIGEN_UNDILATED` holds convolution kernels that TensorFlow runs dilated on a
CPU only with oneDNN (on by default only where the CPU has AVX-512): without it
(`TF_ENABLE_ONEDNN_OPTS=0`, or an AVX2 CPU) their Eigen kernels stop the first step
("do not yet support dilation rates larger than 1"), so they are found here too.
"""

from __future__ import annotations

import re
import weakref

import tensorflow as tf

from tfpod import UserError, compat
from tfpod.keras import preprocessing

_RNN = ("a loop over a TensorList: Keras's recurrent layers (LSTM, GRU, SimpleRNN, RNN) run one unless "
        "built with unroll=True, and so does a tf.TensorArray or tf.map_fn in a loop; build the recurrent layer "
        "with unroll=True (a fixed, short time dimension), or replace the loop")
_DEPTHWISE = ("the gradient of tf.nn.depthwise_conv2d called directly (tfpod swaps Keras's DepthwiseConv and "
              "SeparableConv layers itself): call tfpod.fused.depthwise_conv2d instead")
_BATCH_NORM = ("a fused batch-norm kernel (tfpod swaps Keras's BatchNormalization itself): use "
               "tf_keras.layers.BatchNormalization, or tfpod.fused.batch_norm in a custom layer")
_INPUT_PIPELINE = ("a lookup, encoding, string or image-warping op (tf_keras's lookup, encoding and augmentation "
                   "layers use them): run it in the input pipeline, dataset.map(...), and train on its output")

UNSUPPORTED: dict[str, str] = {
    **{op: _RNN for op in ("TensorListFromTensor", "TensorListReserve", "EmptyTensorList", "TensorListStack",
                           "TensorListGetItem", "TensorListSetItem", "TensorListPushBack", "TensorListPopBack",
                           "TensorListGather", "TensorListScatterIntoExistingList", "TensorListElementShape",
                           "TensorListLength", "TensorListConcatV2", "TensorListSplit")},
    "ReverseV2": "tf.reverse (Keras's Bidirectional and go_backwards=True use it): reverse with a gather of "
                 "reversed indices (tf.gather(x, tf.range(n - 1, -1, -1), axis=...)), or build the recurrent "
                 "layers with unroll=True",
    "ReverseSequence": "tf.reverse_sequence: reverse with a gather of per-row indices",
    "AvgPoolGrad": "the gradient of tf.nn.avg_pool2d called directly (tfpod swaps Keras's AveragePooling1D/2D "
                   "layers itself): call tfpod.fused.avg_pool2d instead",
    "AvgPool3DGrad": "the gradient of 3-D average pooling (AveragePooling3D, tf.nn.avg_pool3d): for windows that "
                     "do not overlap, reshape each spatial axis into (windows, window size) and tf.reduce_mean over "
                     "the window sizes",
    **{op: _INPUT_PIPELINE for op in ("LookupTableFindV2", "Bucketize", "DenseBincount", "AsString", "StringLower",
                                      "ImageProjectiveTransformV3", "StringSplitV2", "StaticRegexReplace")},
    "DepthwiseConv2dNativeBackpropFilter": _DEPTHWISE,
    "DepthwiseConv2dNativeBackpropInput": _DEPTHWISE,
    **{op: _BATCH_NORM for op in ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "FusedBatchNormGrad",
                                  "FusedBatchNormGradV2", "FusedBatchNormGradV3")},
}

# Kernels whose CPU implementation without oneDNN (Eigen) refuses dilations > 1.
EIGEN_UNDILATED = ("Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3D", "Conv3DBackpropInputV2",
                   "Conv3DBackpropFilterV2")
_DILATED = ("tf.nn.conv2d's gradient, tf.nn.conv2d_transpose or tf.nn.conv3d with dilations > 1, which TensorFlow's "
            "CPU kernels run only with oneDNN (off: TF_ENABLE_ONEDNN_OPTS=0, or a CPU without AVX-512): convolve "
            "with the kernel dilated by zeros instead (tf.nn.conv2d(x, tfpod.fused.dilate(kernel, dh, dw), ...))")

_FUNCTION_CALLS = ("f", "body", "cond", "then_branch", "else_branch", "branches")


def _eigen_cpu() -> bool:
    """Whether ops run on TensorFlow's Eigen CPU kernels: no oneDNN and no accelerator."""
    return not compat.onednn_enabled() and not any(tf.config.list_logical_devices(kind) for kind in ("GPU", "TPU"))


def _dilated(node) -> bool:
    return any(d > 1 for d in node.attr["dilations"].list.i)


_INPUT_SPECS = weakref.WeakKeyDictionary()  # subclassed model -> the spec of its first call


def record_input_spec(model, inputs) -> None:
    """Remembers what a subclassed model was first called with (its batch dimension left open)."""
    try:
        _INPUT_SPECS[model] = tf.nest.map_structure(
            lambda x: tf.TensorSpec([None] + list(x.shape[1:]), x.dtype), inputs)
    except (AttributeError, TypeError, ValueError):  # not a (nest of) tensor(s)
        pass


def input_spec(model):
    """The nest of tf.TensorSpec a built model is called with (None when not known)."""
    inputs = getattr(model, "inputs", None)  # a functional model's tf_keras.Input tensors
    if inputs:
        specs = [tf.TensorSpec(t.shape, t.dtype) for t in inputs]
        return specs[0] if len(specs) == 1 else specs
    return _INPUT_SPECS.get(model)  # recorded by the hooks at a subclassed model's first call


def _trace(model, spec) -> tf.Graph:
    """The graph of one forward and backward pass (traced, never run)."""

    def step(inputs):
        with tf.GradientTape() as tape:
            outputs = model(inputs, training=True)
            total = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in tf.nest.flatten(outputs)])
        return tape.gradient(total, model.trainable_variables)

    return tf.function(step, autograph=False).get_concrete_function(spec).graph


def unsupported_ops(graph: tf.Graph, eigen: bool = False) -> list[tuple[str, str]]:
    """(op type, op name in the outer graph) of every op in `graph` (and the functions it
    calls, under the name of the op that calls them) that is in UNSUPPORTED, or, with
    `eigen` (the ops run on Eigen CPU kernels), in EIGEN_UNDILATED with dilations > 1."""
    graph_def = graph.as_graph_def()
    library = {f.signature.name: f for f in graph_def.library.function}
    found, seen = [], set()

    def visit(nodes, outer_name):
        for node in nodes:
            name = outer_name or node.name
            if node.op in UNSUPPORTED or (eigen and node.op in EIGEN_UNDILATED and _dilated(node)):
                found.append((node.op, name))
            for key, attr in node.attr.items():
                if key not in _FUNCTION_CALLS:
                    continue
                for called in [attr.func.name] + [f.name for f in attr.list.func]:
                    if called in library and (called, name) not in seen:
                        seen.add((called, name))
                        visit(library[called].node_def, name)

    visit(graph_def.node, None)
    return found


def _layer_of(model, op_name: str):
    """The outermost layer of `model` (the one its summary lists) whose name scope the op's name
    passes through, or None."""
    layers = {layer.name: layer for layer in compat.flatten_layers(model, include_self=False)}
    for part in op_name.split("/"):
        if part in layers:
            return layers[part]
    return None


def check(model) -> None:
    """Raises one UserError line when the model's train step uses an op DTensor cannot lay out.

    Does nothing when the model's input shapes are not known (a subclassed model built
    without a call); the first step's error is then translated (`translate`).
    """
    spec = input_spec(model)
    if spec is None:
        return
    found = unsupported_ops(_trace(model, spec), eigen=_eigen_cpu())
    if not found:
        return
    located = [(op, _layer_of(model, name), name) for op, name in found]
    op, layer, name = next((f for f in located if f[1] is not None), located[0])
    where = f"layer {layer.name!r} ({type(layer).__name__})" if layer is not None else f"op {name!r}"
    others = sorted({other.name for _, other, _ in located if other is not None and other is not layer})
    more = f" (so do {', '.join(others[:3])}{' and more' if len(others) > 3 else ''})" if others else ""
    if layer is not None and preprocessing.is_preprocessing(layer):
        raise UserError(preprocessing.refusal(model, layer, f"uses the op {op}, which DTensor cannot lay out"))
    if op in EIGEN_UNDILATED:
        raise UserError(f"model {model.name!r}: {where} uses the op {op} dilated{more}: {_DILATED}")
    raise UserError(f"model {model.name!r}: {where} uses the op {op}, which DTensor cannot lay out{more}: "
                    f"{UNSUPPORTED[op]}")


_NO_LAYOUT = re.compile(r"'tf\.(\w+)' op does not implement layout propagation")


def translate(error: Exception, model_name: str) -> UserError | None:
    """One UserError line for DTensor's "op does not implement layout propagation" (else None)."""
    match = _NO_LAYOUT.search(str(error))
    if match is None:
        return None
    op = match.group(1)
    fix = UNSUPPORTED.get(op, "replace the layer or op that uses it, or train this model without tfpod.sharding "
                              "(docs/keras.md lists what trains sharded)")
    return UserError(f"model {model_name!r}: the op {op} in its train step cannot be laid out by DTensor "
                     f"(found when the step compiled): {fix}")


def keras3_refusal(what: str, how: str) -> str:
    """The one line for a Keras 3 object given to this (tf_keras) front end: the Keras 3 path."""
    return (f"{what} {how}, but tfpod.sharding and tfpod.keras serve tf_keras (Keras 2) models: for a Keras 3 model "
            "(import keras) use Keras's own distribution API, which tfpod backs on TensorFlow: "
            "keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=...)) before building it, "
            "then compile and fit as usual (docs/keras.md, 'Keras 3')")


def refuse_keras3(obj, where: str) -> None:
    """One UserError line when `obj` (a model, layer, variable or optimizer) is a Keras 3 object."""
    for item in obj if isinstance(obj, (list, tuple)) else [obj]:
        if type(item).__module__.split(".")[0] == "keras":
            name = getattr(item, "path", None) or getattr(item, "name", "")
            raise UserError(keras3_refusal(f"{where}: the {type(item).__name__} {name!r} is a Keras 3 object",
                                           "(keras, not tf_keras)"))
