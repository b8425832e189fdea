"""What-if projections: step times if GPU work or CPU work were x% faster (model: docs/concepts.md).

Preferred model, when the primary timeline has GPU times: replay the recorded dependency structure.
Per step the thread runs busy CPU segments, launches its GPU work (from the launch point L) and waits
(at most one merged wait region per step); a wait ends at max(wait start', awaited GPU end') + the recorded
wake-up residual. Idle time between steps is kept as recorded. The GPU work of a step ends at
max(previous GPU end' + D, L' + K), by what the step's GPU data can tell:
- kernels recorded (analysis/kernels.py): each kernel starts at max(its launch' + launch latency, the
  previous kernel's end'), so D = the kernels' durations and K = max over kernels of (launch offset' +
  latency + the remaining durations); `cpu` scales launch offsets, `gpu` scales kernels;
- a plain step of a group with recorded kernels: D = the group's GPU busy, K = max(D, interval x r), r the
  group's median change of K on its instrumented steps (GPU-bound groups follow their kernels, launch-bound
  ones their launches); a group without one: r = the CPU scale;
- instrumented steps of a sampled run lose what kernel timing added to their launch calls (measured per
  group against plain steps, kernels.collector_cost): the replay projects the engine as it runs unobserved;
- CUDA events only: one block, D = K = the interval (which holds the gaps between kernels: a faster CPU
  cannot shorten it, a known limit that the report names).
Fallback without any GPU times: a per-step model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
import pandas as pd

from overshoot.analysis import maxplus
from overshoot.analysis.frames import contains, per_step, positions, run_starts
from overshoot.analysis.kernels import StepKernels, median_on_rows

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
    # WhatIf.label -> per group: change of the whole timeline's busy time (ms) when only that group's steps
    # change (replay only; `group_of` given to project)
    group_change_ms: dict[str, np.ndarray] | None = None


def project(
    timeline: pd.DataFrame, spans: pd.DataFrame | None, what_ifs: list[WhatIf], *, mode: str,
    kernels: StepKernels | None = None, group_of: np.ndarray | None = None,
) -> Projection:
    """Projected step times of one timeline (rows sorted by start_ns) for each what-if; `kernels`: the
    timeline's kernel records joined to its steps (analysis/kernels.py). `group_of` (a group number per
    row, -1 for none) adds, per group, the change of the whole timeline when only that group's steps
    change: a step made shorter can make the next one wait longer for GPU work, so a group's own steps can
    claim a gain that the timeline does not get (docs/concepts.md)."""
    recorded = timeline["step_ms"].to_numpy(dtype="float64")
    if not what_ifs:  # nothing to project: skip the replay
        return Projection("none", recorded, {})
    has_kernels = kernels is not None and kernels.any
    if timeline["gpu_end_ns"].notna().sum() == 0 and not has_kernels:
        return Projection("per-step", recorded, {w.label: _per_step(timeline, w, mode) for w in what_ifs})
    plan = _replay_plan(timeline, spans, kernels if has_kernels else None, overlapped=mode == "async")
    same = _levels(plan, 1.0, 1.0)  # built once: the baseline and every group's mix use them
    baseline = _replay(plan, cpu_scale=1.0, gpu_scale=1.0, levels=same)
    projected, changes = {}, {} if group_of is not None and len(group_of) else None
    if changes is not None and same is not None and not _fold_runs(group_of):
        # The groups' mixes read a few nodes of the unchanged reduction: the rest (~150 MB a million steps)
        # goes before any what-if's own is built.
        groups = range(int(group_of.max(initial=-1)) + 1)
        same = maxplus.Reduction(same).kept_for([group_of == g for g in groups], side_a=False)
    for w in what_ifs:
        cpu, gpu = _scales(w)
        changed = _levels(plan, cpu, gpu)
        projected[w.label] = _replay(plan, cpu_scale=cpu, gpu_scale=gpu, levels=changed)
        if changes is not None:
            changes[w.label] = _group_changes(plan, w, group_of, baseline, projected[w.label],
                                              levels=(changed, same))
        del changed  # a million steps' levels are ~150 MB: gone before the next what-if's are built
    # How well the replay reproduces the recording, over the steps it replays as recorded (not those it
    # takes kernel timing's cost out of).
    same_as_recorded = ~plan.corrected if plan.corrected is not None else np.ones(len(recorded), bool)
    total = recorded[same_as_recorded].sum()
    fit = float(baseline[same_as_recorded].sum() / total - 1.0) if total > 0 else None
    return Projection("replay", baseline, projected, fit, changes)


def _scales(w: WhatIf) -> tuple[float, float]:
    """(cpu_scale, gpu_scale) of a what-if."""
    scale = 1.0 + w.change
    return (scale, 1.0) if w.target == "cpu" else (1.0, scale)


def _levels(plan: _Plan, cpu: float, gpu: float) -> list[maxplus.Matrix] | None:
    """The reduction levels (maxplus.reduction_levels) of the steps' max-plus matrices at these scales, or
    None where the replay takes another path. The replay's scan and every group's mix read them."""
    if _independent(plan):
        return None
    matrices = _step_matrices(plan, *_gpu_terms(plan, cpu_scale=cpu, gpu_scale=gpu), cpu_scale=cpu)
    return None if matrices is None else maxplus.reduction_levels(matrices)


def _group_changes(plan: _Plan, w: WhatIf, group_of: np.ndarray, baseline: np.ndarray,
                   projected: np.ndarray, levels: tuple | None = None) -> np.ndarray:
    """Per group: the change of the timeline's total busy time (ms) when only that group's steps change.
    Independent steps: the group's own steps' changes. Otherwise each step takes its matrix with or
    without the change, by group, and only the end of the timeline is computed (maxplus.mixed_final_time,
    from `levels`: the reduction levels with and without the change, when known)."""
    n_groups = int(group_of.max(initial=-1)) + 1
    if _independent(plan):
        own = np.where(group_of >= 0, group_of, n_groups)
        return np.bincount(own, weights=projected - baseline, minlength=n_groups + 1)[:n_groups]
    cpu, gpu = _scales(w)
    changed, same = levels or (_levels(plan, cpu, gpu), _levels(plan, 1.0, 1.0))
    out = np.zeros(n_groups)
    if changed is None or same is None:  # the loop: a full replay a group
        for g in range(n_groups):
            mine = group_of == g
            c, u = np.where(mine, cpu, 1.0), np.where(mine, gpu, 1.0)
            out[g] = float(_replay(plan, cpu_scale=c, gpu_scale=u).sum() - baseline.sum())
        return out
    if _fold_runs(group_of):
        runs = run_starts(group_of)
        changed = maxplus.reduction_levels(maxplus.segment_products(changed[0], group_of))
        same = maxplus.reduction_levels(maxplus.segment_products(_whole(same)[0], group_of))
        group_of = group_of[runs]
    changed, same = maxplus.Reduction(changed), _reduction(same)
    base_end = same.end()
    for g in range(n_groups):
        # idle gaps are kept: the change is all busy
        out[g] = (maxplus.mixed_final_time(changed, same, group_of == g) - base_end) / 1e6
    return out


def _fold_runs(group_of: np.ndarray) -> bool:
    """Steps come in runs of one group (a load level, a batch size held for a while): with many groups, each
    run is folded into one matrix, with and without the change, and the mixes take runs rather than steps.
    A few groups mix steps: only the reduction's nodes at the edges of their runs are composed again."""
    n_groups = int(group_of.max(initial=-1)) + 1
    return n_groups > 6 and len(run_starts(group_of)) * 4 < len(group_of)


