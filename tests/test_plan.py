"""The planner (tfpod.plan): exact state bytes, the plan's fields, --mode=plan, --mesh=auto."""

import json
import math
import os

import pytest

from conftest import main_py, make_run

from tfpod import UserError, api, config, controller, optimizers, partitioning, plan
from tfpod.models import TASKS
from tfpod.plan import devices, memory, timing
from tfpod.plan.planner import Choice, Planner


def configs(task_name, model_config, global_batch=16, optimizer="adamw", precision="float32", preset=None,
            microbatches=1, **sharding):
    task = TASKS[task_name]
    return api.RunConfigs(task=task, experiment=config.ExperimentConfig(model=task_name), model=model_config,
                          data=None, train=controller.TrainConfig(steps=10, global_batch_size=global_batch,
                                                                  precision=precision, microbatches=microbatches),
                          optimizer=optimizers.OptimizerConfig(name=optimizer, weight_decay=0.0 if optimizer == "sgd" else 0.01),
                          sharding=partitioning.ShardingConfig(preset=preset, **sharding))


def lm_tiny():
    return TASKS["gpt"].config_class(vocab_size=2048, seq_len=64, num_layers=2, embed_dim=128, num_heads=8,
                                     mlp_dim=512)


def moe_tiny():
    return TASKS["moe"].config_class(vocab_size=2048, seq_len=64, num_layers=2, embed_dim=64, num_heads=4,
                                     mlp_dim=256, num_experts=4, expert_mlp_dim=128, group_size=32)


def bert_tiny():  # without next-sentence prediction: the pooler is built but does not train
    return TASKS["bert"].config_class(vocab_size=512, seq_len=32, max_predictions=4, num_layers=2, hidden_size=64,
                                      num_heads=4, intermediate_size=128)


def device_bytes(specs, layouts, stage_meshes=()):
    """Per device, the largest stage's: what layouts.txt's totals say."""
    per = {}
    for s in specs:
        stage = partitioning.stages.stage_index(layouts[s.name], stage_meshes) if stage_meshes else 0
        per[stage] = per.get(stage, 0) + partitioning.bytes_per_device(s.shape, s.dtype, layouts[s.name])
    return max(per.values())


@pytest.mark.parametrize("task_name,model,mesh,preset,optimizer,extra", [
    ("gpt", lm_tiny, "data:4,model:2", "tensor", "adamw", {}),
    ("gpt", lm_tiny, "data:4,model:2", "2d", "lamb", {}),
    ("gpt", lm_tiny, "data:8", "weight_update", "adamw", {}),
    ("gpt", lm_tiny, "stage:2,data:2,model:2", "tensor", "adamw", {"microbatches": 2}),
    ("moe", moe_tiny, "data:2,expert:4", "tensor", "sgd", {}),
    ("bert", bert_tiny, "data:4,model:2", "tensor", "lamb", {}),
])
def test_weights_and_optimizer_bytes_equal_the_layout_report(tmp_path, task_name, model, mesh, preset, optimizer,
                                                              extra):
    c = configs(task_name, model(), optimizer=optimizer, preset=preset, **extra)
    run = make_run(c.task, c.model, c.train, c.optimizer, mesh, tmp_path, preset=preset)
    t = run.trainer
    stages = t.placement.stages
    p = Planner(c, devices.get("h100"), 8).plan(Choice(mesh))
    b = p["per_device_bytes"]
    assert b["weights"] == device_bytes(t.specs, t.layouts, stages)
    assert b["optimizer"] == device_bytes(t.state_specs, t.state_layouts, stages)
    trainable = [s for s in t.specs if s.trainable]
    assert b["gradients"] == device_bytes(trainable, t.layouts, stages)
    assert p["parameters"] == sum(v.shape.num_elements() for v in t.model.trainable_variables)


