"""What-if projections: step times if GPU work or CPU work were x% faster (model: docs/concepts.md).

Preferred model, when the primary timeline has GPU times: replay the recorded dependency structure.
Per step the thread runs busy CPU segments, launches its GPU work once (at the launch point L) and waits
(at most one merged wait region per step). GPU work runs in order on its stream, starting at
max(L', previous GPU end'); a wait ends at max(wait start', awaited GPU end') + the recorded wake-up residual.
Idle time between steps is kept as recorded. Fallback without GPU times: a per-step model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

# A wait awaits the latest GPU work that ended by the wait's end plus this (CUDA event placement error);
# a wait no longer than SHORT_WAIT_NS (the thread did not really block) awaits work ended by its start + this.
AWAIT_TOLERANCE_NS = 20_000
SHORT_WAIT_NS = 20_000
_SPEC = re.compile(r"^\s*(gpu|cpu)\s*=\s*([+-]?\d+(?:\.\d+)?)\s*(%?)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class WhatIf:
    target: str  # "gpu" | "cpu"
    change: float  # relative change of that side's durations: -0.10 = 10% faster

    @property
    def label(self) -> str:
        return f"{self.target}{self.change * 100:+g}%"

    def describe(self, step_change_pct: float) -> str:
        side = "GPU step" if self.target == "gpu" else "CPU work per step"
        speed = "faster" if self.change < 0 else "slower"
        verb = "shorten" if step_change_pct <= 0 else "lengthen"
        return (
            f"a {abs(self.change) * 100:g}% {speed} {side} would {verb} steps by {abs(step_change_pct):.1f}%"
        )


def parse_what_if(text: str) -> WhatIf:
    """'gpu=-10%' or 'cpu=-0.1' (a bare number below 1 in magnitude is a fraction) -> WhatIf."""
    match = _SPEC.match(text)
    if not match:
        raise ValueError(f"bad --what-if {text!r}: expected gpu=-10% or cpu=-10%")
    target, number, percent = match.group(1).lower(), float(match.group(2)), match.group(3)
    change = number / 100 if percent or abs(number) >= 1 else number
    if change <= -1:
        raise ValueError(f"bad --what-if {text!r}: a side cannot get 100% or more faster")
    return WhatIf(target, change)


@dataclass
class Projection:
    model: str  # "replay" | "per-step" | "none"
    baseline_ms: np.ndarray  # what the model gives with nothing changed (replay) or the recorded step_ms
    projected_ms: dict[str, np.ndarray]  # WhatIf.label -> projected step ms, aligned to the timeline rows
    fit_error: float | None = None  # replay baseline total vs recorded total, relative


def project(
    timeline: pd.DataFrame, spans: pd.DataFrame | None, what_ifs: list[WhatIf], *, mode: str
) -> Projection:
    """Projected step times of one timeline (rows sorted by start_ns) for each what-if."""
    recorded = timeline["step_ms"].to_numpy(dtype="float64")
    if not what_ifs:  # nothing to project: skip the replay
        return Projection("none", recorded, {})
    if timeline["gpu_end_ns"].notna().sum() == 0:
        return Projection("per-step", recorded, {w.label: _per_step(timeline, w, mode) for w in what_ifs})
    plan = _replay_plan(timeline, spans)
    baseline = _replay(plan, cpu_scale=1.0, gpu_scale=1.0)
    projected = {}
    for w in what_ifs:
        scale = 1.0 + w.change
        projected[w.label] = _replay(
            plan, cpu_scale=scale if w.target == "cpu" else 1.0, gpu_scale=scale if w.target == "gpu" else 1.0
        )
    fit = float(baseline.sum() / recorded.sum() - 1.0) if recorded.sum() > 0 else None
    return Projection("replay", baseline, projected, fit)


def _per_step(timeline: pd.DataFrame, w: WhatIf, mode: str) -> np.ndarray:
    """No GPU times. sync: step = busy + wait, the wait standing for the GPU work not hidden behind the CPU.
    async: step = max(CPU busy, GPU path); the GPU path is known (busy + wait) only in steps that waited;
    in the others it is at most the busy time, which bounds the projection."""
    busy = timeline["busy_ms"].to_numpy(dtype="float64")
    wait = timeline["wait_ms"].to_numpy(dtype="float64")
    cpu, gpu = (1.0 + w.change, 1.0) if w.target == "cpu" else (1.0, 1.0 + w.change)
    if mode == "sync":
        return busy * cpu + wait * gpu
    gpu_path = np.where(wait > 0, busy + wait, busy)
    return np.maximum(busy * cpu, gpu_path * gpu)


@dataclass
class _Plan:
    """Per step of the timeline (numpy arrays, ns)."""

    gap: np.ndarray  # idle/untracked time before the step (kept as recorded)
    c0: np.ndarray  # busy before the first event (launch or wait)
    c1: np.ndarray  # busy between the two events
    c2: np.ndarray  # busy after the second event
    wait_first: np.ndarray  # True: the step waits before it launches
    gpu_ns: np.ndarray  # GPU duration, 0 when the step launched nothing
    has_gpu: np.ndarray
    awaited: np.ndarray  # row index of the GPU work the wait awaits, -1: a wait on something else
    residual: np.ndarray  # wait end - max(wait start, awaited GPU end): wake-up latency, kept
    fixed_wait: np.ndarray  # duration of waits that await no GPU work (kept as recorded)


def _replay_plan(tl: pd.DataFrame, spans: pd.DataFrame | None) -> _Plan:
    start = tl["start_ns"].to_numpy(dtype="float64")
    end = tl["end_ns"].to_numpy(dtype="float64")
    wait_union = tl["wait_ms"].to_numpy(dtype="float64") * 1e6
    # Merged wait region per step: first wait start .. last wait end; busy inside it moves after it.
    ws, we = end - wait_union, end.copy()
    if spans is not None and len(spans):
        waits = spans[(spans["kind"] == "wait") & (spans["step"] >= 0)]
        if len(waits):
            region = (
                waits.assign(end_ns=waits["start_ns"] + waits["dur_ns"])
                .groupby("step")
                .agg(first=("start_ns", "min"), last=("end_ns", "max"))
            )
            pos = pd.Index(tl["step"]).get_indexer(region.index)
            ok = pos >= 0
            ws[pos[ok]] = region["first"].to_numpy(dtype="float64")[ok]
            we[pos[ok]] = region["last"].to_numpy(dtype="float64")[ok]
    has_wait = wait_union > 0
    ws, we = np.where(has_wait, ws, end), np.where(has_wait, we, end)
    inner_busy = np.maximum((we - ws) - wait_union, 0.0)
    g_start = tl["gpu_start_ns"].to_numpy(dtype="float64")
    g_end = tl["gpu_end_ns"].to_numpy(dtype="float64")
    has_gpu = ~np.isnan(g_start)
    # Launch point: recorded when the recorder gives it, else the GPU start if the GPU idled until then, and
    # never after the step's first wait (engines launch, then wait): min(gpu start, wait start).
    if "launch_ns" in tl.columns:
        launch = tl["launch_ns"].to_numpy(dtype="float64")
    else:
        launch = np.fmin(np.fmin(g_start, ws), _launch_span_start(tl, spans))
    launch = np.clip(np.where(has_gpu, launch, ws), start, end)
    wait_first = has_gpu & (launch > ws) & has_wait
    first = np.where(wait_first, ws, launch)
    second = np.where(wait_first, launch, ws)
    c0 = first - start
    c1 = np.where(wait_first, launch - we, second - first)
    c2 = end - np.where(wait_first, launch, we)
    # The awaited GPU work: the latest one (stream order) that had ended by the wait end + tolerance.
    rows_with_gpu = np.flatnonzero(has_gpu)
    ends_in_order = np.maximum.accumulate(g_end[rows_with_gpu]) if len(rows_with_gpu) else g_end[:0]
    awaited_by = np.where(wait_union <= SHORT_WAIT_NS, ws, we) + AWAIT_TOLERANCE_NS
    k = np.searchsorted(ends_in_order, awaited_by, side="right") - 1
    awaited = np.where(
        has_wait & (k >= 0), rows_with_gpu[np.clip(k, 0, None)] if len(rows_with_gpu) else -1, -1
    )
    awaited_end = np.where(awaited >= 0, g_end[np.clip(awaited, 0, None)], np.nan)
    residual = np.where(awaited >= 0, np.maximum(we - np.fmax(ws, awaited_end) - inner_busy, 0.0), 0.0)
    fixed_wait = np.where(awaited >= 0, 0.0, wait_union)
    # Busy inside the merged wait region is CPU work: count it after the wait.
    c2 = np.maximum(c2, 0.0) + inner_busy
    gap = np.concatenate([[0.0], np.maximum(start[1:] - end[:-1], 0.0)])
    gpu_ns = np.where(has_gpu, g_end - g_start, 0.0)
    return _Plan(
        gap,
        np.maximum(c0, 0),
        np.maximum(c1, 0),
        c2,
        wait_first,
        gpu_ns,
        has_gpu,
        awaited.astype("int64"),
        residual,
        fixed_wait,
    )


def _launch_span_start(tl: pd.DataFrame, spans: pd.DataFrame | None) -> np.ndarray:
    """Start of the step's first busy span labelled like a launch ("launch", "launch_batch"...), else NaN.
    When the GPU was still busy at launch its start shows only the previous work's end, not the launch."""
    out = np.full(len(tl), np.nan)
    if spans is None or len(spans) == 0:
        return out
    launches = spans[
        (spans["kind"] == "busy").to_numpy()
        & spans["label"].str.contains("launch", case=False, na=False).to_numpy()
    ]
    if len(launches) == 0:
        return out
    first = launches.groupby("step")["start_ns"].min()
    pos = pd.Index(tl["step"]).get_indexer(first.index)
    out[pos[pos >= 0]] = first.to_numpy(dtype="float64")[pos >= 0]
    return out


