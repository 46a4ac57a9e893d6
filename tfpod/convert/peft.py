"""A LoRA run's adapters alone, in Hugging Face PEFT's format (`adapter_config.json` and
`adapter_model.safetensors`), for the base model's Hub checkpoint.

PEFT's LoRA on a module with weight W_hub: W_hub + (lora_alpha / r) * B @ A, where
`lora_A.weight` is [r, in_features] and `lora_B.weight` [out_features, r]; with
`fan_in_fan_out` (GPT-2's Conv1D, whose weight is [in, out]) the product is transposed.
A tfpod adapter pair on a kernel [*in, *out] (tfpod.lora) is lora_a [*in, r] and lora_b
[r, *out], so A = lora_a flattened to [in, r] and transposed, B = lora_b flattened to
[r, out] and transposed. A Hub tensor that fuses several tfpod kernels (GPT-2's c_attn:
query, key, value) gets one adapter: of rank r when they share one lora_a
(lora.shared_qkv: their B stacked), else of rank n * r (the parts' A stacked, their B on
the diagonal) with alpha n * alpha, the same scale, in PEFT's rank_pattern / alpha_pattern.
Each kind of module's PEFT update is checked against the family's own kernel -> Hub conversion
before anything is written: in its first layer (every layer converts alike), so a big model's
export does not build a full-size delta for every module.

    python -m tfpod.convert export --model_dir=D --peft=OUT
"""

from __future__ import annotations

import json
import logging
import os
import re

import numpy as np

from tfpod import UserError, lora
from tfpod.convert.run import exported_run

log = logging.getLogger("tfpod")

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
TASK_TYPES = {"gpt": "CAUSAL_LM", "llama": "CAUSAL_LM"}  # (BERT: PEFT's generic model)