@pytest.mark.unit
def test_plan_fields_and_what_moves_the_activations():
    c = configs("gpt", TASKS["gpt"].config_class(vocab_size=50304, seq_len=1024, num_layers=12, embed_dim=768,
                                                 num_heads=12, mlp_dim=3072), global_batch=64,
                precision="mixed_bfloat16")
    planner = Planner(c, devices.get("a100-40g"), 16)
    data = planner.plan(Choice("data:16", "data"))
    for key in ("mesh", "preset", "per_device_bytes", "device_memory", "fits", "step_time_s", "tokens_per_sec", "mfu",
                "breakdown"):
        assert key in data
    assert set(data["per_device_bytes"]) == {"weights", "gradients", "optimizer", "activations", "temporary", "total"}
    assert data["per_device_bytes"]["total"] == sum(v for k, v in data["per_device_bytes"].items() if k != "total")
    assert data["tokens_per_sec"] == pytest.approx(64 * 1024 / data["step_time_s"])
    assert 0 < data["mfu"] < 1 and data["num_hosts"] == 2
    tensor = planner.plan(Choice("data:4,model:4", "tensor"))
    sp = planner.plan(Choice("data:4,model:4", "tensor", sequence_parallel=True))
    remat = planner.plan(Choice("data:4,model:4", "tensor", remat=True))
    acts = lambda p: p["per_device_bytes"]["activations"]
    # 16 examples per device instead of 4, but the heads and mlp activations split 4 ways
    assert acts(data) < acts(tensor) < 3 * acts(data)
    assert acts(sp) < acts(tensor) and acts(remat) < acts(sp)
    assert remat["breakdown"]["time"]["matmul_s"] > tensor["breakdown"]["time"]["matmul_s"]  # one more forward
    assert "all_reduce over 'model' (activations)" in tensor["breakdown"]["time"]["collectives"]
    # 2d and weight_update divide the state; the bytes follow the layouts.
    two_d = planner.plan(Choice("data:4,model:4", "2d"))
    wu = planner.plan(Choice("data:16", "weight_update"))
    assert two_d["per_device_bytes"]["weights"] < tensor["per_device_bytes"]["weights"]
    assert wu["per_device_bytes"]["optimizer"] < data["per_device_bytes"]["optimizer"] / 4
    # Pipelines: 1F1B keeps fewer microbatches alive than GPipe; the bubble shrinks with microbatches.
    gpipe = planner.plan(Choice("stage:2,data:8", "data", microbatches=8))
    c.sharding = partitioning.ShardingConfig(pipeline_schedule="1f1b")
    one = Planner(c, devices.get("a100-40g"), 16).plan(Choice("stage:2,data:8", "data", microbatches=8))
    assert acts(one) < acts(gpipe)
    assert gpipe["breakdown"]["time"]["bubble_fraction"] == pytest.approx(1 / 9)


@pytest.mark.unit
def test_planning_errors_are_the_trainers():
    c = configs("gpt", lm_tiny())
    planner = Planner(c, devices.get("h100"), 8)
    with pytest.raises(UserError, match="mesh axis 'modle'"):
        planner.plan(Choice("data:4,modle:2", "tensor"))
    with pytest.raises(UserError, match="does not divide over mesh axis 'model'"):
        Planner(c, devices.get("h100"), 32).plan(Choice("data:2,model:16", "tensor"))
    with pytest.raises(UserError, match="not a known device"):
        devices.get("h800")


@pytest.mark.unit
def test_collectives_and_links():
    h100 = devices.get("h100")
    bw = timing.axis_bandwidths([("data", 4), ("model", 8)], h100)
    e = h100.collective_efficiency
    assert bw == {"model": h100.intra_host_bandwidth * e, "data": h100.inter_host_bandwidth * e}
    # a stage takes devices_per_host / stages of each host: model:8 then crosses hosts
    assert timing.axis_bandwidths([("data", 4), ("model", 8)], h100, num_stages=2)["model"] == \
        h100.inter_host_bandwidth * e
    assert timing.collective_seconds("all_reduce", 8e9, 8, 1e9) == pytest.approx(2 * 7 / 8 * 8)
    assert timing.collective_seconds("all_to_all", 8e9, 1, 1e9) == 0
    assert memory.in_flight(4, 16, "gpipe") == 16 and memory.in_flight(4, 16, "1f1b") == 4


