"""The rules engine: each validation error, layouts from rules tables, the layout report."""

import re

import numpy as np
import pytest
from tensorflow.experimental import dtensor

from tfpod import UserError, partitioning
from tfpod.mesh import make_mesh
from tfpod.models import gpt
from tfpod.partitioning import AxisRule, VarSpec, layout_report, resolve, rules_table


U = dtensor.UNSHARDED


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("data:4,model:2")


TENSOR = rules_table("tensor")


@pytest.mark.unit
def test_layouts_follow_the_table(mesh):
    specs = [VarSpec("m/q/kernel", (16, 8, 4)), VarSpec("m/out/kernel", (8, 4, 16)), VarSpec("m/ln/gamma", (16,))]
    rules = [AxisRule(r".*/q/kernel", ("embed", "heads", "kv")), AxisRule(r".*/out/kernel", ("heads", "kv", "embed")),
             AxisRule(r".*/ln/gamma", ("embed",))]
    layouts = resolve(specs, rules, TENSOR, mesh)
    assert layouts["m/q/kernel"].sharding_specs == [U, "model", U]
    assert layouts["m/out/kernel"].sharding_specs == ["model", U, U]
    assert layouts["m/ln/gamma"].sharding_specs == [U]
    data_only = resolve(specs, rules, rules_table("data"), mesh)
    assert all(s == U for l in data_only.values() for s in l.sharding_specs)


@pytest.mark.unit
def test_mesh_axis_absent_means_replicated():
    mesh = make_mesh("data:8")
    layout = partitioning.layout_for(("batch", "length", "vocab"), TENSOR, mesh)
    assert layout.sharding_specs == ["data", U, U]


@pytest.mark.unit
def test_a_mesh_axis_shards_one_dimension_only(mesh):
    layout = partitioning.layout_for(("heads", "mlp"), TENSOR, mesh)
    assert layout.sharding_specs == ["model", U]


@pytest.mark.unit
def test_user_overrides_replace_preset_entries(mesh):
    table = rules_table("tensor", {"mlp": None, "embed": "model"})
    assert table["mlp"] is None and table["embed"] == "model" and table["heads"] == "model"


def _one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


@pytest.mark.unit
def test_rank_mismatch_names_variable_shape_and_rule(mesh):
    with pytest.raises(UserError) as e:
        resolve([VarSpec("m/dense/kernel", (16, 32))], [AxisRule(r".*dense/kernel", ("embed",))], TENSOR, mesh)
    msg = _one_line(e)
    assert "m/dense/kernel (16, 32)" in msg and "rank 2" in msg and r".*dense/kernel" in msg


@pytest.mark.unit
def test_not_divisible_names_variable_shape_rule_and_axis(mesh):
    with pytest.raises(UserError) as e:
        resolve([VarSpec("m/mlp/kernel", (16, 33))], [AxisRule(r".*mlp/kernel", ("embed", "mlp"))], TENSOR, mesh)
    msg = _one_line(e)
    assert "m/mlp/kernel (16, 33)" in msg and "size 33" in msg and "'model' of size 2" in msg and ".*mlp/kernel" in msg


@pytest.mark.unit
def test_every_dimension_that_does_not_divide_is_named_in_one_error(mesh):
    """All at once (one run to learn them all), grouped by logical axis, size and mesh axis."""
    specs = [VarSpec(f"m/block_{i}/mlp/kernel", (16, 33)) for i in range(3)] + [VarSpec("m/emb", (51, 16))]
    rules = [AxisRule(r".*mlp/kernel", ("embed", "mlp")), AxisRule(r"m/emb", ("vocab", "embed"))]
    with pytest.raises(UserError) as e:
        resolve(specs, rules, TENSOR, mesh)
    msg = _one_line(e)
    assert "m/block_0/mlp/kernel (16, 33)" in msg and "(and 2 more variable(s) alike)" in msg
    assert "m/emb (51, 16): dimension 0 (vocab, size 51)" in msg and "map 'mlp', 'vocab' to no mesh axis" in msg


