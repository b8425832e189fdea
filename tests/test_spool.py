"""Spool on disk: round trip, damaged chunks, load_run errors, and crash safety of real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

from overshoot import Recorder
from overshoot.rundir.meta import RunDirError, read_meta, update_meta, write_meta
from overshoot.rundir.reader import load_run

REPO = Path(__file__).resolve().parents[1]


def write_steps(run_dir, n, *, flush_steps, engine="test"):
    rec = Recorder(run_dir, engine=engine, flush_steps=flush_steps)
    for i in range(n):
        rec.step_begin(batch_size=i, num_tokens=i + 1, phase="decode", k=i * 0.5)
        with rec.busy("work"):
            pass
        with rec.wait("gpu"):
            pass
        rec.gpu_span(1000 + i, 2000 + i)
    rec.close()
    return rec


def steps_file(run_dir, tag="MainThread") -> Path:
    return Path(run_dir) / "spool" / f"{os.getpid()}-{tag}.steps.0000.arrow"


def test_round_trip_keeps_values_and_types(tmp_path):
    rec = write_steps(tmp_path, 23, flush_steps=5)
    run = load_run(tmp_path)
    steps = run.steps
    assert run.run_id == tmp_path.name and run.warnings == [] and run.client is None
    assert steps["step"].tolist() == list(range(23))
    assert steps["batch_size"].tolist() == list(range(23))
    assert steps["k"].tolist() == [i * 0.5 for i in range(23)]
    assert str(steps["batch_size"].dtype) == "Int32" and steps["start_ns"].dtype == "int64"
    assert (steps["pid"] == os.getpid()).all() and (steps["thread"] == rec.tag).all()
    spans = run.spans[run.spans["label"] != "overshoot:flush"]  # the recorder's own flushes, between steps
    assert len(spans) == 46 and set(spans["label"]) == {"work", "gpu"}
    assert (spans.groupby("step").size() == 2).all()
    assert run.gpu["gpu_end_ns"].tolist() == [2000 + i for i in range(23)]
    assert list(run.gpu.columns) == ["step", "gpu_start_ns", "gpu_end_ns", "pid", "thread"]
    assert run.processes[0]["chunks"] >= 5


def test_words_are_dictionary_encoded_and_plain_string_spools_still_read(tmp_path):
    import pyarrow as pa

    write_steps(tmp_path / "new", 12, flush_steps=5)
    path = steps_file(tmp_path / "new")
    assert pa.types.is_dictionary(pa.ipc.open_stream(pa.memory_map(str(path))).schema.field("phase").type)
    # the same run as the spool was written before: the words as plain strings
    old = tmp_path / "old"
    (old / "spool").mkdir(parents=True)
    for file in (tmp_path / "new" / "spool").iterdir():
        if file.suffix != ".arrow":
            (old / "spool" / file.name).write_bytes(file.read_bytes())
            continue
        table = pa.ipc.open_stream(pa.memory_map(str(file))).read_all()
        plain = table.cast(pa.schema([pa.field(f.name, f.type.value_type if pa.types.is_dictionary(f.type)
                                               else f.type) for f in table.schema]))
        with pa.OSFile(str(old / "spool" / file.name), "wb") as sink:
            with pa.ipc.new_stream(sink, plain.schema) as writer:
                writer.write_table(plain)
    (old / "meta.json").write_bytes((tmp_path / "new" / "meta.json").read_bytes())
    a, b = load_run(tmp_path / "new"), load_run(old)
    assert a.warnings == b.warnings == []
    for name in ("steps", "spans", "gpu"):
        pd.testing.assert_frame_equal(getattr(a, name), getattr(b, name))
    assert str(a.steps["phase"].dtype) == "category" and str(a.spans["label"].dtype) == "category"
    # one run dir, two recorders, one of each format: read together
    mixed = tmp_path / "mixed"
    (mixed / "spool").mkdir(parents=True)
    for source, pid in ((tmp_path / "new", os.getpid()), (old, os.getpid() + 1)):
        for file in (source / "spool").iterdir():
            name = f"{pid}-{file.name.split('-', 1)[1]}"
            (mixed / "spool" / name).write_bytes(file.read_bytes())
    (mixed / "meta.json").write_bytes((tmp_path / "new" / "meta.json").read_bytes())
    both = load_run(mixed)
    assert both.warnings == [] and len(both.steps) == 24
    assert both.steps.groupby("pid")["phase"].apply(list).map(tuple).nunique() == 1


def test_truncated_last_chunk_keeps_earlier_chunks(tmp_path):
    write_steps(tmp_path, 20, flush_steps=5)  # 4 chunks of 5 steps
    path = steps_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 60])  # cut inside the last chunk (and drop the end marker)
    run = load_run(tmp_path)
    assert run.steps["step"].tolist() == list(range(15))
    assert run.warnings == [f"spool/{path.name}: truncated after 3 chunks"]


def test_garbage_tail_and_corrupt_file(tmp_path):
    write_steps(tmp_path / "a", 10, flush_steps=5)
    path = steps_file(tmp_path / "a")
    path.write_bytes(path.read_bytes()[:-8] + bytes(range(256)))  # end-of-stream marker replaced by garbage
    run = load_run(tmp_path / "a")
    assert len(run.steps) == 10 and "truncated after 2 chunks" in run.warnings[0]

    write_steps(tmp_path / "b", 10, flush_steps=5)
    steps_file(tmp_path / "b").write_bytes(b"this is not arrow" * 10)
    with pytest.raises(RunDirError, match=r"^no steps recorded in .*not an Arrow stream"):
        load_run(tmp_path / "b")


def test_a_corrupt_recorder_does_not_hide_the_others(tmp_path):
    write_steps(tmp_path, 10, flush_steps=5)
    other = Recorder(tmp_path, engine="test", thread_tag="other")
    other.step_begin()
    other.close()
    steps_file(tmp_path).write_bytes(b"")  # the first recorder's steps are lost
    run = load_run(tmp_path)
    assert run.steps["thread"].tolist() == ["other"]
    assert any("empty file" in w for w in run.warnings)


def test_load_run_errors_are_one_line(tmp_path):
    cases = {
        tmp_path / "missing": "run dir not found",
        tmp_path / "file.txt": "not a directory",
        tmp_path / "empty": "not an overshoot run dir",
        tmp_path / "meta_only": "no steps recorded",
        tmp_path / "bad_meta": "not valid JSON",
    }
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    write_meta(tmp_path / "meta_only", {"engine": "x"})
    (tmp_path / "bad_meta").mkdir()
    (tmp_path / "bad_meta" / "meta.json").write_text("{oops")
    for path, message in cases.items():
        with pytest.raises(RunDirError, match=message) as info:
            load_run(path)
        assert "\n" not in str(info.value)


def test_meta_helpers_and_client_table(tmp_path):
    assert read_meta(tmp_path) == {}
    assert write_meta(tmp_path, {"a": 1}, only_if_absent=True)
    assert not write_meta(tmp_path, {"a": 2}, only_if_absent=True)
    assert update_meta(tmp_path, {"b": [1]}) == {"a": 1, "b": [1]}
    assert read_meta(tmp_path) == {"a": 1, "b": [1]}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    write_steps(tmp_path, 3, flush_steps=5)
    pd.DataFrame({"concurrency": [1], "request": [0]}).to_parquet(tmp_path / "client.parquet")
    assert load_run(tmp_path).client["concurrency"].tolist() == [1]
    (tmp_path / "client.parquet").write_bytes(b"broken")
    run = load_run(tmp_path)
    assert run.client is None and any("client.parquet" in w for w in run.warnings)


# ---- real processes ----------------------------------------------------------------------------------------

CHILD = """
import os, signal, sys, threading, time
from overshoot import Recorder
run_dir, scenario = sys.argv[1], sys.argv[2]

