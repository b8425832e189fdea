"""How fast one launch streams qwen3-4b's 36 layers of projection weights with no dependencies at all.

    python benchmarks/engine/stream_patterns.py

The one-launch decode (decode_layers.py) takes ~48 us a layer with its waits skipped and ~60 with them,
against ~44 for a plain contiguous read of the same bytes. These ways split the streaming part of that: each
reads the layers' qkv, o_proj, gate_up and down weights in one launch, programs taking their roles from a
dispatch counter in the engine's order (qkv, o_proj, gate_up, down tiles), with the engine's tiles and
one-row math (each K step's FMAs against an activation row); none waits for another.
- `tiles`: that, at the registers it needs (4 programs an SM);
- `tiles-3-an-sm` / `-2-an-sm`: the same held to 3 / 2 programs an SM (a branch never taken reserves
  shared memory), as the engine's launch is (3, by its registers);
- `tiles-count` (`tiles-3-an-sm-count`): each tile ending as the engine's do, releasing its stores and
  counting itself on a flag;
- `tile-major`: weights laid out tile by tile (each program's bytes one contiguous run);
- `persistent`: 3 programs an SM, each walking every 3 x SMs-th tile;
- `plain`: a contiguous read-and-sum of the same bytes (layer_tail.py's).
Prints us a layer and TB/s. Needs a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from layer_tail import read_rate  # noqa: E402  (this directory is on sys.path when run as a script)

HIDDEN, INTER, ATTN, QKV, LAYERS = 2560, 9728, 4096, 6144, 36
# (rows, K step, stages) a tile, as MlpTiles() (gate_up at 3 stages, the engine's when this was measured; 5
# since); o_proj loads its whole [O_N, ATTN] tile at once. Read by the kernels below.
Q_N, Q_K, Q_ST = tl.constexpr(16), tl.constexpr(512), tl.constexpr(3)
O_N = tl.constexpr(4)
GU_N, GU_K, GU_ST = tl.constexpr(16), tl.constexpr(256), tl.constexpr(3)
D_N, D_K, D_ST = tl.constexpr(8), tl.constexpr(512), tl.constexpr(4)


@triton.jit
def _tile(w_ptr, a_ptr, t, K, up_offset, N: tl.constexpr, STEP: tl.constexpr, STAGES: tl.constexpr,
          UP: tl.constexpr, MAJOR: tl.constexpr, MATH: tl.constexpr):
    """One tile's K loop: N rows from row t * N, STEP-wide K steps; MAJOR: the tile's bytes are one run."""
    r = tl.arange(0, N)
    kk = tl.arange(0, STEP)
    if MAJOR:
        ptrs = w_ptr + t.to(tl.int64) * N * K + r[:, None] * STEP + kk[None, :]
        step_stride = N * STEP
    else:
        ptrs = w_ptr + (t.to(tl.int64) * N + r)[:, None] * K + kk[None, :]
        step_stride = STEP
    acc = tl.zeros((N, STEP), tl.float32)
    for i in tl.range(0, K // STEP, num_stages=STAGES):
        w = tl.load(ptrs + i * step_stride).to(tl.float32)
        if UP:
            w2 = tl.load(ptrs + i * step_stride + up_offset).to(tl.float32)
        if MATH:
            a = tl.load(a_ptr + i * STEP + kk).to(tl.float32)
            acc += w * a[None, :]
            if UP:
                acc += w2 * a[None, :]
        else:
            acc += w
            if UP:
                acc += w2
    return tl.sum(acc, axis=1)


@triton.jit
def _role(wq, wo, wgu, wd, a_ptr, out_ptr, vid, H: tl.constexpr, INTER: tl.constexpr, A: tl.constexpr,
          QKV: tl.constexpr, MAJOR: tl.constexpr, MATH: tl.constexpr):
    """Tile `vid` of the stack, in the engine's order within a layer: qkv, o_proj, gate_up, down."""
    n_q: tl.constexpr = QKV // Q_N
    n_o: tl.constexpr = H // O_N
    n_gu: tl.constexpr = INTER // GU_N
    n_d: tl.constexpr = H // D_N
    per_layer: tl.constexpr = n_q + n_o + n_gu + n_d
    layer = vid // per_layer
    r = vid % per_layer
    if r < n_q:
        yq = _tile(wq + layer.to(tl.int64) * QKV * H, a_ptr, r, H, 0, Q_N, Q_K, Q_ST, False, MAJOR, MATH)
        tl.store(out_ptr + vid * 16 + tl.arange(0, Q_N), yq)
    elif r < n_q + n_o:
        t = r - n_q
        cols = tl.arange(0, A)
        rows = (t * O_N + tl.arange(0, O_N)).to(tl.int64)
        w = tl.load(wo + layer.to(tl.int64) * H * A + rows[:, None] * A + cols[None, :]).to(tl.float32)
        if MATH:
            w = w * tl.load(a_ptr + cols).to(tl.float32)[None, :]
        tl.store(out_ptr + vid * 16 + tl.arange(0, O_N), tl.sum(w, axis=1))
    elif r < n_q + n_o + n_gu:
        t = r - n_q - n_o
        yg = _tile(wgu + layer.to(tl.int64) * 2 * INTER * H, a_ptr, t, H, INTER * H, GU_N, GU_K, GU_ST, True,
                   MAJOR, MATH)
        tl.store(out_ptr + vid * 16 + tl.arange(0, GU_N), yg)
    else:
        t = r - n_q - n_o - n_gu
        yd = _tile(wd + layer.to(tl.int64) * H * INTER, a_ptr, t, INTER, 0, D_N, D_K, D_ST, False, MAJOR,
                   MATH)
        tl.store(out_ptr + vid * 16 + tl.arange(0, D_N), yd)


