"""Per-process clock alignment with an error bound (record/clock.py stores the samples).

Every process's spans are on its own CLOCK_MONOTONIC. Against a reference process:
- same boot of the same host (equal boot ids): one clock, offset 0; the error is the time to read a
  timestamp (half the narrowest bracket of either process);
- otherwise: offset = (wall - monotonic) of the process - that of the reference, from their samples; the
  error adds both brackets and how far each process's (wall - monotonic) moved between its start and close
  samples (the wall clock slewing under NTP). How far the two hosts' wall clocks disagree is not measured
  here and is not in the bound (basis "wall clock, hosts' sync not included");
- without samples (run directories of earlier versions): unknown.
A cross-process figure is resolved only when it exceeds its bound (`resolved`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Alignment:
    offset_ns: int  # add to the process's times to put them on the reference's clock
    error_ns: int | None  # bound on that placement; None: unknown
    basis: str  # "shared monotonic" | "wall clock, hosts' sync not included" | "unknown"


def _samples(info: dict) -> list[dict]:
    return [s for s in (info.get("clock") or {}).get("samples") or [] if "mono_ns" in s and "wall_ns" in s]


def _offset_and_slew(samples: list[dict]) -> tuple[float, float, float]:
    offsets = [s["wall_ns"] - s["mono_ns"] for s in samples]
    return sum(offsets) / len(offsets), max(offsets) - min(offsets), max(s["error_ns"] for s in samples)


def align(processes: list[dict], reference_pid: int) -> dict[int, Alignment]:
    """Alignment of each process (by pid) to the process `reference_pid`."""
    by_pid = {int(p["pid"]): p for p in processes if "pid" in p}
    ref = by_pid.get(int(reference_pid))
    out: dict[int, Alignment] = {}
    for pid, info in by_pid.items():
        mine, theirs = _samples(info), _samples(ref) if ref else []
        if pid == reference_pid:
            out[pid] = Alignment(0, max((s["error_ns"] for s in mine), default=0), "shared monotonic")
            continue
        if not mine or not theirs:
            out[pid] = Alignment(0, None, "unknown")
            continue
        same_boot = (info.get("clock") or {}).get("boot_id")
        if same_boot and same_boot == (ref.get("clock") or {}).get("boot_id"):
            error = max(max(s["error_ns"] for s in mine), max(s["error_ns"] for s in theirs))
            out[pid] = Alignment(0, int(error), "shared monotonic")
            continue
        (o1, slew1, e1), (o2, slew2, e2) = _offset_and_slew(mine), _offset_and_slew(theirs)
        out[pid] = Alignment(int(round(o1 - o2)), int(e1 + e2 + slew1 + slew2),
                             "wall clock, hosts' sync not included")
    return out


def resolved(value_ns: float, error_ns: float | None) -> bool:
    """A cross-process difference tells something only when it exceeds its bound."""
    return error_ns is not None and abs(value_ns) > error_ns
