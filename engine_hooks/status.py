"""Hook status of this process: which targets are installed, pending or disabled, and why.

Kept up to date in `RUN/hooks/{pid}.json` (when `OVERSHOOT_RUN_DIR` is set) so that `overshoot run` can put it
in meta.json even when no recorder ever opened (a spec disabled as a whole records no steps). Each recorder
also gets the statuses known when it opens, in its process json (`hooks`).
"""

from __future__ import annotations

import json
import os
import sys
import threading

from engine_hooks.spec import HookStatus

_lock = threading.Lock()
_by_spec: dict[str, list[HookStatus]] = {}


def register(spec_name: str, statuses: list[HookStatus]) -> None:
    with _lock:
        _by_spec[spec_name] = statuses


def all_dicts() -> list[dict]:
    with _lock:
        return [dict(s.as_dict(), engine=name) for name, statuses in _by_spec.items() for s in statuses]


def note(target: str, reason: str) -> None:
    """Add a remark to a target that stays installed (e.g. its facts function was disabled)."""
    with _lock:
        for statuses in _by_spec.values():
            for s in statuses:
                if s.target == target:
                    s.reason = reason
    changed()


def changed() -> None:
    """Rewrite this process's status file; never raises (the engine keeps running)."""
    run_dir = os.environ.get("OVERSHOOT_RUN_DIR")
    if not run_dir:
        return
    try:
        folder = os.path.join(run_dir, "hooks")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{os.getpid()}.json")
        body = {"pid": os.getpid(), "argv": sys.argv, "hooks": all_dicts()}
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(body, f, indent=1)
        os.replace(tmp, path)
    except Exception as exc:
        print(f"overshoot: cannot write hook status: {type(exc).__name__}: {exc}", file=sys.stderr)


def clear() -> None:
    with _lock:
        _by_spec.clear()


def read_run(run_dir: str) -> list[dict]:
    """Statuses of every process of a run (for `overshoot run`): one entry per (pid, target)."""
    folder = os.path.join(run_dir, "hooks")
    entries: list[dict] = []
    if not os.path.isdir(folder):
        return entries
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                body = json.load(f)
        except (OSError, ValueError):
            continue
        entries.extend(dict(h, pid=body.get("pid")) for h in body.get("hooks", []))
    return entries


def gather(run_dir: str) -> list[dict]:
    """Hook statuses of a finished run: the per-process status files, completed by the recorders' process json
    (`hooks` from process_info) for processes that left no status file."""
    entries = read_run(run_dir)
    seen_pids = {e.get("pid") for e in entries}
    spool = os.path.join(run_dir, "spool")
    if os.path.isdir(spool):
        for name in sorted(os.listdir(spool)):
            if not name.endswith(".json"):
                continue
            try:
                with open(os.path.join(spool, name)) as f:
                    body = json.load(f)
            except (OSError, ValueError):
                continue
            if body.get("pid") in seen_pids:
                continue
            seen_pids.add(body.get("pid"))
            entries.extend(dict(h, pid=body.get("pid")) for h in body.get("hooks") or [])
    return entries


def summary_lines(entries: list[dict]) -> list[str]:
    """Plain lines for the terminal: counts, then every target that is not installed anywhere, with why."""
    if not entries:
        return [
            "hooks: none installed (the server imported no engine overshoot knows; see --engine / --hooks)"
        ]
    best: dict[tuple[str, str], dict] = {}
    rank = {"installed": 0, "pending": 1, "disabled": 2}
    for e in entries:
        key = (e.get("target", "?"), e.get("role", ""))
        if key not in best or rank.get(e.get("status"), 3) < rank.get(best[key].get("status"), 3):
            best[key] = e
    installed = sum(e.get("status") == "installed" for e in best.values())
    pids = len({e.get("pid") for e in entries if e.get("status") == "installed"})
    engines = sorted({e.get("engine") for e in entries if e.get("engine") and e.get("status") == "installed"})
    lines = [
        f"hooks: {installed} of {len(best)} installed in {pids} process(es)"
        + (f" ({', '.join(engines)})" if engines else "")
    ]
    for (target, role), e in best.items():
        if e.get("status") == "disabled":
            lines.append(f"hook {target} ({role}) disabled: {e.get('reason') or 'no reason given'}")
        elif e.get("status") == "pending":
            lines.append(f"hook {target} ({role}) never installed: its module was not imported")
    return lines
