"""`overshoot report A --compare B`: the two reports side by side, per group present in both and per
client concurrency level, with deltas (relative for times and throughput, points for shares)."""

from __future__ import annotations

from rich.console import Console

from overshoot.report.table import fmt_num, hooks_line, report_table

CLIENT_METRICS = {
    "latency_ms_median": "latency ms (median)",
    "ttft_ms_median": "TTFT ms (median)",
    "itl_ms_p50": "ITL ms (p50)",
    "itl_ms_p99": "ITL ms (p99)",
    "tokens_per_s": "output tok/s",
    "tokens_per_s_per_request": "tok/s per request",
}


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
        for name in CLIENT_METRICS:
            va, vb = ra.get(name), rb.get(name)  # reports of older runs lack the ITL figures
            row[name] = {"a": va, "b": vb, "delta": _delta(va, vb, True)}
        rows.append(row)
    return rows


def _delta(a, b, relative: bool):
    if a is None or b is None:
        return None
    if relative:
        return None if a == 0 else 100.0 * (b - a) / a
    return b - a


def render_compare(a: dict, b: dict, rows: list[dict], console: Console) -> None:
    table = report_table(f"A = {a['run_id']}  vs  B = {b['run_id']}")
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
                fmt_num(v["a"], fmt),
                fmt_num(v["b"], fmt),
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
        client = report_table("client side, per concurrency level")
        for name in ("level", "metric", "A", "B", "B vs A"):
            client.add_column(name, justify="left" if name == "metric" else "right", no_wrap=True)
        for r in client_rows:
            for i, (name, label) in enumerate(CLIENT_METRICS.items()):
                v = r[name]
                delta = "-" if v["delta"] is None else f"{v['delta']:+.1f}%"
                fmt = ".2f" if name.startswith("itl") else ".1f"
                client.add_row(
                    str(r["concurrency"]) if i == 0 else "",
                    label,
                    fmt_num(v["a"], fmt),
                    fmt_num(v["b"], fmt),
                    delta,
                    end_section=i == len(CLIENT_METRICS) - 1,
                )
        console.print(client)
    for name, rep in (("A", a), ("B", b)):
        for g in rep["groups"]:
            console.print(f"- {name}: {g['verdict']}", highlight=False)