def record(rec, n, announce=None):
    for i in range(n):
        rec.step_begin(batch_size=1, phase="decode")
        with rec.busy("work"):
            pass
        if announce and i + 1 == n:
            print(announce, flush=True)

if scenario == "forever":  # records until killed; small chunks
    rec = Recorder(run_dir, engine="child", flush_steps=50)
    i = 0
    while True:
        record(rec, 50)
        i += 1
        if i == 20:
            print("flushed", flush=True)
        time.sleep(0.001)
elif scenario == "sigterm":  # nothing flushed yet when the signal comes, inside an open step
    rec = Recorder(run_dir, engine="child", flush_steps=100_000, flush_seconds=1e6)
    record(rec, 40, announce="ready")
    time.sleep(30)
elif scenario == "sigterm_chained":
    signal.signal(signal.SIGTERM, lambda s, f: (print("previous handler", flush=True), sys.exit(7)))
    rec = Recorder(run_dir, engine="child", flush_steps=100_000, flush_seconds=1e6)
    record(rec, 30, announce="ready")
    time.sleep(30)
elif scenario == "sigint":
    rec = Recorder(run_dir, engine="child", flush_steps=100_000, flush_seconds=1e6)
    try:
        record(rec, 25, announce="ready")
        time.sleep(30)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
        sys.exit(3)
elif scenario == "thread_sigterm":  # recorder owned by a non-main thread
    from overshoot.record.recorder import install_signal_handlers
    install_signal_handlers()  # what a hook bootstrap does on the main thread
    def engine():
        rec = Recorder(run_dir, engine="child", flush_steps=100_000, flush_seconds=1e6)
        record(rec, 35, announce="ready")
        time.sleep(30)
    threading.Thread(target=engine, name="engine", daemon=True).start()
    time.sleep(30)
