"""Generation speed of an exported LM: the key/value cache against the recomputing path and
transformers' TF `generate`, on the same GPT-2 weights (random, GPT-2 small's shape).

    python bench/generation.py [--batches=1,8] [--prompts=128,1024] [--new_tokens=256]
        [--recompute_tokens=8] [--num_layers=12] [--runs=cached,sampled,recompute,transformers]

A random TFGPT2LMHeadModel (n_positions 1280 so that prompt 1024 + 256 new tokens fit) is
written as a Hub folder, imported (`tfpod.convert`) and exported (`tfpod.export`); then,
for each batch and prompt length, greedy:

  cached        the SavedModel's `generate_ids` (prefill, then one slot a step), loaded
                with tf.saved_model.load; new_tokens tokens
  sampled       the same signature sampling: temperature 0.8, top-k 40, top-p 0.95 and a
                seed per row, as per-row options (the filters' cost over greedy)
  recompute     the recomputing path (lm_serving.recomputed_generate: the model on each
                row's last seq_len tokens for every new token; what `generate` ran before
                the cache), compiled; --recompute_tokens tokens (its cost per token is the
                same at every step once the prompt is there, and 256 of them at prompt
                1024 would take most of an hour on 2 cores)
  transformers  TFGPT2LMHeadModel.generate (greedy, its own cache), new_tokens tokens

Each is run once to compile/warm up on a shorter request, then timed once; tokens/s counts
the new tokens all rows made (a row stops early at EOS). The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompts", default="128,1024")
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--recompute_tokens", type=int, default=8)
    p.add_argument("--num_layers", type=int, default=12)
    p.add_argument("--runs", default="cached,sampled,recompute,transformers")
    args = p.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tfpod import runtime

    runtime.initialize(cpu_devices=1, device_type="CPU")  # before anything starts TensorFlow
    import numpy as np
    import tensorflow as tf
    import transformers
    from transformers.modeling_tf_pytorch_utils import convert_tf_weight_name_to_pt_weight_name

    from tfpod import export
    from tfpod.convert import hub as hublib
    from tfpod.convert import run as convert
    from tfpod.models import lm_serving

    runs = args.runs.split(",")
    tf.keras.utils.set_random_seed(0)
    config = transformers.GPT2Config(n_positions=1280, n_layer=args.num_layers, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    hf = transformers.TFGPT2LMHeadModel(config)
    hf(tf.zeros([1, 4], tf.int32))
    work = tempfile.mkdtemp()
    tensors = {}
    for w in hf.weights:  # PyTorch names, [out, in] where PyTorch keeps it so (as Hub folders hold them)
        name, transpose = convert_tf_weight_name_to_pt_weight_name(w.name, tf_weight_shape=w.shape)
        value = w.numpy().T if transpose.name == "SIMPLE" else w.numpy()
        tensors[name] = value[0] if value.ndim == 2 and value.shape[0] == 1 and name.endswith(".bias") else value
    hf.config.architectures = ["GPT2LMHeadModel"]
    hublib.write_folder(os.path.join(work, "hub"), json.loads(hf.config.to_json_string()), sorted(tensors.items()))
    convert.import_hub(os.path.join(work, "hub"), os.path.join(work, "run"))
    served = tf.saved_model.load(export.saved_model(os.path.join(work, "run"))["export_dir"])
    generate_ids = served.signatures["generate_ids"]
    model = export.single_device_model(*_task_and_model(os.path.join(work, "run")))
    recompute = tf.function(lambda ragged, n: lm_serving.recomputed_generate(
        lambda x: model({"inputs": x}, training=False), 1280, ragged, n))

    def timed(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    records = []
    rng = np.random.default_rng(0)
    for batch in map(int, args.batches.split(",")):
        for prompt in map(int, args.prompts.split(",")):
            ids = tf.constant(rng.integers(0, 50000, [batch, prompt]), tf.int32)
            lengths = tf.fill([batch], prompt)
            record = {"batch": batch, "prompt": prompt}
            if "cached" in runs:
                call = lambda n: generate_ids(input_ids=ids, lengths=lengths, max_new_tokens=tf.constant(n),
                                              temperature=tf.constant(0.0), top_k=tf.constant(0),
                                              top_p=tf.constant(1.0), seed=tf.constant(0))["num_tokens"].numpy()
                call(2)
                first = timed(lambda: call(1))  # prefill and one token
                start = time.perf_counter()
                made = int(call(args.new_tokens).sum())  # a row stops early at EOS: count what was made
                seconds = time.perf_counter() - start
                record.update(cached_s=round(seconds, 2), cached_prefill_s=round(first, 2), cached_tokens=made,
                              cached_tokens_per_s=round(made / seconds, 1),
                              cached_decode_tokens_per_s=round((made - batch) / (seconds - first), 1))
            if "sampled" in runs:  # per-row options: temperature, top-k and top-p on every row, seeds per row
                sample = lambda n: generate_ids(
                    input_ids=ids, lengths=lengths, max_new_tokens=tf.constant(n),
                    temperature=tf.fill([batch], 0.8), top_k=tf.fill([batch], 40), top_p=tf.fill([batch], 0.95),
                    seed=tf.range(batch))["num_tokens"].numpy()
                sample(2)
                start = time.perf_counter()
                made = int(sample(args.new_tokens).sum())
                seconds = time.perf_counter() - start
                record.update(sampled_s=round(seconds, 2), sampled_tokens=made,
                              sampled_tokens_per_s=round(made / seconds, 1))
            if "recompute" in runs:
                ragged = tf.RaggedTensor.from_tensor(ids)
                recompute(ragged, tf.constant(1)).numpy()
                seconds = timed(lambda: recompute(ragged, tf.constant(args.recompute_tokens)).numpy())
                record.update(recompute_s=round(seconds, 2), recompute_new_tokens=args.recompute_tokens,
                              recompute_tokens_per_s=round(batch * args.recompute_tokens / seconds, 2))
            if "transformers" in runs:
                hf.generate(ids[:, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)
                seconds = timed(lambda: hf.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                                    do_sample=False, pad_token_id=0).numpy())
                record.update(transformers_s=round(seconds, 2),
                              transformers_tokens_per_s=round(batch * args.new_tokens / seconds, 1))
            if "cached_tokens_per_s" in record:
                for other in ("recompute", "transformers"):
                    if f"{other}_tokens_per_s" in record:
                        record[f"cached_over_{other}"] = round(record["cached_tokens_per_s"]
                                                               / record[f"{other}_tokens_per_s"], 2)
            print(json.dumps(record), flush=True)
            records.append(record)
    print(json.dumps({"bench": "generation", "model": f"gpt2 shape, {args.num_layers} layers, random weights",
                      "new_tokens": args.new_tokens, "records": records}))


def _task_and_model(run_dir):
    """(task, model config, newest checkpoint) of an imported run, from its config.gin."""
    from tfpod import api, config, export

    config.parse_config([os.path.join(run_dir, "config.gin")], [])
    c = api.build_run_configs()
    return c.task, c.model, export.checkpoint_path(run_dir)


if __name__ == "__main__":
    main()
