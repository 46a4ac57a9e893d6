"""How one published tensor maps to tfpod's variables, and back.

A family (gpt2, bert) lists a `Param` per tensor of its Hugging Face checkpoint: the
Hub name, the tfpod variable(s) it fills, and the two conversions. Import reads each
Hub tensor once and writes its variables; export reads the variables and writes the
tensor. One Hub tensor may fill several variables (GPT-2's fused c_attn: query, key and
value).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from tfpod import UserError


def require(hub: dict, keys: tuple[str, ...], architectures: tuple[str, ...]) -> None:
    """One UserError naming every field of `keys` config.json lacks (a family reads them without defaults)."""
    missing = [k for k in keys if k not in hub]
    if missing:
        raise UserError(f"config.json: {', '.join(missing)} missing: is it a {' or '.join(architectures)} config "
                        "(the checkpoint's own config.json)?")


@dataclasses.dataclass(frozen=True)
class Param:
    """One Hub tensor.

    Attributes:
      hub: its name in the head model's state dict (e.g. "transformer.h.0.ln_1.weight").
      tfpod: the tfpod variable names it fills (e.g. "gpt/block_0/self_attention_layer_norm/gamma").
      to_tfpod: Hub array -> one array per tfpod variable.
      to_hub: the tfpod arrays -> the Hub array.
    """

    hub: str
    tfpod: tuple[str, ...]
    to_tfpod: Callable[[np.ndarray], tuple]
    to_hub: Callable[..., np.ndarray]


def same(hub: str, name: str) -> Param:
    """A tensor stored alike (embedding tables, layer norms, GPT-2's Conv1D [in, out] kernels)."""
    return Param(hub, (name,), lambda a: (a,), lambda a: a)


def reshaped(hub: str, name: str, shape: tuple) -> Param:
    """A tensor tfpod keeps in another shape (e.g. a bias [heads * kv] as [heads, kv])."""
    return Param(hub, (name,), lambda a: (a.reshape(shape),), lambda a: a.reshape(-1))


def linear(hub: str, name: str, shape: tuple, in_dims: int = 1) -> Param:
    """A PyTorch Linear weight [out, in] as a tfpod kernel [in, out] of `shape`, whose first
    `in_dims` dimensions are the input (query: [in, heads, kv]; attention output: [heads, kv, out])."""
    rows = int(np.prod(shape[:in_dims]))
    return Param(hub, (name,), lambda a: (a.T.reshape(shape),), lambda a: a.reshape(rows, -1).T)


def layer_norm(hub: str, name: str) -> list[Param]:
    """A LayerNorm's weight and bias as Keras's gamma and beta."""
    return [same(f"{hub}.weight", f"{name}/gamma"), same(f"{hub}.bias", f"{name}/beta")]


def split(hub: str, names: tuple[str, ...], shape: tuple, hub_rank: int) -> Param:
    """A fused Hub tensor of rank `hub_rank` ([..., n * d]) cut in n equal parts along its
    last axis, each reshaped to `shape` (GPT-2's c_attn weight [embed, 3 embed] -> query,
    key and value kernels [embed, heads, kv]; its bias [3 embed] -> biases [heads, kv])."""
    hub_part = (lambda p: p.reshape(p.shape[0], -1)) if hub_rank == 2 else (lambda p: p.reshape(-1))
    return Param(hub, names, lambda a: tuple(p.reshape(shape) for p in np.split(a, len(names), axis=-1)),
                 lambda *parts: np.concatenate([hub_part(p) for p in parts], axis=-1))
