"""BERT (`BertForPreTraining`, `BertForMaskedLM`, `BertModel`) <-> tfpod's bert.

Both are post-norm encoders with word, position and token-type embeddings, an embedding
layer norm, a tanh pooler on [CLS], and a masked-LM head (dense + activation + layer
norm, the output layer tied to the word embeddings, its own bias). PyTorch Linear
weights are [out, in]: transposed to tfpod's [in, out] kernels. What an architecture does
not hold is initialized fresh and said on the console: BertModel has no pretraining
heads, BertForMaskedLM no pooler and no next-sentence classifier. Older files name layer
norms' weight and bias `gamma` and `beta`; both spellings are read.
"""

from __future__ import annotations

import re

from tfpod import UserError
from tfpod.convert.gpt2 import ACTIVATIONS, TO_HUB_ACTIVATION
from tfpod.convert.params import Param, layer_norm, linear, require, reshaped, same
from tfpod.models import bert

MODEL_TYPE = "bert"
TASK = "bert"
PREFIX = "bert."
ARCHITECTURES = ("BertForPreTraining", "BertForMaskedLM", "BertModel")
VOCAB_FILE = "vocab.txt"  # the WordPiece vocabulary a folder may hold (copied into the run)
EXPORT_ARCHITECTURE = "BertForPreTraining"

HEADS = ("bert/masked_lm/", "bert/next_sentence/")
POOLER = "bert/encoder/pooler_transform/"


def model_config(hub: dict) -> bert.BertConfig:
    """tfpod's BertConfig of a BERT config.json (one UserError for what tfpod cannot run)."""
    require(hub, ("vocab_size", "num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size"),
            ARCHITECTURES)
    act = hub.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise UserError(f"config.json: hidden_act={act!r} is not supported: use one of {', '.join(ACTIVATIONS)}")
    if hub.get("position_embedding_type", "absolute") != "absolute":
        raise UserError(f"config.json: position_embedding_type={hub['position_embedding_type']!r} is not supported "
                        "(tfpod's bert learns absolute positions)")
    if hub.get("layer_norm_eps", 1e-12) != bert.NORM_EPSILON:
        raise UserError(f"config.json: layer_norm_eps={hub['layer_norm_eps']} is not supported (Model Garden's "
                        f"encoder fixes {bert.NORM_EPSILON})")
    architecture = (hub.get("architectures") or ["BertForPreTraining"])[0]
    return bert.BertConfig(vocab_size=hub["vocab_size"], seq_len=hub.get("max_position_embeddings", 512),
                           max_predictions=min(76, hub.get("max_position_embeddings", 512)),
                           num_layers=hub["num_hidden_layers"], hidden_size=hub["hidden_size"],
                           num_heads=hub["num_attention_heads"], intermediate_size=hub["intermediate_size"],
                           type_vocab_size=hub.get("type_vocab_size", 2), dropout=hub.get("hidden_dropout_prob", 0.1),
                           attention_dropout=hub.get("attention_probs_dropout_prob", 0.1),
                           init_stddev=hub.get("initializer_range", 0.02), activation=ACTIVATIONS[act],
                           next_sentence=architecture == "BertForPreTraining")


