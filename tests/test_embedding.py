"""Sharded embedding tables (tfpod.embedding): lookups equal to tf.gather / a Keras Embedding,
and sparse updates equal to plain tf_keras's over several steps with repeated ids.

One small model holds a row-split table (sum), a column-split table (mean) and a
row-split table looked up without pooling, on data:4,model:2 (rows and columns over
`model`, the batch over `data`); each device looks up and updates only its own shard
(tfpod.embedding.tables). The references run on one device with ordinary variables.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow.experimental import dtensor

from tfpod import UserError, embedding, optimizers, partitioning, runtime, trainer
from tfpod.embedding.executor import TablesExecutor
from tfpod.executor import OneMesh
from tfpod.mesh import make_mesh
from tfpod.partitioning import AxisRule
from tfpod.task import LossTerms

CPU0 = "/job:localhost/replica:0/task:0/device:CPU:0"
AXES = {"a": ("batch", None), "b": ("batch", None), "c": ("batch", None), "y": ("batch",)}
RULES = (AxisRule(r".*a/embeddings", ("vocab", None)), AxisRule(r".*b/embeddings", (None, "vocab")),
         AxisRule(r".*c/embeddings", ("vocab", None)), AxisRule(r".*d/kernel", (None, None)),
         AxisRule(r".*d/bias", (None,)))


class Model(tf_keras.Model):
    """Three tables (sum, mean, unpooled) into one Dense output."""

    def __init__(self):
        super().__init__(name="m")
        self.a = embedding.Embedding(64, 8, "sum", source="a", name="a")
        self.b = embedding.Embedding(32, 8, "mean", source="b", name="b")
        self.c = embedding.Embedding(16, 4, None, source="c", name="c")
        self.d = tf_keras.layers.Dense(1, name="d")

    def call(self, x):
        c = tf.reshape(self.c(x["c"]), [-1, 8])  # [batch, 2 ids * 4]
        return self.d(tf.concat([self.a(x["a"]), self.b(x["b"]), c], -1))[:, 0]


SIGNATURE = {"a": tf.TensorSpec([None, 3], tf.int32), "b": tf.TensorSpec([None, 4], tf.int32),
             "c": tf.TensorSpec([None, 2], tf.int32)}


def batches(steps, rows=16, seed=0):
    """Few distinct ids (repeats within and across examples), -1 padding, one NaN-free target."""
    rng = np.random.default_rng(seed)
    return {"a": rng.integers(-1, 8, [steps, rows, 3]).astype(np.int32),
            "b": rng.integers(-1, 6, [steps, rows, 4]).astype(np.int32),
            "c": rng.integers(-1, 5, [steps, rows, 2]).astype(np.int32),
            "y": rng.normal(size=[steps, rows]).astype(np.float32)}


def full(v, mesh):
    """A variable's whole value on the host (on `mesh`, or on the sub-mesh of a table placed whole)."""
    del mesh
    own = dtensor.fetch_layout(v).mesh
    return runtime.to_host(dtensor.relayout(v.read_value(), dtensor.Layout.replicated(own, v.shape.rank)))


def sharded(make_optimizer, mesh_spec="data:4,model:2", tables="rows"):
    mesh = make_mesh(mesh_spec)
    placement = partitioning.Placement.from_config(partitioning.ShardingConfig(preset="tensor", tables=tables),
                                                   "tensor", mesh, check=False)
    tf_keras.utils.set_random_seed(1)
    placed = TablesExecutor(Task(), placement).variable_layouts
    model, _, layouts = partitioning.build_sharded(Model, SIGNATURE, mesh, RULES, placement.table, placed=placed)
    optimizer = make_optimizer() if make_optimizer else None
    update = optimizers.Update(optimizer, model.trainable_variables, mesh) if optimizer else None
    tables = embedding.Tables(model, placement, AXES, optimizer)
    return model, placement, tables, update, layouts


def reference(model, mesh):
    """The same model with ordinary variables on one device, the sharded one's initial weights."""
    with tf.device(CPU0):
        ref = Model()
        ref({k: tf.zeros([1] + s.shape[1:], tf.int32) for k, s in SIGNATURE.items()})
        for v, r in zip(model.trainable_variables, ref.trainable_variables):
            r.assign(full(v, mesh))
    return ref


