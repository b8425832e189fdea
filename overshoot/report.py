"""`overshoot report`: the summary as a plain dict (what --json prints) and its rich rendering."""

from __future__ import annotations

import math

import pandas as pd
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from overshoot.analyze import group_title, summarize
from overshoot.whatif import WhatIf

DEFAULT_WHAT_IFS = [WhatIf("gpu", -0.10), WhatIf("cpu", -0.10)]


def build_report(
    run,
    *,
    what_ifs: list[WhatIf] | None = None,
    cpu_bound_ms: float = 0.02,
    warmup_steps: int = 0,
    mode: str | None = None,
) -> dict:
    what_ifs = list(what_ifs) if what_ifs else list(DEFAULT_WHAT_IFS)
    summary = summarize(
        run, cpu_bound_ms=cpu_bound_ms, warmup_steps=warmup_steps, mode=mode, what_ifs=what_ifs
    )
    groups = []
    for row in summary.groups.to_dict("records"):
        row = {k: _plain(v) for k, v in row.items()}
        changes = {w.label: row.pop(f"whatif:{w.label}") for w in what_ifs}
        row["title"] = group_title(row, summary.group_keys)
        row["what_if_pct"] = changes
        row["verdict"] = _verdict(row, what_ifs, summary.mode.mode)
        groups.append(row)
    return {
        "run_id": run.run_id,
        "engine": (run.meta or {}).get("engine") or next((p.get("engine") for p in run.processes), None),
        "mode": summary.mode.mode,
        "mode_source": summary.mode.source,
        "cpu_bound_ms": cpu_bound_ms,
        "warmup_steps": warmup_steps,
        "primary": {"pid": summary.primary[0], "thread": summary.primary[1]},
        "group_keys": summary.group_keys,
        "what_ifs": [w.label for w in what_ifs],
        "groups": groups,
        "client": client_stats(run.client),
        "hook_problems": hook_problems(run),
        "notes": summary.notes,
        "warnings": list(run.warnings),
    }


def hook_problems(run) -> list[dict]:
    """Hooks that were disabled or failed, one entry per (target, role): {target, role, status, reason}.

    From meta.json["hooks"] (written by `overshoot run`: every process's statuses), else from the recorders'
    process json (a server started with the hooks by hand). A target counts as it fared best in any process
    (as `overshoot run` prints it): "disabled" when no process installed it; "failed" when it is installed
    but part of it was switched off at run time (its facts or GPU events raised, status "installed" with a
    reason). Targets still pending (their module never imported) are not problems of the hooks.
    """
    meta_hooks = (run.meta or {}).get("hooks")
    if isinstance(meta_hooks, list):
        entries = meta_hooks
    else:
        entries = [dict(h, pid=p.get("pid")) for p in run.processes for h in p.get("hooks") or []]
    rank = {"installed": 0, "pending": 1, "disabled": 2}
    best: dict[tuple, dict] = {}
    for e in entries:
        if not isinstance(e, dict):
            continue
        key = (e.get("target", "?"), e.get("role", ""))
        if key not in best or rank.get(e.get("status"), 3) < rank.get(best[key].get("status"), 3):
            best[key] = e
    problems = []
    for (target, role), e in best.items():
        status, reason = e.get("status"), e.get("reason") or ""
        if status == "installed" and reason:
            status = "failed"
        if status in ("disabled", "failed"):
            problems.append({"target": target, "role": role, "status": status, "reason": reason})
    return problems


def hooks_line(problems: list[dict]) -> str:
    """The one line under the report's table: 'hooks disabled or failed (2): T (busy) disabled: why; ...'."""
    items = [
        f"{p['target']} ({p['role']}) {p['status']}: {p['reason'] or 'no reason given'}" for p in problems
    ]
    return f"hooks disabled or failed ({len(items)}): " + "; ".join(items)


def _plain(value):
    """JSON-safe scalars: numpy -> Python, NaN/NA -> None."""
    if value is None or value is pd.NA:
        return None
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _pct(value, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}%"


def _verdict(row: dict, what_ifs: list[WhatIf], mode: str) -> str:
    """One line per group. Sync engines wait every step, so their CPU share leads, not the CPU-bound share."""
    bound = f"{_pct(row['cpu_bound_pct'])} of steps CPU-bound"
    share = f"CPU busy {_pct(row['cpu_share_pct'])} of the step"
    parts = [share, bound] if mode == "sync" and row["cpu_share_pct"] is not None else [bound]
    idle = row["gpu_idle_pct"]
    parts.append("GPU idle n/a (no GPU times)" if idle is None else f"GPU idle {_pct(idle)}")
    for w in what_ifs:
        change = row["what_if_pct"][w.label]
        if change is not None:
            parts.append(w.describe(change))
    return f"{row['title']}: " + "; ".join(parts)


