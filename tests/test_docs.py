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


# whole features that exist, in the words a "left out" line used for each while it was not built: a module
# docstring that still says one is left out has gone stale (a combination, "FSDP2 in a lag's worker", may be
# left out; the feature itself may not). Config keys are checked besides these.
BUILT = {"multi-turn rollouts": "rollout.tools", "tool call": "rollout.tools",
         "serving engine": "rollout.vllm.mode server", "as a server": "rollout.vllm.mode server",
         "vllm server": "rollout.vllm.mode server", "proximal policy": "rollout.async_lag (decoupled PPO)",
         "cuda graph": "rollout.cuda_graphs", "curriculum": "data.curriculum", "exact resume": "checkpoint.py"}


def _left_out(path) -> str:
    """The module docstring's "Deliberately left out:" paragraph ('' when it has none)."""
    import ast

    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    at = doc.find("Deliberately left out")
    return "" if at < 0 else doc[at:].split("\n\n")[0]


def _keys() -> set[str]:
    """Every config key as `section.key`."""
    from docuchat_rl.config import Config

    return {f"{s}.{k}" for s, body in Config().to_dict().items() if isinstance(body, dict) for k in body}


MODULES = sorted([*(ROOT / "docuchat_rl").rglob("*.py"), *(ROOT / "rewards").glob("*.py")])


@pytest.mark.parametrize("module", [m for m in MODULES if _left_out(m)], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_left_out_line_names_nothing_that_is_built(module):
    text = _left_out(module)
    lower = text.lower()
    named = [f"{w!r} ({where})" for w, where in BUILT.items() if re.search(rf"\b{re.escape(w)}\b", lower)]
    named += [k for k in _keys() if k.lower() in lower]
    assert not named, f"{module.name}'s 'Deliberately left out' names what exists: {named}\n{text}"
