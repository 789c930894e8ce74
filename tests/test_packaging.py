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


def test_the_wheel_carries_the_recipes_and_the_embedded_default_and_runs_from_an_empty_folder(tmp_path):
    """`pip wheel .`, installed (not editable) in a fresh virtual environment: `docuchat-rl recipes` lists the
    built-in recipes and `docuchat-rl train` runs the default recipe for 2 steps from an empty folder. (The
    environment sees this one's site-packages for torch and the other dependencies: no network needed.)"""
    import json
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    import shutil

    source = tmp_path / "source"  # (the files a clone has: a build folder left in the checkout is not the project)
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    for name in files:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                            str(wheels), str(source)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-1500:]
    wheel = next(wheels.glob("docuchat_rl-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "docuchat_rl/_recipes/default.yaml" in names and "docuchat_rl/_embedded/model/model.safetensors" in names
    assert not any("smollm2-135m" in n for n in names) and wheel.stat().st_size < 8 * 2**20
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    import sysconfig  # (run from a virtual environment, the new one's "system" is the base Python, without torch and
    # the rest: this environment's packages are reached by a path file, whose folder's own .pth files, the
    # checkout's editable install among them, are not read)
    own = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    (Path(own) / "_the_tests_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-1500:]
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "HOME": str(tmp_path)}
    where = subprocess.run([str(py), "-c", "import docuchat_rl; print(docuchat_rl.__file__)"], cwd=empty, env=env,
                           capture_output=True, text=True)
    assert str(venv) in where.stdout, (where.stdout, where.stderr[-500:])  # (the wheel's copy, not the checkout)
    listed = subprocess.run([str(venv / "bin" / "docuchat-rl"), "recipes"], cwd=empty, env=env, capture_output=True,
                            text=True)
    assert listed.returncode == 0 and "smollm2_tools_sft" in listed.stdout, listed.stderr[-800:]
    run = subprocess.run([str(venv / "bin" / "docuchat-rl"), "train", "--set", "run.steps=2", "--set",
                          "eval.limit=8", "--set", "logging.progress=false"], cwd=empty, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-1500:]
    assert json.loads((empty / "runs/default/eval.json").read_text())["after"]["rows"] == 8
    assert (empty / "runs/default/latest").read_text().strip() == "checkpoint-2"
