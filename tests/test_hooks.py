"""engine_hooks: the generic patcher on small real modules, the bootstrap in a real subprocess, the reference
spec on the real reference engine. Recording goes through the real Recorder and is read back with load_run."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from types import MappingProxyType

import pytest

from engine_hooks import EngineSpec, HookTarget, install, patcher, registry
from engine_hooks.spec import _simple_match, attribute_facts, version_matches
from overshoot import Recorder
from overshoot.rundir.reader import load_run

REPO = Path(__file__).resolve().parent.parent
BOOTSTRAP = REPO / "engine_hooks" / "bootstrap"

TOY_ENGINE = """
import queue


class Batch:
    phase = "decode"

    def __init__(self, n):
        self.num_seqs = n


class Engine:
    def __init__(self):
        self.inbox = queue.Queue()

    def step(self):
        batch = self.schedule()
        self.launch(batch)
        return self.wait_for_results(batch)

    def schedule(self):
        return Batch(3)

    def launch(self, batch):
        return batch

    def wait_for_results(self, batch):
        return [1] * batch.num_seqs

    def wait_for_work(self):
        return self.inbox.get()

    @staticmethod
    def helper(x):
        return x + 1


def run(engine, steps):
    for _ in range(steps):
        engine.step()
    engine.inbox.put("stop")
    engine.wait_for_work()
"""


@pytest.fixture(autouse=True)
def clean_patches():
    patcher.reset()
    yield
    patcher.reset()


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A real module written to disk (not imported yet), and a spec naming its functions."""
    name = f"toy_engine_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(TOY_ENGINE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def toy_spec(module: str, *, name: str = "toy", dist=(), versions: str = "", extra=(),
             schedule_facts=lambda b, *a: {"batch_size": b.num_seqs}, launch_facts=None,
             wait_facts=None) -> EngineSpec:
    return EngineSpec(
        name=name,
        dist=dist,
        versions=versions,
        stream=lambda engine: None,
        targets=(
            HookTarget(module, "Engine.step", "step"),
            HookTarget(module, "Engine.schedule", "busy", facts=schedule_facts),
            HookTarget(module, "Engine.launch", "busy", facts=launch_facts),
            HookTarget(module, "Engine.launch", "gpu"),
            HookTarget(module, "Engine.wait_for_results", "wait", label="gpu", facts=wait_facts),
            HookTarget(module, "Engine.wait_for_work", "idle"),
            *extra,
        ),
    )


def record_toy(module, spec: EngineSpec, run_dir: Path, *, steps: int):
    """The spec's hooks installed, the toy engine run `steps` steps, its recorder closed; the run read."""
    opened: list[Recorder] = []
    install(spec, recorder_factory=recorder_in(run_dir, opened))
    module.run(module.Engine(), steps=steps)
    opened[0].close()
    return load_run(run_dir)


def overshoot_lines(capfd) -> list[str]:
    """The lines overshoot logged on stderr."""
    return [line for line in capfd.readouterr().err.splitlines() if line.startswith("overshoot:")]


def recorder_in(run_dir: Path, opened: list):
    def factory(engine: str, process_info: dict) -> Recorder:
        rec = Recorder(run_dir, engine=engine, process_info=process_info)
        opened.append(rec)
        return rec

    return factory


def test_hooks_installed_on_import_record_steps_spans_and_facts(toy, tmp_path):
    opened: list[Recorder] = []
    statuses = install(toy_spec(toy), recorder_factory=recorder_in(tmp_path / "run", opened))
    assert {s.status for s in statuses} == {"pending"}  # the module is not imported yet
    module = importlib.import_module(toy)  # the import hook patches it now
    assert all(s.status == "installed" for s in statuses), statuses
    module.run(module.Engine(), steps=5)
    opened[0].close()

    run = load_run(tmp_path / "run")
    assert len(run.steps) == 5
    assert (run.steps["batch_size"] == 3).all()
    spans = run.spans
    assert (spans[spans.kind == "wait"].label == "gpu").sum() == 5
    assert sorted(spans[spans.kind == "busy"].label.unique()) == ["launch", "schedule"]
    assert (spans.kind == "idle").sum() == 1
    hooks = run.processes[0]["hooks"]
    assert {h["status"] for h in hooks} == {"installed"} and len(hooks) == 6


