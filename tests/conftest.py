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


def with_lora(model, target_modules, r: int = 4, alpha: float = 8):
    """`model` with a LoRA adapter whose B matrices are non-zero (as after training), seeded."""
    import torch
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, task_type="CAUSAL_LM"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return pm
