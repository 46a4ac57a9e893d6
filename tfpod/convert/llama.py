"""Llama and Mistral (`LlamaForCausalLM`, `MistralForCausalLM`) <-> tfpod's llama.

Both are tfpod's llama: RMSNorm, rotary positions in the rotate-half pairing (the Hub's
q/k weights are stored for it), grouped-query attention, a SwiGLU MLP, no biases (Qwen2-
style `attention_bias` aside), a tied or untied `lm_head`. Mistral adds a sliding window,
which is the same network while the window is at least the training length. Weights are
PyTorch Linear [out, in] matrices; tfpod's kernels are [in, heads, head_dim] and so on.
Llama 3.1's `rope_scaling` (rope_type llama3) maps to the llama.rope_* knobs.
"""

from __future__ import annotations

import logging

from tfpod import UserError
from tfpod.convert.params import Param, linear, require, reshaped, same
from tfpod.models import llama

log = logging.getLogger("tfpod")

MODEL_TYPE = "llama"
MODEL_TYPES = ("llama", "mistral")
TASK = "llama"
PREFIX = "model."
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
EXPORT_ARCHITECTURE = "LlamaForCausalLM"
ROPE_TYPES = ("default", "llama3")
VOCAB_FILE = "tokenizer.model"  # SentencePiece (Llama 2, Mistral); Llama 3's tokenizer.json does not run in the graph