def test_missing_target_disables_that_hook_with_one_line(toy, tmp_path, capfd):
    module = importlib.import_module(toy)  # already imported: patched at once
    bogus = HookTarget(toy, "Engine.renamed_in_new_version", "busy")
    opened: list[Recorder] = []
    statuses = install(toy_spec(toy, extra=(bogus,)), recorder_factory=recorder_in(tmp_path / "run", opened))
    by_target = {s.target: s for s in statuses}
    missing = by_target[f"{toy}:Engine.renamed_in_new_version"]
    assert missing.status == "disabled" and "renamed_in_new_version" in missing.reason
    assert by_target[f"{toy}:Engine.step"].status == "installed"
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("overshoot: hook ") and "disabled" in err[0]
    module.run(module.Engine(), steps=2)  # the engine still works, the other hooks still record
    opened[0].close()
    run = load_run(tmp_path / "run")
    assert len(run.steps) == 2
    recorded = {h["target"]: h["status"] for h in run.processes[0]["hooks"]}  # the process json says so too
    assert recorded[f"{toy}:Engine.renamed_in_new_version"] == "disabled"


@pytest.mark.parametrize(
    "dist, versions, expect",
    [
        ("overshoot-no-such-distribution", "", "unknown version"),
        ("pytest", "<1", "unsupported version pytest"),
    ],
)
def test_unknown_or_unsupported_version_disables_the_spec(toy, dist, versions, expect, capfd):
    module = importlib.import_module(toy)
    original = module.Engine.step
    statuses = install(toy_spec(toy, dist=dist, versions=versions))
    assert {s.status for s in statuses} == {"disabled"}
    assert all(expect in s.reason for s in statuses)
    assert module.Engine.step is original  # nothing wrapped
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("overshoot: toy hooks disabled:") and expect in err[0]


def test_close_role_finalizes_the_recorder_when_the_engine_loop_ends(toy, tmp_path):
    """An engine process killed during its teardown, or exiting without atexit (a multiprocessing child),
    still leaves a closed recorder: the close role closes it when the hooked engine loop returns."""
    import json

    opened: list[Recorder] = []
    install(toy_spec(toy, extra=(HookTarget(toy, "run", "close"),)),
            recorder_factory=recorder_in(tmp_path / "run", opened))
    module = importlib.import_module(toy)
    engine = module.Engine()
    module.run(engine, steps=3)
    assert opened[0].closed
    (info_path,) = (tmp_path / "run" / "spool").glob("*.json")
    info = json.loads(info_path.read_text())
    assert info["closed"] is True and info["end_reason"] == "shutdown"
    assert len(load_run(tmp_path / "run").steps) == 3
    engine.step()  # after the close the engine keeps working; nothing more is recorded


def test_patching_twice_wraps_once(toy, tmp_path):
    module = importlib.import_module(toy)
    opened: list[Recorder] = []
    factory = recorder_in(tmp_path / "run", opened)
    first = install(toy_spec(toy))  # like the bootstrap: no factory
    wrapped = module.Engine.step
    again = install(toy_spec(toy), recorder_factory=factory)  # like vLLM's plugin: its factory takes over
    other = install(toy_spec(toy, name="toy-copy"), recorder_factory=factory)  # same targets, another spec
    assert [s.status for s in again] == [s.status for s in first]
    assert all(s.status == "installed" and s.reason == "already installed" for s in other)
    assert module.Engine.step is wrapped and not hasattr(wrapped.__wrapped__, "__wrapped__")
    module.run(module.Engine(), steps=3)
    opened[0].close()
    run = load_run(tmp_path / "run")
    assert len(run.steps) == 3 and (run.spans.kind == "wait").sum() == 3  # one span per call, not two


