"""The Python API on the embedded default, as a TRL user writes GRPOTrainer(...).train(): a recipe by name, a
reward function defined here (a lambda would do), rows in memory, train (with the held-out set before and
after), generate.

    python examples/python_api.py --steps 20 --out runs/api_example
"""

from __future__ import annotations

import argparse
import json

import docuchat_rl as dr


def brevity(completions, **kwargs):
    """A TRL-style reward: shorter completions score higher (0 at 0 characters, -1 at 200)."""
    return [-min(len(c), 200) / 200 for c in completions]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="runs/api_example")
    a = ap.parse_args()
    default = dr.recipe("default")  # the built-in recipe: its task's files, wherever the package is installed
    with open(default.data.train, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f][:400]  # (any list of dicts, or a datasets.Dataset)
    with open(default.data.test, encoding="utf-8") as f:
        held_out = [json.loads(line) for line in f][:64]
    trainer = dr.RLTrainer("default", rewards=["correctness", {"name": "format", "weight": 0.2}, {"function": brevity, "weight": 0.1}],
                           train_dataset=rows, eval_dataset=held_out,
                           overrides={"run.steps": a.steps, "run.output_dir": a.out, "run.overwrite": True,
                                      "logging.progress": False})
    with trainer:
        report = trainer.train()
        print(json.dumps({"before": report["before"]["accuracy"], "after": report["after"]["accuracy"]}))
        print(trainer.generate([held_out[0]["question"]])[0])


if __name__ == "__main__":
    main()