elif scenario == "fork":  # a forked child must not write the parent's buffered rows again
    rec = Recorder(run_dir, engine="child", flush_steps=100_000, flush_seconds=1e6)
    record(rec, 10)
    pid = os.fork()
    if pid == 0:
        import gc
        gc.collect()  # the parent's recorder must not keep the child's collections (nothing would write them)
        if rec._gc.rows:
            sys.exit(4)
        rec.step_begin()
        rec.flush()
        sys.exit(0)  # runs the child's atexit handlers
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(os.waitstatus_to_exitcode(status))
    record(rec, 5)
    rec.close()
elif scenario == "atexit":  # never closed explicitly
    rec = Recorder(run_dir, engine="child", flush_steps=100_000, flush_seconds=1e6)
    record(rec, 12)
"""


def start_child(tmp_path, scenario):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(script), str(tmp_path / "run"), scenario]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for_line(proc, expected, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.strip() == expected:
            return
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"child never printed {expected!r}: {proc.stderr.read()}")


def finish(proc, timeout=20):
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, out, err


def recorder_json(tmp_path) -> dict:
    (path,) = (tmp_path / "run" / "spool").glob("*.json")
    return json.loads(path.read_text())


def test_sigkill_mid_run_leaves_a_readable_run(tmp_path):
    proc = start_child(tmp_path, "forever")
    try:
        wait_for_line(proc, "flushed")
        proc.send_signal(signal.SIGKILL)
    finally:
        code, _, _ = finish(proc)
    assert code == -signal.SIGKILL
    run = load_run(tmp_path / "run")
    assert len(run.steps) >= 950  # 20 x 50 steps were recorded; at most the open chunk is lost
    assert run.steps["step"].tolist() == list(range(len(run.steps)))
    assert recorder_json(tmp_path)["closed"] is False


def test_sigterm_flushes_then_terminates(tmp_path):
    proc = start_child(tmp_path, "sigterm")
    try:
        wait_for_line(proc, "ready")
        proc.send_signal(signal.SIGTERM)
    finally:
        code, _, err = finish(proc)
    assert code == -signal.SIGTERM, err
    run = load_run(tmp_path / "run")
    assert len(run.steps) == 39  # the 40th step was still open
    info = recorder_json(tmp_path)
    assert info["closed"] is True and info["end_reason"] == "SIGTERM"


def test_sigterm_chains_to_the_previous_handler(tmp_path):
    proc = start_child(tmp_path, "sigterm_chained")
    try:
        wait_for_line(proc, "ready")
        proc.send_signal(signal.SIGTERM)
    finally:
        code, out, err = finish(proc)
    assert code == 7 and "previous handler" in out, err
    assert len(load_run(tmp_path / "run").steps) >= 29


def test_sigint_flushes_and_still_raises_keyboard_interrupt(tmp_path):
    proc = start_child(tmp_path, "sigint")
    try:
        wait_for_line(proc, "ready")
        proc.send_signal(signal.SIGINT)
    finally:
        code, out, err = finish(proc)
    assert code == 3 and "KeyboardInterrupt" in out, err
    assert len(load_run(tmp_path / "run").steps) >= 24


def test_sigterm_flushes_a_recorder_owned_by_another_thread(tmp_path):
    proc = start_child(tmp_path, "thread_sigterm")
    try:
        wait_for_line(proc, "ready")
        proc.send_signal(signal.SIGTERM)
    finally:
        code, _, err = finish(proc)
    assert code == -signal.SIGTERM, err
    steps = load_run(tmp_path / "run").steps
    assert len(steps) == 34 and set(steps["thread"]) == {"engine"}


def test_atexit_closes_an_unclosed_recorder(tmp_path):
    code, _, err = finish(start_child(tmp_path, "atexit"))
    assert code == 0, err
    assert len(load_run(tmp_path / "run").steps) == 12
    info = recorder_json(tmp_path)
    assert info["closed"] is True and info["end_reason"] == "atexit"


def test_a_forked_child_does_not_duplicate_the_parents_rows(tmp_path):
    code, _, err = finish(start_child(tmp_path, "fork"))
    assert code == 0, err  # (the forked child exits 4 if the parent's recorder took its collections)
    steps = load_run(tmp_path / "run").steps
    assert steps["step"].tolist() == list(range(15)) and steps["pid"].nunique() == 1


def test_several_processes_write_one_run_dir(tmp_path):
    procs = [start_child(tmp_path, "atexit") for _ in range(3)]
    errs = {}
    for proc in procs:
        code, _, errs[proc.pid] = finish(proc)
        assert code == 0, errs[proc.pid]
    run = load_run(tmp_path / "run")
    steps = run.steps
    # (failed once in a clean-clone CI run with one child's rows missing; not reproduced in 27 runs since:
    # what each child said, and the spool, tell the cause if it comes back)
    spool = sorted(p.name for p in (tmp_path / "run" / "spool").iterdir())
    assert steps["pid"].nunique() == 3 and len(steps) == 36, (errs, spool, run.warnings)
    assert read_meta(tmp_path / "run")["engine"] == "child"
