"""Inject overshoot's timers into served engines without changing their code.

`EngineSpec`/`HookTarget` (spec.py) declare which engine functions get which timer; `install`
(patcher.py) wraps them. Bootstraps: `engine_hooks/bootstrap/sitecustomize.py` (first on PYTHONPATH, put
there by `overshoot run`) and the vLLM general plugin `engine_hooks.vllm_plugin:register`. Nothing is
patched unless `OVERSHOOT_RUN_DIR` is set (or a test installs a spec with its own recorder factory).
"""

from engine_hooks.patcher import install
from engine_hooks.spec import EngineSpec, HookStatus, HookTarget

__all__ = ["EngineSpec", "HookStatus", "HookTarget", "install"]
