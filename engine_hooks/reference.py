"""Hook spec of the bundled reference engine (reference_engine/engine.py, docs/contracts.md section 6).

The reference engine imports nothing from overshoot: it is measured exactly like vLLM, through this spec.
"""

from __future__ import annotations

import operator

from engine_hooks.spec import EngineSpec, HookTarget, attribute_facts

ENGINE_MODULE = "reference_engine.engine"


# Facts of the step from the ScheduledBatch that `Engine.schedule()` returns (None: nothing to run).
batch_facts = attribute_facts(batch_size="num_seqs", num_tokens="num_tokens", phase="phase",
                              spec_tokens="spec_tokens")
# Drafts accepted by the verify step whose results `Engine.update_requests` consumed (speculative decoding
# runs with sync scheduling, so that is this step's batch); nothing after other steps (it returns None).
accepted_facts = attribute_facts(accepted_tokens="")

# The engine's stream (None on CPU: no CUDA events). A C callable: the hooks' C wrapper calls it every step
# with GPU timing on, without a Python frame; a renamed field turns GPU events off, logged.
engine_stream = operator.attrgetter("stream")


def _target(qualname: str, role, **options) -> HookTarget:
    return HookTarget(ENGINE_MODULE, f"Engine.{qualname}", role, **options)


SPEC = EngineSpec(
    name="reference",
    dist=(),  # ships with overshoot: the spec and the engine change together
    versions="",
    targets=(
        _target("step", "step"),
        _target("schedule", "busy", facts=batch_facts),
        _target("prepare_inputs", "busy"),
        _target("launch", "busy"),
        _target("launch", "gpu"),
        _target("wait_for_results", "wait"),
        _target("update_requests", "busy", facts=accepted_facts),
        _target("wait_for_work", "idle"),
    ),
    stream=engine_stream,
)
