"""Configuration: gin files and bindings -> the library's config dataclasses, validated.

The only module that knows gin. Library classes become gin configurables here:
`experiment.*` (ExperimentConfig), `train.*` (TrainConfig), `optimizer.*`
(OptimizerConfig), `sharding.*` (ShardingConfig), `lora.*` (LoraConfig), and each task's model config under
its name (`gpt.*`) and data config under its data name (`lm_data.*`).

Every bound value is checked against its field's type before a config is made (the
field, the value and the expected type in one line), then by the config's own checks
(ranges, choices); gin files mark values an experiment must set as `%gin.REQUIRED`.
The config dataclasses are frozen: once validated, a value changes only by making a new
config (`dataclasses.replace`, as the planner does with its choice), so nothing derived
flows back into a config a user wrote (the input reads the model's config, never writes it).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import os
import types
import typing

import gin

import tfpod
from tfpod import UserError


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """Which model and mesh. Attributes map 1:1 to gin `experiment.<name>`.

    Attributes:
      model: the task (tfpod.models.TASKS: gpt, moe, llama, bert, transformer, resnet, ssd).
      mesh: the mesh spec when --mesh is not given (e.g. data:-1,model:2; -1 fills the rest).
    """

    model: str = "gpt"
    mesh: str = "data:-1"


_CONFIGURABLES: dict = {}  # gin name -> the configurable gin made of the class
_CLASSES: dict = {}  # gin name -> the dataclass


def _register() -> dict:
    """Registers the library's config classes with gin (once per process)."""
    if _CONFIGURABLES:
        return _CONFIGURABLES
    from tfpod import attention, controller, lora, optimizers, partitioning
    from tfpod.models import TASKS

    classes = {"experiment": ExperimentConfig, "train": controller.TrainConfig, "optimizer": optimizers.OptimizerConfig,
               "sharding": partitioning.ShardingConfig, "lora": lora.LoraConfig, "attention": attention.AttentionConfig}
    for name, task in TASKS.items():
        classes[name] = task.config_class
        classes.setdefault(task.data_name, task.data_config_class)  # tasks may share one (gpt, moe: lm_data)
    for name, cls in classes.items():
        _CLASSES[name] = cls
        _CONFIGURABLES[name] = gin.external_configurable(cls, name=name)
    return _CONFIGURABLES


def config_classes() -> dict:
    """{gin name: config dataclass} of every configurable, in registration order."""
    _register()
    return dict(_CLASSES)


def gin_search_dirs() -> list[str]:
    """Folders holding tfpod's gin files: tfpod/gin installed, <checkout>/gin from a clone
    (or an editable install of one), whatever the working directory."""
    found = [os.path.join(p, "gin") for p in tfpod.__path__] + [os.path.join(os.path.dirname(p), "gin")
                                                               for p in tfpod.__path__]
    return [d for d in dict.fromkeys(os.path.abspath(d) for d in found) if os.path.isdir(d)]


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


def _bound(name: str, field: str):
    """The value gin binds to name.field (macros followed), or `_UNBOUND`."""
    try:
        value = gin.query_parameter(f"{name}.{field}")
    except ValueError:
        return _UNBOUND
    for _ in range(16):  # a macro may name a macro
        if isinstance(value, gin.config.ConfigurableReference) and str(value).startswith("%"):
            if str(value) == "%gin.REQUIRED":
                return value
            value = gin.query_parameter(str(value))
        else:
            break
    return value


_UNBOUND = object()


def _check_required(name: str) -> None:
    """gin files mark values every experiment must set as `%gin.REQUIRED`; say which is unset."""
    for field in (f.name for f in dataclasses.fields(_CLASSES[name])):
        if str(_bound(name, field)) == "%gin.REQUIRED":
            raise UserError(
                f"{name}.{field} is required and unset: bind it in your gin file or pass "
                f"--gin_param={name}.{field}=VALUE"
            )


def type_name(hint, nested: bool = False) -> str:
    """A type hint in words: `int`, `str or None`, `tuple of 2 float`, `dict of str to (str or None)`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "None"
    if origin in (types.UnionType, typing.Union):
        text = " or ".join(type_name(a, True) for a in args)
        return f"({text})" if nested else text
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"tuple of {type_name(args[0], True)}"
        return f"tuple of {len(args)} {' and '.join(sorted({type_name(a, True) for a in args}))}"
    if origin in (list, collections.abc.Sequence):
        return f"sequence of {type_name(args[0], True)}" if args else "sequence"
    if origin in (dict, collections.abc.Mapping):
        return f"dict of {type_name(args[0], True)} to {type_name(args[1], True)}" if args else "dict"
    return getattr(hint, "__name__", str(hint))


def matches(value, hint) -> bool:
    """Whether a gin value fits a type hint (ints are floats; bools are not ints; lists are tuples)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if hint is type(None):
        return value is None
    if origin in (types.UnionType, typing.Union):
        return any(matches(value, a) for a in args)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(matches(v, args[0]) for v in value)
        return len(value) == len(args) and all(matches(v, a) for v, a in zip(value, args))
    if origin in (list, collections.abc.Sequence):
        return isinstance(value, (tuple, list)) and all(matches(v, args[0]) for v in value) if args else True
    if origin in (dict, collections.abc.Mapping):
        return isinstance(value, collections.abc.Mapping) and (
            not args or all(matches(k, args[0]) and matches(v, args[1]) for k, v in value.items()))
    return True  # a type this check does not know: left to the config's own checks


def check_types(name: str) -> None:
    """Raises one UserError line for a value gin binds to `name.*` that does not fit its field's type."""
    cls = _CLASSES[name]
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        value = _bound(name, field.name)
        if value is _UNBOUND or isinstance(value, gin.config.ConfigurableReference):
            continue  # unbound (the default), or made by a configurable: checked by the config itself
        hint = hints.get(field.name)
        if hint is not None and not matches(value, hint):
            example = "" if field.default in (None, dataclasses.MISSING) else f" (default: {field.default!r})"
            kind = type(value).__name__
            raise UserError(f"{name}.{field.name}={value!r} is {'an' if kind[0] in 'aeiou' else 'a'} {kind}, but it must be "
                            f"{type_name(hint)}{example}: fix its binding in the gin file or --gin_param")


def build_config(name: str):
    """The config `name` (a gin name: train, optimizer, gpt, lm_data, ...) from the parsed gin config."""
    _register()
    if name not in _CONFIGURABLES:
        raise UserError(f"no config named {name!r}: use one of {', '.join(sorted(_CONFIGURABLES))}")
    _check_required(name)
    check_types(name)
    try:
        return _CONFIGURABLES[name]()
    except UserError as e:  # gin appends "In call to configurable ..." on a new line
        raise UserError(str(e).splitlines()[0]) from None
    except (TypeError, ValueError) as e:
        raise UserError(f"gin config for {name}.*: {_one_line(e)}") from None


def build_task_configs():
    """(task module, model config, data config) from the parsed gin config."""
    from tfpod import lora
    from tfpod.models import get_task

    task = get_task(build_config("experiment").model)
    return lora.adapt(task, build_config("lora")), build_config(task.name), build_config(task.data_name)


def operative_config() -> str:
    """The gin config of every configurable used so far (written to model_dir/config.gin)."""
    return gin.operative_config_str()
