"""vLLM general plugin (entry point `vllm.general_plugins` = `engine_hooks.vllm_plugin:register`).

vLLM calls `register()` in every process it starts (API server, engine core, workers) before `EngineCore`
binds its step function. It installs the vLLM hook spec (engine_hooks/vllm.py) when env `OVERSHOOT_RUN_DIR`
names a run dir and does nothing otherwise, so an installed overshoot never changes a plain `vllm serve`.
It never raises: a failure is one `overshoot:` line on stderr and vLLM runs unmeasured.
"""

from __future__ import annotations

import os
import sys

# vLLM's engine core is killed a few seconds after SIGTERM and its child processes skip atexit: flush often.
FLUSH_SECONDS = 0.2


def recorder_factory(engine: str, process_info: dict):
    from overshoot import Recorder

    return Recorder(
        os.environ["OVERSHOOT_RUN_DIR"], engine=engine, process_info=process_info, flush_seconds=FLUSH_SECONDS
    )


def register() -> None:
    if not os.environ.get("OVERSHOOT_RUN_DIR"):
        return
    try:
        from engine_hooks.patcher import install
        from engine_hooks.vllm import SPEC

        # A no-op when the sitecustomize bootstrap (`overshoot run`) installed the spec already.
        install(SPEC, recorder_factory=recorder_factory)
    except Exception as exc:  # vLLM logs and continues on a plugin error; we say it in one line instead
        message = f"overshoot: vLLM hooks not installed: {type(exc).__name__}: {exc}"
        print(message, file=sys.stderr, flush=True)