def _reduction(levels: list[maxplus.Matrix] | maxplus.Reduction) -> maxplus.Reduction:
    return levels if isinstance(levels, maxplus.Reduction) else maxplus.Reduction(levels)


def _whole(levels: list[maxplus.Matrix] | maxplus.Reduction) -> list[maxplus.Matrix]:
    return levels.levels if isinstance(levels, maxplus.Reduction) else levels


def _independent(p: _Plan) -> bool:
    """Every step waits for its own GPU work or none, launching before it waits (sync engines)."""
    rows = np.arange(len(p.c0))
    return not p.wait_first.any() and bool(np.all(np.where(p.has_gpu, p.awaited == rows, p.awaited < 0)))


def _per_step(timeline: pd.DataFrame, w: WhatIf, mode: str) -> np.ndarray:
    """No GPU times. sync: step = busy + wait, the wait standing for the GPU work not hidden behind the CPU.
    async: step = max(CPU busy, GPU path); the GPU path is known (busy + wait) only in steps that waited.
    In the others the GPU was done before the thread needed it: its path is unknown and taken as nothing,
    so a faster CPU's gain there is an upper bound (the report says so)."""
    busy = timeline["busy_ms"].to_numpy(dtype="float64")
    wait = timeline["wait_ms"].to_numpy(dtype="float64")
    cpu, gpu = (1.0 + w.change, 1.0) if w.target == "cpu" else (1.0, 1.0 + w.change)
    if mode == "sync":
        return busy * cpu + wait * gpu
    gpu_path = np.where(wait > 0, busy + wait, 0.0)
    return np.maximum(busy * cpu, gpu_path * gpu)


