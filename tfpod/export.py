"""SavedModel export for TF Serving: a trained checkpoint -> model_dir/export/<name>/<version>/.

    python main.py --gin_file=gin/lm_tiny.gin --model_dir=runs/lm_tiny --mode=export
    tfpod.export.saved_model("runs/lm_tiny")           # from Python: the run's own config.gin

A SavedModel keeps no DTensor layouts, so the export is a plain single-device copy of the
model: the task's model is built without a mesh and the checkpoint is read into it. A
checkpoint holds every variable whole (each host wrote its shards with their slice of
the full shape), so whatever mesh and host count trained it, the restore gathers it;
optimizer state is left out.

The serving graph is the task's `serving(model, model_config, data_config)`: signatures
whose first dimension (the batch) is dynamic and whose inputs are what a client has: raw
strings for the text models (the tensorflow-text tokenizer is inside the graph), JPEG
bytes for the image model; the LM and BERT also have `ids`, on int32 token ids
[batch, length], for clients that tokenize themselves (trained without a SentencePiece
vocabulary, `ids` is their only signature, also as serving_default). Loading the export
needs only tensorflow and tensorflow_text (for the tokenizer ops).

Versions are integers, a new one per export (the highest present + 1): TF Serving's
model server watches `export/<name>/` and serves the newest. Each version is written to
a temporary folder and renamed into place when complete, so the server never sees a
partial one and an earlier version is never touched.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile

import tensorflow as tf

from tfpod import UserError, attention
from tfpod.checkpoint import read_weights, scan
from tfpod.train_state import TrainState

log = logging.getLogger("tfpod")


def checkpoint_path(model_dir: str, checkpoint: str | None = None) -> str:
    """The checkpoint to export: the given prefix, or the newest complete one in model_dir."""
    if checkpoint:
        if not tf.io.gfile.exists(checkpoint + ".index"):
            raise UserError(f"--checkpoint={checkpoint}: no such checkpoint (expected {checkpoint}.index)")
        return checkpoint
    directory = os.path.join(model_dir, "checkpoints")
    steps, damaged = scan(directory)
    newer = [s for s in damaged if s > max(steps, default=-1)]
    if newer:
        log.warning("checkpoint %s is damaged (its data shards are missing or come from different writes): not "
                    "exported; a training rerun in %s moves it aside", os.path.join(directory, f"ckpt-{newer[-1]}"),
                    model_dir)
    if not steps:
        raise UserError(f"--mode=export: no complete checkpoint in {directory}: train there first, "
                        "or pass --model_dir of a trained run")
    return os.path.join(directory, f"ckpt-{steps[-1]}")


def built(task, model_config):
    """The task's model built without a mesh (its variables made, initialized)."""
    model = task.build(model_config)
    example = {k: tf.zeros([1] + list(s.shape[1:]), s.dtype) for k, s in task.input_signature(model_config).items()}
    model(task.model_inputs(example), training=False)  # creates the variables
    return model


def single_device_model(task, model_config, path: str, merge: bool = True):
    """The task's model built without a mesh, every weight read whole from checkpoint `path`;
    with LoRA adapters (tfpod.lora), the base task's model with them merged into its weights
    (`merge`; else the model with its adapters), read from their run's base and checkpoint."""
    from tfpod import lora

    model = built(task, model_config)
    state = TrainState(None, model)
    if task.lora is not None:  # a run on a base checkpoint (its record in the run folder) saved its adapters alone
        state.base = lora.recorded_base(os.path.dirname(os.path.dirname(os.path.abspath(path))))
        state.saved = lora.saved_weights(model) if state.base is not None else None
    read_weights(state, path, f"checkpoint {path}", "export with the gin config it was trained with")
    if task.lora is not None and merge:

        return lora.merged(model, built(task.base_task, model_config), task.lora)
    return model


def next_version(base: str) -> int:
    """1 + the highest integer version folder under base (1 when there is none)."""
    versions = [int(d) for d in (os.listdir(base) if os.path.isdir(base) else []) if re.fullmatch(r"\d+", d)]
    return max(versions, default=0) + 1


