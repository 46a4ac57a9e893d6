"""Import a Hugging Face folder into a tfpod run, and export a run as one.

Import builds the run exactly as training does (the mesh, the model and optimizer state
in their layouts, tfpod.api), writes each Hub tensor straight into its variables' layouts
(tfpod.partitioning.place: each device gets its piece of the one tensor in host memory),
saves a step-0 checkpoint and writes config.gin, so `main.py --model_dir=D` trains on.
Export reads a run's checkpoint into the single-device model that SavedModel export
uses (tfpod.export) and writes config.json and safetensors.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil

from tfpod import UserError, api, checkpoint, compat, config
from tfpod.convert import bert, gpt2, hub as hublib, llama
from tfpod.convert.params import Param

log = logging.getLogger("tfpod")

FAMILIES = {gpt2.MODEL_TYPE: gpt2, bert.MODEL_TYPE: bert, **{t: llama for t in llama.MODEL_TYPES}}
BASE_GIN = "run/base.gin"  # the run defaults every experiment includes (tfpod's gin/ folder)


def family_of(hub_config: dict):
    """The family module of a config.json (its model_type), and the architecture."""
    model_type = hub_config.get("model_type")
    if model_type not in FAMILIES:
        raise UserError(f"config.json: model_type={model_type!r} cannot be imported: tfpod reads "
                        f"{', '.join(sorted(FAMILIES))}")
    family = FAMILIES[model_type]
    architecture = (hub_config.get("architectures") or [family.ARCHITECTURES[0]])[0]
    if architecture not in family.ARCHITECTURES:
        raise UserError(f"config.json: architecture {architecture!r} cannot be imported: tfpod reads "
                        f"{', '.join(family.ARCHITECTURES)}")
    return family, architecture


def hub_name(folder: hublib.HubFolder, name: str, prefix: str) -> str | None:
    """Where a tensor is in the folder: its name, without the base model's prefix (a base
    model's file, e.g. BertModel's), or with an older layer norm spelling (gamma, beta)."""
    bare = name[len(prefix):] if name.startswith(prefix) else None
    candidates = [name, bare]
    if ".LayerNorm." in name:
        old = name.replace(".LayerNorm.weight", ".LayerNorm.gamma").replace(".LayerNorm.bias", ".LayerNorm.beta")
        candidates += [old, old[len(prefix):] if bare else None]
    return next((c for c in candidates if c and c in folder.names), None)


def match(folder: hublib.HubFolder, family, params: list[Param]) -> dict[str, str]:
    """{Param.hub: the folder's name}; one UserError naming missing or extra tensors."""
    found = {p.hub: hub_name(folder, p.hub, family.PREFIX) for p in params}
    missing = [name for name, there in found.items() if there is None]
    extra = sorted(n for n in folder.names - set(found.values()) if not family.skipped(n))
    show = lambda names: ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    if missing:
        raise UserError(f"--hf={folder.path}: {len(missing)} tensor(s) its config.json implies are missing "
                        f"({show(missing)}): is config.json from the same checkpoint?")
    if extra:
        raise UserError(f"--hf={folder.path}: {len(extra)} tensor(s) tfpod does not know ({show(extra)}): "
                        f"the checkpoint has parts this architecture lacks")
    return found


def gin_text(family, model_config, hub_config: dict, vocab: str | None) -> str:
    """config.gin of an imported model: the run defaults, the model, fine-tuning defaults."""
    origin = f"a Hugging Face {hub_config['model_type']}" if "model_type" in hub_config else "a Model Garden BERT"
    lines = [f"# Imported from {origin} checkpoint (python -m tfpod.convert import); train on with "
             "python main.py --model_dir=<this folder>.",
             f"include '{BASE_GIN}'", f"experiment.model = '{family.TASK}'"]
    for field in dataclasses.fields(model_config):
        lines.append(f"{family.TASK}.{field.name} = {getattr(model_config, field.name)!r}")
    lines += ["train.steps = 100", "train.global_batch_size = 8", "train.checkpoint_every = 100",
              "train.synthetic_data = False", "optimizer.learning_rate = 5e-05", "optimizer.warmup_steps = 10"]
    return "\n".join(lines + family.gin(model_config, hub_config, vocab)) + "\n"


def import_hub(hub_dir: str, model_dir: str, mesh_spec: str | None = None, cpu_devices: int | None = None,
               gin_params: tuple[str, ...] = ()) -> dict:
    """A Hugging Face folder -> model_dir/config.gin and a step-0 checkpoint in model_dir/checkpoints."""
    folder = hublib.HubFolder(hub_dir)
    family, architecture = family_of(folder.config)
    model_config = family.model_config(folder.config)
    params = family.params(model_config, architecture)
    found = match(folder, family, params)  # before anything is built or written

    def arrays():
        for p in params:
            yield from ((name, value, found[p.hub]) for name, value in zip(p.tfpod, p.to_tfpod(folder.read(found[p.hub]))))

    vocab = os.path.join(hub_dir, family.VOCAB_FILE) if family.VOCAB_FILE else None
    lower = _tokenizer_setting(hub_dir, "do_lower_case")
    bindings = tuple(gin_params) + ((f"bert_data.lower_case = {bool(lower)}",) if family is bert and lower is not None
                                    else ())
    return write_run(family, architecture, model_config, folder.config, arrays(), model_dir, mesh_spec, cpu_devices,
                     bindings, hub_dir, vocab if vocab and os.path.isfile(vocab) else None)


def _tokenizer_setting(hub_dir: str, key: str):
    """A value of the folder's tokenizer_config.json (None: no such file or key)."""
    path = os.path.join(hub_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get(key)


def write_run(family, architecture: str, model_config, source_config: dict, arrays, model_dir: str,
              mesh_spec: str | None, cpu_devices: int | None, gin_params, source: str, vocab: str | None) -> dict:
    """Builds the run on its mesh, fills it with `arrays` ((tfpod name, array, source tensor)
    each), saves a step-0 checkpoint and writes config.gin (and a copy of the model's vocabulary
    file `vocab`, the family's VOCAB_FILE, which its config.gin lines name).

    Returns:
      {"step": 0, "checkpoint", "tensors", "fresh": variables initialized fresh, "task"}.
    """
    for name in ("config.gin", "checkpoints"):
        if os.path.exists(os.path.join(model_dir, name)):
            raise UserError(f"--model_dir={model_dir} already holds {name}: import into a new folder (nothing "
                            "there is overwritten)")
    api.check_writable(model_dir)
    copied = os.path.abspath(os.path.join(model_dir, family.VOCAB_FILE)) if vocab else None
    text = gin_text(family, model_config, source_config, copied)
    # gin resolves an include only from a file: the run defaults as one, the rest as bindings
    config.parse_config([BASE_GIN], [line for line in text.splitlines() if not line.startswith("include ")]
                        + list(gin_params))
    c = api.build_run_configs()
    train = dataclasses.replace(c.train, synthetic_data=True)  # nothing is read while converting
    with api.start(dataclasses.replace(c, train=train), api.RunOptions(mesh_spec=mesh_spec, cpu_devices=cpu_devices),
                   model_dir, claim=True) as session:  # a folder a live run holds is refused
        if vocab:
            shutil.copy(vocab, copied)
        run = api.controller(c.task, c.model, train, c.optimizer, session.placement, model_dir, c.data,
                             c.sharding.pipeline_schedule)
        filled, fresh = _fill(run, arrays, family, architecture, source)
        path = run.checkpoints.save()
        checkpoint.write_atomically(os.path.join(model_dir, "config.gin"), text + "".join(f"{b}\n" for b in gin_params))
    log.info("imported %d tensors of %s into %s (step 0)", len(filled), source, path)
    return {"step": 0, "checkpoint": path, "tensors": len(filled), "fresh": fresh, "task": c.task.name}


def _fill(run, arrays, family, architecture: str, source: str) -> tuple[set, list]:
    """Assigns `arrays` to the run's weights in their layouts; (the names filled, those left fresh)."""
    variables = {w.name.split(":")[0]: compat.inner_variable(w) for w in run.trainer.model.weights}
    filled = set()
    for name, value, tensor in arrays:
        variable = variables.get(name)
        if variable is None:
            raise ValueError(f"{tensor} maps to {name}, which the model does not have")
        if tuple(value.shape) != tuple(variable.shape):
            raise UserError(f"{source}: tensor {tensor} gives {name} the shape {list(value.shape)}, but the model's "
                            f"config makes it {variable.shape.as_list()}")
        variable.assign(_placed(value.astype(variable.dtype.as_numpy_dtype), variable))
        filled.add(name)
    fresh = sorted(n for n in variables if n not in filled)
    unexpected = [n for n in fresh if not n.startswith(family.absent(architecture))]
    if unexpected:
        raise UserError(f"{source}: {len(unexpected)} weight(s) of the model are not in it ({', '.join(unexpected[:3])})")
    if fresh:
        log.info("%s has no %s: initialized fresh", architecture, ", ".join(sorted({n.rsplit('/', 1)[0] for n in fresh})))
    return filled, fresh


def _placed(value, variable):
    """value in the variable's layout (each device its own piece); a plain variable takes it whole."""
    from tfpod.partitioning import place

    layout = getattr(variable, "layout", None)
    return place(value, layout) if layout is not None else value


def exported_run(model_dir: str, out: str, flag: str, checkpoint_prefix: str | None = None, merge: bool = True):
    """(the run's configs, its Hugging Face family, the checkpoint, its single-device model) for
    an export into the new folder `out` (given by --`flag`); one UserError line when it cannot."""
    from tfpod import export as export_lib

    gin_path = os.path.join(model_dir, "config.gin")
    if not os.path.isfile(gin_path):
        raise UserError(f"--model_dir={model_dir} has no config.gin: pass the folder of a run tfpod trained or imported")
    if os.path.isdir(out) and os.listdir(out):
        raise UserError(f"--{flag}={out} exists and is not empty: export into a new folder (nothing there is "
                        "overwritten)")
    config.parse_config([gin_path], [])
    c = api.build_run_configs()
    family = next((f for f in FAMILIES.values() if f.TASK == c.task.name), None)
    if family is None:
        raise UserError(f"model {c.task.name!r} has no Hugging Face equivalent: export reads "
                        f"{', '.join(sorted({f.TASK for f in FAMILIES.values()}))}")
    path = export_lib.checkpoint_path(model_dir, checkpoint_prefix)
    return c, family, path, export_lib.single_device_model(c.task, c.model, path, merge)


def export_hub(model_dir: str, out: str, checkpoint_prefix: str | None = None) -> dict:
    """A run's checkpoint (the newest, or `checkpoint_prefix`) -> a Hugging Face folder `out`
    (a LoRA run's with its adapters merged)."""
    c, family, path, model = exported_run(model_dir, out, "hf", checkpoint_prefix)
    values = {w.name.split(":")[0]: w for w in model.weights}
    params = family.params(c.model, family.EXPORT_ARCHITECTURE)
    tensors = ((p.hub, p.to_hub(*[values[n].numpy() for n in p.tfpod])) for p in params)
    files = hublib.write_folder(out, family.hub_config(c.model, c.data), tensors)
    if family is bert and c.data.vocab_path and str(c.data.vocab_path).endswith(".txt"):
        shutil.copy(c.data.vocab_path, os.path.join(out, "vocab.txt"))
    log.info("exported %s (%d tensors) to %s", path, len(params), out)
    return {"checkpoint": path, "files": files, "tensors": len(params)}
