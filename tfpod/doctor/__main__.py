"""python -m tfpod.doctor: every preflight check, one line each (see tfpod.doctor); exits 1
when any check fails on any host, else 0.

    python -m tfpod.doctor --gin_file=gin/lm_tiny.gin --model_dir=runs/lm_tiny --cpu_devices=8 --mesh=data:4,model:2
"""

from __future__ import annotations

import logging
import os
import sys

from absl import app, flags

from tfpod import UserError, console
from tfpod import main as _main  # noqa: F401  (defines main.py's flags: the doctor takes the same)

FLAGS = flags.FLAGS

flags.DEFINE_integer("bandwidth_mb", 16, "the doctor: MiB per device all-reduced to measure the collective's bandwidth "
                                         "(0: not measured)")
flags.DEFINE_integer("write_mb", 64, "the doctor: MiB written and fsynced in --model_dir to measure its write speed")


def main(argv) -> None:
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}: pass settings as --flags or --gin_param", file=sys.stderr)
        sys.exit(2)
    if FLAGS.bandwidth_mb < 0 or FLAGS.write_mb < 0:
        print(f"error: --bandwidth_mb={FLAGS.bandwidth_mb} and --write_mb={FLAGS.write_mb} must be >= 0",
              file=sys.stderr)
        sys.exit(2)
    verbose = FLAGS.verbosity >= 1
    console.setup(verbose)
    if not verbose:
        logging.getLogger("tfpod").setLevel(logging.WARNING)  # the check lines say it all
    import tfpod
    from tfpod import api, doctor, runtime

    try:
        runtime.configure_hosts(FLAGS.num_hosts, FLAGS.host_id, FLAGS.host_addresses)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    clients = int(os.environ.get("DTENSOR_NUM_CLIENTS", "1"))
    prefix = ""
    if clients > 1 and not os.environ.get("TFPOD_HOST_PREFIXED"):  # tfpod.launch prefixes every line itself
        prefix = f"[host {os.environ.get('DTENSOR_CLIENT_ID', '0')}] "

    def emit(result) -> None:
        print(prefix + result.line(), flush=True)

    with console.quiet(enabled=not verbose and tfpod.USER_TF_LOG_LEVEL is None):
        configs, config_error = None, None
        try:
            configs = api.load_configs(FLAGS.gin_file, FLAGS.gin_param, FLAGS.model_dir or "")
        except UserError as e:
            config_error = str(e)
        results = doctor.run_checks(configs, config_error, FLAGS.model_dir, FLAGS.mode, FLAGS.mesh, FLAGS.cpu_devices,
                                    FLAGS.device_type, bandwidth_bytes=FLAGS.bandwidth_mb << 20,
                                    write_bytes=FLAGS.write_mb << 20, emit=emit)
        sys.stdout.flush()
        sys.stderr.flush()
        doctor.leave_together(clients)
        # Now, not at the interpreter's exit: TensorFlow's multi-client teardown logs a warning
        # there, after the console filter has ended (nothing is left to clean up).
        os._exit(1 if any(r.failed for r in results) else 0)


def console_main() -> None:
    """Entry point of the `tfpod-doctor` console script."""
    app.run(main)


if __name__ == "__main__":
    app.run(main)
