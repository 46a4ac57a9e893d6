"""The command line: absl flags -> config (tfpod.config, gin) -> the run (tfpod.api).

    python main.py --gin_file=gin/lm_tiny.gin --model_dir=/tmp/run \
        [--gin_param=train.steps=200 ...] [--mode=train] [--mesh=data:4,model:2] [--cpu_devices=8]

Also installed as the `tfpod` console script. A UserError is printed as one line
(`error: ...`) with exit status 1; `-v 1` adds the traceback and libraries' INFO logs.
"""

from __future__ import annotations

import gc
import sys

import tfpod  # noqa: F401  (selects tf_keras before TensorFlow loads)

# Importing TensorFlow makes some 360,000 lasting objects, which Python's default collector
# walks again and again: with runtime.settle_garbage_collector's thresholds from the first
# import, a process starts about 0.7 s sooner (of 5 s).
gc.set_threshold(*tfpod.GC_THRESHOLDS)

from absl import app, flags  # noqa: E402

from tfpod import UserError, api, console, doctor, goodput, preemption  # noqa: E402

FLAGS = flags.FLAGS

flags.DEFINE_multi_string("gin_file", [], "gin config file(s), applied in order (gin/ is searched too); none: "
                          "model_dir/config.gin if it exists (a run's own, e.g. an imported model's)")
flags.DEFINE_multi_string("gin_param", [], "gin binding(s), e.g. train.steps=200; applied after the files")
flags.DEFINE_string("model_dir", None, "output directory: checkpoints, config.gin, layouts.txt, metrics.jsonl, events")
flags.DEFINE_enum("mode", "train", list(api.MODES), "what to do")
flags.DEFINE_string("mesh", None, "mesh spec, e.g. data:-1,model:2 (default: experiment.mesh)")
flags.DEFINE_integer("cpu_devices", None, "split the host CPU into this many logical devices")
flags.DEFINE_string("device_type", None, "TPU, GPU or CPU (default: auto-detect, in that order)")
flags.DEFINE_string("checkpoint", None,
                    "--mode=eval/export: checkpoint to evaluate or export, e.g. D/checkpoints/ckpt-40 (default: newest)")
flags.DEFINE_string("model_name", None, "--mode=export: the name TF Serving serves the model under (default: the model)")
flags.DEFINE_string("plan_device", None, "--mode=plan: the device to plan for: h100, h200, a100-40g, a100-80g, "
                    "tpu-v4, tpu-v5p, or cpu (this machine, measured; the default)")
flags.DEFINE_integer("plan_num_devices", None, "--mode=plan: devices of the planned job (default: one host's)")
flags.DEFINE_integer("plan_devices_per_host", None, "--mode=plan: devices per host (default: the device's usual: "
                     "8 GPUs, 4 TPU chips, --cpu_devices or 8 logical CPU devices)")
flags.DEFINE_integer("num_hosts", None, "hosts in a multi-host job (default: $DTENSOR_NUM_CLIENTS, else 1)")
flags.DEFINE_integer("host_id", None, "this host's index (default: $DTENSOR_CLIENT_ID)")
flags.DEFINE_string("host_addresses", None, "host:port of every host, comma-separated, in host order ($DTENSOR_JOBS)")
flags.DEFINE_boolean("preflight", True, "train and eval: first the doctor's fast checks (tfpod.doctor: the build against "
                     "the device asked, devices and mesh, model_dir space, input files); --nopreflight skips them")


def main(argv) -> None:
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}: pass settings as --flags or --gin_param", file=sys.stderr)
        sys.exit(2)
    preemption.catch_sigterm()  # first, before TensorFlow loads: a preemption notice at any point ends with status 0
    goodput.mark_launch(goodput.launch_start())  # start-up counts as this launch's badput
    verbose = FLAGS.verbosity >= 1
    console.setup(verbose)
    try:
        from tfpod import runtime

        runtime.configure_hosts(FLAGS.num_hosts, FLAGS.host_id, FLAGS.host_addresses)
        with console.quiet(enabled=not verbose and tfpod.USER_TF_LOG_LEVEL is None):
            api.run(FLAGS.gin_file, FLAGS.gin_param, FLAGS.model_dir, FLAGS.mode,
                    check=doctor.preflight if FLAGS.preflight else None, mesh_spec=FLAGS.mesh,
                    cpu_devices=FLAGS.cpu_devices, device_type=FLAGS.device_type, checkpoint=FLAGS.checkpoint,
                    model_name=FLAGS.model_name, plan_device=FLAGS.plan_device,
                    plan_num_devices=FLAGS.plan_num_devices, plan_devices_per_host=FLAGS.plan_devices_per_host)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        if verbose:
            raise
        sys.exit(1)


def console_main() -> None:
    """Entry point of the `tfpod` console script."""
    app.run(main)
