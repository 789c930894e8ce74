"""`docuchat-rl` command line: train, eval, audit, config.

    docuchat-rl train --config config/default.yaml [--set section.key=value ...] [--resume latest]
    docuchat-rl eval  --config config/default.yaml [--adapter runs/default/checkpoint-200] [--out eval.json]
    docuchat-rl config --config config/default.yaml --explain
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import warnings
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
    a = sub.add_parser("audit", help="summaries, filters, reward-hacking detectors, compare, HTML report of traces",
                       description="Audit reward traces. Filters are DuckDB SQL expressions over the trace "
                       "fields and one struct per reward component, e.g. --where \"correctness.raw == 0 and "
                       "format.raw == 1\" --sort \"advantage desc\" --limit 5.")
    a.add_argument("runs", nargs="*", help="run folders or trace files (several are read together)")
    a.add_argument("--where", help="SQL filter, e.g. \"advantage > 1 and step >= 100\"")
    a.add_argument("--sort", help="SQL order, e.g. \"total desc\"")
    a.add_argument("--limit", type=int, default=None, help="most records shown/exported (default 10 shown)")
    a.add_argument("--export", help="write the selection to a .jsonl or .csv file")
    a.add_argument("--html", help="write a self-contained HTML report here")
    a.add_argument("--bins", type=int, default=5, help="step ranges in the summary and detectors")
    a.add_argument("--accuracy", default="correctness", help="component used as accuracy")
    a.add_argument("--compare", nargs=2, metavar=("A", "B"),
                   help="two selections RUN[@STEP[-STEP]]: prompts that flipped correct<->wrong")
    a.add_argument("--json", action="store_true", help="machine-readable output")
    c = sub.add_parser("config", help="print the resolved config, or every key with its doc")
    _common(c)
    c.add_argument("--explain", action="store_true", help="list every key with its default and doc")
    return ap


def cmd_train(args) -> int:
    from .config import load_config
    from .trainer import Trainer

    from .errors import Preempted

    cfg = load_config(args.config, args.overrides)
    trainer = Trainer(cfg, resume=args.resume)
    report: dict = {}
    do_eval = cfg.eval.before_and_after and cfg.data.test
    try:
        if do_eval and trainer.step == 0:
            report["before"] = trainer.evaluate()
            print("eval before:", json.dumps(report["before"]), flush=True)
        trainer.train()
    except Preempted as p:
        resume = ["docuchat-rl", "train", *(["--config", args.config] if args.config else []),
                  *[a for s in args.overrides for a in ("--set", s)], "--resume", "latest"]
        print(f"docuchat-rl: {p}; resume with: {shlex.join(resume)}", file=sys.stderr, flush=True)
        return 128 + p.signal_number
    finally:
        trainer.close()
    if do_eval:
        last = trainer.last_eval
        # the periodic eval of the final step is the same evaluation: reuse it
        report["after"] = ({k: v for k, v in last.items() if k not in ("step", "minutes")}
                           if last and last["step"] == trainer.step else trainer.evaluate())
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
        print(explain(load_config(args.config, args.overrides)))
        return 0
    import yaml

    print(yaml.safe_dump(load_config(args.config, args.overrides).to_dict(), sort_keys=False))
    return 0


def cmd_audit(args) -> int:
    from rich.console import Console

    from .audit import AuditError, TraceStore, compare, export
    from .report import html_report, print_findings, print_records, print_summary

    console = Console()
    if args.compare:
        result = compare(*args.compare, accuracy=args.accuracy)
        if args.json:
            print(json.dumps(result, default=str))
        else:
            console.print(f"{result['prompts_in_both']} prompts in both; correct: {result['correct_a']} in A, "
                          f"{result['correct_b']} in B; [red]{result['correct_to_wrong']} correct -> wrong[/], "
                          f"[green]{result['wrong_to_correct']} wrong -> correct[/]")
            for key in ("examples_correct_to_wrong", "examples_wrong_to_correct"):
                for e in result[key]:
                    console.print(f"  {key.removeprefix('examples_')}: prompt {e['prompt_id']} "
                                  f"({e['a']:.2f} -> {e['b']:.2f}): {e['prompt'][:100]}")
        return 0
    if not args.runs:
        raise AuditError("give a run folder or a traces file (or --compare A B)")
    with TraceStore(args.runs) as store:
        selecting = args.where or args.sort or args.export or args.limit is not None
        if selecting:
            rows = store.select(args.where, args.sort, args.limit if args.limit is not None else
                                (None if args.export else 10))
            if args.export:
                export(rows, args.export)
                console.print(f"wrote {len(rows)} records to {args.export}")
            elif args.json:
                print(json.dumps(rows, default=str))
            else:
                total = store.count(args.where)
                print_records(rows, store.components, console)
                console.print(f"showing {len(rows)} of {total} matching records")
        summary = findings = None
        if not selecting or args.html:
            summary = store.summary(args.bins, args.accuracy)
            findings = store.detect(args.bins, args.accuracy)
        if not selecting:
            if args.json:
                print(json.dumps({"summary": summary, "findings": [f.__dict__ for f in findings],
                                  "malformed": store.malformed}, default=str))
            else:
                print_summary(summary, findings, store.malformed, console)
        if args.html:
            Path(args.html).write_text(html_report(store, summary, findings, f"docuchat-rl audit: "
                                                   f"{', '.join(map(str, args.runs))}"))
            console.print(f"wrote {args.html}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # peft reads transformers' deprecated `is_gradient_checkpointing` on every PeftModel: noise, not ours.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    from rewards import RewardError

    from .audit import AuditError
    from .config import ConfigError
    from .data import DataError
    from .errors import CheckpointError, CheckpointWarning, ModelError, TrainingError

    plain = warnings.formatwarning  # a damaged checkpoint skipped on resume: one line, like our errors
    warnings.formatwarning = lambda message, category, *a, **k: (
        f"docuchat-rl: warning: {message}\n" if issubclass(category, CheckpointWarning)
        else plain(message, category, *a, **k))

    try:
        if args.command == "train":
            return cmd_train(args)
        if args.command == "eval":
            return cmd_eval(args)
        if args.command == "config":
            return cmd_config(args)
        return cmd_audit(args)
    except (ConfigError, DataError, AuditError, TrainingError, ModelError, CheckpointError, RewardError,
            FileNotFoundError) as e:
        print(f"docuchat-rl: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the disk: full, read-only, a size limit
        where = f" ({e.filename})" if e.filename else ""
        print(f"docuchat-rl: error: could not write{where}: {e.strerror or e}; the last checkpoint is intact",
              file=sys.stderr)
        return 2
