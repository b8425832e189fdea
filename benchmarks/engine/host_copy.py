"""A step's two small host transfers around a busy kernel: DMA copies against zero-copy kernels.

    python benchmarks/engine/host_copy.py

Each iteration is what the engine's stream sees around a step graph: a 280-byte metadata copy from a pinned
host slot to the device, a ~100 us kernel standing in for the graph, an 8-byte token copy back to pinned
memory. `dma`: non-blocking copies (the copy engine); `zero-copy`: reference_engine/host_copy.py's
one-program kernels reading and writing the pinned memory directly; `busy`: the kernel alone. Prints us an
iteration over 300 iterations enqueued back to back (the host ahead, as with async scheduling). Needs a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from reference_engine.host_copy import copy_to, zero_copy_available  # noqa: E402

ITERATIONS = 300
BUSY_CYCLES = 200_000  # ~100 us on an H200


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("host_copy.py: needs a CUDA GPU")
    if not zero_copy_available(torch.device("cuda")):
        sys.exit("host_copy.py: zero-copy kernels do not work here (copy_to falls back to DMA copies)")
    host_meta = torch.arange(70, dtype=torch.int32).pin_memory()
    dev_meta = torch.zeros(70, dtype=torch.int32, device="cuda")
    dev_out = torch.arange(8, dtype=torch.int64, device="cuda")
    host_out = torch.zeros(8, dtype=torch.int64).pin_memory()

    def busy() -> None:
        torch.cuda._sleep(BUSY_CYCLES)

    def dma() -> None:
        dev_meta.copy_(host_meta, non_blocking=True)
        busy()
        host_out.copy_(dev_out, non_blocking=True)

    def zero_copy() -> None:
        copy_to(dev_meta, host_meta)
        busy()
        copy_to(host_out, dev_out)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        zero_copy()
        torch.cuda.synchronize()
        assert torch.equal(dev_meta.cpu(), host_meta) and torch.equal(host_out, dev_out.cpu())
        ways = (("busy", busy), ("dma", dma), ("zero-copy", zero_copy)) * 2
        for name, fn in ways:
            for _ in range(20):
                fn()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(stream)
            for _ in range(ITERATIONS):
                fn()
            end.record(stream)
            torch.cuda.synchronize()
            print(f"{name:10s} {begin.elapsed_time(end) / ITERATIONS * 1e3:8.2f} us an iteration")


if __name__ == "__main__":
    main()
