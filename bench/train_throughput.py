"""Training throughput side by side: tfpod, plain tf_keras `model.fit`, and Model Garden's trainer.

    python bench/train_throughput.py [--model=gpt_small|bert_base|resnet50|llama_small] [--global_batch=N]
        [--seq_len=N] [--num_layers=N] [--warmup=2] [--steps=4] [--steps_per_loop=2]
        [--runs=peak,tfpod,tfpod_bf16,keras_fit,model_garden] [--mesh=data:1] [--cpu_devices=1]
        [--keras_hub_python=PYTHON]   # llama_small's keras_hub runs: a Python with keras_hub installed

In one run on one machine, each measurement in its own fresh process, one after the other
(so none shares the cores with another):

  peak          this machine's large-matmul FLOP/s, fp32 and bf16: the best of several
                square (2048, 4096, 8192) and one tall-skinny (GPT's output layer)
                matmuls, 4 per call, best of 5 calls (flops.measured_matmul_flops)
  tfpod         tfpod's Trainer (the one used by main.py) on a DTensor mesh (`--mesh`,
                one CPU device by default), fp32, synthetic batches as
                train.synthetic_data=True makes them
  tfpod_bf16    the same with train.precision=mixed_bfloat16
  tfpod_real_input  the `tfpod` run fed by the task's real input pipeline on its default
                demo data instead of synthetic batches: for gpt_small the default corpus
                (Python standard library source, prepared on first use), SentencePiece
                2048 in the graph, concat packing to --seq_len, shuffled; for bert_base the
                same corpus masked online; for resnet50 the digits demo set decoded,
                cropped and resized in the pipeline; `real_vs_synthetic` is its rate over
                the `tfpod` run's
  keras_fit     the model written with stock tf_keras layers (bench/plain_models.py), trained by
                plain tf_keras `model.compile` + `model.fit` with default settings on
                one device: x = the model's features, y = its labels, sample_weight =
                its weights, the usual Keras loss (SparseCategoricalCrossentropy, or
                CategoricalCrossentropy with ResNet's label smoothing)
  keras_fit_bf16  the same under Keras's mixed_bfloat16 policy
  keras_hub     llama_small only: KerasHub's LlamaCausalLM of the same shape (Keras 3 on the
                TensorFlow backend, its own AdamW, `fit`; bench/plain_models.py), run by
                --keras_hub_python (KerasHub in its own environment); keras_hub_bf16 under
                mixed_bfloat16
  keras_fit_same_model  tfpod's own model class (models/<task>.build, no mesh) trained by
                the same `model.fit`: against `tfpod`, only the training loop differs
  model_garden  the model as Model Garden builds it (model_garden_model: for gpt_small
                its OnDeviceEmbedding, PositionEmbedding and TransformerEncoderBlocks;
                for bert_base its BertPretrainerV2 on BertEncoderV2; ResNet is tfpod's
                class, which is Model Garden's vision ResNet, with Keras's fused batch
                norm as Model Garden runs it) and the Keras loss above, trained by
                tf-models-official's own trainer:
                an `official.core.base_task.Task` (build_losses = the Keras loss
                above) run by `official.core.base_trainer.Trainer` under an
                `orbit.Controller` with steps_per_loop (tf.while_loop inside tf.function)

All train the same network (the same weights: `parameters` in each run) with the same
Model Garden optimizer and schedule (AdamW for gpt_small, LAMB for bert_base, LARS for
resnet50; global-norm clipping 1.0), at the same global batch, on batches of the same
synthetic distribution already in memory. Each runs `--warmup` steps (compiling) and then
`--steps` timed steps (with --repeats=N the whole list runs N times in rotation and each
figure is its run's fastest: on a shared machine single runs varied by up to 15%); the
rate is tokens (images for ResNet) of the timed steps over the
wall time from the end of the warm-up to the end of the last step, so everything the
training loop does between steps (feeding, logging, metrics) is in it.

MFU is model FLOPs per second (the task's flops_per_token: 6 x weights per token plus
attention, PaLM appendix B) over the measured peak of the same dtype: `mfu_fp32` is the
tfpod run over the fp32 peak, `mfu_bf16` the tfpod_bf16 run over the bf16 peak.

The last line is one JSON object: tokens_per_sec, keras_fit_tokens_per_sec, vs_keras_fit,
model_garden_tokens_per_sec, vs_model_garden, bf16_tokens_per_sec, mfu_fp32, mfu_bf16,
peak_fp32_flops, peak_bf16_flops, the settings, and each run's details ("runs"). For
resnet50 the *_tokens_per_sec figures are images per second. A run that fails has
"error" (its last line of output) and the script exits 1 after the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import plain_models  # bench/plain_models.py (scripts run from bench/)
import workers  # bench/workers.py
from workers import rotate, run_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RUNS = ("peak", "tfpod", "tfpod_bf16", "tfpod_real_input", "keras_fit", "keras_fit_bf16", "keras_fit_same_model",
        "model_garden", "keras_hub", "keras_hub_bf16")
# Per model: task module, config, optimizer, default global batch and sequence length.
MODELS = {
    "gpt_small": dict(task="gpt", batch=4, seq_len=1024, optimizer=dict(name="adamw", learning_rate=6e-4, beta_2=0.95)),
    "bert_base": dict(task="bert", batch=16, seq_len=128, optimizer=dict(name="lamb", learning_rate=1e-4)),
    "resnet50": dict(task="resnet", batch=16, seq_len=None, optimizer=dict(name="lars", learning_rate=0.1, momentum=0.9)),
    "llama_small": dict(task="llama", batch=4, seq_len=512, optimizer=dict(name="adamw", learning_rate=3e-4, beta_2=0.95)),
}


def model_config(args):
    """(task, its model config) for --model, --seq_len and --num_layers."""
    from tfpod import models  # noqa: F401
    from tfpod.models import bert, gpt, llama, resnet

    if args.model == "llama_small":  # 8 layers, 512 wide, 8 query / 2 key-value heads: 30.9M parameters
        return llama.TASK, llama.LlamaConfig(vocab_size=8192, num_layers=args.num_layers or 8, embed_dim=512,
                                             num_heads=8, num_kv_heads=2, mlp_dim=1408, seq_len=args.seq_len)
    if args.model == "gpt_small":
        return gpt.TASK, gpt.GPTConfig(vocab_size=50304, num_layers=args.num_layers or 12, embed_dim=768, num_heads=12,
                                  mlp_dim=3072, seq_len=args.seq_len, dropout=0.0)
    if args.model == "bert_base":
        return bert.TASK, bert.BertConfig(seq_len=args.seq_len, max_predictions=20, num_layers=args.num_layers or 12,
                                     hidden_size=768, num_heads=12, intermediate_size=3072, dropout=0.0,
                                     attention_dropout=0.0)
    return resnet.TASK, resnet.ResNetConfig(depth=50, image_size=224, num_classes=1000)


def optimizer_config(args):
    from tfpod import optimizers

    return optimizers.OptimizerConfig(**MODELS[args.model]["optimizer"], warmup_steps=0, decay="constant", clip_norm=1.0)


def units_per_example(task, cfg) -> int:
    """Tokens per example (1 for images: rates are then examples per second)."""
    return getattr(cfg, "seq_len", None) or 1


def model_garden_model(task, cfg):
    """The model as Model Garden builds it.

    resnet: tfpod's class, which is Model Garden's vision ResNet backbone and a Dense
    head, with Keras's fused batch norm (FusedBatchNormV3) as Model Garden runs it;
    tfpod trains batch norm through `fused.batch_norm` because DTensor cannot lay out
    the fused kernel.

    bert: Model Garden's `BertPretrainerV2` on its `BertEncoderV2` (its own
    TransformerEncoderBlocks with EinsumDense, its gather embedding) and masked-LM head,
    as its BERT pretraining task builds them.

    `OnDeviceEmbedding` (gather) and `PositionEmbedding`, `TransformerEncoderBlock`s with
    norm_first (EinsumDense projections, Keras MultiHeadAttention), a final
    `LayerNormalization`, and the output layer tied to the token table as Model Garden's
    `MaskedLM` ties it (a 2-D `matmul(x, table, transpose_b=True)`): tfpod's GPT before it
    rewrote the blocks as 2-D matmuls, and the same weights.
    """
    import tensorflow as tf
    import tf_keras
    from official.nlp.modeling import layers as mg_layers

    from tfpod import compat, fused
    from tfpod.models import gpt

    if task.name == "resnet":

        model = task.build(cfg)
        for layer in compat.flatten_layers(model):
            if type(layer) is fused.BatchNormalization:
                layer.__class__, layer.fused = tf_keras.layers.BatchNormalization, True
        return model
    init = lambda: tf_keras.initializers.TruncatedNormal(stddev=cfg.init_stddev)
    if task.name == "bert":
        return _model_garden_bert(task, cfg, init)

    class CausalMask(tf_keras.layers.Layer):
        def call(self, ids):
            return gpt.causal_mask(ids)

    class TiedOutput(tf_keras.layers.Layer):
        def __init__(self, embedding, **kwargs):
            super().__init__(**kwargs)
            self.embedding = embedding

        def call(self, x):
            flat = tf.reshape(x, [-1, x.shape[-1]])  # [batch * length, embed]
            logits = tf.matmul(flat, tf.cast(self.embedding.embeddings, x.dtype), transpose_b=True)
            return tf.cast(tf.reshape(logits, [-1, x.shape[1], cfg.vocab_size]), tf.float32)

    ids = tf_keras.Input([cfg.seq_len], dtype=tf.int32, name="inputs")
    embedding = mg_layers.OnDeviceEmbedding(cfg.vocab_size, cfg.embed_dim, initializer=init())
    x = embedding(ids)
    x = x + mg_layers.PositionEmbedding(max_length=cfg.seq_len, initializer=init())(x)
    mask = CausalMask()(ids)
    for _ in range(cfg.num_layers):
        x = mg_layers.TransformerEncoderBlock(
            num_attention_heads=cfg.num_heads, inner_dim=cfg.mlp_dim, inner_activation=cfg.activation,
            norm_first=True, norm_epsilon=cfg.norm_epsilon, kernel_initializer=init())([x, mask])
    x = tf_keras.layers.LayerNormalization(epsilon=cfg.norm_epsilon)(x)
    return tf_keras.Model({"inputs": ids}, TiedOutput(embedding)(x))


def _model_garden_bert(task, cfg, init):
    import tensorflow as tf
    import tf_keras
    from official.nlp.modeling import models as mg_models
    from official.nlp.modeling import networks as mg_networks

    from tfpod.models import bert

    activation = bert._activation(cfg.activation)
    encoder = mg_networks.BertEncoderV2(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, max_sequence_length=cfg.seq_len, type_vocab_size=cfg.type_vocab_size,
        inner_dim=cfg.intermediate_size, inner_activation=activation, output_dropout=cfg.dropout,
        attention_dropout=cfg.attention_dropout, initializer=init(), norm_first=cfg.norm_first)
    pretrainer = mg_models.BertPretrainerV2(encoder_network=encoder, mlm_activation=activation,
                                            mlm_initializer=init())

    class ModelGardenBert(tf_keras.Model):  # tfpod's feature names in, masked-LM logits out
        def __init__(self):
            super().__init__()
            self.pretrainer = pretrainer

        def call(self, inputs, training=None):
            out = self.pretrainer({"input_word_ids": inputs["input_ids"], "input_mask": inputs["input_mask"],
                                   "input_type_ids": inputs["segment_ids"],
                                   "masked_lm_positions": inputs["masked_lm_positions"]}, training=training)
            return tf.cast(out["mlm_logits"], tf.float32)

    return ModelGardenBert()


def keras_adapter(task, cfg):
    """(to_xyw(batch) -> (x, y, sample_weight), the Keras loss) for plain Keras and Model Garden."""
    import tensorflow as tf
    import tf_keras

    name = task.name
    if name in ("gpt", "llama"):
        return (lambda b: ({"inputs": b["inputs"]}, b["targets"], b["weights"]),
                tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if name == "bert":
        return (lambda b: (task.model_inputs(b), b["masked_lm_ids"], tf.cast(b["masked_lm_weights"], tf.float32)),
                tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return (lambda b: (task.model_inputs(b), tf.one_hot(b["labels"], cfg.num_classes), b["weights"]),
            tf_keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=cfg.label_smoothing))


def host_batches(task, cfg, batch: int, count: int, seed: int = 0) -> list[dict]:
    """`count` synthetic global batches, as tfpod's Trainer draws them (seed, step)."""
    import numpy as np

    return [task.synthetic_batch(cfg, batch, np.random.default_rng([seed, step])) for step in range(count)]


