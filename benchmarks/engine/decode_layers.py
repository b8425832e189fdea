"""qwen3-4b's 36 decode layers at one sequence: one launch for all of them against a launch per layer.

    python benchmarks/engine/decode_layers.py [--contexts 170,1024] [--replays 200] [--ways ...] [--trace]

Ways (each the residual stream after the last layer from the embedding, as `Qwen3Model.forward` runs it):
`layers` one launch (decode_layers.py, the engine's default); `layers-o-walk` with o_proj walking its K chunks
as attention fills them instead of holding its whole weight tile across attention; `layers-o-pairs` with each
o_proj program holding one tile across attention and streaming a second after it; `layers-tile64` / `-tile16`
with 64- / 16-token attention tiles (64: the per-layer kernel's); `layers-gu3` with gate_up's 3-stage pipeline
(the default before); `layers-128regs` capped at 128 registers a thread (4 programs an SM instead of 3, some
spilled); `layers-table` reading each layer's tensor offsets from the stack's table instead of computing them;
`layers-no-wait` (`-128regs`) without its dependencies and `layers-skip-attention` without o_proj's wait for
attention (wrong results: what the waits cost); `o+mlp+qkv` two launches a layer (attention, then
fused_mlp's launch), the default before. First checks that graph replays repeat the eager bits (the counters
reset) and that the ways are about as close to the torch reference as the per-layer launches, then times
CUDA-graph replays. Prints us per layer against the floor (the layers' weight bytes at the copy bandwidth
measured here). `--trace` also prints when each one-launch way asked (but those skipping dependencies) passes
each of decode_layers.TRACE_EVENTS within a layer (a build with the GPU's global timer stamped at those
points). Needs a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine_decode import copy_bandwidth  # noqa: E402  (this directory is on sys.path when run as a script)

from reference_engine.config import Config  # noqa: E402
from reference_engine.kernels import decode_layers, torch_ref  # noqa: E402
from reference_engine.kernels.layer_stack import LayerStack, run_layers  # noqa: E402
from reference_engine.kv_cache import allocate_kv_cache  # noqa: E402
from reference_engine.model import Qwen3Model  # noqa: E402

# Ways of the one launch: decode_layers.OPTIONS overrides (benchmark switches).
LAUNCH_OPTIONS = {
    "layers": {},
    "layers-o-walk": {"o_proj_whole": False},
    "layers-o-pairs": {"o_proj_tiles": 2},
    "layers-gu3": {"mlp": {"gu_stages": 3}},
    "layers-128regs": {"maxnreg": 128},
    "layers-tile16": {"tile": 16},
    "layers-tile64": {"tile": 64},
    "layers-no-ahead": {"o_ahead": False},
    "layers-table": {"uniform": False},
    "layers-split-a-tile": {"solo_tiles": 1},
    "layers-skip-attention": {"skip": 2},
    "layers-skip-h": {"skip": 4},
    "layers-skip-act": {"skip": 8},
    "layers-skip-x": {"skip": 16},
    "layers-skip-all-but-qkv": {"skip": 30},
    "layers-no-wait": {},
    "layers-no-wait-128regs": {"maxnreg": 128},
}
WAYS = (*LAUNCH_OPTIONS, "o+mlp+qkv")
WRONG = ("layers-no-wait", "layers-no-wait-128regs", "layers-skip-attention", "layers-skip-h",
         "layers-skip-act", "layers-skip-x", "layers-skip-all-but-qkv")  # dependencies skipped


def way_runner(way: str, model: Qwen3Model, stack: LayerStack, x: torch.Tensor, meta: dict):
    """A no-argument call computing the layers `way`."""
    cfg = model.config
    options = dict(LAUNCH_OPTIONS.get(way, {}))
    tiles = dataclasses.replace(decode_layers._TILES, no_wait=way.startswith("layers-no-wait"),
                                **options.pop("mlp", {}))
    tile = options.pop("tile", decode_layers._ATTENTION_TILE)

    def run() -> torch.Tensor:
        args = (x, stack, meta["slot_mapping"], meta["block_tables"], meta["seq_lens"], model.cos, model.sin,
                model.scale)
        heads = dict(num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, eps=cfg.rms_norm_eps)
        if way == "o+mlp+qkv":  # the Triton ops layer by layer (Config.one_launch_layers=False)
            return run_layers(decode_layers._triton_ops(), *args, **heads)
        saved, decode_layers._ATTENTION_TILE = decode_layers._ATTENTION_TILE, tile
        defaults = dict(decode_layers.OPTIONS)
        decode_layers.OPTIONS.update(options)
        try:
            return decode_layers.decode_layers(*args, **heads, tiles=tiles)
        finally:
            decode_layers._ATTENTION_TILE = saved
            decode_layers.OPTIONS.update(defaults)

    return run


def graph_of(run):
    run()  # allocates counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


def time_graph(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """us per replay, back to back."""
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def trace_layers(way: str, model: Qwen3Model, stack: LayerStack, x: torch.Tensor, meta: dict,
                 replays: int) -> None:
    """Prints, for the one launch `way`, when each trace point is passed (decode_layers.TRACE_EVENTS: the
    GPU's global timer, the latest or earliest program of the layer), in us after the layer's last qkv tile:
    medians over the middle layers of `replays` graph replays, and the layer's time traced."""
    cfg = model.config
    trace, initial = decode_layers.new_trace(cfg.num_layers, x.device)
    run = way_runner(way, model, stack, x, meta)

    def traced() -> torch.Tensor:
        trace.copy_(initial)
        return run()

    decode_layers.OPTIONS["trace"] = trace
    try:
        graph, _ = graph_of(traced)
        samples = []
        for _ in range(replays):
            graph.replay()
            stamps = decode_layers.read_trace(trace, cfg.num_layers)
            unstamped = (stamps <= 0) | (stamps == torch.iinfo(torch.int64).max)  # a point this way skips
            t = (stamps.double() / 1e3).masked_fill(unstamped, float("nan"))  # us
            # Each layer's points after its last qkv tile; the next layer's last qkv tile is the layer's time.
            rel = torch.cat([t[1:-2] - t[1:-2, :1], (t[2:-1, :1] - t[1:-2, :1])], dim=1)
            samples.append(rel)
    finally:
        decode_layers.OPTIONS["trace"] = None
    median = torch.stack(samples).flatten(0, 1).nanmedian(dim=0).values
    names = [f"{name} ({kind})" for name, kind in decode_layers.TRACE_EVENTS] + ["next layer's qkv tile done"]
    context = int(meta["seq_lens"][0])
    print(f"\ntrace of {way}, context {context}: us after the layer's last qkv tile (median of layers "
          f"1-{cfg.num_layers - 3} over {replays} replays)")
    for name, us in zip(names, median.tolist(), strict=True):
        print(f"  {name:<50} {us:+8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="170,1024", help="tokens in the sequence, comma-separated")
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    parser.add_argument("--trace", action="store_true",
                        help="also trace the one-launch ways' phases with the GPU's global timer")
    args = parser.parse_args()
    ways = args.ways.split(",")
    if unknown := set(ways) - set(WAYS):
        sys.exit(f"decode_layers.py: unknown ways {sorted(unknown)}")
    ways = sorted(set(ways) | {"layers", "o+mlp+qkv"}, key=WAYS.index)  # the references
    if not torch.cuda.is_available():
        sys.exit("decode_layers.py: needs a CUDA GPU")
    cfg = Config(preset="qwen3-4b", kernels="triton", max_model_len=args.max_model_len)
    model = Qwen3Model.random(cfg)
    caches = allocate_kv_cache(cfg, dtype=model.dtype)
    for k_cache, v_cache in caches:
        k_cache.normal_()
        v_cache.normal_()
    stack = LayerStack.of(model.layers, caches)
    layer_bytes = (model.weight_bytes_per_step() - model.lm_head.numel() * 2 - model.final_norm.numel() * 2)
    floor_us = layer_bytes / copy_bandwidth("cuda") * 1e6 / cfg.num_layers
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(1, cfg.hidden_size, generator=gen, device="cuda") * 0.02).to(model.dtype)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        blocks = torch.randperm(cfg.total_blocks, device="cuda")[: cfg.max_blocks_per_seq].int()[None]
        last = context - 1
        slot = blocks[0, last // cfg.block_size].long() * cfg.block_size + last % cfg.block_size
        meta = dict(slot_mapping=slot.reshape(1), block_tables=blocks,
                    seq_lens=torch.tensor([context], dtype=torch.int32, device="cuda"))
        runs = {way: way_runner(way, model, stack, x, meta) for way in ways}
        eager = {way: run().clone() for way, run in runs.items()}
        graphs = {way: graph_of(run) for way, run in runs.items()}
        for way, (graph, out) in graphs.items():
            graph.replay()
            graph.replay()
            torch.cuda.synchronize()
            same = torch.equal(out, eager[way]) or way in WRONG
            assert same, f"{way}: graph replays changed the bits"
        # On the GPU the one launch runs attention in 4 warps (the per-layer kernel in 8): its reductions
        # add in another order, so the bits differ by rounding, amplified over 36 layers of random weights.
        # So each way is held to the torch reference as closely as the per-layer launches are.
        ref = torch_ref.decode_layers(
            x, stack, meta["slot_mapping"], meta["block_tables"], meta["seq_lens"], model.cos, model.sin,
            model.scale, num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, eps=cfg.rms_norm_eps,
        ).float()
        diffs = {way: ((eager[way].float() - ref).norm() / ref.norm()).item() for way in ways}
        print(f"context {context}: graph replays repeat the eager bits; relative difference to torch: "
              + ", ".join(f"{way} {d:.4f}" for way, d in diffs.items()), flush=True)
        same_bits = [way for way in ways if torch.equal(eager[way], eager["layers"])]
        print(f"context {context}: the same bits as the default launch: {', '.join(same_bits)}")
        bound = 2 * diffs["o+mlp+qkv"] + 1e-3
        far = [way for way, d in diffs.items() if d >= bound and way not in WRONG]
        assert not far, f"far from torch: {far}"
        for way, (graph, _) in graphs.items():
            us = time_graph(graph, args.replays) / cfg.num_layers
            rows.append((context, way, us))
        for way in ways if args.trace else ():
            if way in LAUNCH_OPTIONS and way not in WRONG:
                trace_layers(way, model, stack, x, meta, replays=20)
    print(f"\nfloor {floor_us:.1f} us a layer (weights at the copy bandwidth)")
    print(f"{'context':>8} {'way':<16} {'us/layer':>9} {'x floor':>8}")
    for context, way, us in rows:
        print(f"{context:>8} {way:<16} {us:>9.2f} {us / floor_us:>8.3f}")


if __name__ == "__main__":
    main()
