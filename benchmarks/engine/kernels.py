"""Torch reference vs Triton kernels on the qwen3-4b decode shapes: correctness on the GPU, then timings.

    python benchmarks/engine/kernels.py [--batches 1 8] [--context 1024 4096] [--json results.json]

Each row is measured side by side in one run: `graph` = do_bench_cudagraph median (GPU time as replayed by
--graph model/step), `eager` = do_bench median (back-to-back eager calls: GPU time or launch cost, whichever
is longer, as in --graph eager), `host` = CPU time per eager call (what the engine thread pays to launch).
Correctness: Triton vs torch on the same random inputs (bf16, rtol/atol 2e-2), and a
CUDA-graph capture + replay of each Triton op giving the same result as the eager call.
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

# qwen3-4b decode shapes
HIDDEN, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE, BLOCK_SIZE = 2560, 32, 8, 128, 9728, 16
EPS = 1e-6


@dataclass
class Row:
    op: str
    shape: str
    torch_eager_us: float
    triton_eager_us: float
    torch_graph_us: float
    triton_graph_us: float
    torch_host_us: float
    triton_host_us: float
    max_abs_err: float
    note: str = ""


def bench_pair(name: str, shape: str, torch_fn: Callable, triton_fn: Callable, *, compare: Callable,
               note: str = "") -> Row:
    import triton.testing as tt

    err = compare(torch_fn(), triton_fn())
    check_graph_replay(triton_fn, name)
    times = [tt.do_bench(fn, return_mode="median") * 1e3 for fn in (torch_fn, triton_fn)]
    times += [tt.do_bench_cudagraph(fn, return_mode="median") * 1e3 for fn in (torch_fn, triton_fn)]
    times += [host_us(fn) for fn in (torch_fn, triton_fn)]
    return Row(name, shape, *times, max_abs_err=err, note=note)


def host_us(fn: Callable, calls: int = 200) -> float:
    """CPU time to launch one call (what an eager engine thread pays), median of 5 batches of calls."""
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return sorted(samples)[2]


def check_graph_replay(fn: Callable, name: str) -> None:
    """Capture fn in a CUDA graph (fails on host syncs) and check a replay reproduces the eager result."""
    expected = flatten(fn())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm up (compile) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(flatten(captured), expected, strict=True):
        if not torch.equal(got, want):
            raise AssertionError(f"{name}: CUDA graph replay differs from the eager call")


def flatten(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


def exact(a, b) -> float:
    """0 when the two results are identical (index ops), else fail like max_err."""
    if not all(torch.equal(x, y) for x, y in zip(flatten(a), flatten(b), strict=True)):
        raise AssertionError("Triton and torch results differ")
    return 0.0


def max_err(expected, actual, *, tol: float = 2e-2) -> float:
    worst = 0.0
    for want, got in zip(flatten(expected), flatten(actual), strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
        worst = max(worst, (got.float() - want.float()).abs().max().item())
    return worst


def paged_inputs(batch: int, context: int, gen: torch.Generator):
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(*shape, generator=gen, device="cuda").bfloat16()
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks - 1, generator=gen, device="cuda") + 1
    block_tables = perm[: batch * blocks_per_seq].view(batch, blocks_per_seq).int()
    # Mixed lengths, none a multiple of the block size, the longest at `context - 3`.
    seq_lens = torch.linspace(context // 2, context - 3, batch, device="cuda").int()
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, generator=gen, device="cuda").bfloat16()
    return q, k_cache, v_cache, block_tables, seq_lens


def bench_attention(batch: int, context: int, gen: torch.Generator, ref, tri) -> list[Row]:
    from reference_engine.kernels import attention

    args = paged_inputs(batch, context, gen)
    kv_bytes = int(args[4].sum().item()) * NUM_KV_HEADS * HEAD_DIM * 2 * 2
    shape = f"B={batch} ctx={context}"
    splits = attention.choose_num_splits(batch, NUM_KV_HEADS, args[3].shape[1] * BLOCK_SIZE, args[0].device,
                                         tile=attention.choose_tile(batch, HEAD_DIM))
    scale = HEAD_DIM**-0.5
    variants = [
        ("attention split-K", lambda: tri.paged_decode_attention(*args, scale), f"{splits} splits"),
        ("attention 1 split", lambda: attention.paged_decode_attention(*args, scale, num_splits=1), ""),
        ("attention fp32 dot", lambda: attention.paged_decode_attention(*args, scale, dot_fp32=True),
         f"{splits} splits"),
    ]
    rows = []
    for name, triton_fn, note in variants:
        row = bench_pair(name, shape, lambda: ref.paged_decode_attention(*args, HEAD_DIM**-0.5), triton_fn,
                         compare=max_err)
        row.note = f"{note} {kv_bytes / row.triton_graph_us / 1e6:.2f} TB/s".strip()
        rows.append(row)
    return rows


def bench_rows(batch: int, gen: torch.Generator, ref, tri) -> list[Row]:
    from reference_engine.kernels import rope_cos_sin

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").bfloat16()

    x, residual, weight = randn(batch, HIDDEN), randn(batch, HIDDEN), randn(HIDDEN)
    gate_up = randn(batch, 2 * INTERMEDIATE)
    qkv = randn(batch, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM)
    q_w, k_w = randn(HEAD_DIM), randn(HEAD_DIM)
    cos, sin = rope_cos_sin(4096, HEAD_DIM, 1e6, device="cuda")
    positions = torch.arange(batch, device="cuda") * 37 + 5
    slots = torch.randperm(64 * BLOCK_SIZE, generator=gen, device="cuda")[:batch] + BLOCK_SIZE
    k_cache = torch.zeros(65, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    shape = f"B={batch}"

    logits = torch.randn(batch, 151936, generator=gen, device="cuda")
    embed, ids = randn(151936, HIDDEN), torch.randint(0, 151936, (batch,), generator=gen, device="cuda")
    meta = torch.zeros(batch, 6 + 64, dtype=torch.int32, device="cuda")
    meta[:, 0], meta[:, 1] = torch.arange(batch, device="cuda"), positions.to(torch.int32)
    meta[:, 6:] = torch.arange(64, dtype=torch.int32, device="cuda")
    tokens = torch.arange(batch + 1, device="cuda")

    def inputs_call(ops):
        return lambda: ops.decode_inputs(meta, tokens, block_size=BLOCK_SIZE, slot_col=0, position_col=1,
                                         blocks_col=6)

    def rope_call(ops):
        return lambda: ops.qk_norm_rope_cache(qkv, q_w, k_w, cos, sin, positions, k_cache, v_cache, slots,
                                              num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, eps=EPS)

    return [
        bench_pair("rmsnorm", shape, lambda: ref.rmsnorm(x, weight, EPS), lambda: tri.rmsnorm(x, weight, EPS),
                   compare=max_err),
        bench_pair("fused_add_rmsnorm", shape, lambda: ref.fused_add_rmsnorm(x, residual, weight, EPS),
                   lambda: tri.fused_add_rmsnorm(x, residual, weight, EPS), compare=max_err),
        bench_pair("silu_and_mul", shape, lambda: ref.silu_and_mul(gate_up),
                   lambda: tri.silu_and_mul(gate_up), compare=max_err),
        bench_pair("qk_norm_rope_cache", shape, rope_call(ref), rope_call(tri),
                   compare=lambda a, b: max_err(a, b, tol=6e-2)),
        bench_pair("argmax (greedy), V=151936", shape, lambda: ref.argmax(logits), lambda: tri.argmax(logits),
                   compare=exact),
        bench_pair("decode_inputs", shape, inputs_call(ref), inputs_call(tri), compare=exact),
        bench_pair("embedding", shape, lambda: ref.embedding(embed, ids), lambda: tri.embedding(embed, ids),
                   compare=exact),
    ]


# (tokens per tile, pipeline stages); the first is the default
TILE_SWEEP = [(64, 2), (64, 3), (32, 2), (32, 4), (128, 2)]


def sweep_splits(batch: int, context: int, gen: torch.Generator) -> str:
    """Graph-replay time of the Triton attention per split count (tunes choose_num_splits)."""
    import triton.testing as tt

    from reference_engine.kernels import attention

    args = paged_inputs(batch, context, gen)
    auto = attention.choose_num_splits(batch, NUM_KV_HEADS, context, args[0].device,
                                       tile=attention.choose_tile(batch, HEAD_DIM))
    lines = []
    for tiles in TILE_SWEEP:
        cells = []
        for splits in (1, 2, 4, 8, 16, 32, 64):
            if splits * 64 > context:
                break
            us = tt.do_bench_cudagraph(lambda s=splits, t=tiles: attention.paged_decode_attention(
                *args, HEAD_DIM**-0.5, num_splits=s, tiles=t), return_mode="median") * 1e3
            cells.append(f"{splits}{'*' if splits == auto else ''}: {us:.1f}")
        lines.append(f"B={batch} ctx={context} tile {tiles[0]}x{tiles[1]} stages  " + "  ".join(cells))
    return "\n".join(lines)


def print_table(rows: list[Row], title: str) -> None:
    print(f"\n{title}")
    head = (f"{'op':<20} {'shape':<15} {'torch graph':>11} {'triton graph':>12} {'speedup':>7} "
            f"{'torch eager':>11} {'triton eager':>12} {'torch host':>10} {'triton host':>11} "
            f"{'max err':>8}  note")
    print(head)
    print("-" * len(head))
    for r in rows:
        speedup = r.torch_graph_us / r.triton_graph_us
        print(f"{r.op:<20} {r.shape:<15} {r.torch_graph_us:>9.1f}us {r.triton_graph_us:>10.1f}us "
              f"{speedup:>6.2f}x {r.torch_eager_us:>9.1f}us {r.triton_eager_us:>10.1f}us "
              f"{r.torch_host_us:>8.1f}us {r.triton_host_us:>9.1f}us {r.max_abs_err:>8.3g}  {r.note}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/engine/kernels.py needs a CUDA GPU (the Triton kernels are timed there)",
              file=sys.stderr)
        return 1
    import triton

    from reference_engine.kernels import get_kernels

    ref, tri = get_kernels("torch"), get_kernels("triton")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, sweeps = [], []
    for batch in args.batches:
        rows += bench_rows(batch, gen, ref, tri)
        for context in args.context:
            rows += bench_attention(batch, context, gen, ref, tri)
            sweeps.append(sweep_splits(batch, context, gen))
    info = (f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
            f"qwen3-4b shapes, bf16 | all Triton outputs match torch and replay in CUDA graphs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": info, "rows": [asdict(r) for r in rows]}, f, indent=1)
    print("\nattention graph-replay us by num_splits (* = automatic choice)")
    print("\n".join(sweeps))
    print_table(rows, info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
