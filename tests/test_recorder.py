"""Recorder API semantics: step boundaries, nested waits, splitting, idle, facts, files, lifecycle."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from time import perf_counter_ns

import pandas as pd
import pytest

from overshoot import Recorder
from overshoot.rundir.meta import read_meta, write_meta
from overshoot.rundir.reader import load_run

REPO = Path(__file__).resolve().parents[1]


def spin(us: float) -> None:
    end = perf_counter_ns() + int(us * 1e3)
    while perf_counter_ns() < end:
        pass


def record(run_dir, body, **options):
    rec = Recorder(run_dir, engine="test", flush_steps=options.pop("flush_steps", 1000), **options)
    try:
        body(rec)
    finally:
        rec.close()
    return load_run(run_dir)


def test_step_begin_ends_previous_step_and_steps_are_contiguous(tmp_path):
    def body(rec):
        for i in range(5):
            rec.step_begin(batch_size=i + 1, num_tokens=2 * i, phase="decode")
            spin(50)

    steps = record(tmp_path, body).steps
    assert list(steps["step"]) == [0, 1, 2, 3, 4]
    assert list(steps["batch_size"]) == [1, 2, 3, 4, 5]
    assert list(steps["num_tokens"]) == [0, 2, 4, 6, 8]
    assert (steps["start_ns"].iloc[1:].to_numpy() == steps["end_ns"].iloc[:-1].to_numpy()).all()
    assert (steps["end_ns"] - steps["start_ns"] >= 50_000).all()
    assert (steps["wait_ns"] == 0).all()
    assert set(steps["phase"]) == {"decode"}


def test_step_end_step_scope_and_missing_facts(tmp_path):
    def body(rec):
        with rec.step(batch_size=2):
            spin(20)
        spin(100)  # between steps: belongs to no step
        rec.step_begin()
        rec.step_end()
        rec.step_end()  # no open step: ignored

    steps = record(tmp_path, body).steps
    assert len(steps) == 2
    assert steps["start_ns"].iloc[1] - steps["end_ns"].iloc[0] >= 100_000
    assert steps["phase"].tolist() == ["unknown", "unknown"]
    assert steps["batch_size"].iloc[0] == 2 and steps["batch_size"].isna().iloc[1]
    assert steps["num_tokens"].isna().all()


def test_nested_waits_count_once_and_busy_spans_are_labelled(tmp_path):
    def body(rec):
        rec.step_begin(batch_size=1, phase="decode")
        with rec.busy("schedule"):
            spin(30)
        with rec.wait("outer"):
            spin(40)
            with rec.wait("inner"):
                spin(60)
        with rec.busy("update"):
            with rec.wait("sync"):  # a wait inside busy is still a wait
                spin(50)

    run = record(tmp_path, body)
    step = run.steps.iloc[0]
    spans = run.spans.set_index("label")
    assert spans.loc["outer", "dur_ns"] >= spans.loc["inner", "dur_ns"] >= 60_000
    assert step["wait_ns"] == spans.loc["outer", "dur_ns"] + spans.loc["sync", "dur_ns"]
    assert set(run.spans["kind"]) == {"busy", "wait"}
    assert spans.loc["schedule", "kind"] == "busy" and spans.loc["inner", "kind"] == "wait"
    assert (run.spans["step"] == 0).all()


def test_span_open_at_a_boundary_is_split_there(tmp_path):
    def body(rec):
        rec.step_begin()
        rec.busy_begin("loop")
        rec.wait_begin("gpu")
        spin(50)
        rec.step_begin()  # both spans still open
        spin(70)
        rec.wait_end()
        rec.busy_end()
        rec.step_end()

    run = record(tmp_path, body)
    s0, s1 = run.steps.iloc[0], run.steps.iloc[1]
    boundary = s0["end_ns"]
    assert s1["start_ns"] == boundary
    parts = run.spans.sort_values(["label", "step"])
    for label in ("loop", "gpu"):
        first, second = parts[parts["label"] == label].itertuples()
        assert (first.step, second.step) == (0, 1)
        assert first.start_ns + first.dur_ns == boundary == second.start_ns
    wait_parts = parts[parts["label"] == "gpu"]["dur_ns"].tolist()
    assert [s0["wait_ns"], s1["wait_ns"]] == wait_parts
    assert s1["wait_ns"] >= 70_000


def test_idle_ends_the_step_and_belongs_to_no_step(tmp_path):
    def body(rec):
        rec.step_begin(phase="prefill")
        spin(30)
        with rec.idle():
            spin(80)
        rec.step_begin(phase="decode")
        spin(10)

    run = record(tmp_path, body)
    idle = run.spans[run.spans["kind"] == "idle"].iloc[0]
    assert idle["step"] == -1 and idle["dur_ns"] >= 80_000
    s0, s1 = run.steps.iloc[0], run.steps.iloc[1]
    # The step ends where the idle span starts (no timing bound: a loaded machine stretches the spins).
    assert s0["end_ns"] <= idle["start_ns"] and idle["start_ns"] + idle["dur_ns"] <= s1["start_ns"]


def test_extra_facts_become_columns_and_a_new_fact_starts_a_segment(tmp_path):
    def body(rec):
        for i in range(6):
            facts = {"spec_tokens": 3} if i >= 2 else {}
            rec.step_begin(batch_size=1, phase="decode", **facts)
            if i == 4:
                rec.step_facts(accepted_tokens=2, batch_size=7, phase="mixed", note="x")
            if i == 3:
                rec.flush()  # a chunk boundary inside the run

    run = record(tmp_path, body, flush_steps=2)
    steps = run.steps
    assert steps["spec_tokens"].isna().tolist() == [True, True, False, False, False, False]
    assert steps["spec_tokens"].dropna().tolist() == [3, 3, 3, 3]
    row = steps.iloc[4]
    assert (row["accepted_tokens"], row["batch_size"], row["phase"], row["note"]) == (2, 7, "mixed", "x")
    assert steps["accepted_tokens"].isna().sum() == 5
    segments = sorted(p.name for p in (tmp_path / "spool").glob("*.steps.*.arrow"))
    assert len(segments) >= 3, segments  # no facts -> +spec_tokens -> +accepted_tokens/note
    assert run.warnings == []


def test_a_fact_that_changes_type_between_flushes_is_read_as_text(tmp_path):
    """A fact given as a number in one flush and as text or a flag in another: the run stays readable,
    every step kept, the fact's values as text; a number that becomes a float widens."""
    values = [3, 4, "draft", True, None, 5, False]

    def body(rec):
        for i, value in enumerate(values):
            rec.step_begin(batch_size=1, phase="decode", mode=value, ratio=i if i < 3 else i / 2)
            rec.flush()  # each value in its own chunk

    run = record(tmp_path, body, flush_steps=2)
    assert len(run.steps) == 7 and run.warnings == []
    assert run.steps["mode"].tolist()[:4] == ["3", "4", "draft", "True"]
    assert pd.isna(run.steps["mode"].iloc[4]) and run.steps["mode"].tolist()[5:] == ["5", "False"]
    assert run.steps["ratio"].tolist() == [0, 1, 2, 1.5, 2, 2.5, 3]