@triton.jit
def _stream_kernel(wq, wo, wgu, wd, a_ptr, out_ptr, sync_ptr, total, H: tl.constexpr, INTER: tl.constexpr,
                   A: tl.constexpr, QKV: tl.constexpr, MAJOR: tl.constexpr, MATH: tl.constexpr,
                   PERSISTENT: tl.constexpr, PAD: tl.constexpr,
                   COUNT: tl.constexpr):
    if PAD > 0:  # a branch never taken whose pipelined loop reserves shared memory: PAD 5 holds 3 programs
        if total < 0:  # an SM, 6 holds 2
            yp = _tile(wq, a_ptr, total, 4096, 0, Q_N, Q_K, PAD, False, False, True)
            tl.store(out_ptr + tl.arange(0, Q_N), yp)
    if PERSISTENT:
        for vid in range(tl.program_id(0), total, tl.num_programs(0)):
            _role(wq, wo, wgu, wd, a_ptr, out_ptr, vid, H, INTER, A, QKV, MAJOR, MATH)
    else:
        vid = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
        _role(wq, wo, wgu, wd, a_ptr, out_ptr, vid, H, INTER, A, QKV, MAJOR, MATH)
        if COUNT:  # the engine's end of a tile: release its stores, count it on a flag
            tl.debug_barrier()
            tl.atomic_add(sync_ptr + 1 + vid % 64, 1, sem="release", scope="gpu")


def main() -> None:
    dev, dtype = "cuda", torch.bfloat16
    torch.manual_seed(0)
    wq = torch.randn(LAYERS, QKV, HIDDEN, device=dev, dtype=dtype)
    wo = torch.randn(LAYERS, HIDDEN, ATTN, device=dev, dtype=dtype)
    wgu = torch.randn(LAYERS, 2 * INTER, HIDDEN, device=dev, dtype=dtype)
    wd = torch.randn(LAYERS, HIDDEN, INTER, device=dev, dtype=dtype)
    a = torch.randn(INTER, device=dev, dtype=dtype)
    per_layer = QKV // Q_N + HIDDEN // O_N + INTER // GU_N + HIDDEN // D_N
    total = LAYERS * per_layer
    out = torch.empty(total * 16, device=dev)
    sync = torch.zeros(65, dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    layer_bytes = sum(w[0].numel() for w in (wq, wo, wgu, wd)) * 2

    def way(major: bool, math: bool, persistent: bool, pad: int = 0, count: bool = False):
        grid = (3 * sms,) if persistent else (total,)

        def run() -> None:
            sync.zero_()
            _stream_kernel[grid](wq, wo, wgu, wd, a, out, sync, total, H=HIDDEN, INTER=INTER, A=ATTN, QKV=QKV,
                                 MAJOR=major, MATH=math, PERSISTENT=persistent, PAD=pad,
                                 COUNT=count, num_warps=4)
        return run

    ways = {
        "tiles": way(False, True, False),
        "tiles-3-an-sm": way(False, True, False, pad=5),
        "tiles-2-an-sm": way(False, True, False, pad=6),
        "tiles-count": way(False, True, False, count=True),
        "tiles-3-an-sm-count": way(False, True, False, pad=5, count=True),
        "tile-major": way(True, True, False),
        "persistent": way(False, True, True),
    }
    rows = []
    for name, run in ways.items():
        run()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench_cudagraph(run, return_mode="median")
        rows.append((name, ms * 1e3 / LAYERS))
    plain = read_rate([wq, wo, wgu, wd], per_tensor=False) * 1e6 / LAYERS
    rows.append(("plain", plain))
    print(f"{'way':<24} {'us a layer':>10} {'TB/s':>6}")
    for name, us in rows:
        print(f"{name:<24} {us:>10.2f} {layer_bytes / us / 1e6:>6.2f}")


if __name__ == "__main__":
    main()
