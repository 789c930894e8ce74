"""Run outputs: a fresh run never appends to an earlier run's files."""

import pytest

from docuchat_rl.outputs import claim_output_dir, read_jsonl


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


def test_empty_run_files_of_a_start_that_failed_do_not_block_the_next_start(tmp_path):
    """A start that failed before step 1 leaves empty files (nothing to lose, nothing to resume): the corrected
    re-run goes ahead and starts them afresh."""
    for name in ("traces.jsonl", "metrics.jsonl", "eval.jsonl"):
        (tmp_path / name).write_text("")
    claim_output_dir(tmp_path, overwrite=False)
    assert list(tmp_path.iterdir()) == []


def test_a_run_without_a_checkpoint_is_not_offered_a_resume(tmp_path):
    (tmp_path / "eval.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ValueError, match=r"\(eval\.jsonl\): it has no checkpoint to resume from: choose another") as e:
        claim_output_dir(tmp_path, overwrite=False)
    assert "--resume" not in str(e.value)


def test_read_back_skips_torn_wrongly_typed_and_non_utf8_lines(tmp_path):
    """Every JSONL file read back (metrics, traces, eval.jsonl in the audit and the export's model card) keeps
    the intact records of a file a kill, a disk error or a hand edit damaged."""
    from docuchat_rl.audit import eval_records
    from docuchat_rl.config import load_config
    from docuchat_rl.inference import _model_card

    path = tmp_path / "eval.jsonl"
    path.write_bytes(b'{"step": 1, "accuracy": 0.5}\n[1, 2]\n7\n"text"\n{"step": "two"}\n{"step": 3, "accur\xe9'
                     b'acy": 0.7}\n{"step": 4, "accuracy": 0.75}\n{"step": 5, "acc')
    assert read_jsonl(path) == [{"step": 1, "accuracy": 0.5}, {"step": "two"}, {"step": 3, "accur\ufffdacy": 0.7},
                                {"step": 4, "accuracy": 0.75}]
    assert [r["step"] for r in eval_records([tmp_path])] == [1, 3, 4]  # (a step that is not a number: left out)
    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text('{"step": 4')  # torn
    (tmp_path / "eval.json").write_text("[]")  # wrongly typed: the card falls back to eval.jsonl's last line
    card = _model_card(load_config(None), ckpt)
    assert "(step ?)" in card and "| after | 0.75 |" in card
