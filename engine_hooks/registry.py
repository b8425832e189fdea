"""Which hook specs exist, and which ones a process installs.

Built-in specs are named here and imported lazily (an engine's spec module must not be imported unless that
engine might run). More specs come from env `OVERSHOOT_EXTRA_SPECS`: comma-separated `module:ATTR` or
`path/to/file.py:ATTR`, where ATTR is an EngineSpec or a sequence of them (a custom engine, or a test).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Iterable

from engine_hooks.spec import EngineSpec

BUILTIN: dict[str, str] = {
    "reference": "engine_hooks.reference:SPEC",
    "vllm": "engine_hooks.vllm:SPEC",
}
# How a server command names each engine: a module run with -m / an executable (for meta.json and reports).
COMMAND_NAMES: dict[str, tuple[str, ...]] = {
    "reference": ("reference_engine",),
    "vllm": ("vllm",),
}


class SpecError(ValueError):
    """A spec reference that cannot be loaded (one-line message)."""


def load(ref: str) -> list[EngineSpec]:
    """Specs named by `module:ATTR` or `file.py:ATTR` (ATTR defaults to SPEC)."""
    where, _, attr = ref.strip().rpartition(":") if ":" in ref else (ref.strip(), ":", "SPEC")
    attr = attr or "SPEC"
    try:
        if where.endswith(".py"):
            name = "overshoot_spec_" + os.path.splitext(os.path.basename(where))[0]
            module_spec = importlib.util.spec_from_file_location(name, where)
            if module_spec is None or module_spec.loader is None:
                raise SpecError(f"cannot load hook spec file {where}")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        found = getattr(module, attr)
    except SpecError:
        raise
    except Exception as exc:
        raise SpecError(f"cannot load hook spec {ref}: {type(exc).__name__}: {exc}") from None
    specs = [found] if isinstance(found, EngineSpec) else list(found)
    if not specs or not all(isinstance(s, EngineSpec) for s in specs):
        raise SpecError(f"hook spec {ref} is not an EngineSpec or a list of them")
    return specs


def extra_refs(environ: dict | None = None) -> list[str]:
    env = os.environ if environ is None else environ
    return [ref for ref in env.get("OVERSHOOT_EXTRA_SPECS", "").split(",") if ref.strip()]


def selected(names: Iterable[str] | None = None, *, on_error=None) -> list[EngineSpec]:
    """Built-in specs by name (all when names is None or contains "auto"; none for "none") plus the extras.

    A built-in spec whose module cannot be imported (e.g. engine_hooks/vllm.py absent) is skipped; an extra
    spec that cannot be loaded raises SpecError, or goes to on_error(message) and is skipped.
    """
    wanted = [n.strip() for n in (names or ["auto"]) if n.strip()]
    if not wanted or "auto" in wanted:
        wanted = list(BUILTIN)
    elif wanted == ["none"]:
        wanted = []
    specs: list[EngineSpec] = []
    for name in wanted:
        if name not in BUILTIN:
            raise SpecError(f"unknown engine {name!r}; known: {', '.join(BUILTIN)}")
        try:
            specs.extend(load(BUILTIN[name]))
        except SpecError:
            continue
    for ref in extra_refs():
        try:
            specs.extend(load(ref))
        except SpecError as exc:
            if on_error is None:
                raise
            on_error(str(exc))
    return specs


def engine_for_command(command: list[str]) -> str | None:
    """The built-in engine a server command starts, from its module or executable names (None: unknown).
    Only a label: the bootstrap installs every spec lazily anyway, so a wrong guess hooks nothing wrong."""
    for arg in command:
        head = os.path.basename(arg).split(".")[0]
        for name, words in COMMAND_NAMES.items():
            if head in words:
                return name
    return None


def install_selected(names: Iterable[str] | None = None) -> None:
    """What the bootstrap does: install each selected spec once its engine's modules are imported."""
    from engine_hooks.patcher import install, log

    try:
        specs = selected(names, on_error=log)
    except SpecError as exc:
        log(str(exc))
        return
    for spec in specs:
        install(spec, defer_until_import=True)
