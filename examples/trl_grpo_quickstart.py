"""TRL's GRPO quickstart (its README, 2026) with one line changed: the trainer is docuchat-rl's.

    python examples/trl_grpo_quickstart.py [--max-steps 20]

What differs from TRL's page, and why: the import (the one change); the model and data set are the embedded
default's (no hub here: TRL's page loads Qwen/Qwen2-0.5B-Instruct and trl-lib/tldr; the rows below are in the same
shape, a "prompt" column); `max_steps` from the command line, so that CI runs a few steps (TRL's page trains three
epochs); and `max_completion_length=64`, since TRL's default of 512 new tokens would fill all 512 positions of the
embedded model (Qwen2's are 32,768). Everything else is TRL's code as written, and runs as TRL runs it: its
defaults included (learning_rate 1e-6, a linear schedule, 8 completions of one prompt a step, the prompt as the
data set gives it: docs/from_trl.md).
"""

import argparse

from datasets import Dataset
from trl import GRPOConfig

from docuchat_rl import RLTrainer as GRPOTrainer  # was: from trl import GRPOTrainer

ap = argparse.ArgumentParser()
ap.add_argument("--max-steps", type=int, default=20)
ap.add_argument("--output-dir", default="runs/Qwen2-0.5B-GRPO")
cli = ap.parse_args()

# (offline stand-in for load_dataset("trl-lib/tldr", split="train"): rows with a "prompt" column)
questions = [line.split('"question": "')[1].split('", "answer"')[0] for line in open("data/task/train.jsonl")][:512]
dataset = Dataset.from_list([{"prompt": q} for q in questions])


# Define the reward function, which rewards completions that are close to 20 characters
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


training_args = GRPOConfig(output_dir=cli.output_dir, logging_steps=10, max_steps=cli.max_steps, use_cpu=True,
                           max_completion_length=64)
trainer = GRPOTrainer(
    model="data/model",  # (TRL's page: "Qwen/Qwen2-0.5B-Instruct")
    reward_funcs=reward_len,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
