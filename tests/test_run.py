"""Run set-up decisions that need no model: the training dtype (float16 refused, auto never float16), and
a float16 run refused before anything is loaded or written."""

import pytest
import torch

from docuchat_rl.config import load_config
from docuchat_rl.errors import TrainingError
from docuchat_rl.run import training_dtype


def test_auto_trains_in_bfloat16_where_the_gpu_has_it_and_float32_elsewhere():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert training_dtype("auto", cuda, bf16_supported=True) == "bfloat16"
    assert training_dtype("auto", cuda, bf16_supported=False) == "float32"  # V100, T4: not float16
    assert training_dtype("auto", cpu, bf16_supported=False) == "float32"  # decided once, recorded in checkpoints
    assert training_dtype("bfloat16", cuda, bf16_supported=True) == "bfloat16"


def test_float16_training_is_refused_in_one_line_naming_the_alternatives(tmp_path):
    from docuchat_rl.trainer import Trainer

    with pytest.raises(TrainingError, match="model.dtype float16 .*bfloat16.*float32") as e:
        Trainer(load_config(None, [f"run.output_dir={tmp_path / 'run'}", "model.dtype=float16"]))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()  # refused before the folder was claimed


def test_a_refused_start_leaves_nothing_behind_and_a_stage_resumes_only_its_own_checkpoints(tmp_path):
    """A resume of a run into a new folder, refused because its training file changed, leaves no folder (before:
    the copied traces and metrics blocked the same command once the data was restored); `train --resume` of an SFT
    stage's folder says which command resumes it, before anything is written; held-out rows that are training
    rows (data.test = data.train, an eval.also set) are refused naming the key."""
    from docuchat_rl.checkpoint import CheckpointError
    from docuchat_rl.data import DataError
    from docuchat_rl.trainer import Trainer

    from .conftest import TASK, train_here

    data = tmp_path / "rows.jsonl"
    data.write_text("".join((TASK / "train.jsonl").read_text().splitlines(True)[:12]))
    small = ["rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_new_tokens=8", "run.threads=1",
             "logging.progress=false", "eval.before_and_after=false", f"data.train={data}"]
    train_here(None, [*small, f"run.output_dir={tmp_path / 'a'}", "run.steps=2"])
    data.write_text("".join((TASK / "train.jsonl").read_text().splitlines(True)[:13]))
    with pytest.raises(CheckpointError, match="changed since checkpoint-2"):
        Trainer(load_config(None, [*small, f"run.output_dir={tmp_path / 'b'}", "run.steps=3"]),
                resume=str(tmp_path / "a" / "checkpoint-2"))
    assert not (tmp_path / "b").exists()
    from docuchat_rl.supervised.trainer import SupervisedTrainer

    stage = SupervisedTrainer(load_config(None, [*small, f"run.output_dir={tmp_path / 's'}", "sft.steps=1",
                                                 "sft.batch_size=2"]))
    stage.train()
    stage.close()
    with pytest.raises(CheckpointError, match="a checkpoint of the SFT stage .*docuchat-rl sft --resume"):
        Trainer(load_config(None, [*small, f"run.output_dir={tmp_path / 'c'}"]), resume=str(tmp_path / "s-sft"))
    assert not (tmp_path / "c").exists()
    with pytest.raises(CheckpointError, match="a checkpoint of an RL run .*docuchat-rl train --resume"):
        SupervisedTrainer(load_config(None, [*small, f"run.output_dir={tmp_path / 'e'}", "sft.steps=1"]),
                          resume=str(tmp_path / "a"))
    for sets, key in (([f"data.test={data}", "eval.before_and_after=true"], "data.test"),
                      ([f"eval.also={{copy: {data}}}"], "eval.also.copy")):
        with pytest.raises(DataError, match=f"^{key}: 13 of its 13 rows ask a question of the training rows"):
            Trainer(load_config(None, [*small, f"run.output_dir={tmp_path / 'd'}", *sets]))
        assert not (tmp_path / "d").exists()
