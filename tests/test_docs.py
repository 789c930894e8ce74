"""The documents a newcomer reads stay true to the tree: the README's code map names every module, every
relative link of the README and docs/ points at a file that exists, and the README stays one short read."""

import re

import pytest

from .conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "scripts" / "README.md"]


def test_the_code_map_names_every_module_and_the_readme_stays_short():
    readme = (ROOT / "README.md").read_text()
    modules = [p.relative_to(ROOT / "docuchat_rl").as_posix() for p in sorted((ROOT / "docuchat_rl").rglob("*.py"))
               if p.name != "__init__.py"]
    missing = [m for m in modules if f"`{m}`" not in readme and f"`{m.split('/')[-1]}`" not in readme]
    assert not missing, f"modules the README's code map leaves out: {missing}"
    assert len(readme.splitlines()) <= 300


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_at_a_file(doc):
    broken = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
        if not re.match(r"[a-z]+://", target) and not (doc.parent / target).exists():
            broken.append(target)
    assert not broken, f"{doc.name}: links to files that do not exist: {broken}"
