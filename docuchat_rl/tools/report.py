"""Showing audit results: rich terminal layouts and a self-contained HTML report (plots inlined as PNG).

Deliberately left out: interactive (JavaScript) charts; the page must open anywhere, offline, as one file.
"""

from __future__ import annotations

import base64
import html
import io
import json
from typing import Any

from .audit import Finding, TraceStore


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def print_summary(summary: dict, findings: list[Finding], malformed: list[dict], console=None) -> None:
    """The audit summary on the console: per-step-range table, then the detectors."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    console.print(f"[bold]{summary['records']}[/] records, components: {', '.join(summary['components'])}")
    for m in malformed[:10]:
        console.print(f"[yellow]skipped malformed line {m['line']} of {m['source']}[/] ({m['why']}): {m['text']!r}")
    if len(malformed) > 10:
        console.print(f"[yellow]... and {len(malformed) - 10} more malformed lines[/]")
    over = Table(title="over time")
    for col in ("steps", "records", "reward", "accuracy", "format rate", "mean length", "truncated"):
        over.add_column(col, justify="right")
    for b in summary["bins"]:
        over.add_row(f"{b['steps'][0]}-{b['steps'][1]}", str(b["records"]), _fmt(b["reward_mean"]),
                     _fmt(b.get("accuracy")), _fmt(b.get("format_rate")), _fmt(b["mean_length"], 1),
                     _fmt(b["truncated_share"]))
    console.print(over)
    comp = Table(title="components per step range")
    for col in ("component", "steps", "mean", "std", "zero", "max", "errors"):
        comp.add_column(col, justify="right")
    for c in summary["components"]:
        for b in summary["bins"]:
            s = b[c]
            comp.add_row(c, f"{b['steps'][0]}-{b['steps'][1]}", _fmt(s["mean"]), _fmt(s["std"]),
                         _fmt(s["share_zero"]), _fmt(s["share_max"]), str(s["errors"]))
    console.print(comp)
    corr = next((v for k, v in summary.items() if k.startswith("correlation_with_")), None)
    if corr:
        console.print("correlation with accuracy: " + ", ".join(f"{k} {_fmt(v)}" for k, v in corr.items()))
    print_findings(findings, console)


def print_findings(findings: list[Finding], console=None) -> None:
    """Each detector's verdict on the console, with the examples of the ones that fired."""
    from rich.console import Console

    console = console or Console()
    for f in findings:
        mark = "[bold red]FIRED[/]" if f.fired else "[green]ok[/]"
        console.print(f"{mark} {f.check}: {f.detail} [dim](threshold: {f.threshold})[/]")
        if f.fired:
            for e in f.examples:
                console.print("    " + json.dumps(e, default=str, ensure_ascii=False)[:300])


def print_records(rows: list[dict], components: list[str], console=None) -> None:
    """Trace rows on the console: prompt, completion and each component's score and reason."""
    from rich.console import Console
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    console = console or Console()
    for r in rows:
        t = Table(show_header=True, box=None)
        for col in ("component", "raw", "weight", "weighted", "error", "info"):
            t.add_column(col)
        for c in components:
            s = r.get(c) or {}
            info = s.get("info")
            t.add_row(escape(c), _fmt(s.get("raw")), _fmt(s.get("weight")), _fmt(s.get("weighted")),
                      escape(s.get("error") or ""),
                      escape(info if isinstance(info, str) else json.dumps(info, ensure_ascii=False)))
        fields = [("model", r.get("model")), ("step", r.get("step")), ("prompt", r.get("prompt_id")),
                  ("group", None if r.get("group") is None and r.get("step") is None else f"{r.get('group')}/{r.get('sample')}"),
                  ("sample", r.get("sample") if r.get("step") is None else None),
                  ("total", None if r.get("total") is None else _fmt(r.get("total"))),
                  ("advantage", None if r.get("advantage") is None else _fmt(r.get("advantage"))),
                  ("tokens", r.get("completion_tokens"))]
        head = "  ".join(f"{k} {v}" for k, v in fields if v is not None) + ("  TRUNCATED" if r.get("truncated") else "")
        body = (f"[bold]prompt[/]\n{escape(r.get('prompt') or '')}\n[bold]completion[/]\n"
                f"{escape(r.get('completion') or '')}\n[bold]gold[/] {escape(str(r.get('gold')))}")
        console.print(Panel.fit(body, title=head, title_align="left"))
        console.print(t)


