"""Compile a C source of this package once per source and platform, into a cache directory.

As Triton compiles its launchers: with the system C compiler, into `$OVERSHOOT_CACHE` (else
`$XDG_CACHE_HOME/overshoot` or `~/.cache/overshoot`), named by a hash of the sources, the platform and the
compile line, so an upgrade never loads a stale build, and written by an atomic rename, so concurrent
processes never load a half-written file. Used by the recorder's hot path (hot.c) and the CUPTI shim.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path


def cache_dir() -> str:
    base = os.environ.get("OVERSHOOT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "overshoot")
    try:
        os.makedirs(base, exist_ok=True)
        return base
    except OSError:
        fallback = os.path.join(tempfile.gettempdir(), f"overshoot-{os.getuid()}")
        os.makedirs(fallback, exist_ok=True)
        return fallback


def find_c_compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def compile_cached(sources: tuple[Path, ...], *, stem: str, suffix: str = ".so", flags: tuple[str, ...] = (),
                   libs: tuple[str, ...] = (), needs: tuple[Path, ...] = (), what: str,
                   out_dir: str | None = None) -> str:
    """Path of the shared library built from `sources`, compiling it if this build has none yet (a build
    found in the cache needs no compiler). Raises RuntimeError naming `what` when there is no compiler, a
    file the build `needs` (a header) is missing, or the source does not compile."""
    key = b"".join(path.read_bytes() for path in sources)
    key += "\0".join((platform.machine(), platform.system(), suffix, *flags, *libs)).encode()
    target = os.path.join(out_dir or cache_dir(), f"{stem}_{hashlib.sha256(key).hexdigest()[:16]}{suffix}")
    if os.path.exists(target):
        return target
    compiler = find_c_compiler()
    if compiler is None:
        raise RuntimeError(f"no C compiler (cc, gcc, clang or $CC) to build {what}")
    for path in needs:
        if not path.exists():
            raise RuntimeError(f"no {path.name} in {path.parent} to build {what}")
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as tmp:
        built = os.path.join(tmp, "build" + suffix)
        done = subprocess.run([compiler, "-O2", "-fPIC", "-shared", "-Wall", *flags, "-o", built,
                               *map(str, sources), *libs], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{what} did not compile: {done.stderr.strip()[:500]}")
        os.replace(built, target)
    return target
