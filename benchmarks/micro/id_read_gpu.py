"""GPU: how long a device-id read takes while a long kernel holds the SMs, by the two ways
the cache could read: a join/gather kernel then ``tolist`` (the cache's way until 4e7bf7d),
and DMA of the span the ids lie in (``HostStage``). Both on a side stream that does not wait
for the busy stream, as settled reads do. Prints the median wall time of each, per busy kernel
length.

    python benchmarks/micro/id_read_gpu.py [--reps 20]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from hpc_radix.binding.device.ids import HostStage, _flat  # noqa: E402


def busy(n: int, size: int) -> None:
    """Queue ``n`` matmuls of ``size``^2 on the current stream (they fill every SM)."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(n):
        a = a @ a


def timed(read, reps: int, size: int, n: int) -> float:
    side = torch.cuda.Stream()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        side.wait_stream(torch.cuda.current_stream())
        busy(n, size)
        with torch.cuda.stream(side):
            t0 = time.perf_counter()
            read(side)
            out.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return 1e3 * statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    row = torch.arange(1 << 18, dtype=torch.int32, device="cuda")
    spare = torch.arange(100 * 64, dtype=torch.int64, device="cuda")
    parts = [row[4096:4096 + 128 * 64:64], spare[::64]]      # a chunk's 128 blocks + 100 spare pages
    stage = HostStage(pinned=True)
    assert stage.read(parts, torch.cuda.current_stream()) == _flat(parts).tolist()
    print(f"{torch.cuda.get_device_name()}: reading 228 ids (2 parts), median of {a.reps}")
    for size, n in ((1024, 0), (4096, 4), (8192, 4), (16384, 2)):
        kernel = timed(lambda s: _flat(parts).tolist(), a.reps, size, n)
        dma = timed(lambda s: stage.read(parts, s), a.reps, size, n)
        label = f"{n} matmuls of {size}^2 queued" if n else "idle GPU"
        print(f"  {label:30s} join+gather kernel {kernel:8.3f} ms   DMA {dma:8.3f} ms")


if __name__ == "__main__":
    main()
