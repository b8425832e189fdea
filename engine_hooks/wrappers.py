"""The wrappers the patcher puts around engine functions, and the per-thread Recorder they call.

One Recorder per thread, opened on the first hooked call in that thread (in the run dir named by env
`OVERSHOOT_RUN_DIR`, or by the spec's recorder factory). A recorder that fails turns recording off and the
engine runs on: measuring must never break what it measures.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import replace

from engine_hooks import status
from engine_hooks.spec import AttributeFacts, EngineSpec, HookTarget

RecorderFactory = Callable[[str, dict], object]  # (engine name, process_info) -> Recorder

_lock = threading.Lock()
_tls = threading.local()  # .rec: this thread's Recorder (None: recording off in this thread)
_recorder_broken = False
_factories: dict[str, RecorderFactory] = {}  # engine name -> the latest factory given to install()


def log(message: str) -> None:
    print(f"overshoot: {message}", file=sys.stderr, flush=True)


def _open_recorder(engine: str, factory: RecorderFactory | None):
    """This thread's Recorder, created on first use (None: recording off here, logged once)."""
    global _recorder_broken
    rec = None
    with _lock:
        explicit = factory is not None or engine in _factories
        if not _recorder_broken and (explicit or os.environ.get("OVERSHOOT_RUN_DIR")):
            try:
                make = _factories.get(engine) or factory or _default_factory
                rec = make(engine, {"hooks": status.all_dicts()})
            except Exception as exc:
                _recorder_broken = True
                log(f"recording disabled: cannot open a recorder: {type(exc).__name__}: {exc}")
    _tls.rec = rec
    return rec


def _default_factory(engine: str, process_info: dict):
    from overshoot import Recorder

    return Recorder(os.environ["OVERSHOOT_RUN_DIR"], engine=engine, process_info=process_info)


def _recording_failed(exc: BaseException) -> None:
    global _recorder_broken
    _recorder_broken = True
    _tls.rec = None
    log(f"recording disabled in thread {threading.current_thread().name}: {type(exc).__name__}: {exc}")


def in_process(pattern: str) -> bool:
    """Whether this process's name (multiprocessing's) matches `pattern`; cached per process."""
    key = (os.getpid(), pattern)
    found = _process_match.get(key)
    if found is None:
        import multiprocessing
        import re

        found = _process_match[key] = bool(re.search(pattern, multiprocessing.current_process().name))
    return found


_process_match: dict[tuple[int, str], bool] = {}


def make_wrapper(func, targets: list[HookTarget], spec: EngineSpec, factory: RecorderFactory | None):
    if any(t.processes for t in targets):
        return _process_wrapper(func, targets, spec, factory)
    wrapper = _c_wrapper(func, targets, spec, factory)
    if wrapper is not None:
        return wrapper
    if (len(targets) == 1 and targets[0].facts is None and targets[0].process_facts is None
            and targets[0].role in ("step", "busy", "wait")):
        fast = {"step": _step_wrapper, "busy": _busy_wrapper, "wait": _wait_wrapper}[targets[0].role]
        wrapper = functools.wraps(func)(fast(func, targets[0].span_label, spec.name, factory))
        wrapper.__overshoot_hooked__ = True
        return wrapper
    return _general_wrapper(func, targets, spec, factory)


C_ROLES = frozenset({"step", "idle", "busy", "wait", "gpu"})


def _c_wrapper(func, targets: list[HookTarget], spec: EngineSpec, factory: RecorderFactory | None):
    """The wrapper in C (overshoot/record/hot.c's Hooked: no Python frame of its own, the span calls in C)
    for every target but those that close the recorder or record process facts; None where hot.c did not
    build (the Python wrappers below do the same)."""
    from overshoot.record import hotpath

    roles = [t.role for t in targets]
    facts = [t for t in targets if t.facts is not None]
    if (hotpath.native is None or not set(roles) <= C_ROLES or len(set(roles)) < len(roles) or len(facts) > 1
            or any(t.process_facts is not None for t in targets)):
        return None
    label = {t.role: t.span_label for t in targets}
    name = targets[0].name

    def facts_failed(exc: BaseException) -> None:  # a renamed field in the engine must not break it
        log(f"facts of {facts[0].name} disabled: {type(exc).__name__}: {exc}")
        status.note(facts[0].name, f"facts disabled: {type(exc).__name__}: {exc}")

    def gpu_failed(exc: BaseException) -> None:
        log(f"GPU events of {name} disabled: {type(exc).__name__}: {exc}")

    fn = facts[0].facts if facts else None
    wrapper = hotpath.native.Hooked(
        func, busy=label.get("busy"), wait=label.get("wait"), step="step" in label, idle="idle" in label,
        stream_of=spec.stream if "gpu" in label else None, facts=fn,
        attrs=fn.fields if isinstance(fn, AttributeFacts) else None,  # read in C, no Python frame
        globals=globals(), open=functools.partial(_open_recorder, spec.name, factory),
        failed=_recording_failed, facts_failed=facts_failed, gpu_failed=gpu_failed)
    functools.update_wrapper(wrapper, func)
    wrapper.__overshoot_hooked__ = True
    return wrapper


# Fast paths for the calls that run several times per step: one role, no facts, no GPU events. Recorder
# failures are caught (try costs nothing in 3.11 until it raises): measuring must never break the engine.


