"""Run callbacks right after a named module is imported (a `sys.meta_path` finder that wraps the loader).

The bootstrap runs before the engine imports its modules: hooks on a module not loaded yet wait here.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

_lock = threading.RLock()
_waiting: dict[str, list[Callable[[object], None]]] = {}


def initializing(module_obj: object) -> bool:
    """True while the module's own code is still running (a half-imported module lacks later names)."""
    return bool(getattr(getattr(module_obj, "__spec__", None), "_initializing", False))


def when_imported(module: str, callback: Callable[[object], None]) -> None:
    """Call callback(module_obj) once the module is imported (now, if it already is)."""
    with _lock:
        loaded = sys.modules.get(module)
        if loaded is None or initializing(loaded):
            _waiting.setdefault(module, []).append(callback)
            if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
                sys.meta_path.insert(0, _PostImportFinder())
            return
    callback(loaded)


def clear() -> None:
    with _lock:
        _waiting.clear()
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PostImportFinder)]


def _imported(fullname: str) -> None:
    with _lock:
        callbacks = _waiting.pop(fullname, [])
        if not _waiting:  # nothing left to wait for: stop looking at every import
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PostImportFinder)]
    module = sys.modules.get(fullname)
    if module is None:
        return
    for callback in callbacks:
        try:
            callback(module)
        except Exception as exc:  # a hook problem must not fail the engine's import
            print(f"overshoot: hook on {fullname} failed: {type(exc).__name__}: {exc}", file=sys.stderr)


class _PostImportFinder:
    """Finds nothing itself: asks the finders after it and wraps the loader of a waited-for module."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _waiting:
            return None
        for finder in list(sys.meta_path):
            if finder is self or isinstance(finder, _PostImportFinder):
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader, fullname)
        return spec


class _PatchingLoader:
    def __init__(self, loader, fullname: str):
        self._loader = loader
        self._fullname = fullname

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        # Put the real loader back so the module looks untouched (reload, resources, inspect).
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None and module.__spec__.loader is self:
            module.__spec__.loader = self._loader
        # The module's code has run; importlib clears the flag only after we return, and hooks check it.
        if getattr(module, "__spec__", None) is not None:
            module.__spec__._initializing = False
        _imported(self._fullname)

    def __getattr__(self, name):
        return getattr(self._loader, name)
