"""Test-only hook spec (`overshoot run --hooks tests/straggler_spec.py:SPEC`): rank 1 of a tensor-parallel
vLLM sleeps a fixed time after each model forward, inside its `Worker.execute_model`: a known straggler."""

from __future__ import annotations

import time

from engine_hooks.spec import EngineSpec, HookTarget
from engine_hooks.vllm import WORKER_PROCESSES

DELAY_S = 0.100
STRAGGLER = 1


def _straggle(_result, *_args, **_kwargs) -> dict:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    if get_tensor_model_parallel_rank() == STRAGGLER:
        time.sleep(DELAY_S)
    return {}


SPEC = EngineSpec(
    name="straggler",
    dist=(),
    versions="",
    targets=(HookTarget("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._model_forward", "busy",
                        "straggle", facts=_straggle, processes=WORKER_PROCESSES),),
)
