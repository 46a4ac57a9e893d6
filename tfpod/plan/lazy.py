"""The planner's lazy build: every leaf layer's output shape recorded, and each repeated
block's symbolic forward pass run once.

tf_keras makes a layer's variables when the layer is first called, so building a model
(with lazily initialized variables: nothing is allocated) runs its forward pass
symbolically, and TensorFlow takes about a millisecond for each op it adds to the graph.
A GPT-3 block adds about 290 ops (variable reads, casts, reshapes and their constants,
recomputation's identities): its 96 blocks took about 30 s of the 40 s a 175B plan took
on 2 CPU cores. The planner reads only the variables and the leaf layers' output shapes,
and a block's follow from what its sublayers build and with which input shapes; so the
first call of each kind of block is recorded, and a later block of the same kind
replays the record:

  the same kind   the same classes, configs (`get_config`, less the block's name) and
                  plain public attributes (flags, sizes, config dataclasses) of the
                  block and its sublayers; the same inputs (structure, shapes, dtypes;
                  other arguments equal); the same names where names make variable
                  names (nested blocks, layers that make weights)
  the record      each sublayer's first build (its input shapes and its name scope
                  below the block's), each leaf layer's output shape, the outputs' specs
  the replay      the sublayers' own `build` with the recorded shapes, under their
                  names below this block's scope: the same variables, named as the
                  block's own forward pass names them; the leaf outputs recorded again;
                  placeholders of the recorded outputs' specs returned

A replayed block adds no ops to the graph, and no losses or updates (the planner reads
none). A block whose record the replay cannot repeat (a weight made outside `build`,
sublayers made while called, outputs that are not plain tensors) is called as written,
and so is every block of a kind seen once. What remains of a 175B build (about 5 s) is
mostly tf_keras making the 1,540 lazy variables' handles.
"""

from __future__ import annotations

import contextlib
import dataclasses

import tensorflow as tf

from tfpod import compat


def _scope() -> str:
    return tf.compat.v1.get_default_graph().get_name_scope()


def _below(scope: str, outer: str) -> str | None:
    """`scope` relative to `outer` (None: not inside it)."""
    if not outer:
        return scope
    return scope[len(outer) + 1:] if scope.startswith(outer + "/") else None


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001  (e.g. arrays in a config: ambiguous, so not the same)
        return False


def _plain(value) -> bool:
    """Plain data (a flag, a size, a dataclass of them): what a layer's code may branch on."""
    if isinstance(value, (tuple, list)):
        return all(_plain(x) for x in value)
    return value is None or isinstance(value, (bool, int, float, str)) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type))


@dataclasses.dataclass
class _Kind:
    """What decides a block's builds and outputs (`_kind`)."""

    key: tuple  # the block's class and its inputs' shapes, dtypes and values (hashable)
    structure: object  # the inputs' nesting
    layers: list  # [(class, config less the name, public plain attributes)] of the block and its sublayers
    names: list  # the sublayers' names


def _kind(layer, layers, inputs, args, kwargs) -> _Kind | None:
    """The kind of block `layer` is on these arguments; None: not one to record or replay."""
    values = []
    for x in tf.nest.flatten((inputs, args, kwargs)):
        if isinstance(x, tf.Tensor) and x.shape.rank is not None:
            values.append((tuple(x.shape.as_list()), x.dtype))
        elif x is None or isinstance(x, (bool, int, float, str)):
            values.append((type(x), x))
        else:
            return None
    described = []
    for each in [layer] + layers:
        if isinstance(each, compat.tf_keras().Model):  # a model's default config is empty (and logs a warning)
            return None
        try:
            config = each.get_config()
        except Exception:  # noqa: BLE001  (a layer without a config: its block is called as written)
            return None
        attributes = {k: v for k, v in vars(each).items() if not k.startswith("_") and k != "built" and _plain(v)}
        described.append((type(each), {k: v for k, v in config.items() if k != "name"}, attributes))
    return _Kind((type(layer), tuple(values)), tf.nest.map_structure(lambda _: 0, (inputs, args, kwargs)), described,
                 [each.name for each in layers])


# What a sublayer's build may be given for its block to be replayed: tensors (TensorSpecs, in a
# replay), recorded as specs, and plain Python values (None, flags, sizes), recorded as they are.
# (An array or a variable holds values a replay would not have.)
_RECORDABLE = (tf.Tensor, tf.TensorSpec, type(None), bool, int, float, str)


def _spec(x):
    return tf.TensorSpec(x.shape, x.dtype) if isinstance(x, tf.Tensor) else x


