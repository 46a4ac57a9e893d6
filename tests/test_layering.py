"""The layering the README draws, checked on the source: every `import` and `from ... import`
of tfpod/, input/ (tfpod.input) and models/ (tfpod.models), lazy imports inside functions
included, read with `ast` (nothing is imported)."""

import ast
import os

import pytest

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = {"tfpod": "tfpod", "input": "tfpod.input", "models": "tfpod.models"}

# Top to bottom. A module may import its own group and any group of a lower layer; groups
# of one layer do not import each other. A module belongs to the group whose prefix names
# it most closely.
LAYERS = [
    {"entry points": ("tfpod.main", "tfpod.launch", "tfpod.config_doc", "tfpod.convert", "tfpod.doctor")},
    {"run API and config": ("tfpod.api", "tfpod.config", "tfpod.export"),
     "Keras front end": ("tfpod.keras", "tfpod.keras3")},
    {"controller and its actions": ("tfpod.controller", "tfpod.actions", "tfpod.nonfinite", "tfpod.feeding", "tfpod.input_position",
                                    "tfpod.metrics_writer", "tfpod.goodput", "tfpod.checkpoint", "tfpod.watchdog", "tfpod.faults",
                                    "tfpod.memory_checkpoint", "tfpod.peer_link",
                                    "tfpod.checkpoint_writer"),
     "planner": ("tfpod.plan",)},
    {"trainer and pipeline": ("tfpod.trainer", "tfpod.executor", "tfpod.train_state", "tfpod.pipeline",
                              "tfpod.embedding.executor"), "models": ("tfpod.models",)},
    {"task contract": ("tfpod.task", "tfpod.lora")},
    {"input": ("tfpod.input",)},
    {"partitioning and the runtime": ("tfpod.partitioning", "tfpod.optimizers", "tfpod.fused", "tfpod.attention", "tfpod.attention_layers",
                                      "tfpod.projection", "tfpod.mesh", "tfpod.embedding", "tfpod.auc",
                                      "tfpod.runtime", "tfpod.measured", "tfpod.flops")},
    {"leaves": ("tfpod.compat", "tfpod.console", "tfpod.preemption", "tfpod.run_folder", "tfpod.cluster",
                "tfpod.evaluation", "tfpod.precision", "tfpod.plan.profile", "tfpod.pipeline.schedules")},
]


def _modules() -> dict[str, str]:
    """{module name: path} of every tfpod module, input/ and models/ under their installed names."""
    found = {}
    for folder, package in FOLDERS.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):  # tfpod/'s links to input/, models/ not followed
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, folder))[:-3]
                    parts = [package] + [p for p in rel.split(os.sep) if p != "__init__"]
                    found[".".join(parts)] = os.path.join(dirpath, f)
    return found


def _imports(name: str, path: str, known) -> set[str]:
    """The tfpod modules `name` imports anywhere in its source."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t not in (name, "tfpod"):  # the package root's lazy public names tie nothing
                out.add(t)
    return out


def _place(module: str) -> tuple[int, str]:
    """(layer index from the top, group) of a module: the group whose prefix matches it most closely."""
    best = None
    for index, layer in enumerate(LAYERS):
        for group, prefixes in layer.items():
            for prefix in prefixes:
                if module == prefix or module.startswith(prefix + "."):
                    if best is None or len(prefix) > best[0]:
                        best = (len(prefix), index, group)
    assert best is not None, f"{module} is in no layer of tests/test_layering.py: add it where the README puts it"
    return best[1], best[2]


def _leaf(module: str) -> str:
    """The leaf a module of the leaves belongs to: its prefix there (a package's modules, e.g.
    tfpod.compat's, import each other)."""
    return max((p for p in LAYERS[-1]["leaves"] if module == p or module.startswith(p + ".")), key=len, default=module)


def test_imports_go_down_the_layers_the_readme_draws():
    known = _modules()
    assert {"tfpod.models.gpt", "tfpod.input.lm_data", "tfpod.partitioning.presets.base"} <= set(known)
    wrong = []
    for name, path in sorted(known.items()):
        if name == "tfpod":
            continue
        layer, group = _place(name)
        for target in sorted(_imports(name, path, known)):
            to_layer, to_group = _place(target)
            if to_layer < layer or (to_layer == layer and to_group != group):
                wrong.append(f"{name} ({group}) imports {target} ({to_group})")
            elif group == "leaves" and _leaf(target) != _leaf(name):
                wrong.append(f"{name} is a leaf but imports {target}")
    assert wrong == [], "\n".join(wrong)


def test_the_keras_front_end_is_used_by_nothing_inside_tfpod():
    known = _modules()
    users = {n for n, p in known.items() if not n.startswith("tfpod.keras") and n != "tfpod"
             and any(t.startswith("tfpod.keras") for t in _imports(n, p, known))}
    assert users == set()
    # The package root installs the Keras 3 backing once keras is imported (tfpod/__init__.py), nothing else.
    root = {t for t in _imports("tfpod", known["tfpod"], known) if t.startswith("tfpod.keras")}
    assert root <= {"tfpod.keras3"}, root


def test_input_and_models_are_visible_in_the_tree_as_tfpod_subpackages():
    """tfpod/input and tfpod/models are links to the top-level folders (no search-path
    appending), so a reader or a tool resolves tfpod.models to models/."""
    for name in ("input", "models"):
        link = os.path.join(ROOT, "tfpod", name)
        assert os.path.islink(link) and os.readlink(link) == os.path.join("..", name)
    assert "__path__.append" not in open(os.path.join(ROOT, "tfpod", "__init__.py")).read()


def test_every_package_is_installed():
    """setup.py lists every package folder (a new one left out would be missing from a wheel)."""
    setup = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    call = next(n for n in ast.walk(setup) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    listed = set(ast.literal_eval(next(k.value for k in call.keywords if k.arg == "packages")))
    packages = {n for n, p in _modules().items() if p.endswith("__init__.py")}
    assert packages <= listed, sorted(packages - listed)
