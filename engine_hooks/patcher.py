"""Turn an EngineSpec into wrappers around the engine's functions.

Rules: patching is idempotent (a function is wrapped once), version-checked, and never breaks the engine: a
missing module/attribute, an unsupported version, a failing facts function or a failing recorder disables that
piece with one `overshoot:` line on stderr and the engine runs on unmeasured. Targets whose module is not
imported yet are patched right after it is imported (engine_hooks/import_hook.py), because the bootstrap runs
before the engine imports its modules.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading

from engine_hooks import import_hook, status, wrappers
from engine_hooks.spec import EngineSpec, HookStatus, version_problem
from engine_hooks.wrappers import RecorderFactory, log

__all__ = ["RecorderFactory", "install", "log", "reset"]

_lock = threading.RLock()
_installed: dict[str, list[HookStatus]] = {}  # spec name -> statuses of its targets
_originals: list[tuple[object, str, object]] = []  # (owner, attribute, original) to undo in reset()


def install(
    spec: EngineSpec, *, recorder_factory: RecorderFactory | None = None, defer_until_import: bool = False
) -> list[HookStatus]:
    """Install the hooks of `spec` in this process; returns the status of each target. Never raises.

    defer_until_import: do nothing (not even the version check) until one of the spec's modules is imported;
    the bootstrap uses it so that specs of engines that never load stay silent.
    """
    try:
        with _lock:
            if recorder_factory is not None:
                wrappers.set_factory(spec.name, recorder_factory)
            if spec.name in _installed:
                return list(_installed[spec.name])
            if defer_until_import and not any(m in sys.modules for m in spec.modules):
                later = functools.partial(_install_later, spec, recorder_factory)
                for module in spec.modules:
                    import_hook.when_imported(module, later)
                return [HookStatus(t.name, "pending", "engine not loaded yet", t.role) for t in spec.targets]
            return _install(spec, recorder_factory)
    except Exception as exc:  # the engine must start whatever happens here
        log(f"{spec.name} hooks disabled: {type(exc).__name__}: {exc}")
        return [HookStatus(t.name, "disabled", f"{type(exc).__name__}: {exc}", t.role) for t in spec.targets]


def _install_later(spec: EngineSpec, factory: RecorderFactory | None, _module: object) -> None:
    install(spec, recorder_factory=factory)


def _install(spec: EngineSpec, factory: RecorderFactory | None) -> list[HookStatus]:
    problem = version_problem(spec)
    state = "disabled" if problem else "pending"
    statuses = [HookStatus(t.name, state, problem or "", t.role) for t in spec.targets]
    _installed[spec.name] = statuses
    status.register(spec.name, statuses)
    if problem:
        log(f"{spec.name} hooks disabled: {problem}")
        status.changed()
        return list(statuses)
    groups: dict[tuple[str, str], list[int]] = {}
    for index, target in enumerate(spec.targets):
        groups.setdefault((target.module, target.qualname), []).append(index)
    for (module, qualname), indices in groups.items():

        def patch(module_obj, qualname=qualname, indices=indices):
            _patch_function(spec, factory, module_obj, qualname, [statuses[i] for i in indices], indices)

        loaded = sys.modules.get(module)
        if loaded is not None and not import_hook.initializing(loaded):
            patch(loaded)
        else:
            import_hook.when_imported(module, patch)
    status.changed()
    return list(statuses)


def _patch_function(spec, factory, module_obj, qualname: str, statuses: list[HookStatus], indices) -> None:
    targets = [spec.targets[i] for i in indices]
    try:
        owner, attr, raw = _resolve(module_obj, qualname)
        func = raw.__func__ if isinstance(raw, staticmethod | classmethod) else raw
        if getattr(func, "__overshoot_hooked__", False):
            _set(statuses, "installed", "already installed")
            return
        if not callable(func):
            raise TypeError(f"{qualname} is not callable")
        if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(f"{qualname} is a coroutine function (not supported)")
        wrapper = wrappers.make_wrapper(func, targets, spec, factory)
        if isinstance(raw, staticmethod):
            wrapper = staticmethod(wrapper)
        elif isinstance(raw, classmethod):
            wrapper = classmethod(wrapper)
        setattr(owner, attr, wrapper)
        _originals.append((owner, attr, raw))
        _set(statuses, "installed", "")
    except Exception as exc:
        reason = str(exc) if isinstance(exc, LookupError) else f"{type(exc).__name__}: {exc}"
        _set(statuses, "disabled", reason)
        roles = ", ".join(t.role for t in targets)
        log(f"hook {module_obj.__name__}:{qualname} ({roles}) disabled: {reason}")
    status.changed()


def _resolve(module_obj, qualname: str) -> tuple[object, str, object]:
    owner = module_obj
    *path, attr = qualname.split(".")
    try:
        for part in path:
            owner = getattr(owner, part)
        # getattr_static: see staticmethod/classmethod objects as stored, and inherited methods too.
        return owner, attr, inspect.getattr_static(owner, attr)
    except AttributeError:
        raise LookupError(f"not found: module {module_obj.__name__} has no {qualname}") from None


def _set(statuses: list[HookStatus], state: str, reason: str) -> None:
    for s in statuses:
        s.status, s.reason = state, reason  # type: ignore[assignment]


def reset() -> None:
    """Undo every patch and forget all state (for tests; the engine never calls it)."""
    with _lock:
        for owner, attr, original in reversed(_originals):
            setattr(owner, attr, original)
        _originals.clear()
        _installed.clear()
        wrappers.reset_recording()
        import_hook.clear()
        status.clear()