def test_gpu_span_keeps_first_start_and_last_end(tmp_path):
    def body(rec):
        rec.gpu_span(1, 2)  # outside a step: a detached interval (step -1), see test_analyze
        rec.step_begin()
        rec.gpu_span(100, 200)
        rec.gpu_span(150, 400)
        rec.step_begin()  # no GPU work
        rec.step_begin()
        rec.gpu_span(500, 600)

    gpu = record(tmp_path, body).gpu
    assert gpu[["step", "gpu_start_ns", "gpu_end_ns"]].values.tolist() == [
        [-1, 1, 2], [0, 100, 400], [2, 500, 600]]


def test_scopes_are_cached_and_misuse_never_raises(tmp_path):
    rec = Recorder(tmp_path, engine="test")
    assert rec.busy("x") is rec.busy("x") and rec.wait("g") is rec.wait("g") and rec.idle() is rec.idle()
    rec.busy_end()  # unmatched end
    rec.step_begin()
    for _ in range(100):  # deeper than the span stack
        rec.busy_begin("deep")
    for _ in range(100):
        rec.busy_end()
    rec.step_begin()
    with rec.busy("after"):
        pass
    rec.close()
    rec.step_begin()  # after close: ignored, no error
    rec.busy_begin("late")
    rec.busy_end()
    run = load_run(tmp_path)
    assert len(run.steps) == 2
    assert (run.spans["label"] == "deep").sum() == 64 and (run.spans["label"] == "after").sum() == 1


def test_hot_path_keeps_only_the_clock_ints(tmp_path):
    rec = Recorder(tmp_path, engine="test", span_capacity=50_000)
    rec.step_begin()
    scope = rec.busy("x")
    for _ in range(100):
        with scope:
            pass
    n = 20_000
    before = sys.getallocatedblocks()
    for _ in range(n):
        with rec.busy("x"):
            pass
    per_span = (sys.getallocatedblocks() - before) / n
    rec.close()
    # Each span stores two ints (start, duration); a per-span tuple/dict/object would add at least one block.
    assert per_span < 2.5, per_span


def _play(rec, ops, use_with: bool) -> None:
    """Run a script of spans as `with` blocks or as the begin/end calls they stand for."""
    for op, *args in ops:
        if op in ("busy", "wait"):
            label, inner = args
            if use_with:
                with rec.busy(label) if op == "busy" else rec.wait(label):
                    _play(rec, inner, use_with)
            else:
                (rec.busy_begin if op == "busy" else rec.wait_begin)(label)
                _play(rec, inner, use_with)
                (rec.busy_end if op == "busy" else rec.wait_end)()
        else:
            getattr(rec, op)(*args)


@contextlib.contextmanager
def fake_clock(monkeypatch, clock):
    """Every clock the recorder reads, the C hot path's included, is `clock` inside the block."""
    import overshoot.record.core
    import overshoot.record.recorder
    import overshoot.record.scopes
    from overshoot.record import hotpath

    for module in (overshoot.record.recorder, overshoot.record.scopes, overshoot.record.core):
        monkeypatch.setattr(module, "perf_counter_ns", clock)  # scopes bind it when created
    if hotpath.native is not None:
        hotpath.native.set_clock(clock)
    try:
        yield
    finally:
        if hotpath.native is not None:
            hotpath.native.set_clock(None)


def _span_script() -> list:
    """Spans nested, misused and deep, steps splitting open spans, more spans than the buffer holds."""
    deep: list = []
    for _ in range(70):  # deeper than the span stack
        deep = [("busy", "deep", deep)]
    return [
        ("step_begin",),
        ("busy", "schedule", [("wait", "gpu", [("wait", "inner", [])])]),
        ("busy", "launch", [("busy", "split", [("step_begin",)])]),  # open spans at a step boundary
        ("wait", "gpu", [("busy", "in-wait", [])]),
        ("busy", "loop", [("busy_begin", "left-open")]),  # the scope's exit ends the innermost span
        ("busy", "outer", [("idle_begin",)]),  # an idle span innermost: the exit takes the general path
        ("step_begin",),
        *deep,
        ("busy_end",),  # unmatched
        *[("busy", "many", [])] * 40,  # more spans than span_capacity: exits flush
        ("wait", "last", []),
    ]