@dataclasses.dataclass
class _Record:
    """What the first call of a kind of block did, to replay on the next of its kind."""

    kind: _Kind
    layers: list  # the block's sublayers (tf_keras's order)
    scope: str  # the name scope the block's call ran in
    weights_before: set  # ids of the weights the block had before its call
    events: list = dataclasses.field(default_factory=list)  # ("build", i, scope below, input specs) | ("output", i, shape)
    made: set = dataclasses.field(default_factory=set)  # ids of the weights its sublayers' builds made
    named: set = dataclasses.field(default_factory=set)  # sublayers whose names make variable names
    outputs: object = None  # nest of TensorSpecs (and Nones)
    weights: list | None = None  # [(name below the scope, shape, dtype)] of the block's weights
    replayable: bool = True

    def index(self, layer) -> int | None:
        index = next((i for i, each in enumerate(self.layers) if each is layer), None)
        self.replayable &= index is not None  # a layer outside the block: not the block's own doing
        return index

    def built(self, layer, scope: str, inputs) -> int:
        """Notes a sublayer's build; returns the event's position (its weights come after)."""
        i, below = self.index(layer), _below(scope, self.scope)
        # A layer builds in its own name scope; the replay names it after the replayed layer.
        self.replayable &= below is not None and (below == layer.name or below.endswith("/" + layer.name))
        self.replayable &= all(isinstance(x, _RECORDABLE) for x in tf.nest.flatten(inputs))
        self.events.append(("build", i, below, tf.nest.map_structure(_spec, inputs)))
        return len(self.events) - 1

    def finish(self, block, outputs) -> None:
        """Checks what the call did can be replayed; keeps the outputs' specs and the weights."""
        flat = tf.nest.flatten(outputs)
        self.replayable &= all(
            x is None or (isinstance(x, tf.Tensor) and compat.keras_mask(x) is None
                          and tf.get_static_value(x) is None) for x in flat)
        self.replayable &= compat.flatten_layers(block, include_self=False) == self.layers  # none made while called
        self.replayable &= all(id(w) in self.made for w in block.weights if id(w) not in self.weights_before)
        self.named |= {i for i, each in enumerate(self.layers) if compat.flatten_layers(each, include_self=False)}
        if self.replayable:
            self.outputs = tf.nest.map_structure(lambda x: None if x is None else _spec(x), outputs)
            self.weights = _weights(block, self.scope)

    def fits(self, kind: _Kind) -> bool:
        return (self.replayable and _same(kind.structure, self.kind.structure) and _same(kind.layers, self.kind.layers)
                and all(kind.names[i] == self.kind.names[i] for i in self.named))


def _weights(block, scope: str) -> list:
    return [(_below(w.name, scope), tuple(w.shape.as_list()), w.dtype) for w in block.weights]


class _Build:
    """The state of one lazy build: leaf outputs, records, and the blocks being recorded."""

    def __init__(self, replay: bool):
        self.replay_blocks = replay
        self.outputs: dict[int, tuple] = {}  # id(layer) -> (layer, output shape), in the order first called
        self.records: dict[tuple, list[_Record]] = {}
        self.recording: list[_Record] = []  # the blocks whose calls are running, outermost first

    def output(self, layer, shape: tuple) -> None:
        for record in self.recording:
            record.events.append(("output", record.index(layer), shape))
        # A layer called again (a functional model's layers run when it is built and again
        # when called) keeps its place, with its last shape.
        self.outputs[id(layer)] = (layer, shape)

    def build(self, layer, inputs, build):
        """A layer's first build (compat.intercepting_layer_builds): noted by every block recording."""
        if not self.recording:
            return build(inputs)
        scope, before = _scope(), {id(w) for w in layer.weights}
        positions = [record.built(layer, scope, inputs) for record in self.recording]
        result = build(inputs)
        made = {id(w) for w in layer.weights if id(w) not in before}
        for record, position in zip(self.recording, positions):
            record.made |= made
            if made and record.replayable:  # the names of layers that make weights make their names
                record.named.add(record.events[position][1])
        return result

    def call(self, layer, call):
        """A layer's call (compat.intercepting_layer_calls): a block's first call is
        recorded, or replays the record of an earlier block of its kind."""
        if layer.built or tf.executing_eagerly() or not self.replay_blocks:
            return call

        def recorded_or_replayed(inputs, *args, **kwargs):
            layers = compat.flatten_layers(layer, include_self=False)
            kind = _kind(layer, layers, inputs, args, kwargs) if layers else None
            if kind is None:
                return call(inputs, *args, **kwargs)
            same_kind = self.records.setdefault(kind.key, [])
            for record in same_kind:
                if record.fits(kind):
                    return self.replay(record, layer, layers)
            record = _Record(kind, layers, _scope(), {id(w) for w in layer.weights})
            self.recording.append(record)
            try:
                outputs = call(inputs, *args, **kwargs)
            finally:
                self.recording.pop()
            record.finish(layer, outputs)
            same_kind.append(record)
            return outputs

        return recorded_or_replayed

    def replay(self, record: _Record, block, layers: list):
        scope = _scope()
        for event, i, *rest in record.events:
            if event == "output":
                self.output(layers[i], rest[0])
                continue
            below, specs = rest
            below = below[: len(below) - len(record.layers[i].name)] + layers[i].name
            with tf.name_scope(f"{scope}/{below}/" if scope else f"{below}/"):
                compat.build_layer(layers[i], specs)
        if _weights(block, scope) != record.weights:
            raise RuntimeError(f"planner: replaying the build of layer {block.name!r} made other weights than the "
                               "first call of its kind did: a bug in tfpod.plan.lazy")
        return tf.nest.map_structure(lambda s: None if s is None else tf.compat.v1.placeholder(s.dtype, s.shape),
                                     record.outputs)


@contextlib.contextmanager
def recorded_build(replay: bool = True):
    """Within: a model's lazy build, for the planner. Yields a list that fills, when the
    context exits, with (layer, its output's shape) of every leaf layer called (once per
    layer, in the order first called, with its last shape), so a profile can read any
    model's activation shapes; repeated blocks' forward passes run once (above), unless
    `replay` is False (every block called as written: what the replay must equal)."""
    layer_class = compat.tf_keras().layers.Layer
    original = layer_class.__call__
    build = _Build(replay)

    def call(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        first = next(iter(tf.nest.flatten(out)), None)
        if getattr(first, "shape", None) is not None and not compat.flatten_layers(self, include_self=False):
            build.output(self, tuple(first.shape))
        return out

    layer_class.__call__ = call
    outputs = []
    try:
        with compat.intercepting_layer_calls(build.call), compat.intercepting_layer_builds(build.build):
            yield outputs
    finally:
        layer_class.__call__ = original
        outputs.extend(build.outputs.values())
