"""bench/plan_accuracy.py's `published` part: tfpod's plans beside published runs.

Megatron-LM (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters", Table 1): GPT models on A100-80GB, tensor parallel 8 within a node,
pipeline stages across nodes, 1F1B, activation recomputation; FLOP/s per GPU counted
with the recomputation, 96 B s l h^2 (1 + s / 6h + V / 16 l h) per step, so their
model-FLOPs utilization is 3/4 of the hardware figure. Memory by Megatron's own formula
(megatron/training/theoretical_memory_usage.py): 18 bytes per parameter on a device
(bf16 weights and gradients, fp32 main weights and Adam), and activations of
34 s b h / t bytes per layer (sequence parallelism with selective recomputation), the
first stage holding p microbatches of L / p layers.

MaxText (its README's v5p table and MaxText/configs/v5p/{32b,64b}.sh): FSDP 16 x tensor 4
on v5p-128 (64 chips), length 2048, per-device batch 7 (32B) and 3 (64B), minimal
recomputation, bf16; 71.47% and 70.31% MFU. Its MLP is gated (three d x f matrices):
tfpod's GPT gets a width of 1.5 f so parameters and FLOPs match.

tfpod cannot place a pipeline stage on its own hosts (DTensor copies only within a
host), so Megatron's layout is planned as tfpod can run it: the stages inside each
host and the tensor axis across hosts; `--mesh=auto`'s choice is shown beside it.
"""

from __future__ import annotations

import sys

A100_PEAK = 312e12
MEGATRON = [  # Table 1 rows: name, layers, hidden, heads, t, p, GPUs, batch, TFLOP/s per GPU (with recompute)
    ("GPT 145.6B (Megatron-LM)", 80, 12288, 96, 8, 8, 1536, 2304, 148e12),
    ("GPT 310.1B (Megatron-LM)", 96, 16384, 128, 8, 16, 1920, 2160, 155e12),
]
MAXTEXT = [  # name, layers, emb, heads, mlp (gated), per-device batch, chips, fsdp, tensor, MFU
    ("MaxText 32B on v5p-128", 32, 8192, 64, 28672, 7, 64, 16, 4, 0.7147),
    ("MaxText 64B on v5p-128", 64, 8192, 64, 28672, 3, 64, 16, 4, 0.7031),
]


def gpt_configs(layers, hidden, heads, mlp, vocab, seq, batch, microbatches=1, schedule="1f1b"):
    """RunConfigs of a GPT (recomputation, bf16, sequence parallelism) for the planner."""
    from tfpod import api, config, controller, optimizers, partitioning
    from tfpod.models import gpt

    model = gpt.GPTConfig(vocab_size=vocab, seq_len=seq, num_layers=layers, embed_dim=hidden, num_heads=heads,
                          mlp_dim=mlp, remat=True)
    return api.RunConfigs(task=gpt.TASK, experiment=config.ExperimentConfig(model="gpt"), model=model, data=None,
                          train=controller.TrainConfig(steps=10, global_batch_size=batch, precision="mixed_bfloat16",
                                                       microbatches=microbatches),
                          optimizer=optimizers.OptimizerConfig(),
                          sharding=partitioning.ShardingConfig(pipeline_schedule=schedule, sequence_parallel=True))


def _brief(p: dict | None) -> dict | None:
    if p is None:
        return None
    return {"choice": p.get("choice") or f"{p['mesh']} preset={p['preset']}", "per_device_gib":
            {k: round(v / 2**30, 2) for k, v in p["per_device_bytes"].items()}, "fits": p["fits"],
            "step_time_s": round(p["step_time_s"], 3), "mfu": round(p["mfu"], 4)}


def megatron_memory(params: float, layers: int, hidden: int, seq: int, t: int, p: int, micro: int = 1) -> dict:
    """Megatron's theoretical_memory_usage.py per GPU of the first stage (no distributed optimizer)."""
    weights_and_optimizer = 18 * params / (t * p)
    activations = 34 * seq * micro * hidden / t * layers  # L / p layers x p microbatches in flight
    return {"weights_and_optimizer_gib": round(weights_and_optimizer / 2**30, 2),
            "activations_gib": round(activations / 2**30, 2)}


def published_part() -> list:
    from tfpod.plan import devices
    from tfpod.plan.planner import Choice, Planner
    from tfpod.plan.search import search

    rows = []
    vocab, seq = 51200, 2048
    for name, layers, hidden, heads, t, p, gpus, batch, flops in MEGATRON:
        print(f"[plan_accuracy] published {name} ...", file=sys.stderr, flush=True)
        data = gpus // (t * p)
        c = gpt_configs(layers, hidden, heads, 4 * hidden, vocab, seq, batch, microbatches=batch // data)
        planner = Planner(c, devices.get("a100-80g"), gpus)
        stages = min(p, 8)  # stages share each host's 8 GPUs in tfpod
        theirs = Choice(f"stage:{stages},data:{gpus // (stages * t)},model:{t}", "tensor", True, True,
                        batch // (gpus // (stages * t)))
        try:
            as_theirs = planner.plan(theirs)
        except Exception as e:  # noqa: BLE001  (reported, not raised: a layout tfpod refuses)
            as_theirs = {"error": str(e)}
        best, _ = search(planner, top=1)
        rows.append({"run": name, "devices": f"{gpus} x A100-80GB", "batch": batch, "parameters": planner.parameters,
                     "reported_mfu": round(flops * 0.75 / A100_PEAK, 4),
                     "reported_hardware_flops_utilization": round(flops / A100_PEAK, 4),
                     "megatron_formula_per_gpu": megatron_memory(planner.parameters, layers, hidden, seq, t, p),
                     "tfpod_plan_of_their_layout": as_theirs if "error" in as_theirs else _brief(as_theirs),
                     "tfpod_auto": _brief(best)})
    for name, layers, emb, heads, mlp, per_device, chips, fsdp, tp, mfu in MAXTEXT:
        print(f"[plan_accuracy] published {name} ...", file=sys.stderr, flush=True)
        c = gpt_configs(layers, emb, heads, mlp * 3 // 2, 32000, seq, per_device * chips)
        planner = Planner(c, devices.get("tpu-v5p"), chips)
        as_theirs = planner.plan(Choice(f"data:{fsdp},model:{tp}", "2d", True, True))
        best, _ = search(planner, top=1)
        rows.append({"run": name, "devices": f"{chips} x TPU v5p", "batch": per_device * chips,
                     "parameters": planner.parameters, "reported_mfu": mfu,
                     "tfpod_plan_of_their_layout": _brief(as_theirs), "tfpod_auto": _brief(best)})
    return rows
