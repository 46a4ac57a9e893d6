"""tfpod: train large models across many accelerators and hosts with TensorFlow DTensor.

Importing tfpod selects Keras 2 (tf_keras): Keras 3 has no DTensor support on
TensorFlow, and tf-models-official is built on tf_keras. The variable must be set
before TensorFlow is first imported.
"""

import os as _os
import time as _time

# When this interpreter began, as tfpod can see it (main.py imports tfpod first), and the
# launcher's start of this process (tfpod.launch sets it; taken here so that no process
# started from this one inherits it): tfpod.goodput counts a launch's start-up from them.
IMPORTED = _time.time()
LAUNCHED = _os.environ.pop("TFPOD_LAUNCH_TIME", None)

_os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
# TensorFlow's C++ log level: the user's when set (tfpod.console keeps it), else INFO and
# WARNING hidden; the command line also hides ERROR-level start-up noise (tfpod.console).
# A level tfpod set itself is marked, so that a process started from this one (a pytest
# worker, a host of a local launch) does not take it for the user's.
_TF_LOG_LEVEL_MARK = "TFPOD_SET_TF_CPP_MIN_LOG_LEVEL"


def set_tf_log_level(level: str) -> None:
    """TensorFlow's C++ log level, as tfpod's choice (not the user's); read when TensorFlow loads."""
    _os.environ["TF_CPP_MIN_LOG_LEVEL"] = _os.environ[_TF_LOG_LEVEL_MARK] = level


USER_TF_LOG_LEVEL = _os.environ.get("TF_CPP_MIN_LOG_LEVEL")
if USER_TF_LOG_LEVEL is not None and _os.environ.get(_TF_LOG_LEVEL_MARK) == USER_TF_LOG_LEVEL:
    USER_TF_LOG_LEVEL = None  # set by the tfpod process that started this one
if USER_TF_LOG_LEVEL is None:
    set_tf_log_level("2")

# `input/` and `models/` are the subpackages tfpod.input and tfpod.models: installed by
# setup.py's package_dir, and in a checkout through the links tfpod/input -> ../input and
# tfpod/models -> ../models, so the tree itself says where they live.

__version__ = "0.1.0"

# Python's garbage collector thresholds for a process that imports TensorFlow and traces
# steps (runtime.settle_garbage_collector; main.py sets them before TensorFlow loads).
GC_THRESHOLDS = (50_000, 20, 20)


class UserError(Exception):
    """Bad input or configuration: the message says what, where, and how to fix it.

    main.py prints the message as one line and exits non-zero (tracebacks only at
    debug verbosity).
    """


def check_positive(config, prefix: str, fields) -> None:
    """UserError naming the first of a config's `fields` below 1 (`prefix.field=value must be positive`)."""
    for field in fields:
        if getattr(config, field) < 1:
            raise UserError(f"{prefix}.{field}={getattr(config, field)} must be positive")


def _back_keras3() -> None:
    """Keras 3 (`import keras`; tf.keras is tf_keras) gets its `keras.distribution` API backed
    by tfpod's DTensor (tfpod.keras3) once both are imported, in either order."""
    import importlib.abc
    import importlib.util
    import sys

    def install():
        import logging

        from tfpod import keras3

        try:
            keras3.install()
        except UserError as e:
            logging.getLogger("tfpod").warning("tfpod does not back keras.distribution: %s", e)

    if "keras" in sys.modules:
        install()
        return

    class Loader(importlib.abc.Loader):
        def __init__(self, loader):
            self._loader = loader

        def create_module(self, spec):
            return self._loader.create_module(spec)

        def exec_module(self, module):
            self._loader.exec_module(module)
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
            install()

    class Finder(importlib.abc.MetaPathFinder):
        """Wraps keras's loader in every spec found for it (TensorFlow looks keras up without importing it)."""

        def find_spec(self, name, path, target=None):
            if name != "keras":
                return None
            index = sys.meta_path.index(self)
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(index, self)
            if spec is not None and spec.loader is not None:
                spec.loader = Loader(spec.loader)
            return spec

    finder = Finder()
    sys.meta_path.insert(0, finder)


_back_keras3()


# Public names, imported on first use so `import tfpod` stays free of TensorFlow:
#   tfpod.make_mesh("data:-1,model:2")         -> tfpod.mesh.make_mesh
#   with tfpod.sharding(mesh, rules=...): ...  -> tfpod.keras.sharding (a user's Keras model, sharded)
#   tfpod.run(gin_files, gin_params, model_dir, mode) -> tfpod.api.run (what main.py runs)
_LAZY = {"make_mesh": ("tfpod.mesh", "make_mesh"), "sharding": ("tfpod.keras", "sharding"),
         "run": ("tfpod.api", "run")}
_SUBMODULES = ("partitioning", "keras", "mesh", "runtime", "input", "api", "config", "actions", "attention")


def __getattr__(name):
    import importlib

    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