@dataclass
class _Plan:
    """Per step of the timeline (numpy arrays, ns)."""

    gap: np.ndarray  # idle/untracked time before the step (kept as recorded)
    c0: np.ndarray  # busy before the first event (launch or wait)
    c1: np.ndarray  # busy between the two events
    c2: np.ndarray  # busy after the second event
    wait_first: np.ndarray  # True: the step waits before it launches
    gpu_ns: np.ndarray  # GPU interval (events), 0 when the step launched nothing
    has_gpu: np.ndarray
    kernels: StepKernels | None  # kernel chains of instrumented steps
    kernel_step: np.ndarray  # the step's GPU work is replayed kernel by kernel
    busy_est: np.ndarray  # plain step of a group with kernel data: the group's GPU busy (ns), else NaN
    busy_group: np.ndarray | None  # the step's group (kernels.busy_groups); None without kernel records
    awaited: np.ndarray  # row index of the GPU work the wait awaits, -1: a wait on something else
    residual: np.ndarray  # wait end - max(wait start, awaited GPU end): wake-up latency, kept
    fixed_wait: np.ndarray  # duration of waits that await no GPU work (kept as recorded)
    corrected: np.ndarray | None = None  # steps replayed without kernel timing's cost on their launches
    busy_pool: np.ndarray | None = None  # its phase and batch size at every level, if borrowed (kernels.py)

    @cached_property
    def chain_k1(self) -> np.ndarray:
        """K of the instrumented steps at the recorded speeds (NaN elsewhere)."""
        return self.kernels.replay_terms(1.0, 1.0)

    @cached_property
    def pattern(self) -> _Pattern:
        """The same for every scale: built once, shared by the step matrices of all of them."""
        return _pattern(self)


