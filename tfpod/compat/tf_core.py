"""TensorFlow's internals: checkpoint object graphs and managers, oneDNN, eager variable
handles, tf.data datasets and iterators, DTensor's iterators, resources and expanded
programs; and sacrebleu's per-sentence statistics.
"""

from __future__ import annotations

import re


def checkpoint_objects(ckpt) -> dict:
    """{checkpoint key: variable} of every variable a tf.train.Checkpoint saves (slots included)."""
    import tensorflow as tf
    from tensorflow.python.checkpoint import graph_view, util

    objects, _, _, _, names = util.objects_ids_and_slot_variables_and_paths(graph_view.ObjectGraphView(ckpt))
    return {f"{names[o]}/.ATTRIBUTES/VARIABLE_VALUE": o for o in objects if isinstance(o, tf.Variable)}


def bound_objects(status) -> list:
    """The objects a restore (its CheckpointLoadStatus) gave values from the checkpoint."""
    return list(status._checkpoint.object_by_proto_id.values())


def checkpoint_object_graph(ckpt) -> bytes:
    """The serialized object graph (TrackableObjectGraph) a save of `ckpt` writes beside its variables."""
    from tensorflow.python.checkpoint import graph_view, save_util

    return save_util.serialize_graph_view(graph_view.ObjectGraphView(ckpt))[3].SerializeToString()


def record_checkpoint(manager, path: str) -> None:
    """Records checkpoint `path`, written by other means, in a tf.train.CheckpointManager: it
    becomes the newest in the `checkpoint` state file and the oldest beyond max_to_keep are
    deleted (what the manager's own save does once its files are written)."""
    import time

    manager._maybe_delete.pop(path, None)
    manager._maybe_delete[path] = time.time()
    manager._latest_checkpoint = path
    manager._record_state()
    manager._sweep()
    manager._record_state()


def onednn_enabled() -> bool:
    """Whether TensorFlow runs oneDNN CPU kernels (else Eigen's): only with AVX-512, not with TF_ENABLE_ONEDNN_OPTS=0."""
    from tensorflow.python.util import _pywrap_util_port

    return bool(_pywrap_util_port.IsMklEnabled())


def share_variable_handle_programs() -> None:
    """Eager variable handles without TensorFlow's per-variable `debug_name` (graph ones keep it):
    DTensor compiles an eager op once per set of attributes, so a name per VarHandleOp cost one
    program per variable (21 ms each on 8 CPU devices against 3 ms reused; gpt's 110 variables
    and slots took 2.3 s). The variables keep their names (Python-side)."""
    from tensorflow.python.eager import context
    from tensorflow.python.ops import gen_resource_variable_ops as ops

    make = ops.var_handle_op
    if getattr(make, "tfpod_shared", False):
        return

    def var_handle_op(*args, **kwargs):
        if context.executing_eagerly():
            kwargs["debug_name"], kwargs["name"] = "", None
        return make(*args, **kwargs)

    var_handle_op.tfpod_shared = True
    ops.var_handle_op = var_handle_op


def unary_dataset_base():
    """tf.data's base class of a dataset that wraps another with the same structure."""
    from tensorflow.python.data.ops import dataset_ops

    return dataset_ops.UnaryUnchangedStructureDataset


def variant_tensor(dataset):
    return dataset._variant_tensor


def iterator_resource(iterator):  # (tf.data's iterator resource)
    return iterator._iterator_resource


def dtensor_iterator_base():
    """DTensor's iterator over per-device iterators (what DTensorDataset iterates with)."""
    from tensorflow.dtensor.python import input_util

    return input_util._DTensorIterator


def set_iterator_element_layouts(packed_resource, layouts) -> None:
    """Tells DTensor the layouts of the elements a packed iterator resource yields."""
    from tensorflow.dtensor.python import api

    api._dtensor_device().set_iterator_element_layouts(packed_resource, layouts)


def pack_resources(resources, layout):
    """Per-device resources (iterators) as one DTensor resource."""
    from tensorflow.dtensor.python import api

    return api.pack(resources, layout)


# ---------------------------------------------------------------------------
# sacrebleu


def bleu_sentence_statistics(bleu, hypotheses: list[str], references: list[str]):
    """sacrebleu's per-sentence BLEU sufficient statistics (what BLEU.corpus_score sums)."""
    return bleu._extract_corpus_statistics(hypotheses, [references])


