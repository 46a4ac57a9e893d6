"""The versions of tf_keras, Model Garden and TensorFlow that tfpod.compat is written against.

Importing tfpod.compat (any of its modules) runs `check_versions` first: an installed version
other than the tested one stops with one line (setup.py pins them), not later in an
AttributeError deep in a library.
"""

from __future__ import annotations

import importlib.metadata

from tfpod import UserError

# distribution -> the version prefix (major.minor) the accesses in tfpod.compat are written for
TESTED = {"tensorflow": "2.20", "tf-keras": "2.20", "tf-models-official": "2.20"}


def check_versions(installed: dict[str, str] | None = None) -> None:
    """Raises one UserError line when an installed version differs from TESTED."""
    for dist, tested in TESTED.items():
        try:
            version = (installed or {}).get(dist) or importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            raise UserError(f"{dist} is not installed: tfpod needs {dist}=={tested}.*; pip install -e . installs "
                            "the tested versions") from None
        if version != tested and not version.startswith(tested + "."):
            raise UserError(f"{dist} {version} is installed, but tfpod is written against {dist} {tested}.x (it uses "
                            f"internals that change between versions): pip install '{dist}=={tested}.*' (pip install -e "
                            ". pins the tested versions)")


check_versions()
