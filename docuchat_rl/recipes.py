"""The built-in recipes and the embedded default, wherever the package is installed.

A git checkout reads them from its `config/` and `data/` folders; an installed wheel carries the same files
as `docuchat_rl/_recipes` (config/) and `docuchat_rl/_embedded` (data/: the embedded model and the synthetic
tasks, not models fetched later; pyproject.toml maps the folders). One rule resolves a recipe's relative
paths: **a path is read from the working folder; when nothing is there and it names a built-in file
(`data/...`), the package's copy is read.** So `docuchat-rl train` runs the default recipe from an empty folder, and a checkout's own files
(or a user's) win where they exist.

Deliberately left out: fetching recipes or data from anywhere else (the hub, a URL).
"""

from __future__ import annotations

from pathlib import Path

def _root(packaged: str, checkout: str) -> Path | None:
    """A data folder: the installed wheel's (beside this module), else the checkout's (beside the package)."""
    for folder in (Path(__file__).resolve().parent / packaged, Path(__file__).resolve().parents[1] / checkout):
        if folder.is_dir():
            return folder
    return None


def recipes_dir() -> Path | None:
    return _root("_recipes", "config")


def embedded_dir() -> Path | None:
    return _root("_embedded", "data")


def builtin_recipes() -> dict[str, Path]:
    """Built-in recipe name -> its file."""
    root = recipes_dir()
    return {} if root is None else {p.stem: p for p in sorted(root.glob("*.yaml"))}


def resolve_recipe(source: str | Path) -> Path:
    """A recipe path as given (when it exists) or a built-in recipe by name ("default", "smollm2_tools_sft")."""
    path = Path(source)
    if path.exists():
        return path
    known = builtin_recipes()
    name = path.stem if path.parent in (Path("."), Path("config")) else None
    if name in known:
        return known[name]
    raise FileNotFoundError(f"config file not found: {source} (nor a built-in recipe of that name: "
                            f"{', '.join(known)})")


def resolve_path(path: str | None) -> str | None:
    """A recipe's relative path (model.name_or_path, data.train, ...) by the rule above: as given when it exists
    here or is not a built-in file, else the package's copy."""
    if not path or Path(path).is_absolute() or Path(path).exists() or not path.startswith("data/"):
        return path
    root = embedded_dir()
    if root is not None and (root / path[len("data/"):]).exists():
        return str(root / path[len("data/"):])
    return path