def module_adapters(param, values: dict, adapters: dict, rank: int,
                    fan_in_fan_out: bool | None = None) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """PEFT's (lora_A [n r, in], lora_B [out, n r], fan_in_fan_out) of one Hub tensor from the
    adapters on the tfpod kernels it holds (None: it has none). `adapters`: {kernel name:
    (lora_a array, lora_b array, the lora_a variable's name)}; kernels sharing one lora_a
    (lora.shared_qkv) give one rank-r adapter. `fan_in_fan_out`: what an earlier layer's
    module of this kind was found to be (None: check it here).

    Raises:
      UserError: the family's conversion of the kernels is not PEFT's update of this form.
    """
    kernels = list(param.tfpod)
    if not any(k in adapters for k in kernels):
        return None
    if not all(k.endswith("/kernel") for k in kernels):
        raise UserError(f"{param.hub} holds adapted kernels and other variables together: PEFT cannot express it")
    flat = {k: (adapters[k][0].reshape(-1, rank), adapters[k][1].reshape(rank, -1)) for k in kernels
            if k in adapters}  # [in, r], [r, out]
    in_features = next(iter(flat.values()))[0].shape[0]
    outs = [values[k].size // in_features for k in kernels]
    adapted = [i for i, k in enumerate(kernels) if k in flat]
    shared = len({adapters[kernels[i]][2] for i in adapted}) == 1
    groups = [adapted] if shared else [[i] for i in adapted]  # the kernels of each A
    lora_a = np.concatenate([flat[kernels[g[0]]][0].T for g in groups], axis=0)  # [n r, in]
    lora_b = np.zeros([sum(outs), rank * len(groups)], lora_a.dtype)  # [out, n r]: each A's kernels' B
    for j, g in enumerate(groups):
        for i in g:
            lora_b[sum(outs[:i]):sum(outs[:i + 1]), j * rank:(j + 1) * rank] = flat[kernels[i]][1].T
    if fan_in_fan_out is not None:
        return lora_a, lora_b, fan_in_fan_out
    # the check: the family's own conversion of each kernel's update is B @ A (or its transpose)
    deltas = [(flat[k][0] @ flat[k][1]).reshape(values[k].shape) if k in flat else np.zeros_like(values[k])
              for k in kernels]
    hub_delta = param.to_hub(*deltas)
    peft = lora_b @ lora_a  # [out, in]
    for fan_in_fan_out, candidate in ((False, peft), (True, peft.T)):
        if candidate.shape == hub_delta.shape and np.allclose(candidate, hub_delta, rtol=1e-5, atol=1e-7):
            return lora_a, lora_b, fan_in_fan_out
    raise UserError(f"{param.hub}: the family's conversion of its kernels is not a PEFT LoRA update: export the "
                    "merged folder (--hf) instead")


def suffix(module: str) -> str:
    """A module's name as target_modules and the patterns name it: its last two parts
    (`attn.c_proj`, not GPT-2's `mlp.c_proj` too; PEFT matches names ending so)."""
    return ".".join(module.split(".")[-2:])


def export_peft(model_dir: str, out: str, checkpoint_prefix: str | None = None) -> dict:
    """A LoRA run's adapters (the newest checkpoint, or `checkpoint_prefix`) -> PEFT folder `out`."""
    c, family, path, model = exported_run(model_dir, out, "peft", checkpoint_prefix, merge=False)
    config = c.task.lora
    if config is None:
        raise UserError(f"--model_dir={model_dir} trained no adapters (lora.rank=0): export its weights with --hf")
    if config.trainable:
        raise UserError(f"lora.trainable={config.trainable!r} trained weights besides the adapters, which PEFT's "
                        "adapter file does not hold: export the merged folder with --hf instead")
    values = {v.name.split(":")[0]: v.numpy() for v in model.weights}
    adapters = {k: (a.numpy(), b.numpy(), a.name) for k, (a, b) in lora.adapters_of(model).items()}
    tensors, ranks, alphas, fan = [], {}, {}, set()
    checked = {}  # module kind (its name without layer numbers) -> fan_in_fan_out
    for param in family.params(c.model, family.EXPORT_ARCHITECTURE):
        kind = re.sub(r"\.\d+\.", ".N.", param.hub)
        found = module_adapters(param, values, adapters, config.rank, checked.get(kind))
        if found is None:
            continue
        lora_a, lora_b, fan_in_fan_out = found
        checked[kind] = fan_in_fan_out
        module = param.hub[: -len(".weight")]
        tensors += [(f"base_model.model.{module}.lora_A.weight", lora_a),
                    (f"base_model.model.{module}.lora_B.weight", lora_b)]
        if lora_a.shape[0] != config.rank:
            name = suffix(module)
            ranks[name], alphas[name] = lora_a.shape[0], config.alpha * lora_a.shape[0] / config.rank
        fan.add(fan_in_fan_out)
    if not tensors:
        raise UserError(f"lora.targets={config.targets!r}: no adapter maps to a Hugging Face module")
    if len(fan) > 1:
        raise UserError("the adapters' modules mix [in, out] and [out, in] weights: PEFT's fan_in_fan_out is one flag")
    targets = sorted({suffix(name[len("base_model.model."):].split(".lora_")[0]) for name, _ in tensors})
    base = None
    record = os.path.join(model_dir, lora.BASE_FILE)
    if os.path.isfile(record):
        with open(record) as f:
            base = json.load(f)["init_from"]
    adapter_config = {
        "peft_type": "LORA", "task_type": TASK_TYPES.get(c.task.name), "base_model_name_or_path": base,
        "r": config.rank, "lora_alpha": config.alpha, "lora_dropout": config.dropout, "target_modules": targets,
        "fan_in_fan_out": fan.pop(), "bias": "none", "inference_mode": True, "init_lora_weights": True,
        "rank_pattern": ranks, "alpha_pattern": alphas, "modules_to_save": None, "use_rslora": False,
        "use_dora": False, "layers_to_transform": None, "layers_pattern": None, "revision": None,
    }
    os.makedirs(out, exist_ok=True)
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors}, os.path.join(out, WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out, CONFIG), "w") as f:
        json.dump(adapter_config, f, indent=2, sort_keys=True)
    log.info("exported the adapters of %s (%d modules) to %s", path, len(tensors) // 2, out)
    return {"checkpoint": path, "files": [CONFIG, WEIGHTS], "modules": len(tensors) // 2}
