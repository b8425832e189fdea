"""DROPPED EXPERIMENT (kept in history only): the one-launch decode MLP against the two launches, batch 1.

    python benchmarks/fused_mlp_sweep.py

36 layers of qwen3-4b MLP weights (5.4 GB, every weight from HBM) chained in one CUDA graph, PDL on; median
us per layer, each fused tile checked against the two-launch output. Measured on an H200 (2026-12-01):
best fused 48.9-50.4 us against 41.8-42.5 for the two launches (docs/benchmarks.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference_engine.kernels import fused_mlp, skinny_gemm  # noqa: E402
from reference_engine.kernels.pdl import set_pdl  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS = 2560, 9728, 36
TILES = [(64, 128, 256, 8, 3), (64, 128, 128, 8, 3), (64, 128, 128, 4, 3), (64, 256, 256, 8, 3),
         (128, 128, 256, 8, 3), (32, 128, 256, 4, 3)]


def graph_us(fn, replays: int = 20) -> tuple[float, torch.Tensor]:
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / LAYERS)
    return sorted(times)[len(times) // 2], out.clone()


def main() -> None:
    torch.manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    gate_ups = [torch.randn(2 * INTERMEDIATE, HIDDEN, **bf) * HIDDEN**-0.5 for _ in range(LAYERS)]
    downs = [torch.randn(HIDDEN, INTERMEDIATE, **bf) * INTERMEDIATE**-0.5 for _ in range(LAYERS)]
    downs_t = [d.t().contiguous().t() for d in downs]  # [I, H] storage: one contiguous slab per program
    norm = torch.rand(HIDDEN, **bf) + 0.5
    x0 = torch.randn(1, HIDDEN, **bf)
    set_pdl(True)

    def two_launch() -> torch.Tensor:
        x = x0
        for gu, d in zip(gate_ups, downs, strict=True):
            x = skinny_gemm.linear_residual(skinny_gemm.norm_gate_up_silu(x, norm, gu, 1e-6), d, x)
        return x

    base_us, base = graph_us(two_launch)
    print(f"two launches {base_us:.2f} us/layer (floor {3 * HIDDEN * INTERMEDIATE * 2 / 4.28e6:.2f})")
    for layout, down_set in (("[H,I]", downs), ("[I,H]", downs_t)):
        for tile in TILES:
            cfg = fused_mlp.MlpConfig(*tile)

            def fused(cfg=cfg, down_set=down_set) -> torch.Tensor:
                x = x0
                for gu, d in zip(gate_ups, down_set, strict=True):
                    x = fused_mlp.mlp_residual(x, norm, gu, d, 1e-6, config=cfg)
                return x

            us, out = graph_us(fused)
            err = ((out.float() - base.float()).norm() / base.float().norm()).item()
            print(f"{layout} {cfg}: {us:.2f} us/layer, rel err {err:.1e}")


if __name__ == "__main__":
    main()