def _plot(plt, xs: list, ys: list, title: str, color: str) -> str:
    """One small chart: the per-step means (thin) and their moving average (thick), as base64 PNG."""
    fig, ax = plt.subplots(figsize=(5, 2.6))
    ys = [float("nan") if y is None else y for y in ys]
    ax.plot(xs, ys, lw=0.7, alpha=0.45, color=color)
    w = max(1, len(ys) // 20)
    if w > 1:
        smooth = [sum(ys[max(0, i - w + 1):i + 1]) / len(ys[max(0, i - w + 1):i + 1]) for i in range(len(ys))]
        ax.plot(xs, smooth, lw=1.8, color=color, label=f"moving average ({w} steps)")
        ax.legend(fontsize=7, loc="best")
    ax.set_title(title)
    ax.set_xlabel("step")
    png = _png(fig)
    plt.close(fig)
    return png


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _trace_html(trace: dict, store: TraceStore) -> str:
    """One completion's trace as the report shows it: where it is, the text, and each component's raw
    score, weight, contribution, error and reason."""
    e = html.escape
    head = " ".join(f"{k} <b>{e(str(trace.get(k)))}</b>" for k in ("step", "prompt_id", "sample", "group", "total",
                                                                      "completion_tokens", "truncated") if k in trace)
    rows = []
    for c in store.components:
        comp = trace.get(c) or {}
        rows.append(f"<tr><td>{e(c)}</td><td>{_fmt(comp.get('raw'))}</td><td>{_fmt(comp.get('weight'))}</td>"
                    f"<td>{_fmt(comp.get('weighted'))}</td><td>{e(str(comp.get('error') or ''))}</td>"
                    f"<td style='text-align:left'>{e(json.dumps(comp.get('info'), default=str)[:300])}</td></tr>")
    return (f"<p class='dim'>{head}</p><pre>{e(str(trace.get('prompt', ''))[:500])}</pre>"
            f"<pre>{e(str(trace.get('completion', ''))[:1500])}</pre><table><tr><th>component</th><th>raw</th>"
            f"<th>weight</th><th>contribution</th><th>error</th><th>reason</th></tr>{''.join(rows)}</table>")


def html_report(store: TraceStore, summary: dict, findings: list[Finding], title: str,
                evals: list[dict] | None = None, rescored: list[dict] | None = None) -> str:
    """A self-contained HTML page: the detectors (a fired one with an example trace beside it), the
    per-step-range table, plots of the traces and of the held-out evaluations (`evals`, from eval.jsonl),
    a rescore's changed completions before and now (`rescored`, audit.rescored_records), malformed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_step = store.con.execute(
        "SELECT step, avg(total), avg(completion_tokens), avg(truncated::INT) FROM traces GROUP BY step ORDER BY step"
    ).fetchall()
    steps = [r[0] for r in per_step]
    figs = []
    for c in store.components:
        vals = store.con.execute(f'SELECT step, avg("{c}".raw) FROM traces GROUP BY step ORDER BY step').fetchall()
        figs.append((c, _plot(plt, [v[0] for v in vals], [v[1] for v in vals], f"{c} (mean raw score)",
                              "tab:blue")))
    for idx, label in ((1, "total reward"), (2, "completion tokens"), (3, "truncated share")):
        figs.append((label, _plot(plt, steps, [r[idx] for r in per_step], f"{label} (mean)", "tab:orange")))
    evals = sorted(evals or [], key=lambda r: r["step"])
    keys = [k for k in dict.fromkeys(k for r in evals for k in r) if k not in ("step", "minutes")
            and all(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool) for r in evals)]
    eval_figs = [(f"held-out {k}", _plot(plt, [r["step"] for r in evals], [r[k] for r in evals],
                                         f"held-out {k} (eval.jsonl)", "tab:green")) for k in keys]
    e = html.escape
    rows = "".join(
        f"<tr><td>{b['steps'][0]}-{b['steps'][1]}</td><td>{b['records']}</td><td>{_fmt(b['reward_mean'])}</td>"
        f"<td>{_fmt(b.get('accuracy'))}</td><td>{_fmt(b.get('format_rate'))}</td><td>{_fmt(b['mean_length'], 1)}</td>"
        f"<td>{_fmt(b['truncated_share'])}</td></tr>" for b in summary["bins"])
    finds = []
    for f in findings:
        exs = "".join(f"<pre>{e(json.dumps(x, default=str, ensure_ascii=False, indent=1)[:1500])}</pre>"
                      for x in f.examples) if f.fired else ""
        if f.fired and f.trace is not None:
            exs += f"<details open><summary>an example and its trace</summary>{_trace_html(f.trace, store)}</details>"
        finds.append(f"<div class='finding {'fired' if f.fired else 'ok'}'><b>{'FIRED' if f.fired else 'ok'}</b> "
                     f"<code>{e(f.check)}</code>: {e(f.detail)} <span class='dim'>(threshold: {e(f.threshold)})"
                     f"</span>{exs}</div>")
    plots = "".join(f"<figure><img alt='{e(name)}' src='data:image/png;base64,{b64}'></figure>" for name, b64 in figs)
    eval_plots = "".join(f"<figure><img alt='{e(name)}' src='data:image/png;base64,{b64}'></figure>"
                         for name, b64 in eval_figs) or "<p>no eval.jsonl beside these traces</p>"
    def contributions(rewards: dict) -> str:
        return "<br>".join(f"{e(k)} {_fmt(c.get('weighted'))}" for k, c in rewards.items())

    changed = "".join(
        f"<tr><td>{r['step']}</td><td>{r['prompt_id']}</td><td>{r['sample']}</td><td style='text-align:left'>"
        f"<pre>{e(str(r.get('completion', ''))[:400])}</pre></td><td>{_fmt(r['before']['total'])}</td>"
        f"<td>{_fmt(r['total'])}</td><td>{_fmt(r['before'].get('advantage'))}</td><td>{_fmt(r.get('advantage'))}</td>"
        f"<td>{contributions(r['before'].get('rewards') or {})}</td><td>{contributions(r.get('rewards') or {})}</td>"
        "</tr>" for r in (rescored or [])[:200])
    rescore = (f"<h2>Rescored: before and now</h2><p>{len(rescored or [])} completions judged differently "
               "(the first 200)</p><table><tr><th>step</th><th>prompt</th><th>sample</th><th>completion</th>"
               "<th>total before</th><th>total now</th><th>advantage before</th><th>advantage now</th>"
               f"<th>contributions before</th><th>contributions now</th></tr>{changed}</table>") if rescored else ""
    malformed = "".join(f"<li>{e(m['source'])}:{m['line']} ({e(m['why'])}): <code>{e(m['text'])}</code></li>"
                        for m in store.malformed[:50])
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{e(title)}</title><style>
body{{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}} figure{{display:inline-block;margin:4px}}
.finding{{margin:6px 0;padding:6px;border-left:4px solid #3a3}} .fired{{border-color:#c33;background:#fee}}
.dim{{color:#777}} pre{{background:#f6f6f6;padding:6px;white-space:pre-wrap}}</style></head><body>
<h1>{e(title)}</h1><p>{summary['records']} completions; components: {e(', '.join(summary['components']))};
{len(store.malformed)} malformed lines skipped.</p>
{rescore}<h2>Detectors</h2>{''.join(finds) or '<p>no checks applied</p>'}
<h2>Over time</h2><table><tr><th>steps</th><th>records</th><th>reward</th><th>accuracy</th><th>format rate</th>
<th>mean length</th><th>truncated</th></tr>{rows}</table>
<h2>Held-out evaluation</h2>{eval_plots}
<h2>Plots</h2>{plots}
{f'<h2>Malformed lines</h2><ul>{malformed}</ul>' if malformed else ''}
</body></html>"""
