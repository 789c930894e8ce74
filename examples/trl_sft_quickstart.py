"""TRL's SFT quickstart (its README, 2026) with one line changed: the trainer is docuchat-rl's; then the RL stage
from its adapter, one argument more.

    python examples/trl_sft_quickstart.py [--max-steps 20]

What differs from TRL's page, and why: the import (the one change); the model and data set are the embedded
default's (no hub here: TRL's page loads Qwen/Qwen2.5-0.5B and trl-lib/Capybara; the rows below are in its shape,
"messages" conversations); `max_steps` from the command line so that CI runs a few steps. The last lines go on
as a notebook would: GRPO from the SFT adapter (`start_from=trainer`).
"""

import argparse
import json

from datasets import Dataset
from trl import GRPOConfig, SFTConfig

from docuchat_rl import RLTrainer
from docuchat_rl import SFTTrainer  # was: from trl import SFTTrainer

ap = argparse.ArgumentParser()
ap.add_argument("--max-steps", type=int, default=20)
ap.add_argument("--output-dir", default="runs/Qwen2.5-0.5B-SFT")
cli = ap.parse_args()

# (offline stand-in for load_dataset("trl-lib/Capybara", split="train"): conversations in "messages")
rows = [json.loads(line) for line in open("data/task/train.jsonl")][:512]
dataset = Dataset.from_list([{"messages": [{"role": "user", "content": r["question"]},
                                           {"role": "assistant", "content": r["answer"]}]} for r in rows])

trainer = SFTTrainer(
    model="data/model",  # (TRL's page: "Qwen/Qwen2.5-0.5B")
    train_dataset=dataset,
    args=SFTConfig(output_dir=cli.output_dir, max_steps=cli.max_steps, use_cpu=True),
)
trainer.train()

# then RL from the SFT adapter: one argument more (it says which checkpoint it starts from)
rl = RLTrainer(model="data/model", reward_funcs=["correctness"], start_from=trainer,
               args=GRPOConfig(output_dir=cli.output_dir + "-grpo", max_steps=2, use_cpu=True,
                               max_completion_length=64))  # (TRL's 512 would fill the embedded model's positions)
print(rl.train()["after"]["accuracy"])
