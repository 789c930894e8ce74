import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "data" / "model"
TASK = ROOT / "data" / "task"


@pytest.fixture(scope="session")
def tiny():
    """The committed default model and tokenizer, loaded once (float32 on CPU)."""
    from docuchat_rl.modeling import load_model_and_tokenizer

    return load_model_and_tokenizer(str(MODEL), dtype="float32", device="cpu")
