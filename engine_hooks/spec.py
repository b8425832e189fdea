"""Declarative hook specs: which engine functions get which timer, for which engine versions.

A spec names functions by module and qualified name, so an engine is measured without editing its code.
The patcher (engine_hooks/patcher.py) turns a spec into wrappers that call the Recorder's allocation-free
methods.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Role = Literal["step", "busy", "wait", "idle", "gpu", "close"]
ROLES: tuple[str, ...] = ("step", "busy", "wait", "idle", "gpu", "close")


@dataclass(frozen=True)
class AttributeFacts:
    """Step facts read from attributes of the hooked call's result, a facts function without code:
    `attribute_facts(batch_size="num_seqs")` gives {"batch_size": result.num_seqs}; an attribute named ""
    is the result itself; a None result gives no facts. The hooks' C wrapper reads them with no Python
    frame (a facts function runs one every step, 1-3 µs inside a real step on the H200 host); the Python
    wrappers call this object."""

    fields: tuple[tuple[str, str], ...]

    def __call__(self, result, *_args, **_kwargs) -> dict:
        found: dict = {}
        if result is not None:
            for name, attr in self.fields:  # a loop, not a comprehension: no frame of its own on 3.11
                found[name] = getattr(result, attr) if attr else result
        return found


def attribute_facts(**fields: str) -> AttributeFacts:
    """Facts named as the keywords, each read from the result's attribute given as its value ("": the
    result itself)."""
    return AttributeFacts(tuple(fields.items()))


@dataclass(frozen=True)
class HookTarget:
    """One engine function and the timer it gets.

    role: step -> a step boundary at entry (the step lasts until the next boundary); busy / wait -> a
    labelled span around the call; idle -> an idle span around the call (ends the open step);
    gpu -> CUDA events around the call on the stream given by `EngineSpec.stream(self)`; close -> the
    thread's recorder is closed (last step ended, flushed, finalized) when the call ends, returning or
    raising: the loop that runs an engine's steps, after which its process may be killed during teardown
    or exit without atexit (multiprocessing children do).
    facts(result, *args, **kwargs) -> dict, called after the call, goes to `Recorder.step_facts`.
    process_facts(result, *args, **kwargs) -> dict, called after the first call in each process only, goes to
    `Recorder.process_facts` (the process record).
    processes: a regular expression on the process name (multiprocessing's); the function is timed only in
    processes it matches (e.g. an engine's worker processes, when the same function also runs inside the
    engine's own stepping thread). Empty: every process.
    Several targets may name the same function (e.g. busy + gpu): it is wrapped once with all of them, and
    they share one `processes`.
    """

    module: str
    qualname: str
    role: Role
    label: str = ""
    facts: Callable[..., dict] | None = None
    process_facts: Callable[..., dict] | None = None
    processes: str = ""

    @property
    def span_label(self) -> str:
        return self.label or self.qualname.rsplit(".", 1)[-1]

    @property
    def name(self) -> str:
        return f"{self.module}:{self.qualname}"


@dataclass(frozen=True)
class EngineSpec:
    """The hooks of one engine.

    dist: distribution name(s) whose installed version is checked against `versions` (the first one
    installed counts). An empty dist skips the check (an engine that ships with overshoot).
    versions: PEP 440 specifier, e.g. ">=0.28,<0.34"; empty = any version.
    stream: self of a "gpu" target -> the CUDA stream its work runs on (None: no GPU events).
    """

    name: str
    dist: str | tuple[str, ...]
    versions: str
    targets: tuple[HookTarget, ...]
    stream: Callable[[object], object] | None = None

    @property
    def dists(self) -> tuple[str, ...]:
        return (self.dist,) if isinstance(self.dist, str) else tuple(self.dist)

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.module for t in self.targets))


@dataclass
class HookStatus:
    """What happened to one target in this process: installed | pending (module not loaded yet) | disabled."""

    target: str
    status: Literal["installed", "pending", "disabled"]
    reason: str = ""
    role: str = ""

    def as_dict(self) -> dict:
        return {"target": self.target, "role": self.role, "status": self.status, "reason": self.reason}


def installed_version(dists: tuple[str, ...]) -> tuple[str, str] | None:
    """(distribution, version) of the first installed distribution, or None."""
    for dist in dists:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_problem(spec: EngineSpec) -> str | None:
    """Why this spec must not be installed here, or None when its version is supported."""
    if not spec.dists:
        return None
    found = installed_version(spec.dists)
    if found is None:
        return f"unknown version: distribution {' / '.join(spec.dists)} not installed"
    dist, version = found
    if not spec.versions:
        return None
    try:
        ok = version_matches(version, spec.versions)
    except ValueError as exc:
        return f"unknown version {dist} {version}: {exc}"
    return None if ok else f"unsupported version {dist} {version} (hooks verified for {spec.versions})"


def version_matches(version: str, specifier: str) -> bool:
    """PEP 440 match via `packaging` when importable, else a small parser for release numbers."""
    try:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
        from packaging.version import InvalidVersion, Version
    except ImportError:
        return _simple_match(version, specifier)
    try:
        # Local/dev builds (0.32.0+cpu, 0.33.0.dev12) count as their release.
        return Version(Version(version).base_version) in SpecifierSet(specifier)
    except (InvalidSpecifier, InvalidVersion) as exc:
        raise ValueError(str(exc)) from exc


_CLAUSE = re.compile(r"^\s*(==|!=|>=|<=|>|<|~=)\s*([0-9][0-9.]*)\s*$")


def _release(text: str) -> tuple[int, ...]:
    match = re.match(r"\d+(\.\d+)*", text.strip())
    if match is None:
        raise ValueError(f"cannot parse version {text!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def _simple_match(version: str, specifier: str) -> bool:
    have = _release(version)
    for clause in filter(None, (c.strip() for c in specifier.split(","))):
        match = _CLAUSE.match(clause)
        if match is None:
            raise ValueError(f"cannot parse version specifier {clause!r}")
        op, want_text = match.groups()
        want = _release(want_text)
        width = max(len(have), len(want))
        a, b = have + (0,) * (width - len(have)), want + (0,) * (width - len(want))
        if op == "~=":
            prefix = want[:-1] if len(want) > 1 else want
            ok = a >= b and have[: len(prefix)] == prefix
        else:
            ok = {"==": a == b, "!=": a != b, ">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b}[op]
        if not ok:
            return False
    return True