def _replay(p: _Plan, *, cpu_scale: float, gpu_scale: float) -> np.ndarray:
    """Projected step times (ms). Steps that each wait for their own GPU work (sync engines) are independent:
    vectorised. Otherwise the sequential recurrence, one tight loop over steps (about 1 µs per step)."""
    rows = np.arange(len(p.c0))
    if not p.wait_first.any() and np.all(np.where(p.has_gpu, p.awaited == rows, p.awaited < 0)):
        # The previous GPU work has ended before this step launches, so GPU start = launch.
        gpu = p.gpu_ns * gpu_scale
        waited = np.where(
            p.awaited >= 0, np.maximum(p.c1 * cpu_scale, gpu) + p.residual, p.c1 * cpu_scale + p.fixed_wait
        )
        return ((p.c0 + p.c2) * cpu_scale + waited) / 1e6
    return _replay_loop(p, cpu_scale=cpu_scale, gpu_scale=gpu_scale)


def _replay_loop(p: _Plan, *, cpu_scale: float, gpu_scale: float) -> np.ndarray:
    gap, c0, c1, c2 = p.gap.tolist(), p.c0.tolist(), p.c1.tolist(), p.c2.tolist()
    wait_first, gpu_ns, has_gpu = p.wait_first.tolist(), p.gpu_ns.tolist(), p.has_gpu.tolist()
    awaited, residual, fixed_wait = p.awaited.tolist(), p.residual.tolist(), p.fixed_wait.tolist()
    n = len(c0)
    gpu_end = [0.0] * n
    out = [0.0] * n
    t = 0.0
    last_gpu_end = -1e300
    for i in range(n):
        t += gap[i]
        begin = t
        t += c0[i] * cpu_scale
        if wait_first[i]:
            k = awaited[i]
            t = (max(t, gpu_end[k]) + residual[i]) if k >= 0 else t + fixed_wait[i]
            t += c1[i] * cpu_scale
            last_gpu_end = max(t, last_gpu_end) + gpu_ns[i] * gpu_scale
            gpu_end[i] = last_gpu_end
        else:
            if has_gpu[i]:
                last_gpu_end = max(t, last_gpu_end) + gpu_ns[i] * gpu_scale
                gpu_end[i] = last_gpu_end
            t += c1[i] * cpu_scale
            k = awaited[i]
            t = (max(t, gpu_end[k]) + residual[i]) if k >= 0 else t + fixed_wait[i]
        t += c2[i] * cpu_scale
        out[i] = t - begin
    return np.asarray(out) / 1e6