@pytest.mark.unit
@pytest.mark.parametrize("task_name,model,precision", [
    ("gpt", dict(vocab_size=256, seq_len=16, num_layers=3, embed_dim=32, num_heads=4, mlp_dim=64, remat=True),
     "mixed_bfloat16"),
    ("moe", dict(vocab_size=256, seq_len=16, num_layers=4, embed_dim=32, num_heads=4, mlp_dim=64, num_experts=4,
                 expert_mlp_dim=32, moe_every=2, group_size=16), "float32"),
    ("bert", dict(vocab_size=256, seq_len=16, max_predictions=4, num_layers=3, hidden_size=32, num_heads=4,
                  intermediate_size=64), "float32"),
], ids=["gpt-remat-bf16", "moe-dense-and-experts", "bert"])
def test_the_planners_build_replays_repeated_blocks_exactly(task_name, model, precision):
    """The planner runs a repeated block's forward pass once (tfpod.plan.lazy): its variables and
    every leaf layer's output shape equal those of the build that calls every block."""
    import tf_keras

    from tfpod.plan import lazy
    from tfpod.precision import precision_policy

    task = TASKS[task_name]
    cfg = task.config_class(**model)
    builds = []
    for replay in (True, False):
        tf_keras.backend.clear_session()  # the same auto-names (dropout_1, ...) in both builds
        with precision_policy(precision), lazy.recorded_build(replay=replay) as outputs:
            _, specs = partitioning.lazy_model(lambda: task.build(cfg), task.input_signature(cfg))
        builds.append((specs, [(layer.name, shape) for layer, shape in outputs]))
    (specs, outputs), (want_specs, want_outputs) = builds
    assert specs == want_specs and outputs == want_outputs
    assert len(outputs) > 10 * model["num_layers"]


def test_a_175b_model_plans_without_allocating():
    """GPT-3 175B's lazy build holds no weights: this process stays far below 175B x 2 bytes."""
    import resource

    gpt3 = TASKS["gpt"].config_class(vocab_size=51200, seq_len=2048, num_layers=96, embed_dim=12288, num_heads=96,
                                     mlp_dim=49152, remat=True)
    c = configs("gpt", gpt3, global_batch=1536, precision="mixed_bfloat16")
    p = Planner(c, devices.get("a100-80g"), 1024).plan(Choice("data:128,model:8", "2d", sequence_parallel=True))
    assert p["parameters"] == pytest.approx(174.6e9, rel=1e-3)
    state = p["per_device_bytes"]
    assert state["weights"] == pytest.approx(p["parameters"] * 4 / 1024, rel=0.01)  # fp32 over all 1024
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < 16 * 2**30


def test_recomputation_is_searched_for_models_with_dropout():
    """A 13B GPT (40 layers, width 5120, 40 heads, MLP 20480) with its dropout 0.1, batch 512 on
    64 H100: on data:16,model:4 only recomputation fits, and the search takes it (recomputation
    with dropout was refused before each block replayed its masks)."""
    from tfpod.plan.search import search

    big = TASKS["gpt"].config_class(vocab_size=50304, seq_len=1024, num_layers=40, embed_dim=5120, num_heads=40,
                                    mlp_dim=20480, dropout=0.1, attention_dropout=0.1)
    planner = Planner(configs("gpt", big, global_batch=512, precision="mixed_bfloat16"), devices.get("h100"), 64)
    kept = planner.plan(Choice("data:16,model:4", "tensor", sequence_parallel=True, remat=False))
    assert not kept["fits"]
    best, _ = search(planner, mesh="data:16,model:4")
    assert best is not None and best["fits"] and best["remat"] is True