@pytest.mark.unit
def test_variable_matched_by_two_rules(mesh):
    rules = [AxisRule(r".*/kernel", ("embed", "mlp")), AxisRule(r".*/mlp/.*", ("embed", "mlp"))]
    with pytest.raises(UserError) as e:
        resolve([VarSpec("m/mlp/kernel", (16, 32))], rules, TENSOR, mesh)
    msg = _one_line(e)
    assert "m/mlp/kernel (16, 32)" in msg and "two sharding rules" in msg and ".*/kernel" in msg and ".*/mlp/.*" in msg


@pytest.mark.unit
def test_variable_matched_by_no_rule(mesh):
    with pytest.raises(UserError) as e:
        resolve([VarSpec("m/other/kernel", (4, 4))], [], TENSOR, mesh)
    assert "m/other/kernel (4, 4) matches no sharding rule" in _one_line(e)


@pytest.mark.unit
def test_rule_that_matches_nothing(mesh):
    rules = [AxisRule(r".*/kernel", ("embed", "mlp")), AxisRule(r".*/typo_kernel", ("embed", "mlp"))]
    with pytest.raises(UserError) as e:
        resolve([VarSpec("m/mlp/kernel", (16, 32))], rules, TENSOR, mesh)
    assert ".*/typo_kernel" in _one_line(e) and "matches no variable" in str(e.value)


@pytest.mark.unit
def test_duplicate_variable_names(mesh):
    with pytest.raises(UserError, match="two variables are named 'm/k'"):
        resolve([VarSpec("m/k", (4,)), VarSpec("m/k", (4,))], [AxisRule("m/k", ("embed",))], TENSOR, mesh)


@pytest.mark.unit
def test_bad_rules_and_presets():
    with pytest.raises(UserError, match="unknown logical axis 'hidden'"):
        AxisRule(r".*", ("hidden",))
    with pytest.raises(UserError, match="not a valid regex"):
        AxisRule(r"(", ("embed",))
    with pytest.raises(UserError, match="sharding.preset='megatron' is not a preset"):
        rules_table("megatron")
    with pytest.raises(UserError, match="unknown logical axis 'hidden'"):
        rules_table("tensor", {"hidden": "model"})


@pytest.mark.unit
def test_validation_happens_before_allocation(mesh, monkeypatch):
    """A bad rule is reported from the lazy build, before any DVariable is created."""
    from tf_keras.src.dtensor import layout_map

    created = []
    real = layout_map._create_dvariable

    def spy(layout_map_, object_path, variable):
        created.append(object_path)
        return real(layout_map_, object_path, variable)

    monkeypatch.setattr(layout_map, "_create_dvariable", spy)

    def build(mlp_dim):
        cfg = gpt.GPTConfig(vocab_size=64, seq_len=8, num_layers=1, embed_dim=16, num_heads=4, mlp_dim=mlp_dim)
        return partitioning.build_sharded(lambda: gpt.TASK.build(cfg), gpt.input_signature(cfg), mesh, gpt.AXIS_RULES, TENSOR)

    with pytest.raises(UserError, match="gpt/block_0/intermediate/kernel \\(16, 33\\)"):
        build(33)
    assert created == []
    build(32)  # the same model with a divisible size allocates through the spied path
    assert created


@pytest.mark.unit
def test_layout_report_lists_bytes_per_device_and_totals(mesh):
    specs = [VarSpec("m/emb", (64, 16)), VarSpec("m/ln", (16,))]
    rules = [AxisRule("m/emb", ("vocab", "embed")), AxisRule("m/ln", ("embed",))]
    report = layout_report(specs, resolve(specs, rules, TENSOR, mesh))
    lines = report.splitlines()
    assert lines[0] == "# variables on mesh data:4,model:2"
    assert lines[1].split() == ["variable", "global", "shape", "layout", "bytes/device"]
    emb = next(l for l in lines if l.startswith("m/emb"))
    assert "(64, 16)" in emb and "[model, unsharded]" in emb and "2.00 KiB" in emb  # 32*16*4 bytes
    assert lines[-2] == "# total: 2 variables, 1,040 parameters, 4.06 KiB; per device: 2.06 KiB"
    assert lines[-1] == "# split over 'model': 1 of 2 variables: m/emb"


