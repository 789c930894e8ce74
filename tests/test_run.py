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