def test_lookups_equal_gather_and_keras_embedding():
    """Row-split (sum), column-split (mean) and row-split unpooled lookups, padded ids (-1) and
    ragged ids, equal tf.gather / tf_keras Embedding / an EmbeddingBag to 1e-6."""
    model, placement, tables, _, layouts = sharded(None)
    mesh = placement.mesh
    assert layouts["m/a/embeddings"].sharding_specs == ["model", dtensor.UNSHARDED]
    assert layouts["m/b/embeddings"].sharding_specs == [dtensor.UNSHARDED, "model"]
    host = {k: v[0] for k, v in batches(1).items() if k != "y"}
    partials = tables.lookup(host)
    assert partials["a"].shape == [2, 16, 8] and partials["c"].shape == [2, 16, 2, 4]

    @tf.function
    def forward(batch, partials):
        with embedding.layer.lookup_scope(tables.scope(partials)):
            return model.a(batch["a"]), model.b(batch["b"]), model.c(batch["c"])

    out = forward(placement.to_global(host, AXES), partials)
    out = [runtime.to_host(dtensor.relayout(o, dtensor.Layout.replicated(mesh, o.shape.rank))) for o in out]
    a, b, c = (full(getattr(model, n).embeddings, mesh) for n in "abc")
    ids = host["a"]
    bag = np.stack([sum(a[i] for i in row if i >= 0) if (row >= 0).any() else np.zeros(8) for row in ids])
    np.testing.assert_allclose(out[0], bag, atol=1e-6)
    mean = np.stack([np.mean([b[i] for i in row if i >= 0], 0) if (row >= 0).any() else np.zeros(8)
                     for row in host["b"]])
    np.testing.assert_allclose(out[1], mean, atol=1e-6)
    keras = tf_keras.layers.Embedding(16, 4)
    keras.build(None)
    keras.set_weights([c])
    want = keras(np.maximum(host["c"], 0)).numpy() * (host["c"] >= 0)[..., None]
    np.testing.assert_allclose(out[2], want, atol=1e-6)
    np.testing.assert_allclose(embedding.lookup(c, np.maximum(host["c"], 0)).numpy(),
                               tf.gather(c, np.maximum(host["c"], 0)).numpy(), atol=1e-6)
    ragged = tf.ragged.constant([[1, 2, 2], [], [5]])
    np.testing.assert_allclose(embedding.lookup(a, ragged, "sum").numpy(),
                               np.stack([a[1] + 2 * a[2], np.zeros(8), a[5]]), atol=1e-6)


def test_dedupe_sums_repeated_ids():
    ids = tf.constant([3, -1, 3, 0, 7, 0, 3])
    values = tf.constant(np.arange(14, dtype=np.float32).reshape(7, 2))
    rows = embedding.dedupe(embedding.Rows(ids, values))
    np.testing.assert_array_equal(rows.ids.numpy(), [0, 3, 7, embedding.sparse.EMPTY, 0, 0, 0][:4] +
                                  [embedding.sparse.EMPTY] * 3)
    np.testing.assert_allclose(rows.values.numpy()[:3], [[6 + 10, 7 + 11], [0 + 4 + 12, 1 + 5 + 13], [8, 9]])
    assert not rows.values.numpy()[3:].any()


class Task:
    """The task the Trainer's executor reads: the mean squared error of the model's output."""

    name = "m"

    @staticmethod
    def loss_terms(model, batch, training):
        return LossTerms([tf.reduce_sum(tf.square(model(batch) - batch["y"]))])

    @staticmethod
    def loss_counts(batch):
        return [tf.cast(tf.size(batch["y"]), tf.float32)]

    @staticmethod
    def batch_axes():
        return AXES

    @staticmethod
    def model_inputs(batch):
        return batch


def train(model, placement, update, stack, clip):
    """The Trainer's loop of steps on the tables' executor (lookups, the one update, the rows)."""
    executor = TablesExecutor(Task(), placement)
    executor.bind(model, update, None)
    loop = trainer.make_train_loop(executor, update, clip, 1)
    steps = len(stack["y"])
    return loop(executor.to_device(stack, steps), steps)


def lazy_adam(var, m, v, indices, values, lr, step, b1=0.9, b2=0.999, eps=1e-7):
    """numpy: Adam on the touched rows (duplicates summed), the others untouched."""
    ids, inverse = np.unique(indices, return_inverse=True)
    g = np.zeros([len(ids), var.shape[1]], np.float64)
    np.add.at(g, inverse, values)
    m[ids] = b1 * m[ids] + (1 - b1) * g
    v[ids] = b2 * v[ids] + (1 - b2) * g * g
    var[ids] -= lr * np.sqrt(1 - b2 ** step) / (1 - b1 ** step) * m[ids] / (np.sqrt(v[ids]) + eps)