def test_plan_mode_writes_plan_json_and_refuses_a_trained_choice(tmp_path):
    out = main_py("--gin_file=gin/gpt_small.gin", "--mode=plan", "--plan_device=h100", "--plan_num_devices=64",
                  "--mesh=data:16,model:4", f"--model_dir={tmp_path}", "--gin_param=train.global_batch_size=512")
    assert out.returncode == 0, out.stderr
    p = json.loads((tmp_path / "plan.json").read_text())
    assert p["mesh"] == "data:16,model:4" and p["num_devices"] == 64 and p["device"] == "h100"
    assert p["fits"] is True and p["preset"] == "tensor"
    assert "plan: gpt" in out.stderr + out.stdout and "tokens/s" in out.stderr + out.stdout
    record = dict(p, trained_with={"mesh": "data:8"})
    (tmp_path / "plan.json").write_text(json.dumps(record))
    with pytest.raises(UserError, match="holds the layout the run"):  # (in this process: the command line's
        api.run(["gin/gpt_small.gin"], [], str(tmp_path), mode="plan", mesh_spec="auto",  # one line is above)
                plan_device="h100", plan_num_devices=64)
    assert json.loads((tmp_path / "plan.json").read_text()) == record


def test_mesh_auto_picks_a_layout_that_trains_lm_tiny_on_8_devices(tmp_path, caplog):
    caplog.set_level("INFO", logger="tfpod")
    params = ["train.steps=2", "train.steps_per_loop=1", "train.log_every=1", "train.synthetic_data=True",
              "train.checkpoint_every=2"]
    result = api.run(["gin/lm_tiny.gin"], params, str(tmp_path), mode="train", mesh_spec="auto")
    assert result["step"] == 2 and all(math.isfinite(x) for x in result["losses"])
    chosen = json.loads((tmp_path / "plan.json").read_text())
    assert chosen["fits"] and chosen["trained_with"]["mesh"] == chosen["mesh"]
    assert f"on mesh {chosen['mesh']}" in (tmp_path / "layouts.txt").read_text()
    text = caplog.text
    assert "--mesh=auto chose" in text and text.count("  rank") == 1 and "\n     5  " in text
    caplog.clear()  # the rerun restores onto the layout chosen at the start (at train.steps: no step compiled)
    result = api.run(["gin/lm_tiny.gin"], params, str(tmp_path), mode="train", mesh_spec="auto")
    assert result["step"] == 2 and "the layout this run chose at its start" in caplog.text
    assert "resumed from" in caplog.text and "nothing to train" in caplog.text
    assert os.path.isfile(tmp_path / "plan.json")


@pytest.mark.unit
def test_auto_ranks_by_predicted_time_and_a_given_mesh_stays():
    from tfpod.plan.search import search

    planner = Planner(configs("gpt", lm_tiny()), devices.get("h100"), 8)
    best, top = search(planner)
    assert best is top[0] and len(top) == 5
    assert [p["step_time_s"] for p in top] == sorted(p["step_time_s"] for p in top)
    best, top = search(planner, mesh="data:4,model:2")  # sharding.preset='auto' with a mesh: the rest is chosen
    assert {p["mesh"] for p in top} == {"data:4,model:2"} and best["fits"]
    tiny = devices.DeviceSpec("tiny", 1e5, 1e12, 1e12, 1e11, 1e10, 1e10, 8)  # 100 kB: nothing fits
    best, top = search(Planner(configs("gpt", lm_tiny()), tiny, 8))
    assert best is None and not any(p["fits"] for p in top)


