"""GPT-2 (`GPT2LMHeadModel`) <-> tfpod's gpt.

GPT-2 is tfpod's gpt with learned positions, pre-norm blocks, biases everywhere, the
tanh gelu (`gelu_new`) and the output layer tied to the token embedding. Its Conv1D
kernels are stored [in, out] as tfpod's, and the attention's query, key and value are
one fused c_attn tensor. Causal-mask buffers (`attn.bias`, `attn.masked_bias`) in older
files are not weights and are skipped; `lm_head.weight` is the tied embedding.
"""

from __future__ import annotations

import logging
import re

from tfpod import UserError
from tfpod.convert.params import Param, layer_norm, require, same, split
from tfpod.models import gpt

log = logging.getLogger("tfpod")

MODEL_TYPE = "gpt2"
TASK = "gpt"
PREFIX = "transformer."
ARCHITECTURES = ("GPT2LMHeadModel",)
EXPORT_ARCHITECTURE = "GPT2LMHeadModel"
VOCAB_FILE = None  # its byte-level BPE does not run in the graph

# Hub activation names -> tfpod's, and back.
ACTIVATIONS = {"gelu_new": "gelu_approximate", "gelu_pytorch_tanh": "gelu_approximate", "gelu": "gelu",
               "relu": "relu"}
TO_HUB_ACTIVATION = {"gelu_approximate": "gelu_new", "gelu": "gelu", "relu": "relu"}


def model_config(hub: dict) -> gpt.GPTConfig:
    """tfpod's GPTConfig of a GPT-2 config.json (one UserError for what tfpod cannot run)."""
    require(hub, ("vocab_size", "n_embd", "n_layer", "n_head"), ARCHITECTURES)
    for key, value in (("scale_attn_by_inverse_layer_idx", False), ("reorder_and_upcast_attn", False),
                       ("add_cross_attention", False), ("tie_word_embeddings", True)):
        if hub.get(key, value) != value:
            raise UserError(f"config.json: {key}={hub[key]} is not supported by tfpod's gpt (it needs {value})")
    act = hub.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise UserError(f"config.json: activation_function={act!r} is not supported: use one of {', '.join(ACTIVATIONS)}")
    dropout, embedding_dropout = hub.get("resid_pdrop", 0.1), hub.get("embd_pdrop", 0.1)
    if dropout != embedding_dropout:
        log.warning("config.json: embd_pdrop=%s differs from resid_pdrop=%s; tfpod's gpt.dropout drops both at %s",
                    embedding_dropout, dropout, dropout)
    embed = hub["n_embd"]
    return gpt.GPTConfig(vocab_size=hub["vocab_size"], seq_len=hub.get("n_positions", hub.get("n_ctx", 1024)),
                         num_layers=hub["n_layer"], embed_dim=embed, num_heads=hub["n_head"],
                         mlp_dim=hub.get("n_inner") or 4 * embed, dropout=dropout,
                         attention_dropout=hub.get("attn_pdrop", 0.1),
                         norm_epsilon=hub.get("layer_norm_epsilon", 1e-5),
                         init_stddev=hub.get("initializer_range", 0.02), activation=ACTIVATIONS[act])


def hub_config(c: gpt.GPTConfig, data=None) -> dict:
    """config.json of a tfpod gpt as GPT2LMHeadModel (`data`: the run's data config, for its EOS)."""
    if c.activation not in TO_HUB_ACTIVATION:
        raise UserError(f"gpt.activation={c.activation!r} has no GPT-2 equivalent: export needs one of "
                        f"{', '.join(TO_HUB_ACTIVATION)}")
    eos = None if data is None else data.eos_id
    eos = c.vocab_size - 1 if eos is None else eos
    return {"architectures": [EXPORT_ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": c.vocab_size,
            "n_positions": c.seq_len, "n_ctx": c.seq_len, "n_embd": c.embed_dim, "n_layer": c.num_layers,
            "n_head": c.num_heads, "n_inner": c.mlp_dim, "activation_function": TO_HUB_ACTIVATION[c.activation],
            "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.attention_dropout,
            "layer_norm_epsilon": c.norm_epsilon, "initializer_range": c.init_stddev, "bos_token_id": eos,
            "eos_token_id": eos, "tie_word_embeddings": True, "use_cache": True}


def params(c: gpt.GPTConfig, architecture: str) -> list[Param]:
    """Every tensor of a GPT2LMHeadModel checkpoint, in the order transformers writes them."""
    del architecture
    heads, kv = c.num_heads, c.embed_dim // c.num_heads
    out = [same(f"{PREFIX}wte.weight", "gpt/token_embedding/embeddings"),
           same(f"{PREFIX}wpe.weight", "gpt/position_embedding/embeddings")]
    for i in range(c.num_layers):
        hub, ours = f"{PREFIX}h.{i}", f"gpt/block_{i}"
        qkv = tuple(f"{ours}/self_attention/{n}" for n in ("query", "key", "value"))
        out += layer_norm(f"{hub}.ln_1", f"{ours}/self_attention_layer_norm")
        out += [split(f"{hub}.attn.c_attn.weight", tuple(f"{n}/kernel" for n in qkv), (c.embed_dim, heads, kv), 2),
                split(f"{hub}.attn.c_attn.bias", tuple(f"{n}/bias" for n in qkv), (heads, kv), 1),
                Param(f"{hub}.attn.c_proj.weight", (f"{ours}/self_attention/attention_output/kernel",),
                      lambda a: (a.reshape(heads, kv, -1),), lambda a: a.reshape(heads * kv, -1)),
                same(f"{hub}.attn.c_proj.bias", f"{ours}/self_attention/attention_output/bias")]
        out += layer_norm(f"{hub}.ln_2", f"{ours}/output_layer_norm")
        out += [same(f"{hub}.mlp.c_fc.weight", f"{ours}/intermediate/kernel"),
                same(f"{hub}.mlp.c_fc.bias", f"{ours}/intermediate/bias"),
                same(f"{hub}.mlp.c_proj.weight", f"{ours}/output/kernel"),
                same(f"{hub}.mlp.c_proj.bias", f"{ours}/output/bias")]
    return out + layer_norm(f"{PREFIX}ln_f", "gpt/final_norm")


def absent(architecture: str) -> tuple[str, ...]:
    """tfpod variables the architecture's checkpoint does not hold (initialized fresh): none."""
    del architecture
    return ()


def skipped(name: str) -> bool:
    """Hub tensors that are not weights tfpod keeps (mask buffers, the tied output layer)."""
    return bool(re.search(r"\.attn\.(bias|masked_bias)$", name)) or name == "lm_head.weight"


def gin(c: gpt.GPTConfig, hub: dict, vocab: str | None = None) -> list[str]:
    """The data lines of an imported GPT-2's config.gin: pre-tokenized ids ending documents with its EOS."""
    del vocab
    eos = hub.get("eos_token_id", c.vocab_size - 1)
    return ["# GPT-2's byte-level BPE does not run in the graph: train on TFRecords of token ids",
            "# (docs/pretrained.md); set lm_data.train_files (and eval_files).",
            "lm_data.format = 'ids'", f"lm_data.eos_id = {eos}"]