def test_gpt_small_is_125m_parameters():
    """gin/gpt_small.gin's shape, counted from a lazy build (nothing allocated)."""
    import math

    cfg = gpt.GPTConfig(vocab_size=50304, seq_len=1024, num_layers=12, embed_dim=768, num_heads=12, mlp_dim=3072)
    specs = partitioning.variable_specs(lambda: gpt.TASK.build(cfg), gpt.input_signature(cfg))
    n = sum(math.prod(s.shape) for s in specs)
    assert 120e6 < n < 130e6, n


@pytest.mark.unit
def test_activation_helpers_relayout_inside_the_context(mesh):
    import tensorflow as tf

    x = dtensor.copy_to_mesh(tf.ones([8, 4, 16]), dtensor.Layout.replicated(mesh, 3))
    assert partitioning.shard(x, ("batch", "length", "embed")) is x  # no context: unchanged
    with partitioning.activation_sharding(mesh, TENSOR):
        sharded = partitioning.shard(x, ("batch", "length", "mlp"))
        assert dtensor.fetch_layout(sharded).sharding_specs == ["data", U, "model"]
        split = partitioning.split(x, 1, "model")
        assert dtensor.fetch_layout(split).sharding_specs == [U, "model", U]
        back = partitioning.replicate(sharded)
        assert dtensor.fetch_layout(back).sharding_specs == [U, U, U]
        assert float(tf.reduce_sum(back)) == 8 * 4 * 16
        with pytest.raises(ValueError, match="got 2 logical axes"):
            partitioning.shard(x, ("batch", "length"))


@pytest.mark.unit
def test_what_changes_a_traced_step_is_one_context_and_its_switches_fail_outside_a_step(mesh):
    """The step's context (partitioning.step_context.StepContext) is opened by a placement's compile
    point; each switch an executor flips inside it (gathered weights, the microbatch, a pipeline
    stage, a stage's prefetched copies) refuses to open outside a step instead of changing nothing,
    and a step that accumulates microbatches refuses a dropout mask drawn for no microbatch."""
    import tensorflow as tf
    import tf_keras

    placement = partitioning.Placement(mesh, TENSOR)
    for switch, name in ((partitioning.gathered_weights, "gathered_weights()"),
                         (lambda: partitioning.microbatch(1), "microbatch(1)"),
                         (lambda: placement.stage_activations(0), "stage_activations(0)"),
                         (lambda: partitioning.stages.prefetched([], mesh), "stages.prefetched")):
        with pytest.raises(RuntimeError, match=rf"^{re.escape(name)} outside a step's context: trace the step"):
            with switch():
                pass
    assert partitioning.active_context() is None

    layer = tf_keras.layers.Dropout(0.5)
    step = tf.Variable(3, dtype=tf.int64)
    assert partitioning.replayable_dropout(tf_keras.Sequential([layer]), step, seed=0) == 1
    x = dtensor.copy_to_mesh(tf.ones([4, 8]), dtensor.Layout.replicated(mesh, 2))
    with placement.activations(microbatches=2):
        context = partitioning.active_context()
        assert (context.mesh, context.microbatches, context.microbatch, context.gathered) == (mesh, 2, None, False)
        with pytest.raises(RuntimeError, match="drawn in a step of 2 microbatches outside partitioning.microbatch"):
            layer(x, training=True)
        with partitioning.microbatch(0):
            first = layer(x, training=True)
            assert partitioning.active_context().microbatch == 0
        with partitioning.microbatch(1):
            second = layer(x, training=True)
        with partitioning.microbatch(0), partitioning.gathered_weights():
            assert partitioning.active_context().gathered
            again = layer(x, training=True)
        assert partitioning.active_context() is context  # each block's change ends with it
    first, second, again = (dtensor.unpack(t)[0].numpy() for t in (first, second, again))
    np.testing.assert_array_equal(first, again)  # the same microbatch replays its mask
    assert not np.array_equal(first, second)
    with placement.activations():  # one microbatch: a mask needs no index
        layer(x, training=True)
