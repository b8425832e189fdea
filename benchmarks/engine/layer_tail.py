"""A decode layer's projections after attention at one row (o_proj + residual, gate_up + SiLU, down +
residual, the next layer's qkv), four ways.

    python benchmarks/engine/layer_tail.py [--sweep]

`o+mlp+qkv`: one launch (fused_mlp.o_proj_mlp with next_qkv, the engine's per-layer default); `o+mlp`:
that launch without the qkv, then qkv; `mlp`: o_proj, the MLP in one launch, qkv; `off`: four skinny_gemm
launches. Each runs 36 layers' distinct qwen3-4b weights chained (so weights come from HBM, as in a step)
under CUDA-graph replay, with PDL as in the engine. First it checks that the fused launches give the separate
launches' bits, also across graph replays (the counters reset). `--sweep` also times tile choices of the
one launch. Then plain reads of the same weights: one launch over all, a launch per weight, and the
projections' tile patterns without their math. Prints us per layer and the HBM floor. Needs a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from reference_engine.kernels import fused_mlp, skinny_gemm  # noqa: E402
from reference_engine.kernels.fused_mlp import MlpTiles  # noqa: E402
from reference_engine.kernels.pdl import launch_options, pdl_prologue  # noqa: E402

HIDDEN, INTER, ATTN, QKV, LAYERS = 2560, 9728, 4096, 6144, 36
MODES = ("off", "mlp", "o+mlp", "o+mlp+qkv")
DEFAULT = MlpTiles()
SWEEP = [  # tile experiments on top of MlpTiles() (H200 2026-12-01, us a layer, in docs/benchmarks.md)
    dict(gu_n=8, gu_stages=4, d_n=4, d_stages=3), dict(q_n=8), dict(q_n=32, q_k=256), dict(o_stages=4),
    dict(no_wait=True),  # the same launch without its dependencies (wrong results): what the waits cost
]


@triton.jit
def _read(src, out, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in tl.range(0, STEPS, num_stages=4):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _read_rows(w, out, K, ROWS: tl.constexpr, COLS: tl.constexpr, STAGES: tl.constexpr,
               USE_PDL: tl.constexpr):
    """The access pattern of a one-row projection tile (ROWS rows, COLS-wide K steps) without its math."""
    pdl_prologue(USE_PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ptrs = w + rows.to(tl.int64)[:, None] * K + tl.arange(0, COLS)[None, :]
    acc = tl.zeros((ROWS, COLS), tl.float32)
    for k in tl.range(0, K, COLS, num_stages=STAGES):
        acc += tl.load(ptrs + k).to(tl.float32)
    tl.store(out + tl.program_id(0), tl.sum(tl.sum(acc, axis=1), axis=0))


def read_patterns(w_o: list[torch.Tensor], w_gu: list[torch.Tensor], w_d: list[torch.Tensor],
                  w_q: list[torch.Tensor]) -> list:
    """us per layer to read these weights with each projection's tile pattern and nothing else, a launch
    per weight with PDL as in the engine (no data dependencies, no arithmetic to speak of)."""
    rows = []
    for name, (o_tile, gu_tile, d_tile, q_tile) in {
        "read, separate kernels' tiles": ((4, 1024, 3), (8, 256, 4), (4, 512, 3), (16, 512, 3)),
        "read, wide tiles (16x512/4 each)": ((16, 512, 4),) * 4,
    }.items():
        jobs = []
        for layer in range(LAYERS):
            tiles = ((w_o[layer], o_tile), (w_gu[layer], gu_tile), (w_d[layer], d_tile), (w_q[layer], q_tile))
            for w, (r, c, st) in tiles:
                jobs.append((w, torch.empty(w.shape[0] // r, device=w.device), r, c, st))

        def run(jobs=jobs) -> None:
            use_pdl, pdl = launch_options(jobs[0][0])
            for w, o, r, c, st in jobs:
                _read_rows[(o.numel(),)](w, o, w.shape[1], ROWS=r, COLS=c, STAGES=st, USE_PDL=use_pdl,
                                         num_warps=4, **pdl)

        rows.append((name, triton.testing.do_bench_cudagraph(run, return_mode="median") * 1e3 / LAYERS))
    return rows


def read_rate(tensors: list[torch.Tensor], *, per_tensor: bool) -> float:
    """Seconds to stream `tensors` through a plain read-and-sum kernel: one launch per tensor (the seams of
    separate kernels, nothing else) or one launch over all of them (contiguous, the best this GPU reads)."""
    block, steps = 2048, 8
    flat = [t.view(-1) for t in tensors] if per_tensor else [torch.cat([t.view(-1) for t in tensors])]
    outs = [torch.empty(triton.cdiv(t.numel(), block * steps), device=t.device) for t in flat]

    def run() -> None:
        for t, o in zip(flat, outs, strict=True):
            _read[(o.numel(),)](t, o, t.numel(), BLOCK=block, STEPS=steps, num_warps=8)

    return triton.testing.do_bench_cudagraph(run, return_mode="median") / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype, dev = torch.bfloat16, "cuda"

    def weights(*shape: int) -> list[torch.Tensor]:
        return [torch.randn(*shape, device=dev, dtype=dtype) * shape[1] ** -0.5 for _ in range(LAYERS)]

    w_o, w_gu, w_d = weights(HIDDEN, ATTN), weights(2 * INTER, HIDDEN), weights(HIDDEN, INTER)
    w_q = weights(QKV, HIDDEN)
    norm = (torch.rand(HIDDEN, device=dev) + 0.5).to(dtype)
    attn = torch.randn(1, ATTN, device=dev, dtype=dtype)
    x0 = torch.randn(1, HIDDEN, device=dev, dtype=dtype)

    def chain(mode: str, tiles: MlpTiles = DEFAULT):
        def run() -> tuple[torch.Tensor, torch.Tensor]:
            x, qkv = x0, None
            for layer in range(LAYERS):
                nxt = (norm, w_q[layer])
                if mode.startswith("o+mlp"):
                    x, qkv = fused_mlp.o_proj_mlp(attn, w_o[layer], x, norm, w_gu[layer], w_d[layer], 1e-6,
                                                  next_qkv=nxt if mode == "o+mlp+qkv" else None, tiles=tiles)
                else:
                    x = skinny_gemm.linear_residual(attn, w_o[layer], x)
                    if mode == "mlp":
                        x = fused_mlp.mlp_residual(x, norm, w_gu[layer], w_d[layer], 1e-6, tiles=tiles)
                    else:
                        act = skinny_gemm.norm_gate_up_silu(x, norm, w_gu[layer], 1e-6)
                        x = skinny_gemm.linear_residual(act, w_d[layer], x)
                if qkv is None:
                    qkv = skinny_gemm.norm_linear(x, *nxt, 1e-6)
                if layer < LAYERS - 1:
                    qkv = None
            return x, qkv
        return run

    separate = chain("off")()
    for mode in MODES[1:]:
        eager = chain(mode)()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                replayed = chain(mode)()
            for _ in range(10):
                graph.replay()
        torch.cuda.synchronize()
        same = [all(map(torch.equal, got, separate)) for got in (eager, replayed)]
        print(f"{mode}: output and last qkv equal to separate launches: eager {same[0]}, "
              f"after 10 graph replays {same[1]}")
        del graph

    floor = (w_o[0].numel() + w_gu[0].numel() + w_d[0].numel() + w_q[0].numel()) * 2 / 4.28e12 * 1e6

    def us(run) -> float:
        return triton.testing.do_bench_cudagraph(run, return_mode="median") * 1e3 / LAYERS

    rows = [(mode, us(chain(mode))) for mode in MODES]
    if args.sweep:
        for change in SWEEP:
            tiles = dataclasses.replace(MlpTiles(), **change)
            rows.append((f"o+mlp+qkv {change}", us(chain("o+mlp+qkv", tiles))))
    tail_weights = [w for layer in range(LAYERS) for w in (w_o[layer], w_gu[layer], w_d[layer], w_q[layer])]
    nbytes = sum(w.numel() * 2 for w in tail_weights)
    for per_tensor, name in ((True, "read only, a launch per weight"), (False, "read only, one launch")):
        seconds = read_rate(tail_weights, per_tensor=per_tensor)
        rows.append((f"{name} ({nbytes / seconds / 1e12:.2f} TB/s)", seconds * 1e6 / LAYERS))
    rows += read_patterns(w_o, w_gu, w_d, w_q)
    print(f"\nus per layer (o_proj, MLP, next qkv; 36 layers chained, graph replays; floor {floor:.2f} us "
          "at 4.28 TB/s):")
    for name, value in rows:
        print(f"  {name:56s} {value:7.2f}")


if __name__ == "__main__":
    main()
