"""Run outputs: a fresh run never appends to an earlier run's files."""

import pytest

from docuchat_rl.outputs import claim_output_dir


def _earlier_run(d):
    (d / "checkpoint-2").mkdir(parents=True)
    (d / "checkpoint-2" / "adapter_model.safetensors").write_bytes(b"x")
    for name in ("traces.jsonl", "metrics.jsonl", "latest"):
        (d / name).write_text("{}\n")
    (d / "notes.txt").write_text("mine")


def test_empty_or_missing_folder_is_fine(tmp_path):
    claim_output_dir(tmp_path / "new", overwrite=False)
    claim_output_dir(tmp_path, overwrite=False)


def test_earlier_run_is_refused_naming_what_is_there(tmp_path):
    _earlier_run(tmp_path)
    with pytest.raises(ValueError, match=r"traces\.jsonl, metrics\.jsonl, latest, checkpoint-2\): continue"):
        claim_output_dir(tmp_path, overwrite=False)
    assert (tmp_path / "traces.jsonl").exists()


def test_overwrite_removes_only_run_outputs(tmp_path):
    _earlier_run(tmp_path)
    claim_output_dir(tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
