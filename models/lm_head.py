"""The language models' output layer and loss: the tied output matmul and the cross entropy
in one function (`output_layer_loss`), and the cross entropy of given logits
(`loss_from_logits`, for vocab-parallel logits)."""

from __future__ import annotations

import tensorflow as tf

from tfpod.partitioning import context


def output_layer_loss(x: tf.Tensor, table: tf.Tensor, batch: dict):
    """Cross entropy of the tied output layer's logits x @ table^T, with its own gradient.

    The same loss as `loss_from_logits(output_logits(x))`, in fewer passes over the
    [tokens, vocab] logits (gpt_small: 4096 x 50304, 824 MB at float32), which at this
    size cost more than the output matmuls' arithmetic on a CPU:

      forward   logits (float32), probs = softmax(logits) in one fused kernel; the
                token loss is log_z - logit[target] with log_z = max(logits) -
                log(max(probs)) (the largest probability is exp(0) / sum, never
                underflows), the target logit a gather.
      backward  d logits = (probs - one_hot(target)) * w, and neither that nor the one-hot
                is formed: d x = (probs @ table - table[target]) * w and d table =
                probs^T @ (x * w) - scatter_add(target, x * w), where the one-hot
                terms are a gather and a scatter of [tokens, embed] rows. Under mixed
                precision probs enter the matmuls in bfloat16 as logits' gradient would;
                the target entry's rounding error is added back in the gathered term,
                so it is exact to float32 (p - 1 for a confident p is not lost).

    Args:
      x: final hidden states [batch, length, embed] (the compute dtype).
      table: the tied embedding [vocab, embed], in x's dtype; its vocab rows unsplit.
      batch: "targets" int32 and "weights" float32 [batch, length].

    Returns:
      {"loss_sum": the weighted token losses' sum, "weight_sum": the weights' sum}, float32
      scalars (the Trainer divides one by the other; `loss_counts`).
    """
    embed, vocab = x.shape[-1], table.shape[0]
    flat = context.flat_tokens(x, embed)  # [tokens, embed] ([batch, length, embed] under context parallelism)
    targets = tf.reshape(batch["targets"], flat.shape[:-1])  # [tokens]
    weights = tf.reshape(tf.cast(batch["weights"], tf.float32), flat.shape[:-1])  # [tokens]
    weight_sum = tf.reduce_sum(weights)
    rows = targets.shape.rank
    at_target = lambda t: tf.squeeze(tf.gather(t, tf.expand_dims(targets, -1), batch_dims=rows), -1)  # -> [tokens]

    @tf.custom_gradient
    def weighted_sum(flat, table):  # sum over tokens of weight * token loss
        logits = tf.cast(context.token_matmul(flat, table, transpose_b=True), tf.float32)  # [tokens, vocab]
        probs = tf.nn.softmax(logits)
        log_z = tf.reduce_max(logits, axis=-1) - tf.math.log(tf.reduce_max(probs, axis=-1))  # [tokens]
        token_loss = log_z - at_target(logits)

        def grad(d_sum):
            s = d_sum * weights  # [tokens]: d / d token_loss
            p = tf.cast(probs, flat.dtype)
            p_target = at_target(probs)  # float32
            rounding = p_target - tf.cast(at_target(p), tf.float32)
            target_coef = tf.expand_dims(tf.cast((rounding - 1.0) * s, flat.dtype), -1)  # [tokens, 1]
            s = tf.expand_dims(tf.cast(s, flat.dtype), -1)
            d_flat = context.token_matmul(p, table) * s + tf.gather(table, targets) * target_coef  # [tokens, embed]
            d_table = context.token_outer(p, flat * s) + tf.math.unsorted_segment_sum(
                flat * target_coef, targets, vocab)  # [vocab, embed]
            return d_flat, d_table

        return tf.reduce_sum(token_loss * weights), grad

    return {"loss_sum": weighted_sum(flat, table), "weight_sum": weight_sum}


def loss_from_logits(logits: tf.Tensor, batch: dict):
    """Cross entropy of logits [batch, length, vocab] against batch targets and weights.

    Written as logsumexp minus the target logit (picked with a one-hot product), so a
    vocab-sharded logits tensor reduces with all-reduces (Megatron's vocab-parallel
    cross entropy) instead of being gathered.

    Returns:
      {"loss_sum", "weight_sum"} as `output_layer_loss`.
    """
    vocab = logits.shape[-1]
    log_z = tf.reduce_logsumexp(logits, axis=-1)  # [batch, length]
    target_logit = tf.reduce_sum(logits * tf.one_hot(batch["targets"], vocab, dtype=logits.dtype), axis=-1)
    token_loss = log_z - target_logit  # [batch, length]
    weights = batch["weights"]
    return {"loss_sum": tf.reduce_sum(token_loss * weights), "weight_sum": tf.reduce_sum(weights)}
