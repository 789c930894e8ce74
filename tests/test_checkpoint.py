"""Checkpoint folders: atomic completion, the `latest` pointer, pruning, resume resolution, and a failed
write that leaves the previous checkpoint in charge."""

import pytest

from docuchat_rl.checkpoint import LATEST, list_checkpoints, resolve_resume, save_checkpoint
from docuchat_rl.errors import CheckpointError


def _writer(step):
    def write_into(folder):
        (folder / "trainer_state.json").write_text(f'{{"step": {step}}}\n')
        (folder / "adapter_model.safetensors").write_bytes(b"x" * step)
    return write_into


def test_save_renames_into_place_updates_latest_and_prunes(tmp_path):
    for step in (1, 2, 3, 4):
        final = save_checkpoint(tmp_path, step, _writer(step), keep_last=2)
        assert final == tmp_path / f"checkpoint-{step}" and (final / "trainer_state.json").exists()
        assert (tmp_path / LATEST).read_text().strip() == f"checkpoint-{step}"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-3", "checkpoint-4"]
    assert not list(tmp_path.glob("*.tmp"))


def test_a_write_that_fails_leaves_the_previous_checkpoint_and_latest(tmp_path):
    save_checkpoint(tmp_path, 1, _writer(1), keep_last=3)

    def broken(folder):
        (folder / "trainer_state.json").write_text("{")
        raise OSError("No space left on device")

    with pytest.raises(CheckpointError, match="could not write checkpoint-2 .*No space left on device; the previous"):
        save_checkpoint(tmp_path, 2, broken, keep_last=3)
    assert (tmp_path / LATEST).read_text().strip() == "checkpoint-1"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1"]  # the .tmp folder is not one
    assert resolve_resume("latest", tmp_path) == tmp_path / "checkpoint-1"
    save_checkpoint(tmp_path, 2, _writer(2), keep_last=3)  # the next save clears the stale .tmp
    assert not list(tmp_path.glob("*.tmp"))


def test_a_first_checkpoint_that_safetensors_cannot_write_is_one_line_and_leaves_no_folder(tmp_path):
    """safetensors reports a full disk as its own SafetensorError (neither OSError nor RuntimeError): one line
    all the same, and no half-written folder that would make the run folder look resumable."""
    from safetensors import SafetensorError

    from docuchat_rl.outputs import claim_output_dir

    def full(folder):
        (folder / "adapter_model.safetensors").write_bytes(b"\0" * 10)
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    (tmp_path / "traces.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(CheckpointError, match="could not write checkpoint-1 .*StorageFull.*no earlier checkpoint"):
        save_checkpoint(tmp_path, 1, full, keep_last=3)
    assert not list(tmp_path.glob("checkpoint-*"))
    with pytest.raises(ValueError, match="it has no checkpoint to resume from"):
        claim_output_dir(tmp_path, overwrite=False)


def test_resolve_resume_accepts_latest_a_run_folder_or_a_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 5, _writer(5), keep_last=3)
    save_checkpoint(tmp_path, 10, _writer(10), keep_last=3)
    assert resolve_resume("latest", tmp_path) == tmp_path / "checkpoint-10"
    assert resolve_resume(str(tmp_path), tmp_path / "elsewhere") == tmp_path / "checkpoint-10"
    assert resolve_resume(str(tmp_path / "checkpoint-5"), tmp_path) == tmp_path / "checkpoint-5"
    with pytest.raises(FileNotFoundError, match=r"no checkpoint to resume .*checkpoint-5', 'checkpoint-10'"):
        resolve_resume(str(tmp_path / "checkpoint-7"), tmp_path)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-5", "checkpoint-10"]  # numeric order


def test_a_crash_between_the_rename_and_the_pointer_resumes_the_newer_sealed_checkpoint(tmp_path):
    """kill -9 after checkpoint-2's rename and before `latest` is replaced: checkpoint-2 is sealed and the
    run's traces reach it, so `latest` resumes it (resuming checkpoint-1 inside the folder would be refused
    as cutting checkpoint-2's history: the run could not go on at all)."""
    save_checkpoint(tmp_path, 1, _writer(1), keep_last=3)
    save_checkpoint(tmp_path, 2, _writer(2), keep_last=3)
    (tmp_path / LATEST).write_text("checkpoint-1\n")  # the pointer as it was before the crash
    assert resolve_resume("latest", tmp_path) == tmp_path / "checkpoint-2"
    (tmp_path / "checkpoint-2" / "adapter_model.safetensors").write_bytes(b"z")  # damaged: the older one
    with pytest.warns(UserWarning, match="resuming from checkpoint-1, the newest intact checkpoint"):
        assert resolve_resume("latest", tmp_path) == tmp_path / "checkpoint-1"


def test_the_manifest_covers_every_file_and_catches_a_same_size_change(tmp_path):
    from docuchat_rl.checkpoint import MANIFEST, verify_checkpoint

    final = save_checkpoint(tmp_path, 1, _writer(7), keep_last=3)
    import json

    manifest = json.loads((final / MANIFEST).read_text())
    assert sorted(manifest) == sorted(p.name for p in final.iterdir() if p.name != MANIFEST)
    assert verify_checkpoint(final) is None
    blob = final / "adapter_model.safetensors"
    blob.write_bytes(b"y" * 7)  # same size, other bytes: only the hash can tell
    assert "damaged" in verify_checkpoint(final)
    blob.unlink()
    assert verify_checkpoint(final) == "checkpoint-1/adapter_model.safetensors is missing"


