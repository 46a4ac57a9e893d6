"""Each model's training step per example for the planner (Task.plan_profile; tfpod.plan.profile).

A profile names what a step keeps for its backward pass and what it moves between
devices, in the logical axes the model's weights use, so the planner lays both out
with the run's own rules table. Transformers are built from `profile.transformer_block`
and convolutional networks from the layer outputs their lazy build recorded
(`profile.conv_layers`). To plan a new model, add its function here and set the task's
`plan_profile`.
"""

from __future__ import annotations

import dataclasses

from tfpod import attention
from tfpod.plan import profile
from tfpod.plan.profile import Collective, Profile, Tensor

STREAM = ("sequence", "embed")  # a Transformer's residual stream per example


def gpt(config, outputs=(), flops=None, mlp_share: float = 1.0, extra_saved=(), extra_collectives=(),
        kv_heads: int | None = None) -> Profile:
    """The causal LM: its blocks, and the embedding, final norm and loss outside them
    (`flops`: the task's flops_per_token; `mlp_share`, `extra_*`: MoE's blocks; `kv_heads`:
    grouped-query attention's). Its sequence splits over a `context` mesh axis (keys and
    values gathered), the local sequence a whole number of attention blocks."""
    del outputs
    s, e = config.seq_len, config.embed_dim
    att = attention.current()
    blockwise = att.implementation == "blockwise"
    saved, collectives = profile.transformer_block(s, e, config.num_heads, config.mlp_dim, config.dropout,
                                                   config.attention_dropout, mlp_share=mlp_share,
                                                   blockwise=blockwise, kv_heads=kv_heads)
    total = flops(config)
    return Profile(
        blocks=config.num_layers, block_saved=saved + list(extra_saved), block_input=Tensor(STREAM, (s, e)),
        block_collectives=collectives + list(extra_collectives),
        block_flops_fraction=1 - 6.0 * config.vocab_size * e / total,
        outside_saved=profile.lm_outside(s, e, config.vocab_size, one_hot_lookup=True),
        # the vocab-parallel lookup's and logits' sums over the vocabulary shards
        outside_collectives=[Collective(Tensor(STREAM, (s, e)), "vocab")], tokens_per_example=s,
        block_temporary=[blockwise_scores(s, config.num_heads)] if blockwise else [],
        causal_attention_share=12.0 * config.num_layers * s * e / total, context_length=s,
        causal_attention_work=causal_work(s) if blockwise else 0.75,
        context_block=min(att.block_size, s) if blockwise else 1)


def blockwise_scores(length: int, heads: int) -> profile.Tensor:
    """What blockwise attention over `length` tokens holds while it runs: one query group's
    scores against one key block."""
    block = attention.block_for(length, True)
    rows = max(n for _, n in attention.query_groups(length, block))
    return profile.blockwise_scores(rows, heads, min(block, length))


def causal_work(length: int) -> float:
    """The share of the whole length x length matrix blockwise causal attention computes:
    query group g of G attends (g + 1) / G of the keys."""
    groups = len(attention.query_groups(length, attention.block_for(length, True)))
    return (groups + 1) / (2 * groups)


def llama(config, outputs=(), flops=None) -> Profile:
    """The Llama family: gpt's, with SwiGLU's third [length, mlp] tensor (gate, up and their
    product are kept). Grouped-query attention keeps its keys and values repeated to every
    query head, as gpt's are; under context parallelism it gathers its `kv_heads` alone."""
    base = gpt(config, outputs, flops, kv_heads=config.num_kv_heads)
    mlp = Tensor(("length", "mlp"), (config.seq_len, config.mlp_dim), 1)
    return dataclasses.replace(base, block_saved=base.block_saved + [mlp])


def moe(config, outputs=(), flops=None) -> Profile:
    """GShard's MoE LM: GPT's, with the dense MLP in the dense blocks only, and each MoE
    block's dispatched tokens, expert hidden activations, routing masks and its two
    all-to-alls (dispatch and return), spread evenly over the blocks."""
    share = config.num_moe_blocks / config.num_layers
    groups, experts, cap = config.seq_len // config.group_size, config.num_experts, config.capacity
    dispatched = Tensor(("expert", None, None, "embed"), (experts, groups, cap, config.embed_dim))
    saved = [Tensor(dispatched.axes, dispatched.shape, 2 * share),  # dispatched tokens, expert outputs
             Tensor(("expert", None, None, "mlp"), (experts, groups, cap, config.expert_mlp_dim), 2 * share),
             Tensor(("expert", None, None, None), (groups, config.group_size, experts, cap), 2 * share)]
    # Not planned over a `context` axis: the routing groups (a logical axis of their own) would not split with it.
    return dataclasses.replace(gpt(config, outputs, flops, mlp_share=1 - share, extra_saved=saved,
                                   extra_collectives=[Collective(dispatched, "expert", "all_to_all", 2 * share)]),
                               context_length=0)