def flat_caller(concrete, *example_args):
    """A call of a ConcreteFunction that skips binding its arguments to its structured
    signature (about 0.3-0.5 ms of Python a call for a dozen nested arguments): the
    arguments are flattened as its signature flattens them (None left out, NumPy arrays
    converted). Checked once on `example_args` against the signature's own flattening (the
    same tensors in the same order; a converted array's dtype and shape); where they
    differ, the plain call.
    """
    import tensorflow as tf
    from tensorflow.python.eager.polymorphic_function import function_type_utils

    def convert(x):  # (NumPy arrays become tensors, as the plain call converts them)
        return x if isinstance(x, tf.Tensor) else tf.convert_to_tensor(x)

    def flat(args):
        return [convert(x) for x in tf.nest.flatten(args) if x is not None]

    try:
        bound = function_type_utils.canonicalize_function_inputs(example_args, {}, concrete.function_type)
        theirs = concrete.function_type.unpack_inputs(bound)
    except Exception:  # noqa: BLE001  (another TensorFlow's internals: the plain call)
        return concrete
    leaves = [x for x in tf.nest.flatten(example_args) if x is not None]
    ours = [convert(x) for x in leaves]
    same = lambda a, b, leaf: a is leaf or (not isinstance(leaf, tf.Tensor) and isinstance(a, tf.Tensor)  # noqa: E731
                                            and a.dtype == b.dtype and a.shape == b.shape)
    if len(theirs) != len(ours) or not all(same(a, b, leaf) for a, b, leaf in zip(theirs, ours, leaves)):
        return concrete
    return lambda *args: concrete._call_flat(flat(args), concrete.captured_inputs)


def dtensor_local_program(concrete, flat_args: list, suffix: str):
    """The program DTensor made of `concrete` (a ConcreteFunction it has run on a mesh of one
    device, with inputs like `flat_args`, its flattened arguments) for that device, callable
    directly: fn(*components) -> its flat outputs, where `components` are the arguments' one
    component each (`dtensor.unpack(x)[0]`), the captured inputs' bound once. It skips
    DTensor's dispatch (~10-20 us per input on CPU: its cache key, layouts, the parallel
    device's queue), so a host loop that calls one small step many times (the embedding
    executor's) saves ~0.5 ms a call.

    DTensor registers each expansion in the eager context as `<name>__func_<hashes>_<n>`, a
    call of the SPMD-expanded body whose inputs are named `op_input_<position>`: an input it
    folded into the program as a constant is missing (DTensor keys its cache on that value).
    Its functions are copied under new names (`suffix` added) with the DTensor device's own
    placements cleared.

    Returns None where no expansion exists yet that takes every argument (it may have
    folded a captured constant, never an argument, whose value changes between calls), or
    where its functions are placed on a device other than DTensor's and the mesh's one: the
    caller keeps calling through DTensor (and may ask again after another call).
    """
    import tensorflow as tf
    from tensorflow.experimental import dtensor
    from tensorflow.python.eager import context, execute

    ctx = context.context()
    captures = [dtensor.unpack(c)[0] for c in concrete.captured_inputs]
    prefix = concrete.name.decode() + "__func_"
    found = []
    for name in ctx.list_function_names():
        if not name.startswith(prefix):
            continue
        kept = [a.name for a in ctx.get_function_def(name).signature.input_arg]
        if not all(re.fullmatch(r"op_input_\d+", k) for k in kept):
            continue
        kept = [int(k[len("op_input_"):]) for k in kept]
        if set(range(len(flat_args))) <= set(kept) and max(kept) < len(flat_args) + len(captures):
            found.append((int(name.rsplit("_", 1)[1]), name, kept))
    if not found:
        return None
    _, name, kept = max(found)
    captures = [captures[k - len(flat_args)] for k in kept[len(flat_args):]]
    if kept[:len(flat_args)] != list(range(len(flat_args))):
        return None
    devices = {"", captures[0].device if captures else dtensor.unpack(flat_args[0])[0].device}
    devices |= {tf.DeviceSpec.from_string(d).to_string() for d in devices if d}
    library, order, todo = {}, [], [name]
    while todo:  # the expansion and every function it calls, callers first
        name = todo.pop()
        if name in library:
            continue
        library[name] = fdef = ctx.get_function_def(name)
        order.append(name)
        for node in fdef.node_def:
            for value in node.attr.values():
                todo.extend(f.name for f in ([value.func] if value.HasField("func") else []) + list(value.list.func))
    copies = []
    for name in order:
        fdef = type(library[name])()
        fdef.CopyFrom(library[name])
        fdef.signature.name = name + suffix
        for node in fdef.node_def:
            if "CUSTOM" in node.device:  # (DTensor's own device: ops it left to the function's)
                node.device = ""
            elif tf.DeviceSpec.from_string(node.device).to_string() not in devices:
                return None
            for value in node.attr.values():
                for f in ([value.func] if value.HasField("func") else []) + list(value.list.func):
                    if f.name in library:
                        f.name += suffix
        copies.append(fdef)
    for fdef in reversed(copies):  # callees first
        if not ctx.has_function(fdef.signature.name):
            ctx.add_function_def(fdef)
    entry = order[0] + suffix
    outputs = len(library[order[0]].signature.output_arg)
    return lambda *components: execute.execute(entry, outputs, list(components) + captures, (), ctx)