@pytest.mark.unit
def test_auto_accumulates_microbatches_when_a_layout_fits_only_so():
    """A task without stages (ResNet-18 at batch 1024) on a device that holds its state but not
    the whole batch's activations: --mesh=auto takes gradient accumulation, the fewest
    microbatches that fit."""
    import dataclasses

    from tfpod.plan.planner import MEMORY_MARGIN
    from tfpod.plan.search import search

    c = configs("resnet", TASKS["resnet"].config_class(depth=18, image_size=224, num_classes=1000), global_batch=1024,
                optimizer="sgd")
    h100 = devices.get("h100")
    planner = Planner(c, h100, 8)
    whole, two, four = (planner.plan(Choice("data:8", "data", microbatches=m)) for m in (None, 2, 4))
    assert four["per_device_bytes"]["activations"] < two["per_device_bytes"]["activations"] < \
        whole["per_device_bytes"]["activations"] / 1.5
    assert four["step_time_s"] > whole["step_time_s"]  # more passes over the weights: accumulation is not free
    # memory between the 4- and 2-microbatch plans' totals: only 4 (or more) fit
    memory = (four["per_device_bytes"]["total"] + two["per_device_bytes"]["total"]) / 2 / (1 - MEMORY_MARGIN)
    small = dataclasses.replace(h100, name="small", memory_bytes=memory)
    best, top = search(Planner(c, small, 8), mesh="data:8")
    assert best["fits"] and best["microbatches"] == 4 and "microbatches=4" in best["choice"]
    assert not any(p["fits"] for p in top if p["microbatches"] < 4)


