"""`overshoot run`: start a server with hooks, drive a concurrency sweep, stop it, report.

    overshoot run                      # the bundled reference engine (tiny on CPU, qwen3-4b on CUDA)
    overshoot run --concurrency 1,4 --max-tokens 64 -- python -m vllm.entrypoints.openai.api_server \
        --model DIR --port {port}

The run dir keeps whatever was recorded, also after a failure or Ctrl-C (exit 130).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

from engine_hooks import registry
from engine_hooks import status as hook_status
from overshoot.report.fmt import output_console
from overshoot.run import launch, live
from overshoot.run.launch import LaunchError, Server
from overshoot.run.load import LoadError, LoadPlan, LoadResults, run_sweep
from overshoot.rundir.meta import host_info, now_iso, read_meta, update_meta, versions, write_meta

DEFAULT_PORT = 8000  # where a server command without {port} or --port is expected to listen (vLLM's default)
# `python -m reference_engine serve` without --async-scheduling runs synchronously (tests/test_run.py checks
# this against the engine's own argument parser). The embedded default on a GPU passes --async-scheduling
# (launch.default_command).
REFERENCE_ASYNC_DEFAULT = False


class Terminated(KeyboardInterrupt):
    """SIGTERM to `overshoot run`: handled like Ctrl-C (stop the server, keep the run), exit 143."""


def _terminated(signum, frame) -> None:
    raise Terminated()


class RunFailed(Exception):
    def __init__(self, message: str, code: int = 1, *, log: str = ""):
        super().__init__(message)
        self.code, self.log = code, log


def async_scheduling_of(command: list[str]) -> bool | None:
    """Whether the server runs with async scheduling, when its command tells: the last
    --async-scheduling / --no-async-scheduling flag (the reference engine's, also vLLM's), else the
    reference engine's default. None when unknown (another engine's default, which may change by version).
    Recorded in meta.json for the report: without GPU times, the data cannot tell sync from async."""
    for arg in reversed(command):
        if arg in ("--async-scheduling", "--no-async-scheduling"):
            return arg == "--async-scheduling"
    if registry.engine_for_command(command) == "reference":
        return REFERENCE_ASYNC_DEFAULT
    return None


def parse_budget(text: str) -> float:
    """--kernel-budget '0.5%' (or '0.5') -> 0.005; more than 0 and at most 100%."""
    from overshoot.report.check import parse_pct

    try:
        pct = parse_pct(text, "--kernel-budget")
    except ValueError as e:
        raise RunFailed(str(e), 2) from None
    if not 0 < pct <= 100:
        raise RunFailed(f"--kernel-budget: {text!r} must be more than 0% and at most 100%", 2)
    return pct / 100.0


def resolve_gpu_timing(mode: str) -> str:
    """The GPU timing the server gets. auto: sampled where kernel timing can run, else events. An explicit
    kernels/sampled that this machine cannot give is refused in one line, before any server starts."""
    from overshoot.record.kernel_timing import unavailable_reason
    from overshoot.record.recorder import GPU_TIMINGS

    if mode not in (*GPU_TIMINGS, "auto"):
        known = ", ".join(GPU_TIMINGS)
        raise RunFailed(f"--gpu-timing: unknown mode {mode!r}; choose auto or one of {known}", 2)
    if mode not in ("kernels", "sampled", "auto"):
        return mode
    reason = unavailable_reason(cuda=launch.cuda_present())
    if mode == "auto":
        return "events" if reason else "sampled"
    if reason:
        raise RunFailed(f"--gpu-timing {mode}: {reason}", 2)
    return mode


def parse_concurrency(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise RunFailed(f"--concurrency wants positive integers like 1,2,4,8, got {text!r}", 2)
    return levels


# fmt: off
def run(
    command: Annotated[list[str] | None, typer.Argument(
        help="Server command after `--` ({port} is replaced).", show_default="the reference engine")] = None,
    concurrency: Annotated[str, typer.Option(help="Concurrency levels to sweep, e.g. 1,2,4,8.")] = "1,2,4,8",
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per request (ignore_eos).")] = 512,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="Approximate prompt length in tokens.")] = 128,
    requests: Annotated[int | None, typer.Option(
        min=1, help="Requests per level.", show_default="4 x concurrency")] = None,
    duration: Annotated[float | None, typer.Option(
        min=0.1, help="Seconds per level (instead of --requests).", show_default=False)] = None,
    warmup: Annotated[int | None, typer.Option(
        min=0, help="Warm-up requests per level (not in client data).", show_default="one per slot")] = None,
    port: Annotated[int | None, typer.Option(
        min=1, max=65535, help="Server port on 127.0.0.1 (replaces {port}).",
        show_default="the command's --port N; else free; 8000 if the command has neither")] = None,
    out: Annotated[Path | None, typer.Option(help="Run dir.", show_default="runs/<timestamp>")] = None,
    ready_timeout: Annotated[float, typer.Option(min=1, help="Seconds to wait for the server.")] = 600.0,
    model: Annotated[str | None, typer.Option(
        help="Model name for requests.", show_default="first of /v1/models")] = None,
    engine: Annotated[str | None, typer.Option(
        help="Only these hook specs (reference, vllm; comma-separated).",
        show_default="every known spec, once its engine is imported")] = None,
    hooks: Annotated[list[str] | None, typer.Option(
        help="Extra hook spec, MODULE:ATTR or FILE.py:ATTR (repeatable).", show_default=False)] = None,
    stop_timeout: Annotated[float, typer.Option(min=0, help="Seconds between SIGTERM and SIGKILL.")] = 15.0,
    gpu_timing: Annotated[str, typer.Option(
        help="GPU timing in the server: events (two CUDA events a step), kernels (every kernel, CUPTI), "
             "sampled (kernels in windows of steps, within a cost budget), off, or auto (sampled where "
             "CUDA and CUPTI are there, else events).")] = "auto",
    kernel_budget: Annotated[str, typer.Option(
        help="sampled: what its windows may cost, a share of the run's step time (more buys more "
             "instrumented steps).")] = "0.5%",
) -> None:
    """Start a server with overshoot's hooks, drive a concurrency sweep, stop it and print the report.

    Examples:\n
      overshoot run --concurrency 1,4 --max-tokens 64\n
      overshoot run --out runs/vllm -- python -m vllm.entrypoints.openai.api_server --model DIR --port {port}
    """
    options = RunOptions(
        command=list(command or []), concurrency=concurrency, max_tokens=max_tokens,
        prompt_tokens=prompt_tokens, requests=requests, duration=duration, warmup=warmup, port=port, out=out,
        ready_timeout=ready_timeout, model=model, engine=engine, hooks=list(hooks or []),
        stop_timeout=stop_timeout, gpu_timing=gpu_timing, kernel_budget=kernel_budget,
    )
    # fmt: on
    try:
        code = execute(options)
    except RunFailed as exc:
        typer.echo(f"overshoot run: error: {exc}", err=True)
        if exc.log:
            typer.echo(exc.log, err=True)
        raise typer.Exit(exc.code) from None
    raise typer.Exit(code)


@dataclass
class RunOptions:
    command: list[str]
    concurrency: str = "1,2,4,8"
    max_tokens: int = 512
    prompt_tokens: int = 128
    requests: int | None = None
    duration: float | None = None
    warmup: int | None = None
    port: int | None = None
    out: Path | None = None
    ready_timeout: float = 600.0
    model: str | None = None
    engine: str | None = None
    hooks: list[str] = field(default_factory=list)
    stop_timeout: float = 15.0
    gpu_timing: str = "auto"
    kernel_budget: str = "0.5%"


def execute(o: RunOptions) -> int:
    """The whole run; raises RunFailed (message, exit code) after leaving a readable run dir."""
    levels = parse_concurrency(o.concurrency)
    gpu_timing = resolve_gpu_timing(o.gpu_timing)
    budget = parse_budget(o.kernel_budget)
    run_dir = o.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise RunFailed(f"{run_dir} already exists; choose another --out", 2)
    command, embedded = o.command, not o.command
    if embedded:
        max_len = max(256, o.prompt_tokens + o.max_tokens + 64)
        command = launch.default_command(
            cuda=launch.cuda_present(), max_num_seqs=max(8, *levels), max_model_len=max_len
        )
    port = _server_port(command, o.port)
    if launch.port_in_use(port):
        raise RunFailed(f"port {port} on {launch.HOST} is in use; stop what listens there or pass --port")
    command = [arg.replace("{port}", str(port)) for arg in command]
    if o.engine and not set(o.engine.split(",")) <= {*registry.BUILTIN, "auto", "none"}:
        raise RunFailed(f"--engine: unknown engine {o.engine!r}; known: {', '.join(registry.BUILTIN)}", 2)
    engine = o.engine or registry.engine_for_command(command) or "auto"
    extra_specs = [_absolute_spec(ref) for ref in o.hooks]
    for ref in extra_specs:
        spec_file = ref.rpartition(":")[0] if ":" in ref else ref
        if spec_file.endswith(".py") and not Path(spec_file).is_file():
            raise RunFailed(f"--hooks: no such file {spec_file}", 2)
    options = dict(vars(o), out=str(run_dir), port=port, engine=engine, hooks=extra_specs,
                   gpu_timing=gpu_timing, kernel_budget=budget)
    options.update(concurrency=list(levels))
    del options["command"]
    scheduling = async_scheduling_of(command)
    write_meta(run_dir, {
        "run_id": run_dir.name, "created": now_iso(), "tool": "overshoot run",
        "engine": None if engine == "auto" else engine,
        "command": command, "embedded_default": embedded, "options": options, "host": host_info(),
        "versions": versions(), "server_log": "server.log", "status": "starting",
        **({} if scheduling is None else {"async_scheduling": scheduling}),
    })  # fmt: skip
    console = output_console()
    header = f"overshoot run: {run_dir} · server: {' '.join(command)}"
    console.print(header, highlight=False, markup=False, soft_wrap=True)
    # Every known spec is installed lazily (on import of its engine) unless --engine narrows the choice.
    env = launch.hooked_env(run_dir, engine=o.engine, extra_specs=extra_specs, embedded=embedded)
    env["OVERSHOOT_GPU_TIMING"] = gpu_timing
    env["OVERSHOOT_KERNEL_BUDGET"] = repr(budget)
    results = LoadResults()
    server: Server | None = None
    status, code, failure = "failed", 1, None
    # `kill` of overshoot run must stop the server too (it runs in its own session).
    previous_term = signal.signal(signal.SIGTERM, _terminated)
    try:
        server = launch.start(command, port=port, env=env, log_path=run_dir / "server.log")
        with console.status("waiting for the server to be ready"):
            ready_s = launch.wait_ready(server, timeout=o.ready_timeout)
        console.print(f"server ready after {ready_s:.1f} s on {server.url}", highlight=False)
        plan = LoadPlan(
            base_url=server.url, concurrency=levels, max_tokens=o.max_tokens, prompt_tokens=o.prompt_tokens,
            requests=o.requests, duration=o.duration, warmup=o.warmup, model=o.model,
        )  # fmt: skip
        asyncio.run(_load_watching_server(server, plan, results, console, run_dir))
        status, code = "ok", 0
    except KeyboardInterrupt as exc:
        status, code = "interrupted", 143 if isinstance(exc, Terminated) else 130
        failure = RunFailed(f"interrupted; kept what was recorded in {run_dir}", code)
    except (LaunchError, LoadError) as exc:
        tail = launch.log_tail(run_dir / "server.log") if server is not None else ""
        log = f"last lines of {run_dir / 'server.log'}:\n{tail}" if tail else ""
        failure = RunFailed(str(exc), 1, log=log)
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        server_code = _stop_quietly(server, o.stop_timeout) if server is not None else None
        server_pid = server.process.pid if server is not None else None
        _finalize(
            run_dir, results, status=status, exit_code=code, server_code=server_code, server_pid=server_pid
        )
    hooks = read_meta(run_dir).get("hooks", [])
    for line in hook_status.summary_lines(hooks) if hooks or failure is None else []:
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    if failure is not None:
        raise failure
    return _print_report(run_dir, console)


async def _load_watching_server(
    server: Server, plan: LoadPlan, results: LoadResults, console, run_dir
) -> None:
    view = live.LiveView(run_dir, results, per_level=plan.requests_per_level)
    terminal = console.is_terminal  # else (CI logs, pipes): plain progress lines instead of a live display

    def save() -> None:  # after each level: a SIGKILL of overshoot run still leaves tagged levels behind
        results.write(run_dir)
        update_meta(run_dir, {"levels": results.levels})
        view.level_done()

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    progress = live.LiveProgress(*columns, console=console, view=view) if terminal else None
    with progress if progress is not None else contextlib.nullcontext():
        load = asyncio.ensure_future(run_sweep(plan, results, progress=progress, on_level_done=save))
        on_refresh = None if terminal else lambda: view.print_plain(console)
        refresher = asyncio.ensure_future(view.refresh_forever(on_refresh))
        try:
            with _sigterm_cancels(load) as terminated:
                while not load.done():
                    await asyncio.wait({load}, timeout=0.25)
                    exit_code = server.exited()
                    if exit_code is not None and not load.done():
                        load.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await load
                        raise LaunchError(f"the server exited with code {exit_code} during the load")
                if terminated:
                    raise Terminated()
        finally:
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher
        load.result()
        if terminal:
            await asyncio.to_thread(view.refresh)  # the panel left on screen: as fresh as it gets


@contextlib.contextmanager
def _sigterm_cancels(load: asyncio.Future):
    """While the load runs, SIGTERM cancels it through the event loop instead of raising wherever the main
    thread happens to be: raised inside one of aiohttp's tasks, Terminated surfaced as "Task exception was
    never retrieved" with a traceback. Yields a list that holds True once SIGTERM came."""
    loop = asyncio.get_running_loop()
    terminated: list[bool] = []

    def on_sigterm() -> None:
        terminated.append(True)
        load.cancel()

    try:
        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    except (NotImplementedError, RuntimeError, ValueError):  # no loop signal handlers here: keep _terminated
        yield terminated
        return
    try:
        yield terminated
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _terminated)  # removal left the default action: restore ours