def _baseline_dataset(task, cfg, args):
    import numpy as np
    import tensorflow as tf

    to_xyw, _ = keras_adapter(task, cfg)
    batches = host_batches(task, cfg, args.global_batch, args.warmup + args.steps)
    stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
    data = tf.data.Dataset.from_tensor_slices(stacked).map(to_xyw)
    return data.repeat().prefetch(2)


def _baseline_model(task, cfg, args, precision: str, build=None):
    """(model, optimizer): build(task, cfg) or, when that gives None, tfpod's model class."""
    import tf_keras

    from tfpod import optimizers

    tf_keras.utils.set_random_seed(0)
    tf_keras.mixed_precision.set_global_policy(precision)
    model = (build and build(task, cfg)) or task.build(cfg)
    opt_cfg = optimizer_config(args)
    # Model Garden's own optimizer classes as they are (tfpod's fused updates are tfpod's).
    optimizer = optimizers.build_optimizer(opt_cfg, args.warmup + args.steps, fused_update=False)
    if getattr(optimizer, "gradient_clip_norm", None) != opt_cfg.clip_norm:  # AdamW clips by itself (at 1.0)
        optimizer.global_clipnorm = opt_cfg.clip_norm
    return model, optimizer


def run_keras_fit(args, plain: bool = True) -> dict:
    """tf_keras compile + fit on one device; per-step times from a callback.

    Args:
      plain: the model written with stock Keras layers (plain_keras_model); False: the
        tfpod model class (what differs is then only the training loop).
    """
    import tf_keras

    task, cfg = model_config(args)
    model, optimizer = _baseline_model(task, cfg, args, args.precision, plain_models.plain_keras_model if plain else None)
    _, loss = keras_adapter(task, cfg)
    model.compile(optimizer=optimizer, loss=loss)
    ends = []

    class Times(tf_keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    history = model.fit(_baseline_dataset(task, cfg, args), epochs=1, steps_per_epoch=args.warmup + args.steps,
                        callbacks=[Times()], verbose=0)
    result = _rate(args, task, cfg, ends[args.warmup - 1], ends[-1], loss=float(history.history["loss"][-1]))
    result["parameters"] = int(sum(v.shape.num_elements() for v in model.trainable_variables))
    result["model"] = f"{type(model).__name__} {model.name}"
    return result


def run_model_garden(args) -> dict:
    """tf-models-official's base_trainer.Trainer under orbit.Controller."""
    import orbit
    from official.core import base_task, base_trainer, config_definitions

    task, cfg = model_config(args)
    model, optimizer = _baseline_model(task, cfg, args, args.precision, model_garden_model)
    to_xyw, keras_loss = keras_adapter(task, cfg)

    class BenchTask(base_task.Task):
        def build_model(self):
            return model

        def build_inputs(self, params, input_context=None):
            return _baseline_dataset(task, cfg, args).map(lambda x, y, w: (x, (y, w)))

        def build_losses(self, labels, model_outputs, aux_losses=None):
            y, w = labels
            return keras_loss(y, model_outputs, sample_weight=w)

    config = config_definitions.ExperimentConfig(
        task=config_definitions.TaskConfig(),
        trainer=config_definitions.TrainerConfig(train_tf_while_loop=True, train_tf_function=True,
                                                 steps_per_loop=args.steps_per_loop),
    )
    bench_task = BenchTask(config.task)
    trainer = base_trainer.Trainer(config, bench_task, model=model, optimizer=optimizer, train=True,
                                   evaluate=False, train_dataset=bench_task.build_inputs(None))
    controller = orbit.Controller(trainer=trainer, global_step=trainer.global_step,
                                  steps_per_loop=args.steps_per_loop)
    logs = []
    loop_end = trainer.train_loop_end
    trainer.train_loop_end = lambda: logs.append(loop_end()) or logs[-1]
    controller.train(steps=args.warmup)
    start = time.perf_counter()
    controller.train(steps=args.warmup + args.steps)
    end = time.perf_counter()
    loss = float(logs[-1]["training_loss"]) if logs and "training_loss" in logs[-1] else None
    result = _rate(args, task, cfg, start, end, loss=loss)
    result["parameters"] = int(sum(v.shape.num_elements() for v in model.trainable_variables))
    return result


def run_tfpod(args) -> dict:
    """tfpod's Trainer and Controller on the mesh; the rate from metrics.jsonl records after the warm-up."""
    from tfpod import runtime

    runtime.initialize(cpu_devices=args.cpu_devices, device_type=None if args.device else "CPU")
    from tfpod import api, controller, mesh as meshlib, partitioning
    from tfpod.input.common import ShardInfo

    task, cfg = model_config(args)
    mesh = meshlib.make_mesh(args.mesh)
    rules = {k: (None if v.lower() == "none" else v) for k, v in (r.split("=") for r in args.rules.split(",") if r)}
    placement = partitioning.Placement.from_config(partitioning.ShardingConfig(preset=args.preset, rules=rules),
                                                   task.default_preset, mesh, check=False)
    train_cfg = controller.TrainConfig(
        steps=args.warmup + args.steps, global_batch_size=args.global_batch, seed=0,
        steps_per_loop=args.steps_per_loop, log_every=args.steps_per_loop, checkpoint_every=10**9,
        synthetic_data=True, precision=args.precision, peak_flops=1.0,  # MFU is computed here, not by the trainer
    )
    with tempfile.TemporaryDirectory() as model_dir:
        run = api.controller(task, cfg, train_cfg, optimizer_config(args), placement, model_dir)
        # the final checkpoint is not part of the rate
        run.checkpoints.save = lambda **kwargs: None
        run.checkpoints.check_finite = lambda: None
        feed = None
        if args.worker == "tfpod_real_input":  # the task's real pipeline on its default (prepared) demo data
            info = run.info
            task_input = task.make_input(task.data_config_class(), cfg, ShardInfo(info.client_id, info.num_clients), 0)
            feed = run.dataset_feed(task_input)
        out = run.train(feed)
        if not run.is_chief:  # host 0 alone writes metrics.jsonl
            return {"host": run.info.client_id, "traces": run.trainer.traces}
        records = [json.loads(line) for line in open(os.path.join(model_dir, "metrics.jsonl"))]
    times = {r["step"]: r["time"] for r in records if r["kind"] == "train"}
    result = _rate(args, task, cfg, times[args.warmup], times[args.warmup + args.steps], loss=out["losses"][-1])
    result["traces"] = run.trainer.traces
    result["parameters"] = int(sum(v.shape.num_elements() for v in run.trainer.model.trainable_variables))
    return result


def run_peak(args) -> dict:
    from tfpod import flops

    return {dtype: flops.peak_matmul_flops(dtype) for dtype in ("float32", "bfloat16")}


def _rate(args, task, cfg, start: float, end: float, loss: float | None) -> dict:
    units = args.steps * args.global_batch * units_per_example(task, cfg)
    per_sec = units / (end - start)
    return {"tokens_per_sec": per_sec, "step_time_s": (end - start) / args.steps, "loss": loss,
            "model_flops_per_sec": per_sec * task.flops_per_token(cfg)}


def worker(args) -> dict:
    if args.worker == "peak":
        return run_peak(args)
    if args.worker.startswith("tfpod"):
        return run_tfpod(args)
    import tfpod  # noqa: F401  (selects tf_keras before TensorFlow loads)

    if args.worker == "model_garden":
        return run_model_garden(args)
    if args.worker.startswith("keras_hub"):
        task, cfg = model_config(args)
        out = plain_models.run_keras_hub(args, task, cfg, host_batches(task, cfg, args.global_batch,
                                                                       args.warmup + args.steps))
        return {**_rate(args, task, cfg, out.pop("start"), out.pop("end"), out.pop("loss")), **out}
    return run_keras_fit(args, plain=args.worker.startswith("keras_fit"))


def run(name: str, args) -> dict:
    """One measurement in a fresh process; its JSON, or {"error": its last line}."""
    precision = "mixed_bfloat16" if name.endswith("_bf16") else "float32"
    python = args.keras_hub_python if name.startswith("keras_hub") and args.keras_hub_python else sys.executable
    cmd = [python, os.path.abspath(__file__), f"--worker={name}", f"--precision={precision}"] + [
        f"--{k}={v}" for k, v in vars(args).items()
        if k not in ("worker", "precision", "runs", "verbose", "device", "repeats", "keras_hub_python") and v is not None
    ] + (["--device"] if args.device else [])
    result = run_worker(cmd, "train_throughput", name, ROOT, args.verbose)
    if "error" in result:
        return result
    summary = (f"{result['tokens_per_sec']:,.1f}/s" if "tokens_per_sec" in result else
               ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in result.items() if k != "process_wall_s"))
    print(f"[train_throughput] {name}: {summary} ({result['process_wall_s']:.0f} s)", file=sys.stderr, flush=True)
    return result