def test_failing_facts_function_disables_itself_and_engine_runs_on(toy, tmp_path, capfd):
    module = importlib.import_module(toy)

    def broken(batch, *args):
        return {"batch_size": batch.field_renamed_upstream}

    spec = EngineSpec(
        "toy",
        (),
        "",
        (HookTarget(toy, "Engine.step", "step"), HookTarget(toy, "Engine.schedule", "busy", facts=broken)),
    )
    run = record_toy(module, spec, tmp_path / "run", steps=4)
    err = overshoot_lines(capfd)
    assert len(err) == 1 and "facts of" in err[0] and "field_renamed_upstream" in err[0]
    assert len(run.steps) == 4


def test_static_methods_and_module_functions_keep_working(toy, tmp_path):
    module = importlib.import_module(toy)
    spec = EngineSpec(
        "toy", (), "", (HookTarget(toy, "Engine.helper", "busy"), HookTarget(toy, "run", "busy"))
    )
    opened: list[Recorder] = []
    statuses = install(spec, recorder_factory=recorder_in(tmp_path / "run", opened))
    assert [s.status for s in statuses] == ["installed", "installed"]
    assert module.Engine.helper(1) == 2 and module.Engine().helper(2) == 3
    patcher.reset()
    assert not getattr(module.Engine.helper, "__overshoot_hooked__", False)  # reset restores the original


def test_no_recording_without_run_dir(toy, monkeypatch):
    monkeypatch.delenv("OVERSHOOT_RUN_DIR", raising=False)
    module = importlib.import_module(toy)
    install(toy_spec(toy))  # no factory, no run dir: wrappers call straight through
    assert module.Engine().step() == [1, 1, 1]


def test_version_matching():
    assert version_matches("0.32.0+cpu", ">=0.28,<0.34")
    assert not version_matches("0.34.1", ">=0.28,<0.34")
    assert version_matches("0.33.0.dev12", ">=0.28,<0.34")
    with pytest.raises(ValueError):
        version_matches("0.1", ">>0.2")
    assert _simple_match("0.32.0", ">=0.28, <0.34") and not _simple_match("0.27.9", ">=0.28")
    assert _simple_match("1.4.2", "~=1.4") and not _simple_match("2.0", "~=1.4")


def test_registry_guesses_engine_and_loads_spec_files(tmp_path):
    assert registry.engine_for_command(["python", "-m", "reference_engine", "serve"]) == "reference"
    assert registry.engine_for_command(["python", "-m", "vllm.entrypoints.openai.api_server"]) == "vllm"
    assert registry.engine_for_command(["./my-server"]) is None
    assert [s.name for s in registry.load("engine_hooks.reference:SPEC")] == ["reference"]
    spec_file = tmp_path / "my_spec.py"
    spec_file.write_text("from engine_hooks import EngineSpec\nSPECS = [EngineSpec('mine', (), '', ())]\n")
    assert [s.name for s in registry.load(f"{spec_file}:SPECS")] == ["mine"]
    with pytest.raises(registry.SpecError, match="cannot load hook spec"):
        registry.load("no_such_module_here:SPEC")
    with pytest.raises(registry.SpecError, match="unknown engine"):
        registry.selected(["sglang-someday"])


