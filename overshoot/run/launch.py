"""Start a server process tree with overshoot's hooks, wait until it serves, stop it (gracefully, then hard).

The server runs in its own session (process group): a Ctrl-C in the terminal reaches `overshoot run` only, and
stopping signals the whole tree (vLLM's engine core and workers included). Its output goes to RUN/server.log.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import engine_hooks

HOST = "127.0.0.1"
BOOTSTRAP_DIR = Path(engine_hooks.__file__).resolve().parent / "bootstrap"
PACKAGE_ROOT = Path(engine_hooks.__file__).resolve().parent.parent


class LaunchError(RuntimeError):
    """The server could not be started or did not become ready (one-line message)."""


@dataclass
class Server:
    process: subprocess.Popen
    command: list[str]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def exited(self) -> int | None:
        return self.process.poll()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def port_in_use(port: int) -> bool:
    """Whether a server could not listen on the port. Binds as servers do (aiohttp, uvicorn): with
    SO_REUSEADDR, so connections of an earlier run still in TIME_WAIT do not count as "in use"."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return True
    return False


def port_in_command(command: list[str]) -> int | None:
    """The port a server command names literally (the last `--port N` or `--port=N`); None when it names
    none or uses the {port} placeholder. Raises ValueError for a value that is not a TCP port."""
    value = None
    for i, arg in enumerate(command):
        if arg == "--port" and i + 1 < len(command):
            value = command[i + 1]
        elif arg.startswith("--port="):
            value = arg.split("=", 1)[1]
    if value is None or "{port}" in value:
        return None
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise ValueError(f"the server command's --port {value!r} is not a TCP port")
    return int(value)


def cuda_present() -> bool:
    if not os.path.exists("/dev/nvidiactl"):  # cheap answer first: no driver, no CUDA (and no torch import)
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def default_command(*, cuda: bool, max_num_seqs: int, max_model_len: int) -> list[str]:
    """The embedded default: the reference engine, sized so every level fits in one batch. On a GPU its best
    configuration (one CUDA graph per step, async scheduling: step n+1 launched while step n runs); on the
    CPU the tiny model, eager and sync (no graphs there, and nothing to overlap with)."""
    model = (
        ["--preset", "qwen3-4b", "--graph", "step", "--async-scheduling", "--device", "cuda"]
        if cuda
        else ["--preset", "tiny", "--device", "cpu"]
    )
    return [
        sys.executable,
        "-m",
        "reference_engine",
        "serve",
        *model,
        "--host",
        HOST,
        "--port",
        "{port}",
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-model-len",
        str(max_model_len),
    ]


def hooked_env(
    run_dir: Path,
    *,
    engine: str | None = None,
    extra_specs: list[str] = (),
    embedded: bool = False,
    base=None,
) -> dict:
    """The server's environment: hooks on (OVERSHOOT_RUN_DIR), the bootstrap first on PYTHONPATH.
    embedded: the server is our reference engine, so the folder holding our packages goes last on it too."""
    env = dict(os.environ if base is None else base)
    paths = [str(BOOTSTRAP_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if embedded:
        paths.append(str(PACKAGE_ROOT))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["OVERSHOOT_RUN_DIR"] = str(Path(run_dir).resolve())
    env["PYTHONUNBUFFERED"] = "1"  # the server log is read while it runs
    if engine:
        env["OVERSHOOT_ENGINE"] = engine
    if extra_specs:
        env["OVERSHOOT_EXTRA_SPECS"] = ",".join(extra_specs)
    return env


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when `overshoot run` dies, even by SIGKILL, so no server is
    left behind in its own session."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def start(command: list[str], *, port: int, env: dict, log_path: Path) -> Server:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        try:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            raise LaunchError(f"cannot start the server ({command[0]}): {exc.strerror or exc}") from None
    return Server(process=process, command=command, port=port, log_path=log_path)


def _answers(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    try:
        with opener.open(url, timeout=2.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_ready(server: Server, *, timeout: float, poll: float = 0.25) -> float:
    """Block until GET /health or /v1/models answers 200; returns the seconds it took."""
    started = time.monotonic()
    while True:
        code = server.exited()
        if code is not None:
            raise LaunchError(f"the server exited with code {code} before it was ready")
        if _answers(f"{server.url}/health") or _answers(f"{server.url}/v1/models"):
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise LaunchError(
                f"the server was not ready after {timeout:g} s (no answer on {server.url}/health)"
            )
        time.sleep(poll)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(server: Server, *, grace: float = 15.0) -> int | None:
    """SIGTERM to the server's process group, SIGKILL what is left after `grace` seconds.
    Returns the leader's exit code (negative: killed by that signal)."""
    pgid = server.process.pid  # start_new_session: the leader's pid is the group id
    if server.exited() is None or _group_alive(pgid):
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (server.exited() is None or _group_alive(pgid)):
            time.sleep(0.05)
        if server.exited() is None or _group_alive(pgid):
            _signal_group(pgid, signal.SIGKILL)
    try:
        return server.process.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        return None


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines)).rstrip()
    except OSError:
        return ""
