"""pyproject.toml's dependency floors are at least the first releases with every API the code calls
(parallel/api_floors.py's table)."""

from __future__ import annotations

import pytest

from parallel.api_floors import NEEDS, minimum_version, version_tuple
from tests.conftest import ROOT


def _declared_floors() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for group in project["optional-dependencies"].values():
        specs += group
    floors = {}
    for spec in specs:
        name, sep, version = spec.partition(">=")
        if sep:
            floors[name.split("[")[0].strip()] = version.split(",")[0].strip()
    return floors


def test_declared_floors_are_at_least_the_versions_our_api_calls_need():
    floors = _declared_floors()
    for package in sorted({need.package for need in NEEDS}):
        assert package in floors, f"pyproject.toml declares no floor for {package}"
        needed = minimum_version(package)
        newer = [n.api for n in NEEDS if n.package == package
                 and version_tuple(n.version) > version_tuple(floors[package])]
        assert version_tuple(floors[package]) >= version_tuple(needed), (
            f"pyproject.toml allows {package}>={floors[package]}, but the code calls APIs that appeared in "
            f"{needed}: {'; '.join(newer)}"
        )
