"""The run API: what main.py runs, for tests, notebooks and other programs to call.

    import tfpod
    tfpod.run(["gin/lm_tiny.gin"], ["train.steps=20"], "runs/demo", mode="train", mesh_spec="data:4,model:2")

`run` parses the gin config (tfpod.config), builds and checks every config before
anything is written, and calls the mode's function in MODES with the configs and the
run's options. A mode is a function (configs, model_dir, options) -> result dict; add
one to MODES and main.py's --mode accepts it.

`start` (the runtime, the mesh and the placement) and `controller` (a Trainer and its
Controller) are the pieces the train and eval modes share, and what tests and
benchmarks build runs from.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable

from tfpod import UserError, config

log = logging.getLogger("tfpod")


@dataclasses.dataclass
class RunConfigs:
    """Every config of a run, built and validated from the parsed gin config."""

    task: object  # tfpod.task.Task
    experiment: config.ExperimentConfig
    model: object
    data: object
    train: object  # controller.TrainConfig
    optimizer: object  # optimizers.OptimizerConfig
    sharding: object  # partitioning.ShardingConfig
    lora: object = None  # lora.LoraConfig with adapters on (the task is then lora.adapt's), else None
    attention: object = None  # attention.AttentionConfig: what the run's models attend with (None: the defaults)


@dataclasses.dataclass
class RunOptions:
    """What main.py's flags give a run besides the gin config.

    Attributes:
      mesh_spec: e.g. "data:-1,model:2" (None: experiment.mesh).
      mesh: a dtensor.Mesh the caller built, instead of mesh_spec (one host; e.g. over some
        of its devices, as the tests run what needs no sharding on one device).
      cpu_devices: split the host CPU into this many logical devices.
      device_type: TPU, GPU or CPU (None: auto-detect).
      checkpoint: eval and export: the checkpoint to use (None: the newest complete one).
      model_name: export: TF Serving's name for the model (None: the task's).
      plan_device: plan: the device to plan for (tfpod.plan.devices; None: cpu, measured).
      plan_num_devices: plan: the job's devices (None: one host's).
      plan_devices_per_host: plan: devices per host (None: the device's usual).
      actions: train and train_and_eval: the run's own actions after each call of the
        compiled loop (tfpod.actions.Action), besides the built-in ones.
    """

    mesh_spec: str | None = None
    mesh: Any = None
    cpu_devices: int | None = None
    device_type: str | None = None
    checkpoint: str | None = None
    model_name: str | None = None
    plan_device: str | None = None
    plan_num_devices: int | None = None
    plan_devices_per_host: int | None = None
    actions: tuple = ()


def build_run_configs() -> RunConfigs:
    """Builds every config (each value checked: types, ranges, choices) from the parsed gin config."""
    task, model, data = config.build_task_configs()
    return RunConfigs(task=task, experiment=config.build_config("experiment"), model=model, data=data,
                      train=config.build_config("train"), optimizer=config.build_config("optimizer"),
                      sharding=config.build_config("sharding"), lora=task.lora,
                      attention=config.build_config("attention"))


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
class Session:
    """A started run: the runtime, the mesh and placement, and this host's input (None: synthetic)."""

    info: object  # runtime.RuntimeInfo
    placement: object  # partitioning.Placement
    task_input: object | None  # input.common.TaskInput
    claim: object | None = None  # run_folder.Claim: this job's hold on model_dir (writing modes)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        if self.claim is not None:
            self.claim.release()


def start(c: RunConfigs, options: RunOptions, model_dir: str = "", claim: bool = False) -> Session:
    """Starts the runtime, makes the mesh and placement (a mesh axis nothing uses is an error),
    and this host's input (the default demo data is prepared here on first use).

    With `claim` (modes that write model_dir) the job first takes model_dir
    (tfpod.run_folder: a folder a live run holds is refused); used as a context manager,
    the Session gives it back at the end.

    `--mesh=auto` (or sharding.preset='auto') asks the planner for the layout: it is
    applied to `c` in place (tfpod.plan.choose_for_run) and kept in model_dir/plan.json.
    """
    from tfpod import mesh as meshlib, partitioning, run_folder, runtime
    from tfpod.input.common import ShardInfo

    info = runtime.initialize(cpu_devices=options.cpu_devices, device_type=options.device_type)
    held = run_folder.take(model_dir, info.client_id, info.num_clients, meshlib.host_max) if claim else None
    try:
        if options.mesh is not None:
            meshes = [_given_mesh(options, info)]
        else:
            spec = options.mesh_spec or c.experiment.mesh
            if spec == "auto" or c.sharding.preset == "auto":
                from tfpod import plan

                spec = plan.choose_for_run(c, spec, info, model_dir)
            meshes = meshlib.make_stage_meshes(spec)
        placement = partitioning.Placement.from_config(c.sharding, c.task.default_preset, meshes,
                                                       attention=c.attention)
        task_input = None
        if not c.train.synthetic_data:
            task_input = c.task.make_input(c.data, c.model, ShardInfo(info.client_id, info.num_clients), c.train.seed)
    except BaseException:
        if held is not None:
            held.release()
        raise
    return Session(info, placement, task_input, held)


def _given_mesh(options: RunOptions, info):
    """RunOptions.mesh, checked: a dtensor.Mesh on one host, and no mesh_spec beside it."""
    from tensorflow.experimental import dtensor

    if not isinstance(options.mesh, dtensor.Mesh):
        raise UserError(f"RunOptions.mesh: a dtensor.Mesh, not {type(options.mesh).__name__}; or give mesh_spec")
    if options.mesh_spec:
        raise UserError(f"RunOptions: mesh_spec={options.mesh_spec!r} and a mesh given; give one of them")
    if info.num_clients > 1:
        raise UserError("RunOptions.mesh is for one host; a job of several hosts gives mesh_spec")
    return options.mesh


def controller(task, model_config, train_config, optimizer_config, placement, model_dir: str, data_config=None,
               schedule: str = "gpipe", actions=()):
    """A Trainer (the model and optimizer on the mesh, the compiled steps) and its Controller
    (`data_config`: the task's, for its host-side eval metrics; `schedule`: a pipeline's;
    `actions`: the run's own, tfpod.actions.Action)."""
    from tfpod import attention
    from tfpod.controller import Controller
    from tfpod.partitioning import check_microbatches
    from tfpod.models import TASKS
    from tfpod.trainer import Trainer

    placement.preset.check_run(task, placement, TASKS)  # image rows, stages
    if placement.stages:
        from tfpod.pipeline import check_pipelines

        check_pipelines(task, ", ".join(sorted(n for n, t in TASKS.items() if t.pipelines)))
    if train_config.microbatches > 1:
        axis = placement.batch_axis(tuple(next(iter(task.batch_axes().values()))))
        check_microbatches(train_config.global_batch_size, placement.mesh.dim_size(axis) if axis else 1,
                           train_config.microbatches)
    with attention.using(placement.attention):  # the model's build traces it as its steps will
        trainer = Trainer(task, model_config, optimizer_config, placement, total_steps=train_config.steps,
                          steps_per_loop=train_config.steps_per_loop, precision=train_config.precision,
                          seed=train_config.seed, data_config=data_config, microbatches=train_config.microbatches,
                          schedule=schedule)
    return Controller(trainer, train_config, model_dir, actions)


def _check_eval_data(c: RunConfigs, session: Session, mode: str) -> None:
    if session.task_input is None or session.task_input.eval is None:
        raise UserError(f"--mode={mode} needs eval data: set {c.task.data_name}.eval_files (the default demo data has "
                        "an eval split; train.synthetic_data=True has none)")


def _eval_batches(session: Session, host_rows: int) -> list:
    return [{k: v.numpy() for k, v in b.items()} for b in session.task_input.eval(host_rows)]


def train(c: RunConfigs, model_dir: str, options: RunOptions, evaluating: bool = False) -> dict:
    """--mode=train (and train_and_eval): trains from the newest checkpoint to train.steps.

    config.gin (the operative config) and layouts.txt are written, atomically, once the
    first call of the compiled loop has trained: a run that stops before leaves the
    record of an earlier run in model_dir as it was.
    """
    check_writable(model_dir)
    with start(c, options, model_dir, claim=True) as session:  # a folder another live run holds is refused
        run = controller(c.task, c.model, c.train, c.optimizer, session.placement, model_dir, c.data,
                         c.sharding.pipeline_schedule, options.actions)
        run.restore()  # a checkpoint that does not fit stops the run here
        eval_batches = None
        if evaluating:
            _check_eval_data(c, session, "train_and_eval")
            if not c.train.eval_every:
                raise UserError("--mode=train_and_eval needs train.eval_every > 0: the steps between evaluations")
            eval_batches = _eval_batches(session, run.host_rows)
        feed = run.dataset_feed(session.task_input) if session.task_input is not None else None
        return run.train(feed, eval_batches=eval_batches, run_files={"config.gin": config.operative_config()})


def train_and_eval(c: RunConfigs, model_dir: str, options: RunOptions) -> dict:
    """--mode=train_and_eval: training with a full evaluation every train.eval_every steps and
    a stop at train.target_metric / target_value."""
    return train(c, model_dir, options, evaluating=True)


def evaluate(c: RunConfigs, model_dir: str, options: RunOptions) -> dict:
    """--mode=eval: the newest (or a given) checkpoint, on any mesh, over the whole eval split."""
    session = start(c, options, model_dir)
    _check_eval_data(c, session, "eval")
    if not os.path.isdir(os.path.join(model_dir, "checkpoints")):
        raise UserError(f"--mode=eval: no checkpoints in {model_dir}: train there first, or pass --model_dir of a "
                        "trained run")
    # (storage's checkpoints only: a live run's in-memory snapshots are its own, tfpod.memory_checkpoint)
    train_config = dataclasses.replace(c.train, memory_checkpoint_every=0)
    run = controller(c.task, c.model, train_config, c.optimizer, session.placement, model_dir, c.data)
    step = run.checkpoints.restore(options.checkpoint) if options.checkpoint else run.checkpoints.restore_latest()
    if step is None:
        raise UserError(f"--mode=eval: no complete checkpoint in {model_dir}/checkpoints to evaluate")
    return run.evaluate(_eval_batches(session, run.host_rows), step)


def export(c: RunConfigs, model_dir: str, options: RunOptions) -> dict:
    """--mode=export: a SavedModel for TF Serving, from a plain single-device copy (no mesh, no runtime)."""
    from tfpod import export as export_lib

    check_writable(model_dir)
    return export_lib.export(c.task, c.model, c.data, model_dir, options.checkpoint, options.model_name,
                             c.attention)


def plan(c: RunConfigs, model_dir: str, options: RunOptions) -> dict:
    """--mode=plan: per-device memory, fit and step time on --plan_num_devices x --plan_device,
    before anything is allocated (no device is created); model_dir/plan.json (tfpod.plan)."""
    from tfpod import plan as planner, run_folder

    if options.mesh is not None:
        raise UserError("--mode=plan plans a mesh spec (mesh_spec), not a built mesh: give mesh_spec")
    check_writable(model_dir)
    with run_folder.take(model_dir):  # plan.json is not written beside a live run
        return planner.plan_mode(c, model_dir, options.mesh_spec or c.experiment.mesh, options.plan_device,
                                 options.plan_num_devices, options.plan_devices_per_host)


MODES: dict[str, Callable[[RunConfigs, str, RunOptions], dict]] = {
    "train": train, "eval": evaluate, "train_and_eval": train_and_eval, "export": export, "plan": plan,
}


def load_configs(gin_files: list[str], gin_params: list[str], model_dir: str) -> RunConfigs:
    """Parses the gin config and builds every config, each value checked (what `run` runs with).

    Args:
      gin_files: gin files, applied in order (tfpod's gin/ folder is searched too); none:
        model_dir/config.gin when it exists (the run's own config, e.g. an imported model's).
      gin_params: bindings applied after them, e.g. "train.steps=200".
      model_dir: the run's folder.
    """
    saved = os.path.join(model_dir, "config.gin")
    if not gin_files and os.path.isfile(saved):  # a run's own config (e.g. an imported model's): train on
        log.info("config: %s (no --gin_file given)", saved)
        try:
            config.parse_config([saved], gin_params)
        except UserError as e:
            try:
                config.parse_config([saved], [])  # the file alone: is it the file, or a --gin_param?
            except UserError:
                raise UserError(f"{saved} is damaged or not a valid config ({e}): restore it from a backup, or pass "
                                "the run's --gin_file(s) and --gin_param(s) again") from None
            raise e from None
    else:
        config.parse_config(gin_files, gin_params)
    return build_run_configs()


def run(gin_files: list[str], gin_params: list[str], model_dir: str, mode: str = "train",
        check: Callable[[RunConfigs, str, str, RunOptions], None] | None = None, **options) -> dict:
    """Parses the gin config, checks every config, and runs `mode` in model_dir.

    Args:
      gin_files: gin files, applied in order (tfpod's gin/ folder is searched too); none:
        model_dir/config.gin when it exists (the run's own config, e.g. an imported model's).
      gin_params: bindings applied after them, e.g. "train.steps=200".
      model_dir: the run's folder.
      mode: a key of MODES.
      check: called as check(configs, model_dir, mode, options) once the configs are built,
        before the mode runs (main.py's preflight, tfpod.doctor.preflight); raises UserError to stop.
      **options: RunOptions fields (mesh_spec or mesh, cpu_devices, device_type, checkpoint, model_name,
        actions: the run's own tfpod.actions.Action objects).

    Returns:
      The mode's result (train: {"step", "loss", "losses", "preempted"}; eval: the metrics).
    """
    from tfpod import goodput

    goodput.mark_launch()  # main.py marked the launch's start already
    if not model_dir:
        raise UserError("--model_dir is required: the folder for checkpoints, config.gin and metrics")
    if mode not in MODES:
        raise UserError(f"--mode={mode!r}: use one of {', '.join(MODES)}")
    configs = load_configs(gin_files, gin_params, model_dir)
    run_options = RunOptions(**options)
    if run_options.actions and mode not in ("train", "train_and_eval"):
        raise UserError(f"actions= run after the calls of training: --mode={mode} trains nothing; use mode='train' "
                        "or 'train_and_eval', or leave actions out")
    if check is not None:
        check(configs, model_dir, mode, run_options)
    return MODES[mode](configs, model_dir, run_options)
