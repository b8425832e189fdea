"""The recorder's hot path: hot.c compiled on first use, or the same code in Python where it cannot be.

`native` is the compiled module (None: the Python core of record/core.py and the Python wrappers of
engine_hooks run instead, recording the same rows); `describe()` says which ran and why, and goes into
each recorder's options in meta.json. Env `OVERSHOOT_HOTPATH`: `auto` (default: C where a compiler and the
Python headers are), `python` (never build; benchmarks/recorder_overhead.py compares the two), `c` (fail
at import when it cannot be built).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

from overshoot.record.cbuild import compile_cached

SOURCE = Path(__file__).with_name("hot.c")


def _load():
    include = sysconfig.get_paths()["include"]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    path = compile_cached((SOURCE,), stem="overshoot_hot", suffix=suffix, what="the recorder's C hot path",
                          flags=(f"-I{include}", f"-DOVERSHOOT_PY={sys.hexversion}"),
                          needs=(Path(include, "Python.h"),))
    spec = importlib.util.spec_from_file_location("overshoot.record._hot", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


native = None
reason = "OVERSHOOT_HOTPATH=python"
_wanted = os.environ.get("OVERSHOOT_HOTPATH", "auto")
if _wanted not in ("auto", "python", "c"):
    raise ImportError(f"OVERSHOOT_HOTPATH must be auto, python or c, not {_wanted!r}")
if _wanted != "python":
    try:
        native = _load()
        reason = ""
    except Exception as exc:  # no compiler, no headers: the Python path records the same rows, slower
        if _wanted == "c":
            raise ImportError(f"OVERSHOOT_HOTPATH=c: {exc}") from exc
        reason = str(exc).splitlines()[0][:200]


def describe() -> str:
    """"c", or "python (why)"."""
    return "c" if native is not None else f"python ({reason})"
