"""meta.json of a run directory: read, write (atomically), update, and the host facts stored in it.

Never imports torch or pandas: served processes that only write meta.json pay for neither.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

META_NAME = "meta.json"
SPOOL_NAME = "spool"


class RunDirError(Exception):
    """A run directory that cannot be read; the message is one line meant for the user."""


def cpu_model() -> str:
    """The host CPU's model name (Linux /proc/cpuinfo; platform fallback elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_info() -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }


def versions() -> dict[str, str]:
    """Versions of what matters, without importing anything new (torch only if the process already has it)."""
    from overshoot import __version__

    found = {"python": platform.python_version(), "overshoot": __version__}
    for name in ("torch", "vllm", "triton"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__version__", None):
            found[name] = str(module.__version__)
    return found


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_meta(run_dir: str | os.PathLike, meta: dict, *, only_if_absent: bool = False) -> bool:
    """Write RUN/meta.json atomically. With `only_if_absent`, never replace an existing one (first writer
    wins across processes). Returns whether this call wrote the file."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / META_NAME
    tmp = run_dir / f".{META_NAME}.{os.getpid()}.{id(meta)}.tmp"
    tmp.write_text(json.dumps(meta, indent=2, default=str) + "\n")
    try:
        if only_if_absent:
            try:
                os.link(tmp, path)  # atomic and fails if it exists: no clobbering a concurrent writer
            except FileExistsError:
                return False
            return True
        os.replace(tmp, path)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def read_meta(run_dir: str | os.PathLike) -> dict:
    """RUN/meta.json as a dict ({} when absent). Raises RunDirError when it is not valid JSON."""
    path = Path(run_dir) / META_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise RunDirError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise RunDirError(f"{path} is not valid JSON (line {e.lineno})") from None
    if not isinstance(meta, dict):
        raise RunDirError(f"{path} is not a JSON object")
    return meta


def update_meta(run_dir: str | os.PathLike, updates: dict) -> dict:
    """Merge `updates` into RUN/meta.json (atomic replace) and return the result."""
    meta = read_meta(run_dir)
    meta.update(updates)
    write_meta(run_dir, meta)
    return meta


