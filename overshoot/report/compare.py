"""`overshoot report A --compare B`: the two reports side by side, per group (groups of only one run stay,
with a dash for the other) and per client concurrency level, with deltas (relative for times and throughput,
points for shares), each with a bootstrap interval that says whether it is outside the noise."""

from __future__ import annotations

import numpy as np
from rich.console import Console

from overshoot.analysis import noise
from overshoot.report.fmt import fmt_num, report_table, signed
from overshoot.report.table import hooks_line

# (report key, label, format, relative delta?)
METRICS = (
    ("step_ms_median", "step ms (median)", ".2f", True),
    ("busy_ms_median", "busy ms (median)", ".2f", True),
    ("gpu_ms_median", "GPU ms (median)", ".2f", True),
    ("cpu_bound_pct", "CPU-bound %", ".0f", False),
    ("gpu_idle_pct", "GPU idle %", ".1f", False),
)
SIDES = {"both": "", "a": " (only in A)", "b": " (only in B)"}

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


def compare(a: dict, b: dict, *, samples_a: list | None = None, samples_b: list | None = None) -> list[dict]:
    """A vs B per group of either run: values, deltas and, given each report's per-group step samples
    (noise.summary_samples), a bootstrap interval per delta. A group of one run only has None for the
    other's values."""
    keys = [k for k in a["group_keys"] if k in b["group_keys"]]
    b_index = {_key(g, keys): i for i, g in enumerate(b["groups"])}
    pairs: list[tuple[int | None, int | None]] = []
    for i, ga in enumerate(a["groups"]):
        pairs.append((i, b_index.pop(_key(ga, keys), None)))
    pairs += [(None, j) for j in b_index.values()]
    rng = np.random.default_rng(noise.SEED)
    rows = []
    for i, j in pairs:
        ga = a["groups"][i] if i is not None else None
        gb = b["groups"][j] if j is not None else None
        head = ga if ga is not None else gb
        side = "both" if ga is not None and gb is not None else ("a" if gb is None else "b")
        row = {"title": head["title"], "in": side, **{k: head.get(k) for k in keys}}
        intervals = {}
        if side == "both" and samples_a is not None and samples_b is not None:
            intervals = noise.delta_intervals(samples_a[i], samples_b[j], rng)
        for name, _, _, relative in METRICS:
            va = ga.get(name) if ga else None
            vb = gb.get(name) if gb else None
            interval = intervals.get(name)
            row[name] = {
                "a": va,
                "b": vb,
                "delta": _delta(va, vb, relative),
                "interval": list(interval) if interval else None,
                "beyond_noise": noise.beyond_noise(interval),
            }
        row["busy_by_label"] = _labels(ga, gb, "busy_by_label")
        row["gpu_idle_by_label"] = _labels(ga, gb, "gpu_idle_by_label")
        rows.append(row)
    return rows


def _labels(ga: dict | None, gb: dict | None, key: str) -> list[dict]:
    """Per label of either group's `key` split (busy_by_label: ms of the median busy; gpu_idle_by_label: GPU
    idle ms a step while the thread was in it): A, B and the relative delta."""
    by_a = {r["label"]: r["ms"] for r in (ga or {}).get(key) or []}
    by_b = {r["label"]: r["ms"] for r in (gb or {}).get(key) or []}
    names = [*by_a, *(n for n in by_b if n not in by_a)]
    return [
        {"label": n, "a": by_a.get(n), "b": by_b.get(n), "delta": _delta(by_a.get(n), by_b.get(n), True)}
        for n in names
    ]


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


def _noise_cells(v: dict, unit: str) -> tuple[str, str]:
    if v["interval"] is None:
        return "-", "-"
    low, high = v["interval"]
    fmt = ".1f"
    where = "outside" if v["beyond_noise"] else "inside"
    return f"[{signed(low, fmt)}, {signed(high, fmt)}]{unit}", where


def render_compare(a: dict, b: dict, rows: list[dict], console: Console, *, by_label: bool = False) -> None:
    for name, rep in (("A", a), ("B", b)):
        if rep.get("status_line"):
            console.print(f"{name}: {rep['status_line']}", highlight=False, markup=False, style="bold")
    table = report_table(f"A = {a['run_id']}  vs  B = {b['run_id']}")
    for name, justify in (
        ("group", "left"),
        ("metric", "left"),
        ("A", "right"),
        ("B", "right"),
        ("B vs A", "right"),
        (f"{noise.CONFIDENCE:.0%} interval", "right"),
        ("noise", "left"),
    ):
        table.add_column(name, justify=justify, no_wrap=name != "group")
    for r in rows:
        lines = []
        for name, label, fmt, relative in METRICS:
            v = r[name]
            unit = "%" if relative else " pts"
            lines.append((label, fmt_num(v["a"], fmt), fmt_num(v["b"], fmt), signed(v["delta"], ".1f", unit),
                          *_noise_cells(v, unit)))  # fmt: skip
        if by_label:
            for key, what in (("busy_by_label", "busy"), ("gpu_idle_by_label", "GPU idle in")):
                for item in r[key]:
                    lines.append((f"  {what}: {item['label']}", fmt_num(item["a"]), fmt_num(item["b"]),
                                  signed(item["delta"], ".1f", "%"), "", ""))  # fmt: skip
        for i, cells in enumerate(lines):
            title = r["title"] + SIDES[r["in"]] if i == 0 else ""
            table.add_row(title, *cells, end_section=i == len(lines) - 1)
    console.print(table)
    if any(r[m]["interval"] for r in rows for m, *_ in METRICS):
        console.print(
            f"noise: {noise.METHOD}; 'outside' when the interval of B vs A excludes zero", highlight=False
        )
    for name, rep in (("A", a), ("B", b)):
        if rep.get("hook_problems"):
            console.print(f"{name}: {hooks_line(rep['hook_problems'])}", highlight=False, markup=False)
    if not any(r["in"] == "both" for r in rows):
        console.print("no group (level, phase, batch size) is present in both runs", highlight=False)
    client_rows = compare_client(a, b)
    if client_rows:
        client = report_table("client side, per concurrency level")
        for name in ("level", "metric", "A", "B", "B vs A"):
            client.add_column(name, justify="left" if name == "metric" else "right", no_wrap=True)
        for r in client_rows:
            for i, (name, label) in enumerate(CLIENT_METRICS.items()):
                v = r[name]
                fmt = ".2f" if name.startswith("itl") else ".1f"
                client.add_row(
                    str(r["concurrency"]) if i == 0 else "",
                    label,
                    fmt_num(v["a"], fmt),
                    fmt_num(v["b"], fmt),
                    signed(v["delta"], ".1f", "%"),
                    end_section=i == len(CLIENT_METRICS) - 1,
                )
        console.print(client)
    for name, rep in (("A", a), ("B", b)):
        for g in rep["groups"]:
            console.print(f"- {name}: {g['verdict']}", highlight=False)
