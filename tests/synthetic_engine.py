"""A synthetic engine thread with a *virtual* in-order device, recording through the real Recorder API.

The device is a timeline, not a thread: a submission starts at max(now, end of the previous submission) and
runs for its known duration; waiting for it spins until its end. (A device thread would need the GIL to signal
completion and so distort the very thing measured.) CPU busy time is spent in busy-spin loops, so durations
are exact to a microsecond or so, and the engine knows the truth that the recorder must reproduce: per step,
whether the thread really had to wait for the device, and how long it was busy.

Modes:
- ``sync``: record n schedules, prepares and launches batch n, waits for batch n, updates it.
- ``async`` (overlapped): record n schedules, prepares and launches batch n+1, then waits for batch n and
  updates it; so a zero wait in record n means batch n had finished before the thread needed it. The first
  record only launches; the last one (and the one before each idle period) only waits, so every launched
  batch is awaited inside a step.

The device starts a batch as soon as its launch begins (the first kernel is enqueued); the thread keeps
launching for the rest of the launch span. Per-step CPU durations are drawn from `random.Random(seed)` up
front, independent of device time, so a rerun with a different device time replays the same CPU work.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from time import perf_counter_ns

# Share of a step's CPU busy time per phase (schedule, prepare, launch, update).
PHASE_SHARES = (0.2, 0.3, 0.3, 0.2)
PHASE_LABELS = ("schedule", "prepare", "launch", "update")


@dataclass(kw_only=True)
class SyntheticConfig:
    mode: str = "sync"  # sync | async
    steps: int = 300
    cpu_ms: float = 0.3  # mean CPU busy per step
    cpu_jitter: float = 0.3  # busy is uniform in cpu_ms * [1 - jitter, 1 + jitter]
    device_ms: float = 0.3  # device time per batch
    device_jitter: float = 0.0
    seed: int = 0
    batch_size: int = 4
    phase: str = "decode"
    idle_every: int = 0  # every N records the engine drains its work and goes idle (0: never)
    idle_ms: float = 1.0

    def __post_init__(self):
        if self.mode not in ("sync", "async"):
            raise ValueError(f"mode must be sync or async, not {self.mode!r}")


@dataclass
class StepTruth:
    """What really happened in one step record (host monotonic ns)."""

    step: int
    start_ns: int
    end_ns: int
    wait_needed_ns: int  # how long the thread had to wait for the awaited batch (0: it was already done)
    busy_ns: int  # step time minus the time spent waiting
    planned_busy_ns: int  # sum of the busy-spin durations
    device_start_ns: int | None  # the batch launched in this record, if any
    device_end_ns: int | None

    def waited(self, threshold_ms: float = 0.02) -> bool:
        return self.wait_needed_ns > threshold_ms * 1e6


@dataclass
class SyntheticRun:
    config: SyntheticConfig
    truth: list[StepTruth] = field(default_factory=list)

    def cpu_bound_fraction(self, threshold_ms: float = 0.02) -> float:
        return sum(not t.waited(threshold_ms) for t in self.truth) / len(self.truth)


class VirtualDevice:
    """In-order device timeline on the host clock."""

    def __init__(self):
        self.last_end_ns = 0

    def submit(self, duration_ns: int) -> tuple[int, int]:
        start = max(perf_counter_ns(), self.last_end_ns)
        self.last_end_ns = start + duration_ns
        return start, self.last_end_ns


def spin_until(deadline_ns: int) -> None:
    while perf_counter_ns() < deadline_ns:
        pass


def spin(duration_ns: int) -> None:
    spin_until(perf_counter_ns() + duration_ns)


def _draws(cfg: SyntheticConfig) -> tuple[list[int], list[int]]:
    rng = random.Random(cfg.seed)
    n = cfg.steps + 1
    cpu = [int(cfg.cpu_ms * 1e6 * rng.uniform(1 - cfg.cpu_jitter, 1 + cfg.cpu_jitter)) for _ in range(n)]
    dev = [int(cfg.device_ms * 1e6 * rng.uniform(1 - cfg.device_jitter, 1 + cfg.device_jitter))
           for _ in range(n)]
    return cpu, dev


def run_synthetic(rec, cfg: SyntheticConfig) -> SyntheticRun:
    """Run `cfg.steps` step records on the calling thread, recording through `rec` (an overshoot Recorder).
    The caller owns `rec` (and closes it)."""
    cpu, dev = _draws(cfg)
    device = VirtualDevice()
    out = SyntheticRun(cfg)
    in_flight: tuple[int, int] | None = None  # (batch index, device end) awaited by the next record
    batch = 0
    for n in range(cfg.steps):
        if cfg.idle_every and n and n % cfg.idle_every == 0 and in_flight is None:
            rec.idle_begin()
            time.sleep(cfg.idle_ms / 1e3)
            rec.idle_end()
        start = perf_counter_ns()
        rec.step_begin(batch_size=cfg.batch_size, num_tokens=cfg.batch_size, phase=cfg.phase)
        busy = [int(cpu[n] * share) for share in PHASE_SHARES]
        planned_busy = 0
        # An overlapped engine launches nothing in its last record before idle (or the end): it only drains.
        last = n == cfg.steps - 1 or (cfg.idle_every and (n + 1) % cfg.idle_every == 0)
        launched: tuple[int, int] | None = None
        if cfg.mode == "sync" or in_flight is None or not last:
            for label, duration in zip(PHASE_LABELS[:2], busy[:2], strict=True):
                rec.busy_begin(label)
                spin(duration)
                rec.busy_end()
            rec.busy_begin("launch")
            t_launch = perf_counter_ns()
            launched = device.submit(dev[batch])  # the device starts at the first kernel of the launch
            rec.gpu_span(*launched)
            spin_until(t_launch + busy[2])
            rec.busy_end()
            batch += 1
            planned_busy += sum(busy[:3])
        awaited = launched if cfg.mode == "sync" else in_flight
        wait_needed = waited_ns = 0
        if awaited is not None:
            t_wait = perf_counter_ns()
            rec.wait_begin("device")
            wait_needed = max(0, awaited[1] - t_wait)
            spin_until(awaited[1])
            waited_ns = perf_counter_ns() - t_wait  # read before the call: the truth brackets the wait only,
            rec.wait_end()  # not the recorder's own work after its clock read
            rec.busy_begin("update")
            spin(busy[3])
            rec.busy_end()
            planned_busy += busy[3]
        in_flight = launched if cfg.mode == "async" else None
        end = perf_counter_ns()  # before the call, as above: the boundary's own work is no part of the step
        rec.step_end()
        out.truth.append(
            StepTruth(
                step=n, start_ns=start, end_ns=end, wait_needed_ns=wait_needed,
                busy_ns=end - start - waited_ns, planned_busy_ns=planned_busy,
                device_start_ns=launched[0] if launched else None,
                device_end_ns=launched[1] if launched else None,
            )
        )
    return out


def record_synthetic(run_dir, cfg: SyntheticConfig, **recorder_options) -> SyntheticRun:
    """Record one synthetic run into `run_dir` with a fresh Recorder (closed on return)."""
    from overshoot import Recorder

    rec = Recorder(run_dir, engine=f"synthetic-{cfg.mode}", **recorder_options)
    try:
        return run_synthetic(rec, cfg)
    finally:
        rec.close()
