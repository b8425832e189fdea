"""DROPPED EXPERIMENT (kept in history only; measured slower than the two launches, docs/benchmarks.md).

The whole decode MLP of one row in one launch: residual + down(silu(gate(n)) * up(n)), n = rmsnorm(x).

Two launches (gate_up, then down) each pay a ramp-up and a tail: at batch 1 the H200 streamed them at 3.3-3.5
TB/s, against 4.28 TB/s for a copy. Here the product is split along the intermediate dimension instead: each
program owns BLOCK_I intermediate rows, computes their gate and up products over the whole hidden row (the
norm's sum of squares on the way), applies SiLU * up, and multiplies the result by the matching BLOCK_I
columns of the down weight. That gives a partial of the whole output row, with no dependency on any other
program, so HBM streams gate, up and down weights without a gap. The partials (fp32, [P, H]) are summed in
a fixed order: every program draws a ticket after storing its partial, and the last REDUCERS to draw one
each wait for the count to reach P and then sum one slice of columns over all P partials, add the
residual and store. The last reducer resets the counters for the next launch. The result does not depend
on timing, so eager and graphed steps give the same bits.

Waiting reducers hold only REDUCERS program slots, and every program they wait for has already drawn a
ticket or has yet to start, so the wait cannot starve the programs it waits for. Under the Triton
interpreter programs run one after another: there REDUCERS is 1 and the last program sums everything.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from reference_engine.kernels.pdl import launch_options, pdl_prologue

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters_for(device: torch.device) -> torch.Tensor:
    """Two zeroed int32 counters per device (arrivals, reducers done), left at zero by every launch."""
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(2, dtype=torch.int32, device=device)
    return _COUNTERS[device]

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class MlpConfig:
    block_i: int  # intermediate rows per program (the split)
    block_k: int  # hidden columns per gate/up step
    block_n: int  # output columns per down step
    num_warps: int
    num_stages: int = 2


@functools.cache
def choose_config(hidden: int, intermediate: int) -> MlpConfig:
    """The largest tiles (up to the H200-tuned sizes) that divide the shapes; small models (tests) shrink."""
    def fit(want: int, n: int) -> int:
        while want > 1 and n % want:
            want //= 2
        return want

    return MlpConfig(block_i=fit(32, intermediate), block_k=fit(128, hidden), block_n=fit(64, hidden),
                     num_warps=4)


def supports(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """One row, contiguous weights, tiles that divide the shapes."""
    rows, hidden = x.numel() // x.shape[-1], x.shape[-1]
    inter = w_down.shape[1]
    down_layout = w_down.stride(1) == 1 or w_down.stride(0) == 1  # [H, I] or a transposed view of [I, H]
    ok = rows == 1 and w_gate_up.is_contiguous() and down_layout and x.stride(-1) == 1
    cfg = choose_config(hidden, inter)
    return ok and cfg.block_i >= 16 and cfg.block_k >= 16 and cfg.block_n >= 16


@triton.jit
def _mlp_kernel(
    x_ptr, norm_ptr, wgu_ptr, wd_ptr, out_ptr, part_ptr, count_ptr,
    K, I, eps, stride_dn, stride_di,  # noqa: E741 (I: the intermediate size, as in the docstring's shapes)
    P: tl.constexpr, REDUCERS: tl.constexpr, RED: tl.constexpr, PB: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    # Both products are MMAs with the weight tile as A and the one activation row padded to 16 columns as
    # B (only column 0 is non-zero): tl.dot operands go through Triton's multi-stage shared-memory
    # pipeline, which keeps enough bytes in flight to stream HBM; plain register loads did not (1.8x the
    # floor, against 1.2x for the two launches).
    j = tl.program_id(0)
    ri = tl.arange(0, BLOCK_I)
    rk = tl.arange(0, BLOCK_K)
    rc = tl.arange(0, 16)
    col0 = rc[None, :] < 1
    gate_ptrs = wgu_ptr + (j * BLOCK_I + ri).to(tl.int64)[:, None] * K + rk[None, :]
    up_ptrs = gate_ptrs + I * K  # I * K and H * I stay far below 2**31 for dense models
    pdl_prologue(USE_PDL)  # x is the previous kernel's output
    acc_g = tl.zeros((BLOCK_I, 16), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_I, 16), dtype=tl.float32)
    sum_sq = tl.zeros((BLOCK_K, 16), dtype=tl.float32)
    xt_ptrs = x_ptr + rk[:, None] + 0 * rc[None, :]
    for k in range(0, K, BLOCK_K):
        xf = tl.load(xt_ptrs + k, mask=col0, other=0.0).to(tl.float32)  # [BLOCK_K, 16], column 0 = x
        sum_sq += xf * xf
        # Same rounding as the skinny GEMMs: x * norm weight in x's dtype; 1/rms scales the sums at the end.
        xn = (xf * tl.load(norm_ptr + k + rk).to(tl.float32)[:, None]).to(x_ptr.dtype.element_ty)
        w_gate = tl.load(gate_ptrs + k)
        w_up = tl.load(up_ptrs + k)
        if DOT_FP32:
            acc_g = tl.dot(w_gate.to(tl.float32), xn.to(tl.float32), acc_g, input_precision="ieee")
            acc_u = tl.dot(w_up.to(tl.float32), xn.to(tl.float32), acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(w_gate, xn, acc_g)
            acc_u = tl.dot(w_up, xn, acc_u)
    inv_rms = tl.rsqrt(tl.sum(tl.sum(sum_sq, axis=1), axis=0) / K + eps)
    gate = acc_g * inv_rms
    up = acc_u * inv_rms
    # The activation is rounded to x's dtype, as the two-launch path stores it; columns past 0 stay 0.
    h = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty)  # [BLOCK_I, 16]

    rn = tl.arange(0, BLOCK_N)
    # The down weight may be stored [H, I] (a column stripe per program) or transposed ([I, H] storage: one
    # contiguous slab per program).
    di = (j * BLOCK_I + ri).to(tl.int64)
    down_ptrs = wd_ptr + rn.to(tl.int64)[:, None] * stride_dn + di[None, :] * stride_di
    for n in range(0, K, BLOCK_N):
        w_down = tl.load(down_ptrs + n * stride_dn)
        if DOT_FP32:
            part = tl.dot(w_down.to(tl.float32), h.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(w_down, h)
        tl.store(part_ptr + j * K + n + rn, tl.sum(part, axis=1))

    # Every thread's partial stores come before the ticket (barrier); the ticket releases them.
    tl.debug_barrier()
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket >= P - REDUCERS:
        while tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu") < P:
            pass
        cols = (ticket - (P - REDUCERS)) * RED + tl.arange(0, RED)
        col_mask = cols < K
        rp = tl.arange(0, PB)
        acc = tl.zeros((RED,), dtype=tl.float32)
        for p0 in range(0, P, PB):  # fixed order: the sum does not depend on who finished first
            rows = p0 + rp
            tile = tl.load(part_ptr + rows[:, None] * K + cols[None, :],
                           mask=(rows < P)[:, None] & col_mask[None, :], other=0.0, cache_modifier=".cg")
            acc += tl.sum(tile, axis=0)
        acc += tl.load(x_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)
        if tl.atomic_add(count_ptr + 1, 1, sem="acq_rel", scope="gpu") == REDUCERS - 1:
            tl.atomic_xchg(count_ptr + 1, 0)  # every reducer is past its wait: ready for the next launch
            tl.atomic_xchg(count_ptr, 0)


def mlp_residual(
    x: torch.Tensor, norm_w: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float, *,
    config: MlpConfig | None = None,
) -> torch.Tensor:
    """x + silu_and_mul(rmsnorm(x, norm_w) @ w_gate_up.T) @ w_down.T for one row (see `supports`)."""
    hidden, inter = x.shape[-1], w_down.shape[1]
    assert supports(x, w_gate_up, w_down) and w_gate_up.shape == (2 * inter, hidden)
    cfg = config or choose_config(hidden, inter)
    programs = inter // cfg.block_i
    # At most 16 reducers wait at a time (they hold program slots while the last programs finish: more
    # reducers than slots would deadlock). Each sums a slice of columns over all partials, PB of them a
    # round. Under the interpreter, which runs programs one by one, the last program alone reduces.
    pb = min(64, triton.next_power_of_2(programs))
    red = triton.next_power_of_2(hidden) if _INTERPRETED else max(triton.next_power_of_2(hidden // 16), 16)
    reducers = triton.cdiv(hidden, red)
    part = torch.empty(programs, hidden, dtype=torch.float32, device=x.device)
    out = torch.empty_like(x)
    use_pdl, pdl = launch_options(x)
    _mlp_kernel[(programs,)](
        x, norm_w, w_gate_up, w_down, out, part, counters_for(x.device),
        hidden, inter, eps, w_down.stride(0), w_down.stride(1),
        P=programs, REDUCERS=reducers, RED=red, PB=pb,
        BLOCK_I=cfg.block_i, BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n, USE_PDL=use_pdl,
        # The interpreter's bf16 tl.dot is wrong (triton 3.9): upcast there; fp32 inputs get exact products.
        DOT_FP32=_INTERPRETED or x.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )
    return out