def bert(config, outputs=(), flops=None) -> Profile:
    """BERT: post-norm encoder blocks; the three embeddings and their norm; the masked-LM
    head on the gathered predictions (transform, norm, vocab-parallel logits)."""
    del outputs
    s, e, p = config.seq_len, config.hidden_size, config.max_predictions
    saved, collectives = profile.transformer_block(s, e, config.num_heads, config.intermediate_size, config.dropout,
                                                   config.attention_dropout)
    head = [Tensor(STREAM, (s, e), 4),  # summed embeddings, their norm's input and output, dropout
            Tensor(("length", "vocab"), (s, config.vocab_size), when_split="vocab"),  # one-hot lookup
            Tensor((None, "embed"), (p, e), 4),  # gathered positions, transform in and out, norm
            Tensor((None, "vocab"), (p, config.vocab_size), 1, "float32")]  # the loss's backprop
    total = flops(config)
    return Profile(blocks=config.num_layers, block_saved=saved, block_input=Tensor(STREAM, (s, e)),
                   block_collectives=collectives,
                   block_flops_fraction=1 - 6.0 * (e * e + config.vocab_size * e) * p / s / total,
                   outside_saved=head, outside_collectives=[Collective(Tensor(STREAM, (s, e)), "vocab")],
                   tokens_per_example=s)


def transformer(config, outputs=(), flops=None) -> Profile:
    """The encoder-decoder: encoder blocks over the source and decoder blocks (self and
    cross attention) over the target, as one block kind weighted by their counts."""
    del outputs
    le, ld = config.encoder_layers, config.decoder_layers
    h, f, s, t = config.hidden_size, config.intermediate_size, config.src_len, config.tgt_len
    enc, enc_c = profile.transformer_block(s, h, config.num_heads, f, config.dropout, config.attention_dropout)
    dec, dec_c = profile.transformer_block(t, h, config.num_heads, f, config.dropout, config.attention_dropout,
                                           cross_length=s)
    weigh = lambda items, n: [type(x)(**{**x.__dict__, "count": x.count * n / (le + ld)}) for x in items]
    return Profile(
        blocks=le + ld, block_saved=weigh(enc, le) + weigh(dec, ld), block_input=Tensor(STREAM, ((s + t) // 2, h)),
        block_collectives=weigh(enc_c, le) + weigh(dec_c, ld),
        block_flops_fraction=1 - 6.0 * config.vocab_size * h * t / (s + t) / flops(config),
        outside_saved=profile.lm_outside(t, h, config.vocab_size, one_hot_lookup=True)
        + [Tensor(STREAM, (s, h), 2)],  # the source embedding and the encoder's output
        outside_collectives=[Collective(Tensor(STREAM, (t, h)), "vocab")], tokens_per_example=s + t)


def conv(config, outputs=(), flops=None) -> Profile:
    """A convolutional network (ResNet, SSD): the outputs its lazy build recorded; no
    repeated blocks (recomputation and pipelines are for Transformers)."""
    del config, flops
    return Profile(blocks=0, outside_saved=profile.conv_layers(outputs), ops_outside=3 * len(outputs))


def dlrm(config, outputs=(), flops=None) -> Profile:
    """DLRM-DCNv2 (models/dlrm.py) per example: the MLPs' and cross layers' activations
    (data parallel); the embedding tables' lookups (tfpod.embedding.tables): every device
    looks up its rows for the whole global batch and the partial sums are reduced over the
    rows' mesh axis (`vocab`), and the step's gradient rows (and ids) are gathered to every
    device, which de-duplicates them (a few copies while it sorts)."""
    del outputs, flops
    tables, d = len(config.table_sizes), config.embedding_dim
    hot, width = sum(config.multi_hot_sizes), config.interaction_width
    mlp = sum(config.bottom_mlp) + config.dense_features + sum(config.top_mlp)
    saved = [Tensor((None,), (2 * mlp,)),  # each MLP layer's input and output
             Tensor((None,), (width,), 2 + 4 * config.cross_layers),  # x0, pooled tables; each cross layer
             Tensor((None,), (config.cross_rank,), config.cross_layers),
             Tensor((None, "embed"), (tables, d), whole_batch=True),  # the partial lookups, every device
             Tensor((None, "embed"), (hot, d), 4, "float32", whole_batch=True)]  # gathered, sorted, summed rows
    collectives = [  # (each once per step: `count` halves the forward + backward the planner counts)
        Collective(Tensor((None, "embed"), (tables, d), whole_batch=True), "vocab", "all_reduce", 0.5),
        Collective(Tensor((None, None), (hot, d + 1), 1, "float32"), "batch", "all_gather", 0.5)]
    return Profile(blocks=0, outside_saved=saved, outside_collectives=collectives, ops_outside=40 + 6 * tables)