def without_gc(frame: pd.DataFrame) -> pd.DataFrame:
    """A table without python:gc spans: collections come when the allocator says, not when a script does."""
    if "label" not in frame:
        return frame
    label = frame["label"].astype(object)  # (a categorical's categories would still name it)
    return frame[label != "python:gc"].assign(label=label[label != "python:gc"]).reset_index(drop=True)


def test_with_scopes_record_exactly_what_begin_end_records(tmp_path, monkeypatch):
    """The `with` scopes are their own code (hot.c's Scope, or record/scopes.py's closures that inline the
    begin/end code): on the same clock readings both forms must write identical spans and steps, misuse
    included."""
    script = _span_script()
    runs = []
    for use_with in (True, False):
        ticks = iter(range(10**9, 2 * 10**9, 1000))
        with fake_clock(monkeypatch, ticks.__next__):
            rec = Recorder(tmp_path / str(use_with), engine="test", span_capacity=8)
            _play(rec, script, use_with)
            rec.close()
        runs.append(load_run(tmp_path / str(use_with)))
    scoped, paired = runs
    assert len(scoped.spans) > 100 and scoped.steps["wait_ns"].gt(0).any()
    pd.testing.assert_frame_equal(without_gc(scoped.spans), without_gc(paired.spans))
    pd.testing.assert_frame_equal(scoped.steps, paired.steps)


class Ticks:
    """A fake clock: each read advances it 1 µs; `jump` stands for time the thread spent (a wait, idle)."""

    def __init__(self):
        self.now = 10**9

    def __call__(self) -> int:
        self.now += 1000
        return self.now

    def jump(self, ns: int) -> None:
        self.now += ns


def _step_script(rec, ticks: Ticks) -> None:
    """Steps through every branch of the recorder's core: facts positional, by keyword, extra and merged;
    CUDA events (on host-clock events: the real ring's bookkeeping) on a stream and on the current one,
    re-recorded ends, detached pairs outside steps; host-clock GPU intervals; long waits (the next wait
    resolves events or flushes); flushes due by count, by fill and by time; step_end and idle between."""
    rec._ring = _host_ring(size=8)  # fewer slots than steps between flushes: the oldest are dropped
    for i in range(90):
        if i % 7 == 0:
            rec.step_begin(i % 3, 2 * i, "decode")
        else:
            extra = {"lora": i % 2} if i % 3 else {}
            rec.step_begin(batch_size=i % 5 or None, phase="prefill" if i % 4 else None, **extra)
        rec.step_facts(num_tokens=i, accepted=str(i))
        if i % 2:
            rec.step_facts(batch_size=7, more=i)
        rec.busy_begin("launch")
        stream = None if i % 4 == 0 else "stream"
        rec.gpu_begin(stream)
        rec.gpu_begin(stream)  # the first call of a step counts
        rec.gpu_end(stream)
        if i % 5 == 0:
            rec.gpu_end(stream)  # the last end counts
        rec.busy_end()
        if i % 11 == 0:
            rec.gpu_span(ticks.now, ticks.now + 500)
        rec.wait_begin("gpu")
        # >= WORK_IN_WAIT_NS: the next wait gets the work; steps 40-69 are CPU-bound: flushes between steps
        ticks.jump(300_000 if i % 3 and not 40 <= i < 70 else 20_000)
        rec.wait_end()
        if i % 13 == 0:
            rec.step_end()
            rec.step_facts(batch_size=99)  # outside a step: no-op
        if i % 17 == 0:
            rec.idle_begin()
            ticks.jump(50_000)
            rec.idle_end()
            rec.gpu_begin("stream")  # no step open: a detached pair, committed at its end
            rec.gpu_end("stream")
    rec.step_begin(batch_size=1, phase="decode")
    rec.busy_begin("left-open")  # closed by close()


def _random_ops(seed: int, n: int = 600) -> list[tuple]:
    """A seeded random sequence of the recorder's calls, valid or misused (unmatched ends, idle inside spans,
    GPU calls outside steps, facts outside steps), with time passing between them."""
    import random

    rnd = random.Random(seed)
    values = [None, 0, 3, 17, "decode", "prefill", True, 2.5]

    def facts(positional: int) -> tuple[tuple, dict]:
        args = tuple(rnd.choice(values) for _ in range(positional))
        names = ["batch_size", "num_tokens", "phase"][positional:] + ["lora", "accepted_tokens", "spec"]
        kwargs = {name: rnd.choice(values) for name in rnd.sample(names, rnd.randint(0, 3))}
        return args, kwargs

    ops: list[tuple] = []
    for _ in range(n):
        roll = rnd.random()
        if roll < 0.12:
            ops.append(("step_begin", *facts(rnd.randint(0, 3))))
        elif roll < 0.2:
            ops.append(("step_facts", *facts(rnd.randint(0, 2))))
        elif roll < 0.45:
            ops.append((rnd.choice(["busy_begin", "wait_begin"]), (rnd.choice(["a", "b", "gpu"]),), {}))
        elif roll < 0.65:
            ops.append((rnd.choice(["busy_end", "wait_end", "_end"]), (), {}))
        elif roll < 0.75:
            ops.append((rnd.choice(["gpu_begin", "gpu_end"]), (rnd.choice([None, "stream"]),), {}))
        elif roll < 0.8:
            ops.append((rnd.choice(["idle_begin", "idle_end", "step_end", "flush"]), (), {}))
        elif roll < 0.83:
            ops.append(("gpu_span", (rnd.randint(0, 5000), rnd.randint(0, 5000)), {}))
        else:
            ops.append(("jump", (rnd.choice([1_000, 50_000, 250_000, 3_000_000]),), {}))
    return ops


