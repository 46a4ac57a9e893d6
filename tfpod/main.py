"""The command line: absl flags -> config (tfpod.config, gin) -> run.

    python main.py --gin_file=gin/lm_tiny.gin --model_dir=/tmp/run \
        [--gin_param=train.steps=200 ...] [--mode=train] [--mesh=data:4,model:2] [--cpu_devices=8]
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

import tfpod  # noqa: F401  (selects tf_keras before TensorFlow loads)
from absl import app, flags

from tfpod import UserError, config

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


@dataclasses.dataclass
class RunConfigs:
    """Every config of a run, built and validated from the parsed gin config."""

    task: object
    experiment: config.ExperimentConfig
    model: object
    data: object
    train: object
    optimizer: object
    sharding: object


def build_run_configs() -> RunConfigs:
    """Builds every config (each value checked: types, ranges, choices) before anything is written."""
    experiment = config.build_config("experiment")
    from tfpod.models import get_task

    task = get_task(experiment.model)
    return RunConfigs(task=task, experiment=experiment, model=config.build_config(task.NAME),
                      data=config.build_config(task.DATA), train=config.build_config("train"),
                      optimizer=config.build_config("optimizer"), sharding=config.build_config("sharding"))


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
    """Parses the config, starts the runtime and runs `mode`. Returns the mode's result.

    Nothing is written to model_dir until the config is valid; config.gin and
    layouts.txt are written (atomically) only once training has started, so a run that
    stops before that leaves an earlier run's record as it was.
    """
    if not model_dir:
        raise UserError("--model_dir is required: the folder for checkpoints, config.gin and metrics")
    config.parse_config(gin_files, gin_params)
    c = build_run_configs()
    task = c.task
    if mode != "eval":
        check_writable(model_dir)
    if mode == "export":  # a plain single-device copy: no mesh, no runtime
        from tfpod import export

        return export.export(task, c.model, c.data, model_dir, checkpoint, model_name)
    placement = c.sharding.trainer_args(task.DEFAULT_PRESET)

    from tfpod import mesh as meshlib, runtime, sharding, trainer

    info = runtime.initialize(cpu_devices=cpu_devices, device_type=device_type)
    mesh = meshlib.make_mesh(mesh_spec or c.experiment.mesh)
    sharding.check_mesh_axes(mesh, placement["table"], (placement["update_axis"], placement["gather_axis"]),
                             preset=c.sharding.preset or task.DEFAULT_PRESET,
                             fix=f"map a logical axis to it with sharding.rules (e.g. {{'mlp': '<axis>'}})")
    task_input = None
    if not c.train.synthetic_data:  # the default demo data is prepared here on first use
        task_input = task.make_input(c.data, c.model, info.num_clients, info.client_id, c.train.seed)
    if mode == "eval":
        return _evaluate(task, c.model, c.train, c.optimizer, mesh, placement, model_dir, checkpoint, task_input)
    t = trainer.Trainer(task, c.model, c.train, c.optimizer, mesh, model_dir=model_dir, **placement)
    if task_input is not None:
        t.corrupt_finder = task_input.find_corrupt
    t.restore()  # a checkpoint that does not fit stops the run here
    eval_batches = None
    if mode == "train_and_eval":
        if task_input is None or task_input.eval is None:
            raise UserError(f"--mode=train_and_eval needs eval data: set {task.DATA}.eval_files "
                            "(train.synthetic_data=True has none)")
        if not c.train.eval_every:
            raise UserError("--mode=train_and_eval needs train.eval_every > 0: the steps between evaluations")
        eval_batches = [{k: v.numpy() for k, v in b.items()} for b in task_input.eval(t.host_rows)]
    return t.train(task_input.train if task_input else None,
                   checkpointable_input=task_input.checkpointable if task_input else True, eval_batches=eval_batches,
                   run_files={"config.gin": config.operative_config()},
                   input_source=task_input.source if task_input else None)


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
    from tfpod import preemption

    preemption.catch_sigterm()  # first, before TensorFlow loads: a preemption notice at any point ends with status 0
    setup_logging(verbose=FLAGS.verbosity >= 1)
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
