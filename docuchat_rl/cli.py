"""`docuchat-rl` command line: train, eval, audit, config.

    docuchat-rl train --config config/default.yaml [--set section.key=value ...] [--resume latest]
    docuchat-rl eval  --config config/default.yaml [--adapter runs/default/checkpoint-200] [--out eval.json]
    docuchat-rl config --config config/default.yaml --explain
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML config (default: built-in defaults = config/default.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set rollout.num_generations=4 (repeatable)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="docuchat-rl", description="Teach small language models to reason with RL "
                                 "(GRPO; PPO and A2C) on LoRA adapters, with traced rewards.")
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a LoRA adapter with RL; evaluates before and after")
    _common(t)
    t.add_argument("--resume", default=None, help="'latest', a run folder or a checkpoint folder")
    e = sub.add_parser("eval", help="greedy accuracy, pass@k and reward means on the held-out set")
    _common(e)
    e.add_argument("--adapter", default=None, help="a checkpoint folder (peft adapter) to apply")
    e.add_argument("--out", default=None, help="write the JSON here as well as to stdout")
    a = sub.add_parser("audit", help="inspect reward traces of a run (not yet: see issue 6)")
    a.add_argument("run_dir", nargs="?", help="a run folder or a traces.jsonl file")
    c = sub.add_parser("config", help="print the resolved config, or every key with its doc")
    _common(c)
    c.add_argument("--explain", action="store_true", help="list every key with its default and doc")
    return ap


def _run_eval(model, tokenizer, cfg) -> dict:
    from .evaluate import evaluate

    return evaluate(model, tokenizer, cfg)


def cmd_train(args) -> int:
    from .config import load_config
    from .trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    trainer = Trainer(cfg, resume=args.resume)
    model = trainer.accelerator.unwrap_model(trainer.model)
    report: dict = {}
    do_eval = cfg.eval.before_and_after and cfg.data.test
    if do_eval and trainer.step == 0:
        report["before"] = _run_eval(model, trainer.tokenizer, cfg)
        print("eval before:", json.dumps(report["before"]), flush=True)
    trainer.train()
    trainer.close()
    if do_eval:
        report["after"] = _run_eval(model, trainer.tokenizer, cfg)
        print("eval after: ", json.dumps(report["after"]), flush=True)
        path = Path(cfg.run.output_dir) / "eval.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
    out = Path(cfg.run.output_dir)
    print(f"outputs: {out / 'latest'} -> checkpoint, {out / 'metrics.jsonl'}, {out / 'traces.jsonl'}"
          + (f", {out / 'eval.json'}" if do_eval else ""))
    return 0


def cmd_eval(args) -> int:
    from .config import load_config
    from .evaluate import evaluate
    from .modeling import load_model_and_tokenizer

    cfg = load_config(args.config, args.overrides)
    m = cfg.model
    model, tok = load_model_and_tokenizer(m.name_or_path, m.dtype, m.device, m.trust_remote_code, m.revision)
    if args.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter)
    result = {"model": m.name_or_path, "adapter": args.adapter, **evaluate(model, tok, cfg)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def cmd_config(args) -> int:
    from .config import explain, load_config

    if args.explain:
        print(explain())
        return 0
    import yaml

    print(yaml.safe_dump(load_config(args.config, args.overrides).to_dict(), sort_keys=False))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from .config import ConfigError
    from .data import DataError

    try:
        if args.command == "train":
            return cmd_train(args)
        if args.command == "eval":
            return cmd_eval(args)
        if args.command == "config":
            return cmd_config(args)
        print("docuchat-rl audit: not yet (see issue 6)", file=sys.stderr)
        return 2
    except (ConfigError, DataError) as e:
        print(f"docuchat-rl: error: {e}", file=sys.stderr)
        return 2