def test_bootstrap_hooks_a_fresh_process_and_chains_sitecustomize(toy, tmp_path):
    """The real path of `overshoot run`: PYTHONPATH bootstrap first, OVERSHOOT_RUN_DIR, a spec from a file."""
    other = tmp_path / "other_site"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITECUSTOMIZE'] = 'ran'\n")
    spec_file = tmp_path / "toy_spec.py"
    spec_file.write_text(
        textwrap.dedent(f"""
        from engine_hooks import EngineSpec, HookTarget
        SPEC = EngineSpec("toy", (), "", (
            HookTarget("{toy}", "Engine.step", "step"),
            HookTarget("{toy}", "Engine.wait_for_results", "wait"),
            HookTarget("{toy}", "Engine.wait_for_work", "idle"),
            HookTarget("{toy}", "Engine.gone", "busy"),
        ))
    """)
    )
    run_dir = tmp_path / "run"
    env = dict(
        os.environ,
        OVERSHOOT_RUN_DIR=str(run_dir),
        OVERSHOOT_ENGINE="none",
        OVERSHOOT_EXTRA_SPECS=f"no_such_spec_module:SPEC,{spec_file}:SPEC",  # a bad one: skipped
        PYTHONPATH=os.pathsep.join([str(BOOTSTRAP), str(other), str(tmp_path), str(REPO)]),
    )
    code = f"import os, {toy} as m; m.run(m.Engine(), 7); print(os.environ.get('OTHER_SITECUSTOMIZE'))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ran"
    assert proc.stderr.count("overshoot: hook") == 1 and "Engine.gone" in proc.stderr
    assert proc.stderr.count("overshoot: cannot load hook spec no_such_spec_module:SPEC") == 1
    run = load_run(run_dir)
    assert len(run.steps) == 7 and (run.spans.kind == "wait").sum() == 7
    from engine_hooks import status

    hooks = {h["target"].split(":")[1]: h["status"] for h in status.gather(str(run_dir))}
    assert hooks == {
        "Engine.step": "installed",
        "Engine.wait_for_results": "installed",
        "Engine.wait_for_work": "installed",
        "Engine.gone": "disabled",
    }


def test_bootstrap_is_inert_without_run_dir(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OVERSHOOT_RUN_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(BOOTSTRAP), str(REPO)])
    code = "import sys; print('engine_hooks' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "False" and proc.stderr == ""


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_reference_spec_on_the_real_engine(tmp_path, async_scheduling):
    """The reference engine, measured only through its spec (it imports nothing from overshoot)."""
    from engine_hooks.reference import SPEC
    from reference_engine.config import Config
    from reference_engine.engine import Engine, SamplingParams

    opened: list[Recorder] = []
    statuses = install(SPEC, recorder_factory=recorder_in(tmp_path / "run", opened))
    assert all(s.status == "installed" for s in statuses), statuses
    engine = Engine(Config(preset="tiny", device="cpu", async_scheduling=async_scheduling))
    engine.start()
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        outputs = engine.generate([[5, 6, 7, 8]] * 4, params)
        # Let the engine thread go idle: that ends its last step (a recorder closed from another thread keeps
        # only finished steps).
        deadline = time.monotonic() + 10
        while engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
    finally:
        engine.shutdown()
    assert [len(o) for o in outputs] == [12] * 4
    for rec in opened:
        rec.close()
    run = load_run(tmp_path / "run")
    steps = run.steps[run.steps["thread"] == "engine"]
    decode = steps[steps["phase"] == "decode"]
    assert 4 in set(decode["batch_size"]) and decode["batch_size"].max() <= 4
    assert decode["batch_size"].sum() >= 4 * 11  # every token after the prefill one came from a decode step
    # Async: the last record only collects the previous batch (schedule() returned None): no facts.
    assert set(steps["phase"].dropna()) <= (
        {"prefill", "decode", "unknown"} if async_scheduling else {"prefill", "decode"}
    )
    assert (run.spans["kind"] == "wait").sum() >= len(decode)
    assert "spec_tokens" in run.steps.columns


def test_deferred_spec_stays_silent_until_its_engine_loads(toy, capfd):
    """The bootstrap installs every known spec lazily: an engine that never loads costs no log line."""
    statuses = install(toy_spec(toy, dist="overshoot-no-such-distribution"), defer_until_import=True)
    assert {s.status for s in statuses} == {"pending"}
    assert capfd.readouterr().err == ""
    module = importlib.import_module(toy)
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "toy hooks disabled: unknown version" in err[0]
    assert not getattr(module.Engine.step, "__overshoot_hooked__", False)


