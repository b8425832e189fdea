"""`python -m reference_engine serve ...`: the OpenAI-compatible server over the reference engine.

    python -m reference_engine serve --preset tiny --graph step --port 8000
    python -m reference_engine serve --preset qwen3-4b --graph step --kernels triton --async-scheduling
    python -m reference_engine serve --model path/to/hf-dir --max-model-len 2048
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from reference_engine.config import DEVICES, DRAFTERS, GRAPH_MODES, KERNEL_CHOICES, PRESETS

PROCESS_START = time.perf_counter()  # torch is imported later: counts it in the time-to-ready log line


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit 2), not usage + message."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def port_number(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m reference_engine", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    serve = commands.add_parser("serve", help="serve the OpenAI completions API",
                                description="Serve POST /v1/completions, GET /v1/models, /health, /stats.")
    model = serve.add_mutually_exclusive_group()
    model.add_argument("--preset", choices=list(PRESETS), help="random-weight model shape (default: tiny)")
    model.add_argument("--model", metavar="DIR", help="local Hugging Face directory")
    serve.add_argument("--served-model-name", help="name in /v1/models and responses (default: preset/dir)")
    serve.add_argument("--graph", choices=GRAPH_MODES, default="eager",
                       help="CUDA graphs: none, per model forward, or one per decode step (default: eager)")
    serve.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto",
                       help="auto = triton on CUDA, torch on CPU")
    serve.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
                       help="launch step n+1 before step n's tokens reach the host")
    serve.add_argument("--one-launch-layers", action=argparse.BooleanOptionalAction, default=True,
                       help="one sequence's decode step through every layer in one launch (Triton kernels); "
                            "--no-one-launch-layers: a launch per layer, as most engines")
    serve.add_argument("--device", choices=DEVICES, default="auto")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=port_number, default=8000)
    serve.add_argument("--max-num-seqs", type=positive_int, default=8, help="requests decoded together")
    serve.add_argument("--max-model-len", type=positive_int, help="prompt + completion tokens per request")
    serve.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV-cache block")
    serve.add_argument("--num-blocks", type=positive_int, help="KV-cache blocks (default: enough for all)")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--spec-tokens", type=int, default=0,
                       help="prompt-lookup draft tokens verified per decode step (0: off)")
    serve.add_argument("--drafter", choices=DRAFTERS, default="host",
                       help="host: drafts and acceptance on the engine thread (eager, sync); device: inside "
                            "the step (graph eager or step, sync or async)")
    serve.add_argument("--queue-limit", type=positive_int,
                       help="requests that may wait beyond --max-num-seqs; more get HTTP 503 (default: none)")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="on SIGTERM, seconds in-flight requests get to finish before they are aborted")
    serve.add_argument("--no-warmup", dest="warmup", action="store_false",
                       help="skip the short generation that compiles kernels and captures graphs at start")
    return parser


def config_from_args(args: argparse.Namespace):
    """The engine's Config from parsed serve arguments (benchmarks build engines the way serve does)."""
    from reference_engine.config import Config

    return Config(
        preset=args.preset, model=args.model, max_model_len=args.max_model_len, device=args.device,
        graph=args.graph, kernels=args.kernels, async_scheduling=args.async_scheduling,
        max_num_seqs=args.max_num_seqs, block_size=args.block_size, num_blocks=args.num_blocks,
        seed=args.seed, queue_limit=args.queue_limit, spec_tokens=args.spec_tokens, drafter=args.drafter,
        one_launch_layers=args.one_launch_layers,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    prog = "python -m reference_engine serve"
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    from reference_engine.server import ServeOptions, run_server

    options = ServeOptions(host=args.host, port=args.port, queue_limit=args.queue_limit,
                           drain_timeout=args.drain_timeout, warmup=args.warmup,
                           model_name=args.served_model_name)
    return run_server(config, options, started=PROCESS_START)


if __name__ == "__main__":
    sys.exit(main())