def _step_wrapper(func, _label, engine, factory):
    def wrapper(*args, **kwargs):
        try:
            rec = _tls.rec
        except AttributeError:
            rec = _open_recorder(engine, factory)
        if rec is not None:
            try:
                rec.step_begin()
            except Exception as exc:
                _recording_failed(exc)
        return func(*args, **kwargs)

    return wrapper


def _span_wrapper(begin_name: str, end_name: str):
    """A wrapper maker for one span kind: begin/end around the call, never failing the call itself."""

    def make(func, label, engine, factory):
        def wrapper(*args, **kwargs):
            try:
                rec = _tls.rec
            except AttributeError:
                rec = _open_recorder(engine, factory)
            if rec is None:
                return func(*args, **kwargs)
            try:
                getattr(rec, begin_name)(label)
            except Exception as exc:
                _recording_failed(exc)
                return func(*args, **kwargs)
            try:
                return func(*args, **kwargs)
            finally:
                try:
                    getattr(rec, end_name)()
                except Exception as exc:
                    _recording_failed(exc)

        return wrapper

    return make


_busy_wrapper = _span_wrapper("busy_begin", "busy_end")
_wait_wrapper = _span_wrapper("wait_begin", "wait_end")


def _general_wrapper(func, targets: list[HookTarget], spec: EngineSpec, factory):
    """Any combination of roles on one function (e.g. busy + gpu), with facts."""
    roles = {t.role for t in targets}
    step = "step" in roles
    idle = "idle" in roles
    close = "close" in roles
    busy_label = next((t.span_label for t in targets if t.role == "busy"), None)
    wait_label = next((t.span_label for t in targets if t.role == "wait"), None)
    stream_of = spec.stream if "gpu" in roles else None
    facts = [(t.facts, t.name) for t in targets if t.facts is not None]
    once = [(t.process_facts, t.name) for t in targets if t.process_facts is not None]
    once_in: set[int] = set()  # processes (pids: a fork starts afresh) whose process facts are recorded
    engine = spec.name

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            rec = _tls.rec
        except AttributeError:
            rec = _open_recorder(engine, factory)
        if rec is None:
            return func(*args, **kwargs)
        stream = None
        try:
            if step:
                rec.step_begin()
            if idle:
                rec.idle_begin()
            if busy_label is not None:
                rec.busy_begin(busy_label)
            if wait_label is not None:
                rec.wait_begin(wait_label)
            # A ring of False: GPU timing off or no CUDA, no stream to look up (as in the C wrapper).
            if stream_of is not None and getattr(rec, "_ring", None) is not False:
                stream = _stream(stream_of, args)
                if stream is not None:
                    rec.gpu_begin(stream)
        except Exception as exc:
            _recording_failed(exc)
            return func(*args, **kwargs)
        try:
            result = func(*args, **kwargs)
        finally:
            try:
                if stream is not None:
                    rec.gpu_end(stream)
                if wait_label is not None:
                    rec.wait_end()
                if busy_label is not None:
                    rec.busy_end()
                if idle:
                    rec.idle_end()
                if close:  # the engine loop is over: seal before the process's teardown can kill it
                    from overshoot.record.lifecycle import sigterm_deferred

                    with sigterm_deferred():
                        rec.close(reason="shutdown")
            except Exception as exc:
                _recording_failed(exc)
        if facts:
            for item in tuple(facts):
                fn, name = item
                try:
                    found = fn(result, *args, **kwargs)
                    if found:
                        rec.step_facts(**found)
                except Exception as exc:  # a renamed field in the engine must not break it
                    facts.remove(item)
                    log(f"facts of {name} disabled: {type(exc).__name__}: {exc}")
                    status.note(name, f"facts disabled: {type(exc).__name__}: {exc}")
        if once and os.getpid() not in once_in:
            once_in.add(os.getpid())
            for fn, name in once:
                try:
                    found = fn(result, *args, **kwargs)
                    if found:
                        rec.process_facts(**found)
                except Exception as exc:  # a renamed field in the engine must not break it
                    log(f"process facts of {name} failed: {type(exc).__name__}: {exc}")
                    status.note(name, f"process facts failed: {type(exc).__name__}: {exc}")
        return result

    def _stream(fn, args):
        nonlocal stream_of
        try:
            return fn(args[0] if args else None)
        except Exception as exc:
            stream_of = None
            log(f"GPU events of {targets[0].name} disabled: {type(exc).__name__}: {exc}")
            return None

    wrapper.__overshoot_hooked__ = True
    return wrapper


def _process_wrapper(func, targets: list[HookTarget], spec: EngineSpec, factory):
    """Targets timed only in the processes their `processes` pattern names; elsewhere the call runs as is."""
    pattern = next(t.processes for t in targets if t.processes)
    timed = make_wrapper(func, [replace(t, processes="") for t in targets], spec, factory)

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if in_process(pattern):
            return timed(*args, **kwargs)
        return func(*args, **kwargs)

    wrapper.__overshoot_hooked__ = True
    return wrapper


def _reset_after_fork() -> None:
    # A forked child must not write into its parent's spool files: open fresh recorders per thread.
    global _tls
    _tls = threading.local()


os.register_at_fork(after_in_child=_reset_after_fork)


def set_factory(engine: str, factory: RecorderFactory) -> None:
    """Use this factory for recorders of `engine` opened from now on (e.g. vLLM's plugin, which wants fast
    flushing, after the bootstrap installed the same spec without a factory)."""
    _factories[engine] = factory


def reset_recording() -> None:
    global _tls, _recorder_broken
    _tls = threading.local()
    _recorder_broken = False
    _factories.clear()