def test_vllm_accepted_drafts_fact_counts_tokens_sampled_beyond_one():
    """The vLLM spec's accepted_tokens: per request with drafts, sampled tokens beyond the one a step always
    samples (requests without drafts and requests missing from the output count nothing)."""
    from types import SimpleNamespace

    from engine_hooks.vllm import accepted_facts

    scheduler = SimpleNamespace(num_sampled_tokens_per_step=1)
    scheduled = SimpleNamespace(scheduled_spec_decode_tokens={"a": [5, 6, 7], "b": [9], "gone": [1, 2]})
    output = SimpleNamespace(sampled_token_ids=[[5, 6, 2], [4], [8]],
                             req_id_to_index={"a": 0, "b": 1, "c": 2})
    assert accepted_facts(None, scheduler, scheduled, output) == {"accepted_tokens": 2}
    assert accepted_facts(None, scheduler, scheduler_output=scheduled, model_runner_output=output) == {
        "accepted_tokens": 2}
    no_drafts = SimpleNamespace(scheduled_spec_decode_tokens={})
    assert accepted_facts(None, scheduler, no_drafts, output) == {}


@pytest.mark.parametrize(("pattern", "timed"), [("^MainProcess$", True), ("^VllmWorker-", False)])
def test_targets_limited_to_named_processes(toy, tmp_path, pattern, timed):
    """A target with `processes` is timed only where the process name matches (vLLM's worker targets run
    in the engine core's own thread under the in-process executor, and must not step there)."""
    module = importlib.import_module(toy)
    opened: list[Recorder] = []
    spec = toy_spec(toy, extra=(HookTarget(toy, "Engine.helper", "busy", "only_there", processes=pattern),))
    install(spec, recorder_factory=recorder_in(tmp_path / "run", opened))
    engine = module.Engine()
    engine.step()
    assert module.Engine.helper(1) == 2  # the call itself runs either way
    engine.step()
    opened[0].close()
    labels = set(load_run(tmp_path / "run").spans["label"])
    assert ("only_there" in labels) is timed


def test_process_facts_go_to_the_process_record_once(toy, tmp_path):
    module = importlib.import_module(toy)
    calls: list[int] = []

    def layout(_result, *_args, **_kwargs) -> dict:
        calls.append(1)
        return {"rank": 3, "world_size": 4}

    spec = toy_spec(toy, extra=(HookTarget(toy, "Engine.launch", "busy", process_facts=layout),))
    process = record_toy(module, spec, tmp_path / "run", steps=5).processes[0]
    assert (process["rank"], process["world_size"]) == (3, 4) and len(calls) == 1


@pytest.fixture(params=["c", "python"])
def wrappers_in(request, monkeypatch):
    """Each test runs with the C wrappers (hot.c's Hooked) and with the Python ones they stand in for."""
    from engine_hooks import wrappers
    from overshoot.record import hotpath

    if request.param == "c" and hotpath.native is None:
        pytest.skip(f"no C hot path here: {hotpath.describe()}")
    if request.param == "python":
        monkeypatch.setattr(wrappers, "_c_wrapper", lambda *args: None)
    return request.param


def test_wrappers_record_the_same_rows_in_c_and_python(toy, tmp_path, monkeypatch):
    """Both wrapper kinds on the same clock readings write identical steps (facts included) and spans."""
    from test_recorder import fake_clock

    from engine_hooks import wrappers

    module = importlib.import_module(toy)
    runs = {}
    for impl in ("c", "python"):
        patcher.reset()
        if impl == "python":
            monkeypatch.setattr(wrappers, "_c_wrapper", lambda *args: None)
        ticks = iter(range(10**9, 2 * 10**9, 1000))
        with fake_clock(monkeypatch, ticks.__next__):
            opened: list[Recorder] = []
            # Facts named and extra, None (ignored), and three calls a step whose extras merge: a function
            # returning a mapping that is not a dict, attributes of the result and the result itself (read
            # in C).
            spec = toy_spec(toy, schedule_facts=lambda b, *a: MappingProxyType({
                                "batch_size": b.num_seqs, "phase": None, "num_tokens": 2 * b.num_seqs,
                                "drafts": 2}),
                            launch_facts=attribute_facts(launched="num_seqs", phase="phase"),
                            wait_facts=attribute_facts(results=""))
            install(spec, recorder_factory=recorder_in(tmp_path / impl, opened))
            kind = type(module.Engine.__dict__["schedule"]).__name__
            module.run(module.Engine(), steps=6)
            opened[0].close()
        runs[impl] = (kind, load_run(tmp_path / impl))
    from overshoot.record import hotpath

    assert runs["python"][0] == "function" and runs["c"][0] == ("Hooked" if hotpath.native else "function")
    c, python = runs["c"][1], runs["python"][1]
    assert len(c.steps) == 6 and (c.steps["batch_size"] == 3).all() and len(c.spans) == 19
    assert (c.steps["num_tokens"] == 6).all() and (c.steps["phase"] == "decode").all()
    assert (c.steps["drafts"] == 2).all() and (c.steps["launched"] == 3).all()
    assert (c.steps["results"] == "[1, 1, 1]").all()

    def rows(frame):
        return frame.drop(columns=[col for col in ("pid", "tid", "thread") if col in frame])

    import pandas as pd

    pd.testing.assert_frame_equal(rows(c.steps), rows(python.steps))
    pd.testing.assert_frame_equal(rows(c.spans), rows(python.spans))