def client_stats(client: pd.DataFrame | None) -> list[dict]:
    """Per concurrency level: requests, errors, latency and TTFT (median, p90), output tokens/s."""
    if client is None or len(client) == 0:
        return []
    rows = []
    for level, df in client.groupby("concurrency", sort=True):
        ok = df[df["ok"].astype(bool)]
        window_s = (df["end_ns"].max() - df["start_ns"].min()) / 1e9
        tokens = int(ok["completion_tokens"].sum())
        per_request = ok["completion_tokens"] / (ok["latency_ms"] / 1e3)
        rows.append(
            {
                k: _plain(v)
                for k, v in {
                    "concurrency": int(level),
                    "requests": len(df),
                    "errors": int(len(df) - len(ok)),
                    "latency_ms_median": ok["latency_ms"].median(),
                    "latency_ms_p90": ok["latency_ms"].quantile(0.9),
                    "ttft_ms_median": ok["ttft_ms"].median(),
                    "ttft_ms_p90": ok["ttft_ms"].quantile(0.9),
                    "output_tokens": tokens,
                    "tokens_per_s": tokens / window_s if window_s > 0 else None,
                    "tokens_per_s_per_request": per_request.median(),
                }.items()
            }
        )
    return rows


def _num(value, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def render(report: dict, console: Console) -> None:
    table = _groups_table(report, report["what_ifs"])
    wide = console.options.update_width(10_000)  # measure unclamped: Measurement caps at the options width
    narrow = report["what_ifs"] and Measurement.get(console, wide, table).maximum > console.width
    if narrow:  # the what-if numbers are also in the verdict lines: drop them before any number is cut
        table = _groups_table(report, [])
    console.print(table)
    if narrow:
        console.print("(what-if columns left out at this width: see the lines below, or widen the terminal)",
                      highlight=False)
    if report.get("hook_problems"):  # right under the table: these numbers lack what those hooks measure
        console.print(hooks_line(report["hook_problems"]), highlight=False, markup=False)
    for g in report["groups"]:
        console.print(f"- {g['verdict']}", highlight=False)
    if report["client"]:
        console.print(_client_table(report["client"]))
    for note in report["notes"]:
        console.print(f"[dim]note: {note}[/dim]", highlight=False)


def _groups_table(report: dict, what_ifs: list[str]) -> Table:
    keys = report["group_keys"]
    title = f"overshoot report: {report['run_id']}" + (
        f" ({report['engine']})" if report.get("engine") else ""
    )
    table = _table(title)
    if "concurrency" in keys:
        table.add_column("level", justify="right", no_wrap=True)
    for name in (
        "phase",
        "batch",
        "steps",
        "step\nms",
        "p90\nms",
        "busy\nms",
        "wait\nms",
        "GPU\nms",
        "CPU-\nbound",
        "GPU\nidle",
        "CPU\nshare",
    ):
        table.add_column(name, justify="left" if name == "phase" else "right", no_wrap=True)
    for label in what_ifs:
        table.add_column(f"step if\n{label}", justify="right", no_wrap=True)
    for g in report["groups"]:
        cells = [_level_cell(g)] if "concurrency" in keys else []
        cells += [
            g["phase"],
            str(g["batch_size"]),
            str(g["steps"]),
            _num(g["step_ms_median"]),
            _num(g["step_ms_p90"]),
            _num(g["busy_ms_median"]),
            _num(g["wait_ms_median"]),
            _num(g["gpu_ms_median"]),
            _pct(g["cpu_bound_pct"]),
            _pct(g["gpu_idle_pct"]),
            _pct(g["cpu_share_pct"]),
        ]
        cells += [
            _num(g["what_if_pct"][label], "+.1f") + "%" if g["what_if_pct"][label] is not None else "-"
            for label in what_ifs
        ]
        table.add_row(*cells)
    return table


def _level_cell(group: dict) -> str:
    if group.get("concurrency") is None:
        return "warm-up" if group.get("load_window") == "warmup" else "-"
    return str(group["concurrency"])


def _table(title: str) -> Table:
    # Compact: fits 80 columns for the common case (no level column, two what-ifs).
    return Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 0),
        pad_edge=False,
        show_edge=False,
    )


def _client_table(rows: list[dict]) -> Table:
    table = _table("client side, per concurrency level")
    for name in (
        "level",
        "requests",
        "errors",
        "latency\nms",
        "latency\np90",
        "TTFT\nms",
        "TTFT\np90",
        "output\ntok/s",
        "tok/s per\nrequest",
    ):
        table.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(
            str(r["concurrency"]),
            str(r["requests"]),
            str(r["errors"]),
            _num(r["latency_ms_median"], ".1f"),
            _num(r["latency_ms_p90"], ".1f"),
            _num(r["ttft_ms_median"], ".1f"),
            _num(r["ttft_ms_p90"], ".1f"),
            _num(r["tokens_per_s"], ".1f"),
            _num(r["tokens_per_s_per_request"], ".1f"),
        )
    return table