@pytest.mark.unit
def test_a_cpu_figure_is_measured_once_per_machine_and_kept(tmp_path, monkeypatch, caplog):
    """tfpod.measured: measured on the first call, read back after (in another process too);
    keyed by the machine; TFPOD_CACHE_DIR=off measures every time; a damaged or unwritable
    cache is one warning and the figure is measured."""
    import subprocess
    import sys

    from conftest import ROOT
    from tfpod import measured

    calls = []
    measure = lambda: calls.append(1) or 7.5e10
    monkeypatch.setenv("TFPOD_CACHE_DIR", str(tmp_path / "cache"))
    assert measured.figure("matmul test", measure) == 7.5e10 and len(calls) == 1
    assert measured.figure("matmul test", measure) == 7.5e10 and len(calls) == 1  # read back
    assert measured.figure("matmul test", measure, key="another CPU") == 7.5e10 and len(calls) == 2
    table = json.loads((tmp_path / "cache" / "measured.json").read_text())
    assert set(table) == {f"matmul test | {measured.machine_key()}", "matmul test | another CPU"}
    assert "AVX-512" in measured.machine_key() and "intra-op threads" in measured.machine_key()
    read = subprocess.run([sys.executable, "-c", "from tfpod import measured; "
                           "print(measured.figure('matmul test', lambda: 1.0, key='another CPU'))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert read.stdout.split()[-1] == "75000000000.0", read.stderr[-2000:]
    # the real figures the trainer and the planner use go through it
    from tfpod import flops

    peak = flops.measured_matmul_flops("float32", n=256, repeats=1)
    assert peak > 0 and any(k.startswith("matmul float32 n=256") for k in
                            json.loads((tmp_path / "cache" / "measured.json").read_text()))
    flops.measured_matmul_flops.cache_clear()

    monkeypatch.setenv("TFPOD_CACHE_DIR", "off")
    measured.figure("matmul test", measure)
    measured.figure("matmul test", measure)
    assert len(calls) == 4
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "measured.json").write_text('{"matmul')
    monkeypatch.setenv("TFPOD_CACHE_DIR", str(tmp_path / "damaged"))
    assert measured.figure("matmul test", measure) == 7.5e10 and len(calls) == 5
    assert caplog.text.count("measured.json cannot be read") == 1
    assert json.loads((tmp_path / "damaged" / "measured.json").read_text())  # rewritten whole
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TFPOD_CACHE_DIR", str(tmp_path / "file" / "cache"))  # under a file: cannot be made
    assert measured.figure("matmul test", measure) == 7.5e10 and len(calls) == 6
    assert "cannot keep them in" in caplog.text


def long_gpt(seq_len=4096, heads=8):
    return TASKS["gpt"].config_class(vocab_size=256, seq_len=seq_len, num_layers=2, embed_dim=128, num_heads=heads,
                                     mlp_dim=512)


@pytest.mark.unit
def test_context_divides_activations_like_data_and_adds_the_gathered_keys_and_values():
    """GPT at 4,096 tokens, blockwise, fp32, batch 8 on 8 devices (tfpod.plan.predict, the bench's entry point):
    `data:4,context:2` holds 2 examples of half the sequence where `data:8` holds 1 whole, so every activation is
    the same bytes, plus the whole length's keys and values each layer keeps (exactly 2 layers x 2 examples x
    2 x 4,096 x 128 x 4 bytes); the K/V all-gather and its gradient's all-reduce over `context` (each (C-1)/C of the gathered
    bytes, per layer, forward and backward), the gradients all-reduced over `context` too, and the causal attention
    at 3/4 of the whole matrix instead of 5/8 (blockwise's 4 query groups)."""
    from tfpod.plan.timing import CONTEXT_ATTENTION_WORK

    c = configs("gpt", long_gpt(), global_batch=8)
    data, ctx = (plan.predict(c, mesh, device="h100") for mesh in ("data:8", "data:4,context:2"))
    d, x = data["plan"]["breakdown"], ctx["plan"]["breakdown"]
    gathered = 2 * 2 * 2 * 4096 * 128 * 4
    assert x["memory"]["blocks"] - d["memory"]["blocks"] == gathered
    assert x["memory"]["outside_blocks"] == d["memory"]["outside_blocks"]
    # one query group (a quarter of the sequence; under context a device's chunk, the same) x one key block,
    # of each example a device holds
    assert x["memory"]["attention_scores"] == 2 * d["memory"]["attention_scores"] == 2 * 8 * 1024 * 512 * 4
    assert ctx["activation_bytes"] - data["activation_bytes"] == gathered
    assert ctx["plan"]["context"] == 2 and data["plan"]["context"] == 1
    # the collectives: per layer, the whole length's K and V of the device's 2 examples
    bw = x["bandwidths"]["context"]
    kv_seconds = 2 * timing.collective_seconds("all_gather", 2 * 2 * 4096 * 128 * 4, 2, bw)  # 2 layers
    assert x["time"]["collectives"]["all_gather over 'context' (activations)"] == pytest.approx(kv_seconds, rel=1e-12)
    kv_sums = 2 * timing.collective_seconds("all_reduce", 2 * 2 * 4096 * 128 * 4, 2, bw)  # their gradients' sums
    assert x["time"]["collectives"]["all_reduce over 'context' (activations)"] == pytest.approx(kv_sums, rel=1e-12)
    assert "all_reduce over 'context' (gradients)" in x["time"]["collectives"]
    assert not any("context" in name for name in d["time"]["collectives"])
    sync = {(s["axis"], s["kind"]): s["bytes"] for s in x["gradient_sync"]}
    assert sync[("context", "all_reduce")] == sync[("data", "all_reduce")] == ctx["plan"]["per_device_bytes"]["weights"]
    # attention FLOPs: 12 x layers x length x embed per token, at 3/4 under context and 5/8 without (4 query groups)
    share = 12 * 2 * 4096 * 128 / TASKS["gpt"].flops_per_token(c.model)
    assert x["time"]["flops_per_device"] == pytest.approx(
        d["time"]["flops_per_device"] * (1 - (1 - CONTEXT_ATTENTION_WORK) * share) / (1 - (1 - 5 / 8) * share),
        rel=1e-12)


@pytest.mark.unit
def test_context_gathers_grouped_query_attentions_own_key_value_heads():
    """Llama with 8 query heads and 2 key/value heads, batch 16 on `data:2,context:2,model:2` (tensor): the
    table the planner lays the activations out with (the trainer's, ShardingConfig.table on the mesh's axes) puts
    `length` and `sequence` on `context`; each layer keeps the gathered keys and values of its 8 examples as the
    2 kv heads split over `model` (2 x 8 x 2,048 x 1 x 16 x 4 bytes), not the 8 heads they are repeated to."""
    from tfpod.partitioning import Placement
    from tfpod.plan.memory import tensor_bytes

    llama = TASKS["llama"].config_class(vocab_size=256, seq_len=2048, num_layers=2, embed_dim=128, num_heads=8,
                                        num_kv_heads=2, mlp_dim=256)
    c = configs("llama", llama, preset="tensor")
    planner = Planner(c, devices.get("h100"), 8)
    p = planner.plan(Choice("data:2,context:2,model:2"))
    placement = Placement.from_config(c.sharding, c.task.default_preset, planner._meshes("data:2,context:2,model:2")[3])
    table, mesh = placement.table, placement.mesh
    assert table["length"] == table["sequence"] == "context" and table["kv_heads"] == "model"
    gathered = [t for t in planner.profile.block_saved if t.when_split == "length"]
    assert [t.axes for t in gathered] == [(None, "kv_heads", "kv")]
    assert tensor_bytes(gathered[0], 16, table, mesh, "float32") == 2 * 8 * 2048 * 1 * 16 * 4
    assert p["breakdown"]["memory"]["blocks"] == 2 * sum(tensor_bytes(t, 16, table, mesh, "float32")
                                                         for t in planner.profile.block_saved)


@pytest.mark.unit
def test_context_is_refused_where_the_attention_or_the_length_cannot_split():
    with pytest.raises(UserError, match="does not support"):
        Planner(configs("bert", bert_tiny()), devices.get("h100"), 8).plan(Choice("data:4,context:2", "data"))
    with pytest.raises(UserError, match="into 16 equal chunks"):  # 4,100 tokens: the causal balance's 2C chunks
        Planner(configs("gpt", long_gpt(4100)), devices.get("h100"), 8).plan(Choice("data:1,context:8", "data"))


@pytest.mark.unit
def test_mesh_auto_takes_context_only_where_nothing_fits_without_it():
    """GPT at 4,096 tokens with one head, batch 4, on 4 devices: without context a device holds at least one
    whole sequence (`model` cannot split one head; one example per `data` shard), with `data:1,context:4` and
    4 microbatches a quarter of one. On a device between the two smallest totals the search takes a `context`
    mesh (the fastest that fits); on an H100 the run fits without one and gets none."""
    import dataclasses

    from tfpod.plan.planner import MEMORY_MARGIN
    from tfpod.plan.search import candidates, context_sizes, search

    c = configs("gpt", long_gpt(heads=1), global_batch=4)
    h100 = devices.get("h100")
    planner = Planner(c, h100, 4)
    assert context_sizes(planner) == [2, 4]  # 4,096 / 2 and / 4 are whole blocks of 512

    def smallest(context):
        totals = []
        for choice in candidates(planner, context=context):
            for m in (None, 2, 4):
                try:
                    totals.append(planner.plan(dataclasses.replace(choice, microbatches=m))["per_device_bytes"]["total"])
                except UserError:  # the batch shards do not split into m
                    pass
        return min(totals)

    without, within = smallest(False), smallest(True)
    assert within < without / 1.5
    small = dataclasses.replace(h100, name="small", memory_bytes=(within + without) / 2 / (1 - MEMORY_MARGIN))
    best, top = search(Planner(c, small, 4))
    assert best is not None and best["fits"] and best["context"] > 1 and f"context:{best['context']}" in best["mesh"]
    assert not any(p["fits"] for p in top if p["context"] == 1)
    best, _ = search(planner)
    assert best["context"] == 1 and "context" not in best["mesh"]