def test_an_engine_exception_passes_through_with_its_span_closed(toy, tmp_path, wrappers_in):
    module = importlib.import_module(toy)

    def launch(self, batch):
        raise ValueError(f"engine failure {batch.num_seqs}")

    module.Engine.launch = launch  # before install: the hook wraps it
    opened: list[Recorder] = []
    install(toy_spec(toy), recorder_factory=recorder_in(tmp_path / "run", opened))
    engine = module.Engine()
    for _ in range(2):
        with pytest.raises(ValueError, match="engine failure 3") as raised:
            engine.step()
        assert raised.traceback[-1].name == "launch"  # the engine's own frame is where it raised
    assert engine.schedule().num_seqs == 3  # the wrappers work on after it
    opened[0].close()
    spans = load_run(tmp_path / "run").spans
    assert list(spans[spans.label == "launch"].groupby("step").size()) == [1, 1]  # closed, once a call


def test_a_failing_recorder_turns_recording_off_and_the_engine_runs_on(toy, tmp_path, capfd, wrappers_in):
    module = importlib.import_module(toy)

    class Failing(Recorder):
        __slots__ = ()

        def busy_begin(self, label):
            raise RuntimeError("disk full")

    opened: list[Recorder] = []

    def factory(engine: str, process_info: dict) -> Recorder:
        opened.append(Failing(tmp_path / "run", engine=engine))
        return opened[-1]

    install(toy_spec(toy), recorder_factory=factory)
    engine = module.Engine()
    assert [engine.step() for _ in range(3)] == [[1, 1, 1]] * 3
    opened[0].close()
    err = overshoot_lines(capfd)
    assert len(err) == 1 and "recording disabled" in err[0] and "RuntimeError: disk full" in err[0]
    assert len(opened) == 1 and len(load_run(tmp_path / "run").steps) == 1  # off from the first busy span


def test_a_failing_stream_lookup_turns_gpu_events_off_only(toy, tmp_path, capfd, wrappers_in):
    module = importlib.import_module(toy)

    def no_stream(engine):
        return engine.stream_renamed_upstream

    spec = toy_spec(toy)
    spec = EngineSpec(spec.name, spec.dist, spec.versions, spec.targets, stream=no_stream)
    run = record_toy(module, spec, tmp_path / "run", steps=3)
    err = overshoot_lines(capfd)
    assert len(err) == 1 and "GPU events of" in err[0] and "stream_renamed_upstream" in err[0]
    assert len(run.steps) == 3 and (run.spans.label == "launch").sum() == 3