def model_config(hub: dict) -> llama.LlamaConfig:
    """tfpod's LlamaConfig of a Llama or Mistral config.json; every value tfpod cannot run is
    reported together, one line each."""
    require(hub, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
            ARCHITECTURES)
    problems = []
    heads, embed = hub["num_attention_heads"], hub["hidden_size"]
    seq_len = hub.get("max_position_embeddings", 2048)
    if hub.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hub['hidden_act']!r} (tfpod's llama runs SwiGLU with silu)")
    if hub.get("mlp_bias", False):
        problems.append("mlp_bias=true (tfpod's llama has no MLP biases)")
    if hub.get("head_dim") not in (None, embed // heads):
        problems.append(f"head_dim={hub['head_dim']} (tfpod's llama uses hidden_size / num_attention_heads = "
                        f"{embed // heads})")
    window = hub.get("sliding_window")
    if window is not None and window < seq_len:
        problems.append(f"sliding_window={window} below max_position_embeddings={seq_len} (tfpod attends to the "
                        "whole sequence: set max_position_embeddings to at most the window)")
    scaling = hub.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        problems.append(f"rope_scaling type {rope_type!r} (tfpod reads {', '.join(ROPE_TYPES)})")
    if problems:
        raise UserError("config.json: tfpod's llama cannot run " + "; ".join(problems))
    rope = {}
    if rope_type == "llama3":
        rope = dict(rope_scaling_factor=float(scaling["factor"]),
                    rope_low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                    rope_high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                    rope_original_len=int(scaling.get("original_max_position_embeddings", 8192)))
    return llama.LlamaConfig(
        vocab_size=hub["vocab_size"], seq_len=seq_len, num_layers=hub["num_hidden_layers"], embed_dim=embed,
        num_heads=heads, num_kv_heads=hub.get("num_key_value_heads") or heads, mlp_dim=hub["intermediate_size"],
        rope_theta=float(hub.get("rope_theta", 10000.0)), norm_epsilon=hub.get("rms_norm_eps", 1e-6),
        qkv_bias=bool(hub.get("attention_bias", False)), tie_embeddings=bool(hub.get("tie_word_embeddings", False)),
        init_stddev=hub.get("initializer_range", 0.02), dropout=0.0,
        attention_dropout=float(hub.get("attention_dropout", 0.0)), **rope)


def hub_config(c: llama.LlamaConfig, data=None) -> dict:
    """config.json of a tfpod llama as LlamaForCausalLM (`data`: the run's data config, for its EOS and BOS)."""
    if c.dropout:
        log.warning("llama.dropout=%s has no LlamaForCausalLM equivalent (only attention_dropout): not exported",
                    c.dropout)
    eos = None if data is None else data.eos_id
    eos = c.vocab_size - 1 if eos is None else eos
    bos = None if data is None else data.bos_id
    out = {"architectures": [EXPORT_ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": c.vocab_size,
           "max_position_embeddings": c.seq_len, "hidden_size": c.embed_dim, "intermediate_size": c.mlp_dim,
           "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
           "num_key_value_heads": c.num_kv_heads, "hidden_act": "silu", "rms_norm_eps": c.norm_epsilon,
           "rope_theta": c.rope_theta, "attention_bias": c.qkv_bias, "attention_dropout": c.attention_dropout,
           "mlp_bias": False, "tie_word_embeddings": c.tie_embeddings, "initializer_range": c.init_stddev,
           "bos_token_id": eos if bos is None else bos, "eos_token_id": eos, "use_cache": True, "rope_scaling": None}
    if c.rope_scaling_factor:
        out["rope_scaling"] = {"rope_type": "llama3", "factor": c.rope_scaling_factor,
                               "low_freq_factor": c.rope_low_freq_factor, "high_freq_factor": c.rope_high_freq_factor,
                               "original_max_position_embeddings": c.rope_original_len}
    return out


def params(c: llama.LlamaConfig, architecture: str) -> list[Param]:
    """Every tensor of the checkpoint, in the order transformers writes them."""
    del architecture
    e, h, kvh, d = c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim
    out = [same(f"{PREFIX}embed_tokens.weight", "llama/token_embedding/embeddings")]
    for i in range(c.num_layers):
        hub, ours = f"{PREFIX}layers.{i}", f"llama/block_{i}"
        attention = f"{ours}/self_attention"
        out += [linear(f"{hub}.self_attn.q_proj.weight", f"{attention}/query/kernel", (e, h, d)),
                linear(f"{hub}.self_attn.k_proj.weight", f"{attention}/key/kernel", (e, kvh, d)),
                linear(f"{hub}.self_attn.v_proj.weight", f"{attention}/value/kernel", (e, kvh, d))]
        if c.qkv_bias:
            out += [reshaped(f"{hub}.self_attn.{n}_proj.bias", f"{attention}/{name}/bias", (heads, d))
                    for n, name, heads in (("q", "query", h), ("k", "key", kvh), ("v", "value", kvh))]
        out += [linear(f"{hub}.self_attn.o_proj.weight", f"{attention}/attention_output/kernel", (h, d, e), 2),
                linear(f"{hub}.mlp.gate_proj.weight", f"{ours}/mlp/gate/kernel", (e, c.mlp_dim)),
                linear(f"{hub}.mlp.up_proj.weight", f"{ours}/mlp/up/kernel", (e, c.mlp_dim)),
                linear(f"{hub}.mlp.down_proj.weight", f"{ours}/mlp/down/kernel", (c.mlp_dim, e)),
                same(f"{hub}.input_layernorm.weight", f"{ours}/attention_norm/scale"),
                same(f"{hub}.post_attention_layernorm.weight", f"{ours}/mlp_norm/scale")]
    out.append(same(f"{PREFIX}norm.weight", "llama/final_norm/scale"))
    if not c.tie_embeddings:
        out.append(same("lm_head.weight", "llama/output_embedding/embeddings"))
    return out


def absent(architecture: str) -> tuple[str, ...]:
    """tfpod variables the checkpoint does not hold: none."""
    del architecture
    return ()


def skipped(name: str) -> bool:
    """Hub tensors tfpod does not keep: rotary caches some files carry, a tied lm_head."""
    return name.endswith("rotary_emb.inv_freq") or name == "lm_head.weight"


def gin(c: llama.LlamaConfig, hub: dict, vocab: str | None) -> list[str]:
    """The data lines of an imported model's config.gin: its SentencePiece tokenizer.model in the
    graph (Llama 2, Mistral; the run's copy), else pre-tokenized ids (Llama 3's tokenizer.json);
    documents end with its EOS."""
    eos = hub.get("eos_token_id", c.vocab_size - 1)
    eos = eos[0] if isinstance(eos, list) else eos
    bos = hub.get("bos_token_id")
    ids = [f"lm_data.eos_id = {eos}"] + ([] if bos is None else [
        "# Documents and served prompts start with the model's BOS, as its tokenizer does.", f"lm_data.bos_id = {bos}"])
    if vocab is not None:
        return ["# The model's SentencePiece tokenizer.model runs in the input pipeline and the SavedModel;",
                "# set lm_data.train_files (text or TFRecords of text).", f"lm_data.vocab_path = {vocab!r}"] + ids
    return ["# Train on TFRecords of the model's own token ids without BOS (docs/pretrained.md); set",
            "# lm_data.train_files (and eval_files).", "lm_data.format = 'ids'"] + ids