def _play_random(rec, ticks: Ticks, ops: list[tuple]) -> None:
    rec._ring = _host_ring(size=16)
    for name, args, kwargs in ops:
        if name == "jump":
            ticks.jump(*args)
        elif name == "gpu_span":
            rec.gpu_span(ticks.now + args[0], ticks.now + args[0] + args[1])
        else:
            getattr(rec, name)(*args, **kwargs)


@pytest.mark.parametrize("use_with", [True, False], ids=["with", "begin-end"])
def test_c_and_python_hot_paths_record_the_same_rows(tmp_path, use_with):
    """hot.c and record/core.py + scopes.py are one contract in two languages: the same scripts on the same
    clock readings write identical spans, steps and GPU intervals through either."""
    from overshoot.record import cbuild

    if cbuild.find_c_compiler() is None:
        pytest.skip("no C compiler: only the Python hot path exists here")
    code = textwrap.dedent(f"""
        import sys
        import pytest
        sys.path.insert(0, {str(REPO / "tests")!r})
        import test_recorder as t
        from overshoot import Recorder
        from overshoot.record import hotpath
        ticks = iter(range(10**9, 2 * 10**9, 1000))
        with t.fake_clock(pytest.MonkeyPatch(), ticks.__next__):
            rec = Recorder(sys.argv[1] + "/spans", engine="test", span_capacity=8)
            t._play(rec, t._span_script(), {use_with})
            rec.close()
        ticks = t.Ticks()
        patch = pytest.MonkeyPatch()
        patch.setattr(t, "perf_counter_ns", ticks)  # the host-clock events' clock
        with t.fake_clock(patch, ticks):
            rec = Recorder(sys.argv[1] + "/steps", engine="test", flush_steps=16, flush_seconds=0.004,
                           span_capacity=64)
            t._step_script(rec, ticks)
            rec.close()
            dropped = rec._ring.dropped
            for seed in range(6):
                rec = Recorder(sys.argv[1] + f"/random{{seed}}", engine="test", flush_steps=8,
                               flush_seconds=0.002, span_capacity=32)
                t._play_random(rec, ticks, t._random_ops(seed))
                rec.close()
        print(dropped, hotpath.describe())
    """)
    ran = {}
    for mode in ("c", "python"):  # each run says which path ran, in its process record too
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path / mode)], capture_output=True,
                              text=True, env={**os.environ, "OVERSHOOT_HOTPATH": mode}, timeout=120)
        assert done.returncode == 0, done.stderr
        ran[mode] = done.stdout.split()
    assert [ran["c"][1], ran["python"][1]] == ["c", "python"]
    def rows(frame: pd.DataFrame) -> pd.DataFrame:  # the process's identity differs, by design
        return without_gc(frame.drop(columns=[col for col in ("pid", "tid", "thread") if col in frame]))

    for script in ("spans", "steps", *(f"random{seed}" for seed in range(6))):
        c, python = load_run(tmp_path / "c" / script), load_run(tmp_path / "python" / script)
        assert len(c.spans) > 100 and (script == "spans" or len(c.steps) > 50), script
        assert c.processes[0]["options"]["hotpath"] == "c"
        assert python.processes[0]["options"]["hotpath"] == "python (OVERSHOOT_HOTPATH=python)"
        pd.testing.assert_frame_equal(rows(c.spans), rows(python.spans))
        pd.testing.assert_frame_equal(rows(c.steps), rows(python.steps))
        pd.testing.assert_frame_equal(rows(c.gpu), rows(python.gpu))
    # The step script reached what it was written for.
    c = load_run(tmp_path / "c" / "steps")
    steps, gpu = c.steps, c.gpu
    assert len(steps) == 91 and steps["batch_size"].eq(7).sum() == 45
    in_waits = _flushes_inside_waits(c)
    assert any(in_waits) and not all(in_waits), "flushes both inside waits and between steps"
    dropped = int(ran["c"][0])
    assert dropped > 0 and ran["python"][0] == ran["c"][0]
    assert len(gpu) + dropped == 90 + 6 + 9  # a CUDA slot a step and a detached pair, gpu_span in 9 steps
    assert (gpu["step"] == -1).sum() >= 5


