"""Blockwise attention (tfpod.attention) against the materialized score matrix: values and
gradients, masks from positions and segments, dropout, graph mode and XLA, and whole models."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from conftest import device_mesh
from tfpod import UserError, attention
from tfpod.api import run


def _compare(b=2, h=3, lq=40, lk=40, d=8, causal=True, segments=True, rate=0.0, block=16, seed=0, fn=None):
    """Max relative differences of the output and the q, k, v gradients, blockwise vs materialized."""
    rng = np.random.default_rng(seed)
    q, k, v = (tf.constant(rng.normal(size=(b, h, n, d)), tf.float32) for n in (lq, lk, lk))
    ids = None
    if segments:  # three packed documents, then padding (segment 0)
        s = np.sort(rng.integers(1, 4, size=(b, lk)), axis=1)
        s[:, -5:] = 0
        ids = tf.constant(s, tf.int32)
    dropout_seed = tf.constant([7, 11])
    keep = attention.dropout_keep(dropout_seed, [b, h, lq, lk], rate, block) if rate else None
    weights = tf.constant(rng.normal(size=(b, h, lq, d)), tf.float32)

    def both(q, k, v):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([q, k, v])
            one = attention.blockwise(q, k, v, ids, ids, causal, block, rate, dropout_seed if rate else None)
            two = attention.materialized(q, k, v, ids, ids, causal, keep)
            losses = tf.reduce_sum(one * weights), tf.reduce_sum(two * weights)
        return [one, *tape.gradient(losses[0], [q, k, v])], [two, *tape.gradient(losses[1], [q, k, v])]

    got, want = (fn or (lambda f: f))(both)(q, k, v)
    return [float(tf.reduce_max(tf.abs(a - b)) / tf.reduce_max(tf.abs(b))) for a, b in zip(got, want)]


@pytest.mark.unit
@pytest.mark.parametrize("case", [
    dict(), dict(causal=False), dict(segments=False), dict(rate=0.3), dict(lq=37, lk=37),
    dict(block=64), dict(causal=False, segments=False, rate=0.1, lq=33, lk=33, block=8)],
    ids=["causal-segments", "bidirectional", "causal", "dropout", "uneven", "one-block", "dropout-uneven"])
def test_blockwise_equals_the_materialized_matrix_with_its_gradients(case):
    """Outputs and q, k, v gradients within 1e-6 (relative, fp32): causal or not, packed
    segments with padding, lengths no block divides, dropout (the same per-block masks)."""
    assert max(_compare(**case)) < 1e-6


def test_blockwise_runs_in_graph_mode_and_under_xla():
    for fn in (tf.function, lambda f: tf.function(f, jit_compile=True)):
        assert max(_compare(fn=fn)) < 1e-6


def _score_matmuls_first_in_line(graph_def, rows: int, block: int) -> list[str]:
    """The [.., rows, block] matmuls (scores, and the gradient's dp) of a traced step that no
    other such matmul comes before along data edges (control edges are left out: DTensor's
    graph passes drop those between stateless ops)."""
    nodes = {n.name: n for n in graph_def.node}
    shape = lambda n: [d.size for d in n.attr["_output_shapes"].list.shape[0].dim]
    big = {n.name for n in graph_def.node if n.op in ("BatchMatMulV2", "MatMul", "Einsum")
           and "_output_shapes" in n.attr and shape(n)[-2:] == [rows, block]}
    memo = {}

    def after_big(name):  # does some big matmul come before `name` along data edges?
        if name not in memo:
            memo[name] = False
            for i in nodes[name].input:
                if i.startswith("^"):
                    continue
                src = i.split(":")[0]
                if src in nodes and (src in big or after_big(src)):
                    memo[name] = True
                    break
        return memo[name]

    return sorted(n for n in big if not after_big(n))


@pytest.mark.parametrize("causal,rate", [(True, 0.0), (False, 0.1)])
def test_each_pair_waits_for_the_previous_one_by_data(causal, rate):
    """Memory linear in the length needs one pair's temporaries at a time: every pair's
    scores (forward and gradient) come after the previous pair's results through data, so
    the executor cannot make them all as soon as q and k exist. Only the first is free."""
    b, h, length, d, block = 1, 2, 64, 8, 8
    q, k, v = (tf.random.stateless_normal([b, h, length, d], [i, 0]) for i in range(3))
    seg = tf.ones([b, length], tf.int32)

    @tf.function
    def step(q, k, v, seg):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = attention.blockwise(q, k, v, seg, seg, causal, block, rate, tf.constant([1, 2]) if rate else None)
            loss = tf.reduce_sum(out * out)
        return tape.gradient(loss, [q, k, v])

    graph = step.get_concrete_function(q, k, v, seg).graph.as_graph_def(add_shapes=True)
    rows = attention.query_groups(length, block)[0][1]
    assert len(_score_matmuls_first_in_line(graph, rows, block)) == 1  # (with control dependencies: 40)


@pytest.mark.unit
def test_bad_settings_are_one_line():
    with pytest.raises(UserError, match="attention.implementation='flash': use one of blockwise, materialized"):
        attention.AttentionConfig(implementation="flash")
    with pytest.raises(UserError, match="attention.block_size=0 must be at least 1"):
        attention.AttentionConfig(block_size=0)


@pytest.mark.unit
def test_two_steps_of_one_process_attend_each_with_its_placements_implementation():
    """The implementation is a field of the step context that Placement.compile opens, not of
    the process: steps of two placements on one device, one materialized and one blockwise
    (block 8), each trace their own kernel (the mask a GPT block passes it: [batch, length,
    length] or segment ids [batch, 1]) and attend alike (relative 1e-5), called in turn; an
    eval step's context (Placement.activations) is the placement's; `using` changes it for a
    block of a trace, outside any step too; outside every context the defaults apply."""
    from tfpod import partitioning
    from tfpod.models import gpt

    mesh = device_mesh("data:1")
    rng = np.random.default_rng(0)
    q, k, v = (tf.constant(rng.normal(size=(2, 2, 16, 4)), tf.float32) for _ in range(3))
    ids = tf.ones([2, 16], tf.int32)

    def step(q, k, v, ids):
        mask = gpt.attention_mask(ids)
        return attention.attend(q, k, v, mask, True), tf.shape(mask)

    steps = {impl: partitioning.Placement(mesh, {}, attention=attention.AttentionConfig(impl, 8)).compile(step)
             for impl in attention.IMPLEMENTATIONS}
    out = {}
    for impl in ("materialized", "blockwise", "materialized"):
        out[impl] = steps[impl](q, k, v, ids)
        assert steps[impl].experimental_get_tracing_count() == 1
    assert out["materialized"][1].numpy().tolist() == [2, 16, 16] and out["blockwise"][1].numpy().tolist() == [2, 1]
    np.testing.assert_allclose(out["blockwise"][0], out["materialized"][0], rtol=1e-5, atol=1e-6)
    placement = partitioning.Placement(mesh, {}, attention=attention.AttentionConfig("materialized"))
    with placement.activations():
        assert attention.current().implementation == "materialized"
        with attention.using(attention.AttentionConfig(block_size=4)):
            assert attention.current().block_size == 4 and partitioning.active_context().mesh is mesh
        assert attention.current().implementation == "materialized"
    with attention.using(attention.AttentionConfig("materialized")):  # (export, the planner: no mesh)
        assert attention.current().implementation == "materialized" and partitioning.active_context() is None
    assert attention.current() == attention.AttentionConfig()


def test_a_model_trains_the_materialized_losses_with_blockwise_attention(tmp_path):
    """GPT with packed documents on the Megatron tensor layout, 8 devices: blockwise attention
    (block 32: several blocks a row) gives the materialized path's losses step by step
    (relative 1e-5, fp32). (Every other test that trains GPT, MoE or Llama runs blockwise: the
    sharded-against-one-device comparisons of every preset among them.)"""
    params = ["train.steps=3", "train.log_every=1", "train.steps_per_loop=3", "sharding.preset='tensor'",
              "lm_data.packing='segments'"]
    losses = {}
    for impl, block in (("materialized", 512), ("blockwise", 32)):
        out = run(["gin/lm_tiny.gin"], params + [f"attention.implementation='{impl}'", f"attention.block_size={block}"],
                  str(tmp_path / impl), mesh=device_mesh("data:2,model:4"))
        losses[impl] = out["losses"]
    np.testing.assert_allclose(losses["blockwise"], losses["materialized"], rtol=1e-5)


@pytest.mark.unit
def test_the_planner_keeps_no_length_squared_term_for_blockwise_attention():
    """GPT-2 small at 1,024 tokens on 8 H100s (8 examples a device, fp32): blockwise attention's
    activations are the materialized path's less each layer's [heads, 1024, 1024] probabilities,
    plus two float32 statistics a row (max and sum)."""
    from test_plan import configs
    from tfpod.models import TASKS
    from tfpod.plan import devices
    from tfpod.plan.planner import Choice, Planner

    model = TASKS["gpt"].config_class(vocab_size=50304, seq_len=1024, num_layers=12, embed_dim=768, num_heads=12,
                                      mlp_dim=3072)
    acts = {}
    for impl in attention.IMPLEMENTATIONS:
        c = dataclasses.replace(configs("gpt", model, global_batch=64), attention=attention.AttentionConfig(impl))
        plan = Planner(c, devices.get("h100"), 8).plan(Choice("data:8", "data"))
        acts[impl] = plan["per_device_bytes"]["activations"]
    assert acts["materialized"] - acts["blockwise"] == 12 * 8 * 12 * 1024 * (1024 - 2) * 4