@pytest.mark.parametrize("kind,tables", [("sgd", "rows"), ("momentum", "rows"), ("adagrad", "rows"), ("adam", "rows"),
                                         ("adagrad", "whole"), ("adam", "whole")])
def test_sparse_updates_equal_plain_keras_over_steps(kind, tables):
    """Four steps with repeated ids and clipping active: tables (row- and column-split, or
    with tables='whole' the row-split ones each whole on the devices of one position of
    `model`) and their slots equal plain tf_keras's sparse update on one device (rtol 1e-6);
    Adam is lazy (rows a step does not touch keep their moments), checked against numpy;
    the global norm counts each table's de-duplicated rows (the norm of its dense gradient)."""
    make = {"sgd": lambda: tf_keras.optimizers.legacy.SGD(0.1),
            "momentum": lambda: tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9),
            "adagrad": lambda: tf_keras.optimizers.legacy.Adagrad(0.1),
            "adam": lambda: tf_keras.optimizers.legacy.Adam(0.01)}[kind]
    model, placement, _, update, layouts = sharded(make, tables=tables)
    if tables == "whole":  # a and c whole on model=0 and model=1 (the larger first); b's columns split as before
        assert [partitioning.submesh.position(layouts[f"m/{n}/embeddings"].mesh, placement.mesh)
                for n in "abc"] == [("model", 0), None, ("model", 1)]
    mesh = placement.mesh
    ref = reference(model, mesh)
    stack = batches(4)
    losses, norms = train(model, placement, update, stack, clip=0.5)
    with tf.device(CPU0):
        ref_optimizer = make()
        tables_ref = {id(ref.a.embeddings), id(ref.b.embeddings), id(ref.c.embeddings)}
        moments = {id(t): (np.zeros(t.shape), np.zeros(t.shape)) for t in ref.trainable_variables}
        for n in range(4):
            batch = {k: v[n] for k, v in stack.items()}
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(ref(batch) - batch["y"]))
            grads = tape.gradient(loss, ref.trainable_variables)
            norm = tf.linalg.global_norm([tf.convert_to_tensor(g) for g in grads])
            np.testing.assert_allclose(losses[n], loss.numpy(), rtol=1e-6)
            np.testing.assert_allclose(norms[n], norm.numpy(), rtol=1e-5)
            grads, _ = tf.clip_by_global_norm(grads, 0.5, use_norm=norm)
            if kind != "adam":
                ref_optimizer.apply_gradients(zip(grads, ref.trainable_variables))
                continue
            dense = [(g, v) for g, v in zip(grads, ref.trainable_variables) if id(v) not in tables_ref]
            ref_optimizer.apply_gradients(dense)
            for g, v in zip(grads, ref.trainable_variables):
                if id(v) in tables_ref:
                    keep = g.indices.numpy() >= 0
                    value = v.numpy().astype(np.float64)
                    m, s = moments[id(v)]
                    lazy_adam(value, m, s, g.indices.numpy()[keep], g.values.numpy()[keep], 0.01, n + 1)
                    v.assign(value.astype(np.float32))
    for v, r in zip(model.trainable_variables, ref.trainable_variables):
        np.testing.assert_allclose(full(v, mesh), r.numpy(), rtol=1e-6, atol=1e-7, err_msg=v.name)
        for slot in update.optimizer.get_slot_names():
            want = (moments[id(r)][("m", "v").index(slot)] if kind == "adam" and id(r) in tables_ref
                    else ref_optimizer.get_slot(r, slot).numpy())
            np.testing.assert_allclose(full(update.optimizer.get_slot(v, slot), mesh), want, rtol=1e-5, atol=1e-7,
                                       err_msg=f"{v.name}/{slot}")


def test_a_nonfinite_step_changes_nothing_but_the_counter():
    model, placement, tables, update, _ = sharded(lambda: tf_keras.optimizers.legacy.Adagrad(0.1))
    mesh = placement.mesh
    before = [full(v, mesh) for v in model.variables]
    slots = [full(update.optimizer.get_slot(v, "accumulator"), mesh) for v in model.trainable_variables]
    stack = batches(1)
    stack["y"][0, 3] = np.nan
    losses, _ = train(model, placement, update, stack, clip=None)
    assert np.isnan(losses[0]) and int(runtime.to_host(update.optimizer.iterations)) == 1
    for v, b in zip(model.variables, before):
        np.testing.assert_array_equal(full(v, mesh), b)
    for v, s in zip(model.trainable_variables, slots):
        np.testing.assert_array_equal(full(update.optimizer.get_slot(v, "accumulator"), mesh), s)