def test_without_a_compiler_the_python_hot_path_records_and_says_why(tmp_path):
    """No C compiler on PATH and no cached build: the recorder still records, in Python, and its process
    record says so and why; asking for C then fails at import with the reason. A build already in the
    cache loads without a compiler."""
    code = textwrap.dedent("""
        import sys
        from overshoot import Recorder
        from overshoot.rundir.reader import load_run
        rec = Recorder(sys.argv[1], engine="test")
        rec.step_begin()
        with rec.busy("schedule"):
            pass
        rec.close()
        run = load_run(sys.argv[1])
        print(len(run.steps), len(run.spans), run.processes[0]["options"]["hotpath"])
    """)
    env = {**os.environ, "PATH": str(tmp_path / "empty"), "OVERSHOOT_CACHE": str(tmp_path / "cache")}
    env.pop("CC", None)
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    why = "python (no C compiler (cc, gcc, clang or $CC) to build the recorder's C hot path)"
    assert done.stdout.split(maxsplit=2) == ["1", "1", why + "\n"]
    forced = subprocess.run([sys.executable, "-c", "from overshoot import Recorder"], capture_output=True,
                            text=True, env={**env, "OVERSHOOT_HOTPATH": "c"}, cwd=REPO, timeout=120)
    assert forced.returncode != 0 and "OVERSHOOT_HOTPATH=c: no C compiler" in forced.stderr
    from overshoot.record import cbuild

    if cbuild.find_c_compiler() is None:
        return
    # A build already in the cache needs no compiler: built once with one, then loaded without.
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "built")], check=True, capture_output=True,
                   env={**os.environ, "OVERSHOOT_CACHE": str(tmp_path / "cache")}, cwd=REPO, timeout=120)
    cached = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cached")], capture_output=True,
                            text=True, env=env, cwd=REPO, timeout=120)
    assert cached.returncode == 0, cached.stderr
    assert cached.stdout.split() == ["1", "1", "c"]


def test_time_based_flush_makes_data_readable_while_recording(tmp_path):
    rec = Recorder(tmp_path, engine="test", flush_steps=10_000, flush_seconds=0.0)
    for _ in range(3):
        rec.step_begin()
        spin(10)
    rec.step_begin()
    run = load_run(tmp_path)  # the recorder is still open
    assert len(run.steps) == 3
    flush_spans = run.spans[run.spans["label"] == "overshoot:flush"]
    assert len(flush_spans) >= 2 and (flush_spans["step"] == -1).all()
    rec.close()
    assert len(load_run(tmp_path).steps) == 4


def test_default_recorder_flushes_within_a_second_while_stepping(tmp_path):
    """What the live view of `overshoot run` reads: with the defaults (every 256 steps or 1 s, checked at step
    boundaries), slow steps reach the spool about a second after they ran, long before 256 of them."""
    rec = Recorder(tmp_path, engine="test")
    start = perf_counter_ns()
    while perf_counter_ns() - start < 1.2e9:  # ~200 steps of 6 ms: fewer than flush_steps
        rec.step_begin()
        spin(6000)
    visible = len(load_run(tmp_path).steps)  # the recorder is still open
    total = rec.steps_recorded
    rec.close()
    assert total < 256 and 0.7 * total < visible < total


def test_paused_time_does_not_count_toward_the_flush_interval(tmp_path):
    """hook_overhead's recorders see a quarter of the rounds: the time of the others must not make them
    flush four times as often per step as in a served engine."""
    def flushes(pause: bool) -> int:
        rec = Recorder(tmp_path / str(pause), engine="test", flush_steps=10_000, flush_seconds=0.2)
        for _ in range(4):
            for _ in range(5):
                rec.step_begin()
                spin(1000)
            if pause:
                rec.pause()
            time.sleep(0.12)  # unrecorded work
            if pause:
                rec.resume()
        rec.step_begin()
        rec.close()
        spans = load_run(tmp_path / str(pause)).spans
        return int((spans["label"] == "overshoot:flush").sum())

    assert flushes(pause=True) == 0  # 21 ms of recorded time: no flush due before close
    assert flushes(pause=False) >= 2
    steps = load_run(tmp_path / "True").steps
    duration_ms = (steps["end_ns"] - steps["start_ns"]) / 1e6
    assert len(steps) == 21 and duration_ms.max() < 50  # the last step of a stretch ends at pause()


def test_recorder_json_meta_and_unique_tags(tmp_path):
    info = {"hooks": [{"target": "engine.step", "status": "ok", "reason": None}], "server": "demo"}
    a = Recorder(tmp_path, engine="eng", thread_tag="engine/0", process_info=info)
    b = Recorder(tmp_path, engine="eng", thread_tag="engine/0")
    assert a.tag == "engine_0" and b.tag == "engine_0-2"
    for rec in (a, b):
        rec.step_begin()
        rec.close()
    meta = read_meta(tmp_path)
    assert meta["engine"] == "eng" and meta["created_by"] == "recorder" and meta["host"]["cpu"]
    processes = {p["tag"]: p for p in load_run(tmp_path).processes}
    pa_ = processes["engine_0"]
    assert pa_["hooks"] == info["hooks"] and pa_["server"] == "demo" and pa_["closed"] is True
    assert pa_["engine"] == "eng" and pa_["options"]["flush_steps"] == 256 and pa_["steps"] == 1
    assert pa_["thread"] == threading.current_thread().name and "perf_counter_ns" in pa_["clock"]
    assert set(load_run(tmp_path).steps["thread"]) == {"engine_0", "engine_0-2"}


def test_existing_meta_is_not_replaced(tmp_path):
    write_meta(tmp_path, {"created_by": "overshoot run", "levels": []})
    Recorder(tmp_path, engine="x").close()
    assert read_meta(tmp_path)["created_by"] == "overshoot run"
    assert json.loads((tmp_path / "meta.json").read_text())["levels"] == []


