"""The command line: absl flags -> gin -> run. The only module that knows gin.

    python main.py --gin_file=gin/lm_tiny.gin --model_dir=/tmp/run \
        [--gin_param=train.steps=200 ...] [--mode=train] [--mesh=data:4,model:2] [--cpu_devices=8]

Library classes become gin configurables here: `train.*` (TrainConfig),
`optimizer.*` (OptimizerConfig), `sharding.*` (ShardingConfig), `experiment.*`, and each
model's config under its name (`gpt.*`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

import tfpod  # noqa: F401  (selects tf_keras before TensorFlow loads)
import gin
from absl import app, flags

from tfpod import UserError

FLAGS = flags.FLAGS
MODES = ("train", "eval", "train_and_eval", "export")

flags.DEFINE_multi_string("gin_file", [], "gin config file(s), applied in order (gin/ is searched too)")
flags.DEFINE_multi_string("gin_param", [], "gin binding(s), e.g. train.steps=200; applied after the files")
flags.DEFINE_string("model_dir", None, "output directory: checkpoints, config.gin, layouts.txt, metrics.jsonl, events")
flags.DEFINE_enum("mode", "train", MODES, "what to do")
flags.DEFINE_string("mesh", None, "mesh spec, e.g. data:-1,model:2 (default: experiment.mesh)")
flags.DEFINE_integer("cpu_devices", None, "split the host CPU into this many logical devices")
flags.DEFINE_string("device_type", None, "TPU, GPU or CPU (default: auto-detect, in that order)")
flags.DEFINE_string("checkpoint", None,
                    "--mode=eval/export: checkpoint to evaluate or export, e.g. D/checkpoints/ckpt-40 (default: newest)")
flags.DEFINE_string("model_name", None, "--mode=export: the name TF Serving serves the model under (default: the model)")
flags.DEFINE_integer("num_hosts", None, "hosts in a multi-host job (default: $DTENSOR_NUM_CLIENTS, else 1)")
flags.DEFINE_integer("host_id", None, "this host's index (default: $DTENSOR_CLIENT_ID)")
flags.DEFINE_string("host_addresses", None, "host:port of every host, comma-separated, in host order ($DTENSOR_JOBS)")


@dataclasses.dataclass
class ExperimentConfig:
    """Which model and mesh. Attributes map 1:1 to gin `experiment.<name>`."""

    model: str = "gpt"
    mesh: str = "data:-1"


_CONFIGURABLES = {}


def _register():
    """Registers the library's config classes with gin (once per process)."""
    if _CONFIGURABLES:
        return _CONFIGURABLES
    from tfpod import optimizers, sharding, trainer
    from tfpod.models import TASKS

    _CONFIGURABLES["experiment"] = gin.external_configurable(ExperimentConfig, name="experiment")
    _CONFIGURABLES["train"] = gin.external_configurable(trainer.TrainConfig, name="train")
    _CONFIGURABLES["optimizer"] = gin.external_configurable(optimizers.OptimizerConfig, name="optimizer")
    _CONFIGURABLES["sharding"] = gin.external_configurable(sharding.ShardingConfig, name="sharding")
    for name, task in TASKS.items():
        _CONFIGURABLES[name] = gin.external_configurable(task.Config, name=name)
        if task.DATA not in _CONFIGURABLES:  # tasks may share one data config (gpt, moe: lm_data)
            _CONFIGURABLES[task.DATA] = gin.external_configurable(task.DataConfig, name=task.DATA)
    return _CONFIGURABLES


def gin_search_dirs() -> list[str]:
    """Folders holding tfpod's gin files: <checkout>/gin from a clone, tfpod/gin installed."""
    return [d for d in (os.path.join(p, "gin") for p in tfpod.__path__) if os.path.isdir(d)]


def resolve_gin_file(path: str) -> str:
    """The gin file a --gin_file names: as given, else under tfpod's gin folders."""
    if os.path.isfile(path):
        return path
    rel = path[len("gin/"):] if path.startswith("gin/") else path
    for d in gin_search_dirs():
        candidate = os.path.join(d, rel)
        if os.path.isfile(candidate):
            return candidate
    known = sorted(
        os.path.relpath(os.path.join(r, f), d)
        for d in gin_search_dirs() for r, _, fs in os.walk(d) for f in fs if f.endswith(".gin")
    )
    raise UserError(f"--gin_file={path}: no such file (here or in tfpod's gin/: {', '.join(known)})")


