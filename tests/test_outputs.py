"""Run outputs: a fresh run never appends to an earlier run's files."""

import json

import pytest

from docuchat_rl.outputs import add_to_report, adopt_history, check_new_file, claim_output_dir, read_jsonl


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
    from docuchat_rl.config import load_config
    from docuchat_rl.tools.audit import eval_records
    from docuchat_rl.tools.inference import _model_card

    path = tmp_path / "eval.jsonl"
    path.write_bytes(b'{"step": 1, "accuracy": 0.5}\n[1, 2]\n7\n"text"\n{"step": "two"}\n{"step": 3, "accur\xe9'
                     b'acy": 0.7}\n{"step": 4, "accuracy": 0.75}\n{"step": 5, "acc')
    skipped, why = [], {}
    assert read_jsonl(path, skipped, why) == [{"step": 1, "accuracy": 0.5}, {"step": "two"},
                                              {"step": 4, "accuracy": 0.75}]  # (never read with U+FFFD)
    assert skipped == [2, 3, 4, 6, 8] and why[6] == "not UTF-8 text" and why[2] == "not a JSON object"
    assert [r["step"] for r in eval_records([tmp_path])] == [1, 4]  # (a step that is not a number: left out)
    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text('{"step": 4')  # torn
    (tmp_path / "eval.json").write_text("[]")  # wrongly typed: the card falls back to eval.jsonl's last line
    card = _model_card(load_config(None), ckpt)
    assert "(step ?)" in card and "| after | 0.75 |" in card


def test_a_before_only_evaluation_is_a_start_that_trained_nothing_and_does_not_block_a_fresh_start(tmp_path):
    """eval.json is written as soon as the evaluation before training ends (a run stopped later keeps it): alone,
    it blocks no fresh start; with an `after`, it is a finished run's."""
    add_to_report(tmp_path / "eval.json", "before", {"accuracy": 0.25})
    claim_output_dir(tmp_path, overwrite=False)
    assert list(tmp_path.iterdir()) == []
    add_to_report(tmp_path / "eval.json", "before", {"accuracy": 0.25})
    assert add_to_report(tmp_path / "eval.json", "after", {"accuracy": 0.5}) == {"before": {"accuracy": 0.25},
                                                                                 "after": {"accuracy": 0.5}}
    with pytest.raises(ValueError, match=r"already holds a run \(eval\.json\)"):
        claim_output_dir(tmp_path, overwrite=False)


def test_a_resume_from_another_folder_refuses_a_folder_holding_a_run_and_adopts_the_history_otherwise(tmp_path):
    source, other, new = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    _earlier_run(other)
    before = {p.name: p.read_bytes() for p in other.iterdir() if p.is_file()}
    with pytest.raises(ValueError, match=r"b already holds another run .*resuming .*checkpoint-2 there would cut its "
                                         r"files: choose a new run.output_dir"):
        claim_output_dir(other, overwrite=False, resuming=source / "checkpoint-2")
    assert {p.name: p.read_bytes() for p in other.iterdir() if p.is_file()} == before  # untouched
    source.mkdir()
    (source / "traces.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    (source / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    add_to_report(source / "eval.json", "before", {"accuracy": 0.25})
    add_to_report(source / "eval.json", "after", {"accuracy": 0.75})
    new.mkdir()
    claim_output_dir(new, overwrite=False, resuming=source / "checkpoint-2")
    adopt_history(new, source, {"traces": 24, "metrics": 12, "evals": 0})
    assert (new / "traces.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'  # up to the checkpoint's offsets
    assert (new / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert json.loads((new / "eval.json").read_text()) == {"before": {"accuracy": 0.25}}  # the source's after is
    # not this run's
    assert (source / "traces.jsonl").read_text().count("\n") == 3  # the source is only read


@pytest.mark.parametrize("name", ["traces.jsonl", "metrics.jsonl", "eval.json", "latest", ".lock"])
def test_an_output_file_is_never_a_runs_own_file_nor_an_existing_one(tmp_path, name):
    _earlier_run(tmp_path)
    with pytest.raises(FileExistsError, match=rf"--out .*{name} is a file of the training run in .*under another name"):
        check_new_file(tmp_path / name, "--out")
    with pytest.raises(FileExistsError, match="is a file of the training run"):
        check_new_file(tmp_path / "checkpoint-2" / "x.jsonl", "--out")
    with pytest.raises(FileExistsError, match=r"notes.txt already exists: give a new file name \(nothing is overwritten\)"):
        check_new_file(tmp_path / "notes.txt", "--export")
    with pytest.raises(FileExistsError, match="is a folder"):
        check_new_file(tmp_path / "checkpoint-2", "--html")
    assert check_new_file(tmp_path / "rescored.jsonl", "--out") == tmp_path / "rescored.jsonl"


def test_an_output_file_is_never_written_through_a_dangling_link(tmp_path):
    (tmp_path / "out.jsonl").symlink_to(tmp_path / "elsewhere" / "target.jsonl")
    with pytest.raises(FileExistsError, match="is a symbolic link to .*target.jsonl, which does not exist"):
        check_new_file(tmp_path / "out.jsonl", "--out")
    assert not (tmp_path / "elsewhere").exists()