def hub_config(c: bert.BertConfig, data=None) -> dict:
    """config.json of a tfpod bert as BertForPreTraining (`data`, the run's data config, adds nothing)."""
    del data
    if c.activation not in TO_HUB_ACTIVATION:
        raise UserError(f"bert.activation={c.activation!r} has no Hugging Face equivalent")
    if c.norm_first:
        raise UserError("bert.norm_first=True (pre-norm blocks) has no Hugging Face BERT equivalent (post-norm)")
    return {"architectures": [EXPORT_ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
            "intermediate_size": c.intermediate_size, "hidden_act": TO_HUB_ACTIVATION[c.activation],
            "hidden_dropout_prob": c.dropout, "attention_probs_dropout_prob": c.attention_dropout,
            "max_position_embeddings": c.seq_len, "type_vocab_size": c.type_vocab_size,
            "initializer_range": c.init_stddev, "layer_norm_eps": bert.NORM_EPSILON, "pad_token_id": 0,
            "position_embedding_type": "absolute", "tie_word_embeddings": True}


def params(c: bert.BertConfig, architecture: str) -> list[Param]:
    """The tensors an architecture's checkpoint holds, with BertForPreTraining's names."""
    h, heads, kv = c.hidden_size, c.num_heads, c.hidden_size // c.num_heads
    enc = "bert/encoder"
    out = [same(f"{PREFIX}embeddings.word_embeddings.weight", f"{enc}/word_embeddings/embeddings"),
           same(f"{PREFIX}embeddings.position_embeddings.weight", f"{enc}/position_embedding/embeddings"),
           same(f"{PREFIX}embeddings.token_type_embeddings.weight", f"{enc}/type_embeddings/embeddings")]
    out += layer_norm(f"{PREFIX}embeddings.LayerNorm", f"{enc}/embeddings/layer_norm")
    for i in range(c.num_layers):
        hub, ours = f"{PREFIX}encoder.layer.{i}", f"{enc}/transformer/layer_{i}"
        for name in ("query", "key", "value"):
            out += [linear(f"{hub}.attention.self.{name}.weight", f"{ours}/self_attention/{name}/kernel", (h, heads, kv)),
                    reshaped(f"{hub}.attention.self.{name}.bias", f"{ours}/self_attention/{name}/bias", (heads, kv))]
        out += [linear(f"{hub}.attention.output.dense.weight", f"{ours}/self_attention/attention_output/kernel",
                       (heads, kv, h), in_dims=2),
                same(f"{hub}.attention.output.dense.bias", f"{ours}/self_attention/attention_output/bias")]
        out += layer_norm(f"{hub}.attention.output.LayerNorm", f"{ours}/self_attention_layer_norm")
        out += [linear(f"{hub}.intermediate.dense.weight", f"{ours}/intermediate/kernel", (h, c.intermediate_size)),
                same(f"{hub}.intermediate.dense.bias", f"{ours}/intermediate/bias"),
                linear(f"{hub}.output.dense.weight", f"{ours}/output/kernel", (c.intermediate_size, h)),
                same(f"{hub}.output.dense.bias", f"{ours}/output/bias")]
        out += layer_norm(f"{hub}.output.LayerNorm", f"{ours}/output_layer_norm")
    if architecture != "BertForMaskedLM":
        out += [linear(f"{PREFIX}pooler.dense.weight", f"{POOLER}kernel", (h, h)),
                same(f"{PREFIX}pooler.dense.bias", f"{POOLER}bias")]
    if architecture != "BertModel":
        out += [same("cls.predictions.bias", "bert/masked_lm/output_bias/bias"),
                linear("cls.predictions.transform.dense.weight", "bert/masked_lm/transform/dense/kernel", (h, h)),
                same("cls.predictions.transform.dense.bias", "bert/masked_lm/transform/dense/bias")]
        out += layer_norm("cls.predictions.transform.LayerNorm", "bert/masked_lm/transform/LayerNorm")
    if architecture == "BertForPreTraining":
        out += [linear("cls.seq_relationship.weight", "bert/next_sentence/kernel", (h, 2)),
                same("cls.seq_relationship.bias", "bert/next_sentence/bias")]
    return out


def absent(architecture: str) -> tuple[str, ...]:
    """Prefixes of the tfpod variables the architecture's checkpoint does not hold (initialized fresh)."""
    return {"BertForPreTraining": (), "BertForMaskedLM": (POOLER, HEADS[1]), "BertModel": HEADS}[architecture]


def skipped(name: str) -> bool:
    """Hub tensors that are not weights tfpod keeps: position-id buffers and the tied decoder
    (its bias is cls.predictions.bias)."""
    return bool(re.search(r"position_ids$|^cls\.predictions\.decoder\.(weight|bias)$", name))


def gin(c: bert.BertConfig, hub: dict, vocab: str | None) -> list[str]:
    """The data lines of an imported BERT's config.gin: its WordPiece vocab.txt (the run's copy)
    when the folder had one, else records of its own ids (and an export of the ids signature alone)."""
    del c, hub
    if vocab is None:
        return ["# No vocab.txt came with it: its data is create_pretraining_data.py records of its own ids.",
                "bert_data.format = 'records'"]
    return ["# The model's WordPiece vocab.txt, for text masked online. Text has no sentence pairs: train it",
            "# with bert.next_sentence = False.", f"bert_data.vocab_path = {vocab!r}"]