def parse_config(gin_files: list[str], gin_params: list[str]) -> None:
    """Clears gin and applies files then bindings; any gin error becomes one UserError line."""
    gin.clear_config()
    _register()
    for d in gin_search_dirs():
        gin.add_config_file_search_path(d)
        gin.add_config_file_search_path(os.path.dirname(d))
    files = [resolve_gin_file(f) for f in gin_files]
    from absl import logging as absl_logging

    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.FATAL)  # gin logs an ERROR for each include path it probes
    try:
        gin.parse_config_files_and_bindings(files, gin_params, finalize_config=False)
    except Exception as e:  # gin raises ValueError, KeyError, ImportError, SyntaxError...
        raise UserError(f"gin config: {_one_line(e)} (files: {', '.join(files) or 'none'}; params: {gin_params})") from None
    finally:
        absl_logging.set_verbosity(verbosity)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) < 400 else text[:400] + "..."


def _check_required(name: str) -> None:
    """gin files mark values every experiment must set as `%gin.REQUIRED`; say which is unset."""
    for field in (f.name for f in dataclasses.fields(_CONFIGURABLES[name])):
        try:
            value = gin.query_parameter(f"{name}.{field}")
        except ValueError:
            continue
        if str(value) == "%gin.REQUIRED":
            raise UserError(
                f"{name}.{field} is required and unset: bind it in your gin file or pass "
                f"--gin_param={name}.{field}=VALUE"
            )


def _build_config(name: str):
    _check_required(name)
    try:
        return _CONFIGURABLES[name]()
    except UserError as e:  # gin appends "In call to configurable ..." on a new line
        raise UserError(str(e).splitlines()[0]) from None
    except (TypeError, ValueError) as e:
        raise UserError(f"gin config for {name}.*: {_one_line(e)}") from None


def build_task_configs():
    """(task module, model config, data config) from the parsed gin config."""
    from tfpod.models import get_task

    task = get_task(_build_config("experiment").model)
    return task, _build_config(task.NAME), _build_config(task.DATA)


def setup_logging(verbose: bool = False) -> None:
    """tfpod's progress lines on stderr; other libraries' INFO chatter only when verbose."""
    from absl import logging as absl_logging

    if not verbose:
        absl_logging.set_verbosity(absl_logging.WARNING)
        logging.getLogger("tensorflow").setLevel(logging.WARNING)
    logger = logging.getLogger("tfpod")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)