def test_a_split_table_without_the_tables_executor_is_one_line():
    """A task that does not declare sparse_tables gets OneMesh, whose step would gather a
    split table: refused by a UserError naming the capability (tf_keras adds its call's
    context around the line)."""
    model, placement, _, update, _ = sharded(lambda: tf_keras.optimizers.legacy.SGD(0.1))
    executor = OneMesh(Task(), placement)
    executor.bind(model, update, None)
    loop = trainer.make_train_loop(executor, update, None, 1)
    with pytest.raises(UserError, match=r"embedding \w: its table's rows are split .* `sparse_tables = True`"):
        loop(executor.to_device(batches(1), 1), 1)


@pytest.mark.unit
def test_tables_placed_whole_balance_by_bytes_and_refuse_in_one_line():
    """Table-wise positions are greedy by bytes (largest first, to the least-loaded position);
    a position's sub-mesh is the mesh's devices there; what cannot be placed whole is one
    UserError line."""
    from tfpod.embedding import whole

    assert whole.positions({"a": 10, "b": 6, "c": 5, "d": 1}, 2) == {"a": 0, "b": 1, "c": 1, "d": 0}
    assert whole.heaviest({"a": 10, "b": 6, "c": 5, "d": 1}, 2) == ["a", "d"]  # 11 bytes against 11: the lowest
    assert whole.heaviest({"a": 10, "b": 6, "c": 5}, 2) == ["b", "c"]
    mesh = make_mesh("data:4,model:2")
    sub = partitioning.submesh.at(mesh, "model", 1)
    assert sub.shape() == [4, 1] and [d[-5:] for d in sub.local_devices()] == ["CPU:1", "CPU:3", "CPU:5", "CPU:7"]
    assert partitioning.submesh.position(sub, mesh) == ("model", 1)
    with pytest.raises(UserError, match=r"sharding.tables='sideways': use 'rows' .* or 'whole'"):
        partitioning.ShardingConfig(tables="sideways")
    replicated = {"t": dtensor.Layout.replicated(mesh, 2)}
    with pytest.raises(UserError, match=r"no table's rows map to a mesh axis .* sharding.rules=\{'vocab': 'data'\}"):
        whole.layouts(["t"], replicated, {"t": (8, 4)}, {"t": 4}, mesh)
    placement = partitioning.Placement.from_config(partitioning.ShardingConfig(preset="tensor", tables="whole"),
                                                   "tensor", mesh, check=False)
    task = Task()
    task.sparse_tables = False
    with pytest.raises(UserError, match=r"sharding.tables='whole': task 'm' has no embedding tables to place"):
        trainer.executor_for(task, placement)


def test_the_loops_flat_call_gives_the_plain_calls_results():
    """compat.flat_caller (the tables' host loop calls its concrete functions so): nested
    arguments with None and NumPy leaves give the plain call's outputs; arguments the
    signature flattens otherwise fall back to the plain call."""
    from tfpod import compat

    fn = tf.function(lambda d, xs, none, a: {"s": d["b"] - d["a"] + xs[0] * xs[1], "a": a * 2.0})
    args = ({"b": tf.constant([3.0]), "a": tf.constant([1.0])}, [tf.constant(2.0), tf.constant(5.0)], None,
            np.array([1.5], np.float32))
    concrete = fn.get_concrete_function(*args)
    fast = compat.flat_caller(concrete, *args)
    assert fast is not concrete
    again = ({"b": tf.constant([7.0]), "a": tf.constant([2.0])}, [tf.constant(1.0), tf.constant(3.0)], None,
             np.array([4.0], np.float32))
    got, want = fast(*again), concrete(*again)
    assert got["s"].numpy().tolist() == want["s"].numpy().tolist() == [8.0]
    assert got["a"].numpy().tolist() == want["a"].numpy().tolist() == [8.0]
    scalar = tf.function(lambda x, n: x * n).get_concrete_function(tf.constant(2.0), 3)  # a Python value: bound
    assert compat.flat_caller(scalar, tf.constant(2.0), 3) is scalar