def write(module: tf.Module, signatures: dict, base: str) -> str:
    """Saves `module` with `signatures` as the next version under base; returns its folder.

    The SavedModel serves: it holds the signatures and what they read (`_serving_objects`),
    not Keras's own SavedModel form of each layer (tf_keras traces every layer's call for
    it: 6-10 s of a small MoE's export, against 1 s without), and no custom gradient
    functions (TensorFlow traces one per `tf.custom_gradient`, a third of the rest);
    training goes on from checkpoints."""
    os.makedirs(base, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".partial-", dir=base)
    try:
        tf.saved_model.save(_serving_objects(module), tmp, signatures=signatures,
                            options=tf.saved_model.SaveOptions(experimental_custom_gradients=False))
        while True:  # another export may take a version number between our check and rename
            final = os.path.join(base, str(next_version(base)))
            try:
                os.rename(tmp, final)
                return final
            except OSError:
                if not os.path.exists(final):
                    raise
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _serving_objects(module: tf.Module) -> tf.Module:
    """`module` with each Keras layer or model it holds replaced by that layer's variables
    (the signatures capture them; a SavedModel must track what its functions capture)."""
    import tf_keras

    objects = tf.Module()
    for name, value in vars(module).items():
        if not name.startswith("_"):
            setattr(objects, name, list(value.variables) if isinstance(value, tf_keras.layers.Layer) else value)
    return objects


def _input_specs(fn) -> dict:
    """{input name: TensorSpec} of a concrete function (positional specs by their names)."""
    args, kwargs = fn.structured_input_signature
    return {**{s.name: s for s in args}, **kwargs}


def export(task, model_config, data_config, model_dir: str, checkpoint: str | None = None,
           model_name: str | None = None, attention_config=None) -> dict:
    """Exports a checkpoint of model_dir as a SavedModel for TF Serving.

    Args:
      task: the task (tfpod.task.Task).
      model_config, data_config: the configs the run was trained with (the data config
        gives the tokenizer).
      model_dir: the run's folder.
      checkpoint: a checkpoint prefix; None: the newest complete one.
      model_name: the name TF Serving serves it under (default: the task's name).
      attention_config: what the signatures attend with (tfpod.attention.AttentionConfig,
        the run's gin `attention.*`; None: the defaults), the context they are traced in.

    Returns:
      {"export_dir", "version", "step", "signatures": {name: {"inputs", "outputs"}}}.
    """
    if not task.serves:
        raise UserError(f"model {task.name!r} has no serving signatures (Task.serving): it trains and evaluates, "
                        f"but --mode=export is not available for it")
    path = checkpoint_path(model_dir, checkpoint)
    base = os.path.join(model_dir, "export", model_name or task.name)
    with attention.using(attention_config):  # (the signatures are traced here and in `write`)
        model = single_device_model(task, model_config, path)
        module, signatures = task.serving(model, model_config, data_config)
        final = write(module, signatures, base)
    described = {
        name: {"inputs": {k: f"{s.dtype.name}{s.shape}" for k, s in _input_specs(fn).items()},
               "outputs": {k: f"{s.dtype.name}{s.shape}" for k, s in fn.structured_outputs.items()}}
        for name, fn in signatures.items()
    }
    step = int(path.rsplit("-", 1)[1])
    default = signatures.get("serving_default")  # may be another signature under a second name (`ids`)
    same = [name for name, fn in sorted(signatures.items()) if fn is default and name != "serving_default"]
    listed = [f"{name} (= {same[0]})" if name == "serving_default" and same else name for name in sorted(described)]
    log.info("exported %s (step %d) to %s: signatures %s", path, step, final, ", ".join(listed))
    return {"export_dir": final, "version": int(os.path.basename(final)), "step": step, "signatures": described}


def saved_model(model_dir: str, checkpoint: str | None = None, model_name: str | None = None,
                gin_params: list[str] | None = None) -> dict:
    """Exports a run from Python, configured by the config.gin its training wrote.

    Args:
      model_dir: a trained run's folder (holds config.gin and checkpoints/).
      checkpoint: a checkpoint prefix; None: the newest complete one.
      model_name: TF Serving's name for it (default: the model's task name).
      gin_params: bindings applied after config.gin (e.g. a different lm_data.vocab_path).

    Returns:
      export()'s result.
    """
    from tfpod.config import build_config, build_task_configs, parse_config

    config = os.path.join(model_dir, "config.gin")
    if not os.path.exists(config):
        raise UserError(f"{config} does not exist: export a folder a tfpod run trained in, or use "
                        "main.py --mode=export with the run's gin files")
    parse_config([config], list(gin_params or ()))
    task, model_config, data_config = build_task_configs()
    return export(task, model_config, data_config, model_dir, checkpoint, model_name, build_config("attention"))