def test_a_curriculum_set_or_dropped_on_resume_is_refused_and_cuda_graphs_applied(tmp_path):
    """data.curriculum null in the checkpoint and set now (or the reverse) changes the data order: refused,
    naming the section; rollout.cuda_graphs is a speed switch: applied and said."""
    import json

    from docuchat_rl.checkpoint import check_resumable
    from docuchat_rl.config import load_config

    from .conftest import ROOT

    plain = load_config(ROOT / "config/default.yaml").to_dict()
    curriculum = load_config(ROOT / "config/default.yaml", ["data.curriculum.start=2"]).to_dict()
    for before, after in ((plain, curriculum), (curriculum, plain)):
        (tmp_path / "run_config.json").write_text(json.dumps({"step": 1, "config": before}))
        with pytest.raises(CheckpointError, match=r"a different recipe: data.curriculum="):
            check_resumable(tmp_path, after)
    eager = load_config(ROOT / "config/default.yaml", ["rollout.cuda_graphs=false"]).to_dict()
    (tmp_path / "run_config.json").write_text(json.dumps({"step": 1, "config": eager}))
    graphs = load_config(ROOT / "config/default.yaml", ["rollout.cuda_graphs=true"]).to_dict()
    assert check_resumable(tmp_path, graphs) == ["rollout.cuda_graphs: False -> True"]
    assert check_resumable(tmp_path, eager) == []


@pytest.mark.parametrize("option", [None, {"use_rslora": True}, {"alpha_pattern": {"q_proj": 64}},
                                    {"use_dora": True}], ids=["plain", "rslora", "alpha_pattern", "dora"])
def test_a_plain_peft_start_adapter_starts_where_peft_loads_it_or_is_refused_naming_its_scale_option(tmp_path, option):
    """lora.init_from with a plain peft adapter: one trained at alpha / r starts at the very policy peft's own
    loader gives (the same logits); one whose adapter_config.json changes the scale or form (rsLoRA, an alpha
    pattern, DoRA) is one line naming the option, never a silent start at another scale."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel, get_peft_model

    from docuchat_rl.checkpoint import load_start_adapter
    from docuchat_rl.config import LoraConfig
    from docuchat_rl.modeling import build_lora, load_model_and_tokenizer

    from .conftest import MODEL

    base, tok = load_model_and_tokenizer(str(MODEL), dtype="float32", device="cpu")
    trained = get_peft_model(base, PeftLoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                  task_type="CAUSAL_LM", **(option or {})))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    folder = tmp_path / "adapter"
    trained.save_pretrained(folder)
    ours = build_lora(load_model_and_tokenizer(str(MODEL), dtype="float32", device="cpu")[0],
                      LoraConfig(r=8, alpha=16, target_modules=["q_proj", "v_proj"]))
    if option is not None:
        with pytest.raises(CheckpointError, match=f"sets {next(iter(option))}: "):
            load_start_adapter(ours, folder, LoraConfig(r=8, alpha=16, target_modules=["q_proj", "v_proj"]),
                               str(MODEL))
        return
    load_start_adapter(ours, folder, LoraConfig(r=8, alpha=16, target_modules=["q_proj", "v_proj"]), str(MODEL))
    loaded = PeftModel.from_pretrained(load_model_and_tokenizer(str(MODEL), dtype="float32", device="cpu")[0],
                                       str(folder))
    ids = tok(["Ava has 3 apples. How many?"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.allclose(ours.eval()(input_ids=ids).logits, loaded.eval()(input_ids=ids).logits, atol=1e-5)
        fresh = load_model_and_tokenizer(str(MODEL), dtype="float32", device="cpu")[0]
        assert not torch.allclose(ours(input_ids=ids).logits, fresh(input_ids=ids).logits, atol=1e-3)  # (it moved)


def test_a_folder_never_sealed_is_no_checkpoint_wherever_it_is_named(tmp_path):
    """A checkpoint whose write never finished (no manifest: killed before its seal, or the .tmp folder itself)
    is refused as --adapter, as lora.init_from and as --resume, in one line; a plain peft folder (no trainer
    state, no manifest) is still an adapter."""
    import shutil

    from docuchat_rl.checkpoint import resolve_adapter

    from .conftest import train_here

    run = tmp_path / "run"
    train_here(None, [f"run.output_dir={run}", "run.steps=1", "eval.before_and_after=false",
                      "logging.progress=false", "rollout.prompts_per_step=2", "rollout.max_new_tokens=8"])
    sealed = run / "checkpoint-1"
    for name in ("checkpoint-1.tmp", "cut"):
        unsealed = tmp_path / name
        shutil.copytree(sealed, unsealed)
        (unsealed / "manifest.json").unlink()
        for key in ("--adapter", "lora.init_from"):
            with pytest.raises(CheckpointError, match=f"{key} .*never sealed"):
                resolve_adapter(unsealed, key)
        with pytest.raises(CheckpointError, match="manifest.json is missing"):
            resolve_resume(str(unsealed), tmp_path)
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(sealed / f, plain / f)
    assert resolve_adapter(plain) == plain