def test_recorders_on_several_threads_do_not_collide(tmp_path):
    def engine_thread(i):
        rec = Recorder(tmp_path, engine="t")
        for _ in range(50 + i):
            rec.step_begin(batch_size=i)
            with rec.busy("work"):
                spin(5)
        rec.close()

    threads = [threading.Thread(target=engine_thread, args=(i,), name=f"engine-{i}") for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    steps = load_run(tmp_path).steps
    counts = steps.groupby("thread").size().to_dict()
    assert counts == {"engine-0": 50, "engine-1": 51, "engine-2": 52}
    assert steps["pid"].nunique() == 1


def test_import_is_light_and_gpu_calls_are_noops_without_cuda(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        import overshoot
        assert "torch" not in sys.modules and "pandas" not in sys.modules and "pyarrow" not in sys.modules
        rec = overshoot.Recorder({str(tmp_path)!r}, engine="cpu")
        for _ in range(3):
            rec.step_begin()
            rec.busy_begin("launch")
            rec.busy_end()
        rec.close()
        print("torch" in sys.modules, "pandas" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]  # recording never loads torch or pandas
    try:
        import torch
    except ImportError:
        pytest.skip("torch not installed")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: covered by the GPU check")
    rec = Recorder(tmp_path / "gpu", engine="cpu")
    rec.step_begin()
    rec.gpu_begin(None)
    rec.gpu_end(None)
    rec.close()
    run = load_run(tmp_path / "gpu")
    assert len(run.steps) == 1 and len(run.gpu) == 0 and list(run.gpu.columns)[:3] == [
        "step", "gpu_start_ns", "gpu_end_ns"]


def test_nvtx_ranges_do_not_change_what_is_recorded(tmp_path):
    pytest.importorskip("nvtx")
    rec = Recorder(tmp_path, engine="test", nvtx=True)
    assert type(rec).__name__ == "_NvtxRecorder"
    for _ in range(3):
        rec.step_begin()
        with rec.busy("schedule"):
            with rec.wait("gpu"):
                spin(20)
        with rec.idle():
            pass
    rec.close()
    run = load_run(tmp_path)
    assert len(run.steps) == 3 and (run.steps["wait_ns"] >= 20_000).all()
    assert run.spans["kind"].value_counts().to_dict() == {"busy": 3, "wait": 3, "idle": 3}
    assert run.processes[0]["options"]["nvtx"] is True


# ---- CUDA (runs where a GPU is present; skipped on CPU-only CI) --------------------------------------------


def _cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch


def test_cuda_events_resolve_to_plausible_gpu_times(tmp_path):
    torch = _cuda()
    stream = torch.cuda.Stream()
    a = torch.randn(2048, 2048, device="cuda")
    with torch.cuda.stream(stream):
        for _ in range(5):
            a @ a
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(40):
            a @ a
        end.record(stream)
    end.synchronize()
    matmul_ms = start.elapsed_time(end) / 40

    rec = Recorder(tmp_path, engine="cuda-test", flush_steps=8)
    for _ in range(30):
        rec.step_begin(batch_size=1, phase="decode")
        with rec.busy("launch"), torch.cuda.stream(stream):
            rec.gpu_begin(stream)
            for _ in range(4):
                a @ a
            rec.gpu_end(stream)
        with rec.wait("gpu"):
            stream.synchronize()
    rec.close()
    run = load_run(tmp_path)
    assert run.processes[0]["gpu"] and run.processes[0]["gpu_events"]["dropped"] == 0
    gpu = run.gpu.merge(run.steps, on=["pid", "thread", "step"])
    assert len(gpu) == 30
    gpu_ms = (gpu["gpu_end_ns"] - gpu["gpu_start_ns"]) / 1e6
    assert (gpu_ms.median() / (4 * matmul_ms)) == pytest.approx(1.0, rel=0.25), (gpu_ms.median(), matmul_ms)
    # Host-clock placement: each step's GPU work lies inside its step (launch .. end of the wait), give or
    # take the anchor's error of a few µs.
    slack = 50_000
    assert (gpu["gpu_start_ns"] >= gpu["start_ns"] - slack).all()
    assert (gpu["gpu_end_ns"] <= gpu["end_ns"] + slack).all()


def test_cuda_hot_path_and_flush_never_wait_for_the_gpu(tmp_path):
    torch = _cuda()
    stream = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda")
    rec = Recorder(tmp_path, engine="cuda-test", cuda=True)
    torch.cuda.synchronize()
    rec.step_begin()
    t0 = perf_counter_ns()
    rec.gpu_begin(stream)
    with torch.cuda.stream(stream):
        for _ in range(200):  # tens of ms of GPU work
            a @ a
    rec.gpu_end(stream)
    rec.step_begin()  # commits the slot
    rec.flush()  # queries, must not wait
    host_ms = (perf_counter_ns() - t0) / 1e6
    assert rec._ring.unresolved == 1, "the GPU cannot have finished yet"
    stream.synchronize()
    gpu_ms = (perf_counter_ns() - t0) / 1e6
    assert host_ms < gpu_ms / 3, (host_ms, gpu_ms)
    rec.close()
    run = load_run(tmp_path)
    assert len(run.gpu) == 1 and run.gpu["step"].iloc[0] == 0


def test_cuda_ring_drops_oldest_and_reanchors(tmp_path):
    torch = _cuda()
    from overshoot.record.cuda_events import CudaEventRing

    stream = torch.cuda.Stream()
    ring = CudaEventRing(size=4, reanchor_seconds=0.0)
    for step in range(6):  # never resolved in between: the two oldest are dropped, nothing waits
        slot = ring.acquire()
        ring.begin_events[slot].record(stream)
        ring.end_events[slot].record(stream)
        ring.commit(slot, step)
    assert ring.dropped == 2 and ring.unresolved == 4
    stream.synchronize()
    out: tuple[list, list, list] = ([], [], [])
    ring.drain(*out)
    assert out[0] == [2, 3, 4, 5] and all(e >= s for s, e in zip(out[1], out[2], strict=True))
    ring.drain(*out)  # records a new anchor (reanchor_seconds=0) ...
    torch.cuda.synchronize()
    ring.drain(*out)  # ... and adopts it once reached
    assert ring.anchors >= 2 and ring.max_drift_us < 1000


def test_sigterm_inside_a_deferred_block_arrives_after_it():
    """The close at an engine's shutdown finishes before a SIGTERM sent meanwhile is acted on."""
    import signal

    from overshoot.record.lifecycle import sigterm_deferred

    got: list[str] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append("handler"))
    try:
        with sigterm_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            got.append("block done")
        assert got == ["block done", "handler"]
        assert signal.getsignal(signal.SIGTERM) is not None and got.count("handler") == 1
    finally:
        signal.signal(signal.SIGTERM, previous)


class _HostEvent:
    """A CUDA event's interface on the host clock: done when recorded (the GPU keeps up with the host)."""

    def __init__(self):
        self.t = None

    def record(self, stream=None):
        self.t = perf_counter_ns()

    def query(self):
        return self.t is not None

    def elapsed_time(self, other):
        return (other.t - self.t) / 1e6


def _host_ring(size: int = 64):
    """The real CudaEventRing's bookkeeping (acquire, commit, resolve, anchors) over host-clock events."""
    from overshoot.record.cuda_events import CudaEventRing

    ring = object.__new__(CudaEventRing)
    ring.size, ring.dropped, ring.write_head, ring.resolve_head = size, 0, 0, 0
    ring.begin_events = [_HostEvent() for _ in range(size)]
    ring.end_events = [_HostEvent() for _ in range(size)]
    ring.slot_step = [0] * size
    ring.record = lambda event, stream: event.record(stream)
    # never re-anchored: the anchor may be on a fake clock, far from the real one that decides re-anchoring
    ring.reanchor_ns, ring.max_drift_us, ring.anchors, ring.gpu_name = 2**62, 0.0, 1, "host clock"
    ring._anchor = _HostEvent()
    ring._anchor.record()
    ring._anchor_host_ns = ring._last_anchor_ns = ring._anchor.t
    ring._pending_anchor = None
    return ring


@pytest.mark.parametrize("wait_us", [400, 0])
def test_gpu_bound_waits_resolve_the_events_the_flush_would(tmp_path, wait_us):
    """Steps that waited on the GPU >= 0.2 ms resolve finished steps' events in their next wait, so the
    flush between steps has none left to do; steps that did not wait leave them to the flush. Either way the
    run has every step's GPU interval, once, in order."""
    rec = Recorder(tmp_path, engine="t", flush_steps=64, flush_seconds=600)  # no flush due in between
    rec._ring = _host_ring()
    in_wait = []
    for _ in range(40):
        rec.step_begin(batch_size=1, phase="decode")
        rec.gpu_begin(None)
        spin(20)
        rec.gpu_end(None)
        with rec.wait("gpu"):
            spin(wait_us)
        in_wait.append(len(rec._ring_rows[0]))
    rec.close()
    run = load_run(tmp_path)
    assert list(run.gpu["step"]) == list(range(40))
    assert (run.gpu["gpu_end_ns"] > run.gpu["gpu_start_ns"]).all()
    if wait_us:  # from the second wait on, each resolves the step before it
        assert in_wait[1:] == list(range(1, 40)), in_wait
    else:
        assert not any(in_wait)


def _launch_wait_update(rec: Recorder, steps: int, *, launch_us: float, wait_us: float) -> None:
    """Decode steps of an engine that launches, waits for the GPU, then updates (three spans a step)."""
    for _ in range(steps):
        rec.step_begin(batch_size=1, phase="decode")
        with rec.busy("launch"):
            spin(launch_us)
        with rec.wait("gpu"):
            spin(wait_us)
        with rec.busy("update"):
            spin(20)


def _flushes_inside_waits(run) -> list[bool]:
    spans = run.spans
    flushes = spans[spans["label"] == "overshoot:flush"]
    waits = spans[spans["kind"] == "wait"]
    starts, ends = waits["start_ns"].to_numpy(), (waits["start_ns"] + waits["dur_ns"]).to_numpy()
    return [bool(((starts <= f.start_ns) & (f.start_ns + f.dur_ns <= ends)).any())
            for f in flushes.itertuples()]


def test_buffers_filling_up_flush_inside_waits_not_between_steps(tmp_path):
    """A synchronous GPU-bound engine (every step waits) whose buffers fill before the flush interval: the
    flush runs in a wait once they are 3/4 full, instead of between steps when they are full (which is what
    a flush due by count alone did: it could never be moved). Every step is still written."""
    rec = Recorder(tmp_path, engine="t", flush_steps=16, flush_seconds=3600)
    # waits of 8 ms: a flush of 16 steps takes over 1.6 ms (what a 2 ms wait fits) on a loaded 2-core machine
    _launch_wait_update(rec, 112, launch_us=20, wait_us=8000)
    rec.close()
    run = load_run(tmp_path)
    assert list(run.steps["step"]) == list(range(112))
    inside = _flushes_inside_waits(run)
    assert len(inside) >= 112 // 16
    # the first flush has no cost known yet and is not sent into a wait; a loaded machine may slow one more
    assert sum(inside) >= len(inside) - 2, inside


def test_buffers_that_fill_without_a_fitting_wait_flush_between_steps_when_full(tmp_path):
    """Steps that never wait: the flush waits for a wait it fits in until the buffer is full, then runs
    between steps; nothing is lost and no buffer overflows."""
    rec = Recorder(tmp_path, engine="t", flush_steps=16, flush_seconds=3600)
    for _ in range(100):
        rec.step_begin(batch_size=1, phase="decode")
        with rec.busy("launch"):
            pass
    rec.close()
    run = load_run(tmp_path)
    assert list(run.steps["step"]) == list(range(100))
    flushes = run.spans[run.spans["label"] == "overshoot:flush"]
    assert len(flushes) == 100 // 16  # one a full buffer (the close writes the rest)
    assert not any(_flushes_inside_waits(run))


@pytest.mark.parametrize("wait_us", [6000, 0])  # 6 ms: a flush on a loaded 2-core machine fits with room
def test_a_due_flush_runs_inside_the_next_wait_of_a_gpu_bound_stretch(tmp_path, wait_us):
    """A flush due after a step that waited >= 0.2 ms, and at least 1.25 times the last flush's time, runs at
    the start of the next wait (its time part of that wait), not between steps; after steps that did not wait
    it runs between steps. Every step and span is written either way."""
    rec = Recorder(tmp_path, engine="t", flush_seconds=0.0)  # a flush is due at every boundary
    _launch_wait_update(rec, 30, launch_us=50, wait_us=wait_us)
    rec.close()
    run = load_run(tmp_path)
    assert list(run.steps["step"]) == list(range(30))
    spans = run.spans
    assert (spans[spans["step"] >= 0].groupby("step").size() == 3).all()
    inside = _flushes_inside_waits(run)
    assert len(inside) >= 25
    if wait_us:
        # the first flush (no cost known yet) may fall between steps, and a flush slowed past half a wait by
        # a loaded machine sends the next one between steps
        assert sum(inside) >= 0.8 * len(inside), inside
        step_wait_ms = run.steps["wait_ns"].to_numpy()[1:] / 1e6
        assert (step_wait_ms >= wait_us / 1e3).all()
    else:
        assert not any(inside)


def test_a_garbage_collection_on_the_engine_thread_is_a_python_gc_span_inside_the_call_it_interrupted(
        tmp_path):
    """A collection on the recorder's thread becomes a busy span `python:gc` of its step, nested in the span
    that was open (so `schedule` keeps only its own time); its start and length match the gc.collect() call
    timed around it. Another thread's collection is not this thread's."""
    import gc
    import threading

    from overshoot.analysis.analyze import summarize
    from overshoot.analysis.labels import busy_by_label

    was_enabled = gc.isenabled()
    gc.disable()  # only the collections this test runs
    try:
        rec = Recorder(tmp_path / "r", engine="test")
        rec.step_begin(batch_size=1, phase="decode")
        with rec.busy("schedule"):
            garbage = [[] for _ in range(300_000)]
            for a, b in zip(garbage, garbage[1:], strict=False):
                a.append(b)
                b.append(a)
            del garbage, a, b
            t0 = perf_counter_ns()
            gc.collect()
            t1 = perf_counter_ns()
        other = threading.Thread(target=gc.collect)
        other.start()
        other.join()
        rec.step_begin(batch_size=1, phase="decode")
        rec.close()
    finally:
        if was_enabled:
            gc.enable()
    run = load_run(tmp_path / "r")
    (span,) = run.spans[run.spans["label"] == "python:gc"].itertuples(index=False)
    assert (span.kind, span.step) == ("busy", 0)
    assert t0 <= span.start_ns and span.start_ns + span.dur_ns <= t1
    assert span.dur_ns >= 0.9 * (t1 - t0) - 50_000, (span.dur_ns, t1 - t0)  # the call's own overhead aside
    summary = summarize(run)
    (split,) = busy_by_label(summary.steps.iloc[:1], run.spans, summary.groups, summary.group_keys)
    by = {r["label"]: r["mean_ms"] for r in split}
    assert by["python:gc"] == pytest.approx(span.dur_ns / 1e6, rel=1e-6)
    schedule = run.spans[run.spans["label"] == "schedule"]["dur_ns"].iloc[0]
    assert by["schedule"] == pytest.approx((schedule - span.dur_ns) / 1e6, rel=1e-6)


def test_the_report_publishes_what_the_recorder_cost_the_engine_thread(tmp_path, monkeypatch):
    """Flushes between steps are overshoot's own work on the engine thread: the report's note counts them
    and sums their time as the recorder's `overshoot:flush` spans say, which match the flush calls timed
    from outside (the same count; the spans' total within the timer's own calls of it)."""
    from overshoot.report.table import build_report

    calls: list[int] = []
    real_flush = Recorder.flush

    def timed(self):
        t = perf_counter_ns()
        real_flush(self)
        calls.append(perf_counter_ns() - t)

    monkeypatch.setattr(Recorder, "flush", timed)
    rec = Recorder(tmp_path / "r", engine="test", flush_steps=16)
    for _ in range(100):
        rec.step_begin(batch_size=1, phase="decode")
        with rec.busy("work"):
            pass
    rec.close()
    run = load_run(tmp_path / "r")
    spans = run.spans[run.spans["label"] == "overshoot:flush"]
    between = len(spans)  # (the close writes the rest without a flush call or a span: it ends the run)
    assert between >= 5 and len(calls) == between
    assert spans["dur_ns"].sum() == pytest.approx(sum(calls), rel=0.2, abs=200_000)
    (note,) = [n for n in build_report(run)["notes"] if n.startswith("overshoot's own work")]
    assert f"flush {between}x, {spans['dur_ns'].sum() / 1e6:.1f} ms" in note
