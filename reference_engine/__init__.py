"""A small, fast reference LLM engine (dense Qwen3) that overshoot measures through its hook spec.

    from reference_engine.config import Config
    from reference_engine.engine import Engine, SamplingParams
    engine = Engine(Config(preset="tiny", device="cpu"))
    print(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8)))

Imports nothing from overshoot or engine_hooks. Importing this package does not import torch.
"""

__all__ = ["Config", "Engine", "SamplingParams"]


def __getattr__(name: str):
    if name == "Config":
        from reference_engine.config import Config

        return Config
    if name in ("Engine", "SamplingParams"):
        from reference_engine import engine

        return getattr(engine, name)
    raise AttributeError(name)
