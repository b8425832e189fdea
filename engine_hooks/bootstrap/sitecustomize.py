"""overshoot's bootstrap: `overshoot run` puts this folder first on the server's PYTHONPATH.

Active only when env `OVERSHOOT_RUN_DIR` names a run dir: it installs the selected hook specs (env
`OVERSHOOT_ENGINE`: comma-separated names, default all), each one once its engine's modules get imported.
Then it runs the next `sitecustomize` on the path, if any, so an environment's own one keeps working.
Nothing here may stop the interpreter from starting.
"""

import os
import sys


def _activate() -> None:
    try:
        import engine_hooks  # noqa: F401
    except ImportError:
        # The server's Python does not have overshoot installed: use the copy this file belongs to,
        # appended so the server's own packages keep precedence.
        sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        from engine_hooks import registry

        registry.install_selected(os.environ.get("OVERSHOOT_ENGINE", "auto").split(","))
    except Exception as exc:
        print(f"overshoot: hooks not installed: {type(exc).__name__}: {exc}", file=sys.stderr)


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    this = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        import sitecustomize  # noqa: F401  (the next one on the path)
    except ImportError:
        if this is not None:
            sys.modules["sitecustomize"] = this
    except Exception as exc:  # as site.py does: report and carry on
        print(f"overshoot: error in the next sitecustomize: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        sys.path[:] = saved + [p for p in sys.path if p not in saved]


if os.environ.get("OVERSHOOT_RUN_DIR"):
    _activate()
_chain()