def summarize(args, runs: dict) -> dict:
    def rate(name):
        return runs.get(name, {}).get("tokens_per_sec")

    def ratio(a, b):
        return a / b if a and b else None

    peak = runs.get("peak", {})
    fp32, bf16 = peak.get("float32"), peak.get("bfloat16")
    mfu = lambda name, p: ratio(runs.get(name, {}).get("model_flops_per_sec"), p)
    return {
        "model": args.model, "global_batch": args.global_batch, "seq_len": args.seq_len,
        "num_layers": args.num_layers, "mesh": args.mesh, "warmup": args.warmup, "steps": args.steps,
        "steps_per_loop": args.steps_per_loop,
        "units": "images" if args.model == "resnet50" else "tokens",
        "tokens_per_sec": rate("tfpod"),
        "keras_fit_tokens_per_sec": rate("keras_fit"), "vs_keras_fit": ratio(rate("tfpod"), rate("keras_fit")),
        "keras_fit_same_model_tokens_per_sec": rate("keras_fit_same_model"),
        "vs_keras_fit_same_model": ratio(rate("tfpod"), rate("keras_fit_same_model")),
        "model_garden_tokens_per_sec": rate("model_garden"),
        "vs_model_garden": ratio(rate("tfpod"), rate("model_garden")),
        "bf16_tokens_per_sec": rate("tfpod_bf16"),
        "vs_keras_fit_bf16": ratio(rate("tfpod_bf16"), rate("keras_fit_bf16")),
        "keras_hub_tokens_per_sec": rate("keras_hub"), "vs_keras_hub": ratio(rate("tfpod"), rate("keras_hub")),
        "vs_keras_hub_bf16": ratio(rate("tfpod_bf16"), rate("keras_hub_bf16")),
        "real_input_tokens_per_sec": rate("tfpod_real_input"),
        "real_vs_synthetic": ratio(rate("tfpod_real_input"), rate("tfpod")),
        "mfu_fp32": mfu("tfpod", fp32), "mfu_bf16": mfu("tfpod_bf16", bf16),
        "peak_fp32_flops": fp32, "peak_bf16_flops": bf16,
        "runs": runs,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=tuple(MODELS), default="gpt_small")
    p.add_argument("--global_batch", type=int)
    p.add_argument("--seq_len", type=int)
    p.add_argument("--num_layers", type=int, help="override the model's layer count (quick runs)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first call compiles)")
    p.add_argument("--steps", type=int, default=4, help="timed steps")
    p.add_argument("--steps_per_loop", type=int, default=2, help="tfpod and Orbit: steps per host call")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    p.add_argument("--mesh", default="data:1", help="tfpod's mesh")
    p.add_argument("--preset", default="data", help="tfpod's sharding preset")
    p.add_argument("--rules", default="", help="tfpod's rules overrides: logical=mesh_axis|none,...")
    p.add_argument("--cpu_devices", type=int, default=1, help="logical CPU devices for tfpod")
    p.add_argument("--device", action="store_true", help="tfpod on the machine's accelerator instead of the CPU")
    p.add_argument("--precision", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=RUNS, help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=1,
                   help="run the list this many times in rotation; each figure is its run's fastest")
    p.add_argument("--verbose", action="store_true", help="show each run's log")
    p.add_argument("--keras_hub_python", help="the Python with keras_hub installed (default: this one)")
    p.add_argument("--learning_rate", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    spec = MODELS[args.model]
    args.global_batch = args.global_batch or spec["batch"]
    args.seq_len = args.seq_len or spec["seq_len"]
    args.learning_rate = spec["optimizer"]["learning_rate"]
    if args.warmup < 1 or args.steps < 1 or args.warmup % args.steps_per_loop or args.steps % args.steps_per_loop:
        p.error(f"--warmup={args.warmup} and --steps={args.steps} must be positive multiples of "
                f"--steps_per_loop={args.steps_per_loop}")
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0
    names = [n for n in args.runs.split(",") if n]
    trials = rotate(names, RUNS, args.repeats, lambda name: run(name, args), p.error)
    print(json.dumps(summarize(args, {name: best(results) for name, results in trials.items()})), flush=True)
    return 1 if any("error" in r for results in trials.values() for r in results) else 0


def best(results: list[dict]) -> dict:
    """The fastest of a run's repeats (the peak: each dtype's best), with every repeat's rate."""
    ok = [r for r in results if "error" not in r]
    if ok and "tokens_per_sec" not in ok[0]:  # the peak
        return {k: max(r[k] for r in ok) for k in ("float32", "bfloat16")}
    return workers.best(results, "tokens_per_sec")


if __name__ == "__main__":
    sys.exit(main())