def test_a_hooked_method_pickles_binds_and_weakrefs_as_a_function(toy, tmp_path, wrappers_in):
    """Engines pickle functions by reference and keep weak references to bound methods (callbacks): a hooked
    method must behave as the function it replaces, in C as in Python."""
    import inspect
    import pickle
    import weakref

    module = importlib.import_module(toy)
    opened: list[Recorder] = []
    install(toy_spec(toy), recorder_factory=recorder_in(tmp_path / "run", opened))
    hooked = module.Engine.__dict__["schedule"]
    assert pickle.loads(pickle.dumps(hooked)) is hooked
    engine = module.Engine()
    bound = weakref.WeakMethod(engine.schedule)
    assert bound().__self__ is engine and bound()().num_seqs == 3
    assert weakref.ref(hooked)() is hooked
    assert hooked.__name__ == "schedule" and hooked.__qualname__ == "Engine.schedule"
    assert inspect.signature(hooked) == inspect.signature(hooked.__wrapped__)
    assert engine.schedule.__func__ is hooked and module.Engine.schedule is hooked
    opened[0].close()


def test_threads_exceptions_and_collections_under_the_debug_allocator(toy, tmp_path):
    """The C hot path under Python's debug allocator (`-X dev`): four engine threads, each with its own
    recorder, engine exceptions every seventh step, the cyclic collector run often, a flush per 64 spans.
    Every thread's steps and spans are recorded, nothing crashes, and the recorders close cleanly."""
    code = textwrap.dedent(f"""
        import gc, json, sys, threading
        sys.path[:0] = [{str(REPO / "tests")!r}, {str(tmp_path)!r}]
        import {toy} as m
        from engine_hooks import install
        from overshoot import Recorder
        from test_hooks import toy_spec
        from overshoot.record import hotpath
        assert hotpath.native is not None, hotpath.describe()
        opened = []
        def factory(engine, info):
            opened.append(Recorder(sys.argv[1], engine=engine, thread_tag=threading.current_thread().name,
                                   span_capacity=64))
            return opened[-1]
        real_launch = m.Engine.launch
        def flaky(self, batch):
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls % 7 == 0:
                raise ValueError("engine failure")
            return real_launch(self, batch)
        m.Engine.launch = flaky  # before install: the hooks wrap it
        install(toy_spec("{toy}"), recorder_factory=factory)
        counted = {{}}  # the truth: collections each thread ran once its recorder existed
        def count(phase, info):
            me = threading.get_ident()
            if phase == "stop" and any(rec._owner == me for rec in list(opened)):
                name = threading.current_thread().name
                counted[name] = counted.get(name, 0) + 1
        gc.callbacks.insert(0, count)
        def work(n):
            engine = m.Engine()
            for i in range(300):
                try:
                    engine.step()
                except ValueError:
                    pass
                if i % 50 == 0:
                    gc.collect()
            engine.inbox.put("stop")
            engine.wait_for_work()  # idle: ends the thread's last step
        threads = [threading.Thread(target=work, args=(n,), name=f"engine-{{n}}") for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for rec in opened:
            rec.close()
        print(len(opened), json.dumps(counted))
    """)
    from overshoot.record import hotpath

    if hotpath.native is None:
        pytest.skip(f"no C hot path here: {hotpath.describe()}")
    done = subprocess.run([sys.executable, "-X", "dev", "-c", code, str(tmp_path / "run")],
                          capture_output=True, text=True, cwd=REPO, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    opened, counted = done.stdout.split(maxsplit=1)
    assert opened == "4"
    run = load_run(tmp_path / "run")
    assert sorted(run.steps.groupby("thread").size().tolist()) == [300] * 4
    busy = run.spans[run.spans.kind == "busy"].groupby("label").size().to_dict()
    # every collection a thread ran (its gc.collect() calls, those a busy collector skipped aside, and the
    # automatic ones), as a python:gc span in its own recorder and in no other
    collections = run.spans[run.spans.label == "python:gc"].groupby("thread").size().to_dict()
    assert collections == json.loads(counted) and sum(collections.values()) >= 6, (collections, counted)
    del busy["python:gc"]
    assert busy == {"launch": 4 * 300, "schedule": 4 * 300}  # a launch that raised still closed its span
    assert (run.spans.kind == "wait").sum() == 4 * (300 - 300 // 7)  # its step awaited nothing