def _key(g: dict, keys: list[str]) -> tuple:
    return tuple(g.get(k) for k in keys)


def compare(a: dict, b: dict) -> list[dict]:
    """A vs B per group present in both (and per client level): values and deltas."""
    keys = [k for k in a["group_keys"] if k in b["group_keys"]]
    b_groups = {_key(g, keys): g for g in b["groups"]}
    rows = []
    for ga in a["groups"]:
        gb = b_groups.get(_key(ga, keys))
        if gb is None:
            continue
        row = {"title": ga["title"], **{k: ga.get(k) for k in keys}}
        for name, relative in (
            ("step_ms_median", True),
            ("busy_ms_median", True),
            ("gpu_ms_median", True),
            ("cpu_bound_pct", False),
            ("gpu_idle_pct", False),
        ):
            va, vb = ga[name], gb[name]
            row[name] = {"a": va, "b": vb, "delta": _delta(va, vb, relative)}
        rows.append(row)
    return rows


def compare_client(a: dict, b: dict) -> list[dict]:
    """Client-side figures per concurrency level present in both runs."""
    b_levels = {r["concurrency"]: r for r in b["client"]}
    rows = []
    for ra in a["client"]:
        rb = b_levels.get(ra["concurrency"])
        if rb is None:
            continue
        row = {"concurrency": ra["concurrency"]}
        for name in ("latency_ms_median", "ttft_ms_median", "tokens_per_s", "tokens_per_s_per_request"):
            row[name] = {"a": ra[name], "b": rb[name], "delta": _delta(ra[name], rb[name], True)}
        rows.append(row)
    return rows


def _delta(a, b, relative: bool):
    if a is None or b is None:
        return None
    if relative:
        return None if a == 0 else 100.0 * (b - a) / a
    return b - a


def render_compare(a: dict, b: dict, rows: list[dict], console: Console) -> None:
    table = _table(f"A = {a['run_id']}  vs  B = {b['run_id']}")
    for name, justify in (
        ("group", "left"),
        ("metric", "left"),
        ("A", "right"),
        ("B", "right"),
        ("B vs A", "right"),
    ):
        table.add_column(name, justify=justify, no_wrap=name != "group")
    spec = [
        ("step_ms_median", "step ms (median)", ".2f", "%"),
        ("busy_ms_median", "busy ms (median)", ".2f", "%"),
        ("gpu_ms_median", "GPU ms (median)", ".2f", "%"),
        ("cpu_bound_pct", "CPU-bound %", ".0f", " pts"),
        ("gpu_idle_pct", "GPU idle %", ".1f", " pts"),
    ]
    for r in rows:
        for i, (name, label, fmt, unit) in enumerate(spec):
            v = r[name]
            delta = "-" if v["delta"] is None else f"{v['delta']:+.1f}{unit}"
            table.add_row(
                r["title"] if i == 0 else "",
                label,
                _num(v["a"], fmt),
                _num(v["b"], fmt),
                delta,
                end_section=i == len(spec) - 1,
            )
    console.print(table)
    for name, rep in (("A", a), ("B", b)):
        if rep.get("hook_problems"):
            console.print(f"{name}: {hooks_line(rep['hook_problems'])}", highlight=False, markup=False)
    if not rows:
        console.print("no group (level, phase, batch size) is present in both runs", highlight=False)
    client_rows = compare_client(a, b)
    if client_rows:
        client = _table("client side, per concurrency level")
        for name in ("level", "metric", "A", "B", "B vs A"):
            client.add_column(name, justify="left" if name == "metric" else "right", no_wrap=True)
        labels = {
            "latency_ms_median": "latency ms (median)",
            "ttft_ms_median": "TTFT ms (median)",
            "tokens_per_s": "output tok/s",
            "tokens_per_s_per_request": "tok/s per request",
        }
        for r in client_rows:
            for i, (name, label) in enumerate(labels.items()):
                v = r[name]
                delta = "-" if v["delta"] is None else f"{v['delta']:+.1f}%"
                client.add_row(
                    str(r["concurrency"]) if i == 0 else "",
                    label,
                    _num(v["a"], ".1f"),
                    _num(v["b"], ".1f"),
                    delta,
                    end_section=i == len(labels) - 1,
                )
        console.print(client)
    for name, rep in (("A", a), ("B", b)):
        for g in rep["groups"]:
            console.print(f"- {name}: {g['verdict']}", highlight=False)
