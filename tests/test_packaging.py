"""The install asks only for what exists: every extra our dependencies name is one that the installed
distribution provides (pip warns "does not provide the extra" otherwise)."""

import importlib.metadata as md
import re

import tomllib

from .conftest import ROOT


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_requested_extra_is_provided_by_the_installed_distribution():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    asked = [re.match(r"^([A-Za-z0-9_.-]+)\[([^\]]+)\]", d) for d in deps]
    for m in filter(None, asked):
        provided = {_norm(x) for x in md.metadata(m.group(1)).get_all("Provides-Extra") or []}
        for extra in m.group(2).split(","):
            assert extra.strip() in provided, (m.group(1), extra, sorted(provided))