def _stop_quietly(server: Server, grace: float) -> int | None:
    # A second Ctrl-C must not leave the server running: ignore it while stopping (bounded by grace).
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return launch.stop(server, grace=grace)
    finally:
        signal.signal(signal.SIGINT, previous)


def _finalize(
    run_dir: Path, results: LoadResults, *, status: str, exit_code: int, server_code, server_pid
) -> None:
    if results.rows or results.levels:
        results.write(run_dir)
    meta = read_meta(run_dir)
    hooks = hook_status.gather(str(run_dir))
    engines = sorted({h.get("engine") for h in hooks if h.get("status") == "installed" and h.get("engine")})
    if engines:
        meta["engine"] = ",".join(engines)
    meta.update(
        status=status,
        exit_status=exit_code,
        server_exit_code=server_code,
        server_pid=server_pid,
        finished=now_iso(),
        levels=results.levels,
        model=results.model or meta.get("options", {}).get("model"),
        hooks=hooks,
    )
    write_meta(run_dir, meta)


def _print_report(run_dir: Path, console: Console) -> int:
    from overshoot.report.table import build_report, render
    from overshoot.rundir.meta import RunDirError
    from overshoot.rundir.reader import load_run

    try:
        run = load_run(run_dir)
        for warning in run.warnings:
            typer.echo(f"warning: {warning}", err=True)
        render(build_report(run), console)
    except RunDirError as exc:
        raise RunFailed(f"{exc} (were the engine's hooks installed? see the hook lines above)") from None
    return 0


def _server_port(command: list[str], option: int | None) -> int:
    """Where the server will listen: {port} in the command takes --port (or a free port); a literal
    `--port N` in the command is the port (a different --port is an error); else --port or vLLM's 8000."""
    try:
        literal = launch.port_in_command(command)
    except ValueError as exc:
        raise RunFailed(str(exc), 2) from None
    if literal is not None:
        if option is not None and option != literal:
            raise RunFailed(f"--port {option} but the server command says --port {literal}; give one of "
                            "them, or write --port {port} in the command", 2)
        return literal
    if option is not None:
        return option
    return launch.free_port() if any("{port}" in arg for arg in command) else DEFAULT_PORT


def _absolute_spec(ref: str) -> str:
    where, sep, attr = ref.rpartition(":")
    if sep and where.endswith(".py"):
        return f"{Path(where).resolve()}:{attr}"
    if ref.endswith(".py"):
        return str(Path(ref).resolve())
    return ref