def _replay_plan(tl: pd.DataFrame, spans: pd.DataFrame | None, kernels: StepKernels | None = None, *,
                 overlapped: bool = False) -> _Plan:
    """The plan of one timeline (`overlapped`: async scheduling). Built in steps whose intermediate arrays
    die with them: at a million steps each is 8 MB, and they would all live at once in one function."""
    start = tl["start_ns"].to_numpy(dtype="float64")
    end = tl["end_ns"].to_numpy(dtype="float64")
    wait_union = tl["wait_ms"].to_numpy(dtype="float64") * 1e6
    ws, we = _wait_region(tl, spans, end, wait_union)
    has_wait = wait_union > 0
    g_start, g_end, kernel_step = _gpu_interval(tl, kernels)
    has_gpu = ~np.isnan(g_start)
    launch = _launch_point(tl, spans, kernels, kernel_step, g_start, ws, has_gpu, start, end)
    wait_first, c0, c1, c2 = _segments(start, end, ws, we, launch, has_gpu, has_wait)
    del launch
    corrected = None
    if kernels is not None and "_collector_ns" in tl.columns:
        kernels, corrected = _without_collector(kernels, kernel_step, tl["_collector_ns"].to_numpy("float64"),
                                                wait_first, c1, c2)
    # Busy inside the merged wait region is CPU work: it counts after the wait.
    inner_busy = np.maximum((we - ws) - wait_union, 0.0)
    own_first = has_gpu & ~wait_first if overlapped else None
    awaited, residual = _awaited(ws, we, wait_union, has_wait, g_end, has_gpu, inner_busy, own_first)
    fixed_wait = np.where(awaited >= 0, 0.0, wait_union)
    del ws, we, wait_union
    np.maximum(c2, 0.0, out=c2)
    c2 += inner_busy
    del inner_busy
    gap = np.concatenate([[0.0], np.maximum(start[1:] - end[:-1], 0.0)])
    gpu_ns = np.where(has_gpu, g_end - g_start, 0.0)
    del g_start, g_end
    busy_est = np.full(len(tl), np.nan)
    busy_group = busy_pool = None
    if kernels is not None and "_busy_group" in tl.columns:
        busy_est = np.where(~kernel_step & has_gpu, tl["_gpu_busy_est_ms"].to_numpy(dtype="float64") * 1e6,
                            np.nan)
        busy_group = tl["_busy_group"].to_numpy("int64")
        if "_busy_pool" in tl.columns:
            busy_pool = tl["_busy_pool"].to_numpy("int64")
    np.maximum(c0, 0, out=c0)
    np.maximum(c1, 0, out=c1)
    return _Plan(gap, c0, c1, c2, wait_first, gpu_ns, has_gpu, kernels, kernel_step, busy_est, busy_group,
                 awaited, residual, fixed_wait, corrected, busy_pool)


def _without_collector(kernels: StepKernels, kernel_step: np.ndarray, cost: np.ndarray,
                       wait_first: np.ndarray, c1: np.ndarray,
                       c2: np.ndarray) -> tuple[StepKernels, np.ndarray]:
    """Instrumented steps as the engine runs them unobserved: each launch call of the step (counted from
    its first launch, the launch point) was `cost` ns longer under kernel timing, so the busy segment that
    holds the launches (c1, or c2 when the step waits first) and each kernel's launch offset shrink by
    what the calls before it added. c1 and c2 change in place. Returns the kernels and the steps changed."""
    cost = np.where(kernel_step, np.nan_to_num(cost), 0.0)
    corrected = cost > 0
    if not corrected.any():
        return kernels, corrected
    extra = cost * np.nan_to_num(kernels.dense(kernels.launches))
    c1 -= np.where(wait_first, 0.0, extra)
    c2 -= np.where(wait_first, extra, 0.0)
    offset = np.maximum(kernels.chain_offset - cost[kernels.chain_step] * kernels.chain_launch, 0.0)
    return replace(kernels, chain_offset=offset), corrected


