"""docs/config.md: every gin knob with its default and meaning, from the config dataclasses.

    python -m tfpod.config_doc > docs/config.md

The meanings are the `Attributes:` sections of the dataclasses' docstrings (a subclass's
inherited fields from its base's), the defaults the fields' own. tests/test_architecture.py
checks that docs/config.md is this output and that every field has a meaning, so adding a
knob means writing its line in the dataclass's docstring and regenerating the page.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

from tfpod import config

HEADER = """# Gin knobs

Every knob a run takes, as `--gin_param=NAME=VALUE` or in a gin file (the README's
[Gin files](../README.md#gin-files) says how the files layer). Generated from the config
dataclasses' docstrings by `python -m tfpod.config_doc > docs/config.md`; a test fails when
this page and the code differ.
"""


def attribute_docs(cls) -> list[tuple[list[str], str]]:
    """(field names, meaning) as the `Attributes:` sections of cls and its bases write them,
    the class's own first; names written together ("a, b: ...") share one meaning."""
    out, seen = [], set()
    for klass in cls.__mro__:
        doc = inspect.cleandoc(klass.__dict__.get("__doc__") or "")
        match = re.search(r"^Attributes[^\n]*:\n(.*?)(?=^\S|\Z)", doc, re.S | re.M)
        if not match:
            continue
        for entry in re.split(r"\n(?=  \w[\w, ]*:)", "\n" + match.group(1).rstrip()):
            head, _, text = entry.strip().partition(":")
            names = [n.strip() for n in head.split(",") if n.strip() and n.strip() not in seen]
            if names:
                seen.update(names)
                out.append((names, " ".join(text.split())))
    return out


def undocumented() -> list[str]:
    """`gin.name` of every field no docstring describes."""
    missing = []
    for name, cls in config.config_classes().items():
        described = {n for names, _ in attribute_docs(cls) for n in names}
        missing += [f"{name}.{f.name}" for f in dataclasses.fields(cls) if f.name not in described]
    return missing


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "(required)"
    return f"`{value!r}`"


def markdown() -> str:
    """The page: one table per configurable, in registration order."""
    parts = [HEADER]
    for name, cls in config.config_classes().items():
        fields = {f.name: f for f in dataclasses.fields(cls)}
        parts.append(f"\n## `{name}.*` ({cls.__module__}.{cls.__name__})\n\n| knob | default | meaning |\n|---|---|---|\n")
        for names, text in attribute_docs(cls):
            names = [n for n in names if n in fields]
            if names:
                knobs = ", ".join(f"`{name}.{n}`" for n in names)
                defaults = ", ".join(_default(fields[n]) for n in names)
                parts.append(f"| {knobs} | {defaults} | {text.replace('|', '/')} |\n")
    return "".join(parts)


if __name__ == "__main__":
    print(markdown(), end="")