def check_writable(model_dir: str) -> None:
    """Creates model_dir and writes a scratch file in it; one UserError line when it cannot."""
    probe = os.path.join(model_dir, f".tfpod-write-check-{os.getpid()}")
    try:
        os.makedirs(model_dir, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UserError(f"--model_dir={model_dir} cannot be written ({e.strerror or e}): pass a folder this "
                        "process may create and write, e.g. on a local or mounted disk") from None


def run(
    gin_files: list[str],
    gin_params: list[str],
    model_dir: str,
    mode: str = "train",
    mesh_spec: str | None = None,
    cpu_devices: int | None = None,
    device_type: str | None = None,
    checkpoint: str | None = None,
    model_name: str | None = None,
) -> dict:
    """Parses the config, starts the runtime and runs `mode`. Returns the mode's result."""
    if not model_dir:
        raise UserError("--model_dir is required: the folder for checkpoints, config.gin and metrics")
    parse_config(gin_files, gin_params)
    if mode != "eval":
        check_writable(model_dir)
    if mode == "export":  # a plain single-device copy: no mesh, no runtime
        from tfpod import export

        task, model_config, data_config = build_task_configs()
        return export.export(task, model_config, data_config, model_dir, checkpoint, model_name)
    experiment = _build_config("experiment")
    from tfpod.models import get_task

    task = get_task(experiment.model)
    model_config = _build_config(task.NAME)
    train_config = _build_config("train")
    opt_config = _build_config("optimizer")
    sharding_config = _build_config("sharding")
    placement = sharding_config.trainer_args(task.DEFAULT_PRESET)

    from tfpod import mesh as meshlib, runtime, sharding, trainer

    info = runtime.initialize(cpu_devices=cpu_devices, device_type=device_type)
    mesh = meshlib.make_mesh(mesh_spec or experiment.mesh)
    sharding.check_mesh_axes(mesh, placement["table"], (placement["update_axis"], placement["gather_axis"]),
                             preset=sharding_config.preset or task.DEFAULT_PRESET,
                             fix=f"map a logical axis to it with sharding.rules (e.g. {{'mlp': '<axis>'}})")
    task_input = None
    if not train_config.synthetic_data:  # the default demo data is prepared here on first use
        task_input = task.make_input(_build_config(task.DATA), model_config, info.num_clients, info.client_id,
                                     train_config.seed)
    if mode == "eval":
        return _evaluate(task, model_config, train_config, opt_config, mesh, placement, model_dir, checkpoint,
                         task_input)
    os.makedirs(model_dir, exist_ok=True)
    t = trainer.Trainer(task, model_config, train_config, opt_config, mesh, model_dir=model_dir, **placement)
    if task_input is not None:
        t.corrupt_finder = task_input.find_corrupt
    t.restore()  # a checkpoint that does not fit stops the run here, before config.gin is written
    if info.client_id == 0:
        with open(os.path.join(model_dir, "config.gin"), "w") as f:
            f.write(gin.operative_config_str())
    eval_batches = None
    if mode == "train_and_eval":
        if task_input is None or task_input.eval is None:
            raise UserError(f"--mode=train_and_eval needs eval data: set {task.DATA}.eval_files "
                            "(train.synthetic_data=True has none)")
        if not train_config.eval_every:
            raise UserError("--mode=train_and_eval needs train.eval_every > 0: the steps between evaluations")
        eval_batches = [{k: v.numpy() for k, v in b.items()} for b in task_input.eval(t.host_rows)]
    return t.train(task_input.train if task_input else None,
                   checkpointable_input=task_input.checkpointable if task_input else True, eval_batches=eval_batches)


def _evaluate(task, model_config, train_config, opt_config, mesh, placement, model_dir, checkpoint, task_input):
    """--mode=eval: the newest (or a given) checkpoint, on any mesh, over the whole eval split."""
    from tfpod import trainer

    if task_input is None or task_input.eval is None:
        raise UserError(f"--mode=eval needs eval data: set {task.DATA}.eval_files (the default demo data has an eval "
                        "split; train.synthetic_data=True has none)")
    if not os.path.isdir(os.path.join(model_dir, "checkpoints")):
        raise UserError(f"--mode=eval: no checkpoints in {model_dir}: train there first, or pass --model_dir of a trained run")
    t = trainer.Trainer(task, model_config, train_config, opt_config, mesh, model_dir=model_dir, **placement)
    step = t.checkpoints.restore(checkpoint) if checkpoint else t.checkpoints.restore_latest()
    if step is None:
        raise UserError(f"--mode=eval: no complete checkpoint in {model_dir}/checkpoints to evaluate")
    batches = [{k: v.numpy() for k, v in b.items()} for b in task_input.eval(t.host_rows)]
    return t.evaluate(batches, step)


def main(argv) -> None:
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}: pass settings as --flags or --gin_param", file=sys.stderr)
        sys.exit(2)
    setup_logging(verbose=FLAGS.verbosity >= 1)
    from tfpod import checkpoint

    checkpoint.catch_sigterm()  # a preemption notice at any point ends the run with status 0
    try:
        from tfpod import runtime

        runtime.configure_hosts(FLAGS.num_hosts, FLAGS.host_id, FLAGS.host_addresses)
        run(FLAGS.gin_file, FLAGS.gin_param, FLAGS.model_dir, FLAGS.mode, FLAGS.mesh, FLAGS.cpu_devices, FLAGS.device_type,
            FLAGS.checkpoint, FLAGS.model_name)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        if FLAGS.verbosity >= 1:
            raise
        sys.exit(1)


def console_main() -> None:
    """Entry point of the `tfpod` console script."""
    app.run(main)