def _wait_region(tl: pd.DataFrame, spans: pd.DataFrame | None, end: np.ndarray,
                 wait_union: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merged wait region per step: first wait start .. last wait end (busy inside it moves after it);
    both at the step's end when it did not wait."""
    ws, we = end - wait_union, end.copy()
    if spans is not None and len(spans):
        step = spans["step"].to_numpy()
        is_wait = (spans["kind"] == "wait").to_numpy() & (step >= 0)
        if is_wait.any():
            start_ns = spans["start_ns"].to_numpy()[is_wait]
            steps, first = per_step(step[is_wait], start_ns, "min")
            _, last = per_step(step[is_wait], start_ns + spans["dur_ns"].to_numpy()[is_wait], "max")
            pos = positions(tl["step"].to_numpy(), steps)
            ok = pos >= 0
            ws[pos[ok]] = first.astype("float64")[ok]
            we[pos[ok]] = last.astype("float64")[ok]
    has_wait = wait_union > 0
    return np.where(has_wait, ws, end), np.where(has_wait, we, end)


def _gpu_interval(tl: pd.DataFrame, kernels: StepKernels | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per step: GPU start and end (ns, NaN: none), from its kernels where recorded, else its events; and
    whether its GPU work is replayed kernel by kernel."""
    g_start = tl["gpu_start_ns"].to_numpy(dtype="float64")
    g_end = tl["gpu_end_ns"].to_numpy(dtype="float64")
    kernel_step = np.zeros(len(tl), bool)
    if kernels is not None:
        has = kernels.with_kernels
        at = kernels.rows[has]
        kernel_step[at] = True
        g_start, g_end = g_start.copy(), g_end.copy()  # (to_numpy may hand out the frame's own data)
        g_start[at] = kernels.first_ns[has]
        g_end[at] = kernels.last_ns[has]
    return g_start, g_end, kernel_step


def _launch_point(tl: pd.DataFrame, spans: pd.DataFrame | None, kernels: StepKernels | None,
                  kernel_step: np.ndarray, g_start: np.ndarray, ws: np.ndarray, has_gpu: np.ndarray,
                  start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Launch point: recorded when the recorder gives it, else the GPU start if the GPU idled until then, and
    never after the step's first wait (engines launch, then wait): min(gpu start, wait start)."""
    if "launch_ns" in tl.columns:
        launch = tl["launch_ns"].to_numpy(dtype="float64")
    else:
        launch = np.fmin(np.fmin(g_start, ws), _launch_span_start(tl, spans))
    if kernels is not None:  # launch offsets of the kernel chains are relative to the first launch
        has = kernels.with_kernels
        launch = launch.copy()
        launch[kernels.rows[has]] = kernels.first_launch_ns[has]
    return np.clip(np.where(has_gpu, launch, ws), start, end)


def _segments(start: np.ndarray, end: np.ndarray, ws: np.ndarray, we: np.ndarray, launch: np.ndarray,
              has_gpu: np.ndarray, has_wait: np.ndarray) -> tuple[np.ndarray, ...]:
    """(wait_first, c0, c1, c2): whether the step waits before it launches, and its busy time before the
    first event, between the two and after the second (c0, c1 may be negative: the caller clips them)."""
    wait_first = has_gpu & (launch > ws) & has_wait
    first = np.where(wait_first, ws, launch)
    second = np.where(wait_first, launch, ws)
    c0 = first - start
    c1 = np.where(wait_first, launch - we, second - first)
    c2 = end - np.where(wait_first, launch, we)
    return wait_first, c0, c1, c2


def _awaited(ws: np.ndarray, we: np.ndarray, wait_union: np.ndarray, has_wait: np.ndarray, g_end: np.ndarray,
             has_gpu: np.ndarray, inner_busy: np.ndarray,
             own_first: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(awaited, residual): the row of the GPU work each wait awaits, the latest one (stream order) that had
    ended by the wait end + tolerance (-1: none); and the wake-up residual after it.

    `own_first` (async scheduling: the steps that launch before they wait): a wait that did not block in
    such a step awaits the GPU work before the step's own, as the engine does, even when the step's own
    work had also ended by then. That happens when the CPU was slow (under kernel timing's cost, say); a
    replay in which the step waited for its own work would turn it synchronous the moment the CPU gets
    faster (the mixed async step's CPU what-if read about half its rerun's gain on the H200)."""
    rows_with_gpu = np.flatnonzero(has_gpu)
    ends_in_order = np.maximum.accumulate(g_end[rows_with_gpu]) if len(rows_with_gpu) else g_end[:0]
    short = wait_union <= SHORT_WAIT_NS
    awaited_by = np.where(short, ws, we) + AWAIT_TOLERANCE_NS
    k = np.searchsorted(ends_in_order, awaited_by, side="right") - 1
    del ends_in_order, awaited_by
    if own_first is not None and len(rows_with_gpu):
        rows = np.arange(len(k))
        own = own_first & short & (k >= 0) & (rows_with_gpu[np.clip(k, 0, None)] == rows)
        k = np.where(own, k - 1, k)
    awaited = np.where(
        has_wait & (k >= 0), rows_with_gpu[np.clip(k, 0, None)] if len(rows_with_gpu) else -1, -1
    ).astype("int64", copy=False)
    awaited_end = np.where(awaited >= 0, g_end[np.clip(awaited, 0, None)], np.nan)
    residual = np.where(awaited >= 0, np.maximum(we - np.fmax(ws, awaited_end) - inner_busy, 0.0), 0.0)
    return awaited, residual


def _gpu_terms(p: _Plan, *, cpu_scale, gpu_scale) -> tuple[np.ndarray, np.ndarray]:
    """(D, K) per step: its GPU work ends at max(previous GPU end + D, launch' + K) (module docstring)."""
    block = _scaled(p.gpu_ns, gpu_scale)
    d, k = block, block
    chain_k = None
    if p.kernels is not None and p.kernel_step.any():
        chain_k = p.kernels.replay_terms(cpu_scale, gpu_scale)
    estimate = ~np.isnan(p.busy_est)
    if estimate.any():
        busy = p.busy_est * gpu_scale
        d = np.where(estimate, busy, d)
        # The plain step's interval changes as its group's instrumented steps' K does (launch-bound: with the
        # CPU; GPU-bound: with the kernels); a group without one: as if its launches bounded it.
        ratio = _group_ratio(p, chain_k) if chain_k is not None and p.busy_group is not None else np.full(
            len(d), np.nan)
        k_est = np.where(np.isnan(ratio), p.gpu_ns * cpu_scale, p.gpu_ns * ratio)
        k = np.where(estimate, np.maximum(busy, k_est), k)
    if chain_k is not None:
        d = np.where(p.kernel_step, p.kernels.dense(p.kernels.chain_total) * gpu_scale, d)
        k = np.where(p.kernel_step, chain_k, k)
    return d, k


def _group_ratio(p: _Plan, chain_k: np.ndarray) -> np.ndarray:
    """Per step: the median, over the instrumented steps of its group, of K at the what-if's scales over K
    as recorded; for a group with none, over those of its phase and batch size at the other levels (where
    it borrowed its GPU busy from); NaN where neither has one."""
    k1 = p.chain_k1
    rows = p.kernel_step & (k1 > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = chain_k / k1
    out = median_on_rows(p.busy_group, ratio, rows)
    if p.busy_pool is not None:
        out = np.where(np.isnan(out), median_on_rows(p.busy_pool, ratio, rows), out)
    return out


def _scaled(values: np.ndarray, scale: float | np.ndarray) -> np.ndarray:
    """values x scale; unscaled, the values themselves (read only here: x 1.0 changes no float)."""
    return values if np.ndim(scale) == 0 and scale == 1.0 else values * scale


def _launch_span_start(tl: pd.DataFrame, spans: pd.DataFrame | None) -> np.ndarray:
    """Start of the step's first busy span labelled like a launch ("launch", "launch_batch"...), else NaN.
    When the GPU was still busy at launch its start shows only the previous work's end, not the launch."""
    out = np.full(len(tl), np.nan)
    if spans is None or len(spans) == 0:
        return out
    launches = (spans["kind"] == "busy").to_numpy() & contains(spans["label"], "launch")
    if not launches.any():
        return out
    steps, first = per_step(spans["step"].to_numpy()[launches], spans["start_ns"].to_numpy()[launches], "min")
    pos = positions(tl["step"].to_numpy(), steps)
    out[pos[pos >= 0]] = first.astype("float64")[pos >= 0]
    return out


def _replay(p: _Plan, *, cpu_scale: float | np.ndarray, gpu_scale: float | np.ndarray,
            levels: list[maxplus.Matrix] | None = None) -> np.ndarray:
    """Projected step times (ms); scales: one for all steps or one per step. Steps that each wait for their
    own GPU work (sync engines) are independent: vectorised. Steps that wait for the previous GPU work, their
    own or none: a max-plus scan (maxplus.py). Otherwise the sequential recurrence, one tight loop over steps
    (about 1 µs per step)."""
    if levels is None:  # (given: built by _levels for these scales)
        d, k = _gpu_terms(p, cpu_scale=cpu_scale, gpu_scale=gpu_scale)
        if _independent(p):
            # The previous GPU work has ended before this step launches, so its GPU work ends at launch' + K.
            waited = np.where(
                p.awaited >= 0, np.maximum(p.c1 * cpu_scale, k) + p.residual, p.c1 * cpu_scale + p.fixed_wait
            )
            return ((p.c0 + p.c2) * cpu_scale + waited) / 1e6
        matrices = _step_matrices(p, d, k, cpu_scale=cpu_scale)
        if matrices is None:
            return _replay_loop(p, d, k, cpu_scale=cpu_scale)
        levels = maxplus.reduction_levels(matrices)
    t = maxplus.thread_times(levels[0], levels)
    begin = np.concatenate([[0.0], t[:-1]]) + p.gap
    return (t - begin) / 1e6


@dataclass
class _Pattern:
    """What each step's wait awaits, by its place in the max-plus state, and the constant entries that the
    step matrices of every scale share (read-only: the scan never writes into its inputs)."""

    on1: np.ndarray  # the latest GPU work before the step
    on2: np.ndarray  # the one before it
    own: np.ndarray  # the step's own GPU work, launched before the wait
    none: np.ndarray  # no GPU work
    scannable: bool  # every wait is one of those (else the loop replays)
    all_gpu: bool  # every step launched GPU work
    neg: np.ndarray  # -inf everywhere (also G1' from G2: nothing, a step with GPU work or not)
    zero: np.ndarray
    g2: list[np.ndarray]  # G2' from (t, G1, G2): G1 after a step with GPU work, else G2


def _pattern(p: _Plan) -> _Pattern:
    n = len(p.c0)
    rows = np.arange(n)
    gpu_rows = np.flatnonzero(p.has_gpu)
    pos = np.cumsum(p.has_gpu) - p.has_gpu - 1  # the last GPU row before each step (its place in gpu_rows)
    prev1 = np.where(pos >= 0, gpu_rows[np.maximum(pos, 0)], -1) if len(gpu_rows) else np.full(n, -1)
    prev2 = np.where(pos >= 1, gpu_rows[np.maximum(pos - 1, 0)], -1) if len(gpu_rows) else np.full(n, -1)
    waits = p.awaited >= 0
    on1, on2 = waits & (p.awaited == prev1), waits & (p.awaited == prev2)
    own = waits & (p.awaited == rows) & p.has_gpu & ~p.wait_first
    none = ~waits
    neg, zero = np.full(n, maxplus.NEG), np.zeros(n)
    g = p.has_gpu
    all_gpu = bool(g.all())
    g2 = [neg, zero, neg] if all_gpu else [neg, np.where(g, zero, neg), np.where(g, neg, zero)]
    for a in (neg, zero, *g2):
        a.flags.writeable = False
    return _Pattern(on1, on2, own, none, bool(np.all(on1 | on2 | own | none)), all_gpu, neg, zero, g2)


def _step_matrices(p: _Plan, d: np.ndarray, k: np.ndarray, *, cpu_scale) -> maxplus.Matrix | None:
    """Each step's max-plus matrix over (thread time, latest GPU end, the one before), or None when some wait
    awaits other GPU work than those two, the step's own, or none (the loop handles those)."""
    pat = p.pattern
    if not pat.scannable:
        return None
    on1, on2, own, none, neg = pat.on1, pat.on2, pat.own, pat.none, pat.neg
    u = p.gap + _scaled(p.c0, cpu_scale)
    c1, post, res = _scaled(p.c1, cpu_scale), _scaled(p.c2, cpu_scale), p.residual
    uc1, res_post = u + c1, res + post  # (sums in the order they always had: the same figures to the bit)
    # Launch first (the usual order): the thread's end from t, G1, G2.
    t_t = np.where(none, uc1 + p.fixed_wait + post,
                   np.where(own, np.maximum(uc1, u + k) + res + post, uc1 + res + post))
    t_g1 = np.where(on1, res_post, np.where(own, d + res + post, neg))
    t_g2 = np.where(on2, res_post, neg)
    # The GPU: a step with work pushes it on (G1' from t and G1; G2' = G1); one without keeps both.
    g = p.has_gpu
    if pat.all_gpu:  # (np.where would copy every value)
        g1 = [u + k, d, neg]
    else:
        g1 = [np.where(g, u + k, neg), np.where(g, d, pat.zero), neg]
    if p.wait_first.any():  # wait, then launch: the thread reaches the launch at `at` (from t, G1, G2)
        wf = p.wait_first
        at_t = np.where(none, u + p.fixed_wait + c1, u + res + c1)
        at_g1 = np.where(on1, res + c1, neg)
        at_g2 = np.where(on2, res + c1, neg)
        pairs = ((at_t, t_t), (at_g1, t_g1), (at_g2, t_g2))
        t_t, t_g1, t_g2 = (np.where(wf, at + post, x) for at, x in pairs)
        g1 = [np.where(wf, at_t + k, g1[0]), np.where(wf, np.maximum(d, at_g1 + k), g1[1]),
              np.where(wf, at_g2 + k, g1[2])]
    return [[t_t, t_g1, t_g2], g1, pat.g2]


def _replay_loop(p: _Plan, d_ns: np.ndarray, k_ns: np.ndarray, *, cpu_scale) -> np.ndarray:
    scale = np.broadcast_to(cpu_scale, p.c0.shape)  # the CPU scale is folded into the busy segments
    gap = p.gap.tolist()
    c0, c1, c2 = (p.c0 * scale).tolist(), (p.c1 * scale).tolist(), (p.c2 * scale).tolist()
    wait_first, has_gpu = p.wait_first.tolist(), p.has_gpu.tolist()
    d_gpu, k_gpu = d_ns.tolist(), k_ns.tolist()
    awaited, residual, fixed_wait = p.awaited.tolist(), p.residual.tolist(), p.fixed_wait.tolist()
    n = len(c0)
    gpu_end = [0.0] * n
    out = [0.0] * n
    t = 0.0
    last_gpu_end = -1e300
    for i in range(n):
        t += gap[i]
        begin = t
        t += c0[i]
        if wait_first[i]:
            k = awaited[i]
            t = (max(t, gpu_end[k]) + residual[i]) if k >= 0 else t + fixed_wait[i]
            t += c1[i]
            last_gpu_end = max(last_gpu_end + d_gpu[i], t + k_gpu[i])
            gpu_end[i] = last_gpu_end
        else:
            if has_gpu[i]:
                last_gpu_end = max(last_gpu_end + d_gpu[i], t + k_gpu[i])
                gpu_end[i] = last_gpu_end
            t += c1[i]
            k = awaited[i]
            t = (max(t, gpu_end[k]) + residual[i]) if k >= 0 else t + fixed_wait[i]
        t += c2[i]
        out[i] = t - begin
    return np.asarray(out) / 1e6
