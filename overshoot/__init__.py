"""overshoot: is my LLM server's decode step CPU-bound or GPU-bound, step by step?

`from overshoot import Recorder` gives the timer API (overshoot/record/recorder.py). The package import
itself is kept light on purpose: it loads neither torch nor pandas (nor pyarrow), so `overshoot report`
starts fast and a patched engine pays only for what it uses.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["Recorder", "__version__"]

if TYPE_CHECKING:
    from overshoot.record.recorder import Recorder


def __getattr__(name: str):
    # Lazy so that importing overshoot (e.g. for the CLI) does not import pyarrow via the recorder.
    if name == "Recorder":
        from overshoot.record.recorder import Recorder

        return Recorder
    raise AttributeError(f"module 'overshoot' has no attribute {name!r}")
