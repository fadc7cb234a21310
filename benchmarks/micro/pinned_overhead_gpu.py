"""GPU: does a pinned host tier slow the scheduler thread's own work? With ample memory the
hybrid cache with a host tier (no host write, no host hit) was 1.16x slower to first token
than without one, and every cache call ~25 % slower, on two H200 hosts. This times a
scheduler-like step (small pageable uploads, kernel launches, one small read back, some
Python) in one process: before the host tier's memory exists, while it is pinned (the cache's
own ``HostMemory``, filled by its background thread), after it is unpinned, and while the
same bytes are pinned the way SGLang's HiCache pins its host pool.

    python benchmarks/micro/pinned_overhead_gpu.py [--mib 1907] [--steps 2000] [--rounds 3]
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

from hpc_radix.binding.host.memory import HostMemory  # noqa: E402
from hpc_radix.index.slabs import SlabPool  # noqa: E402


def step(x: torch.Tensor, table: dict) -> None:
    """One scheduler-like iteration: what SGLang and the cache do per batch, in miniature."""
    ids = torch.tensor(list(range(64)), dtype=torch.int64, device="cuda")   # pageable upload
    for _ in range(40):
        x.add_(1.0)                                                         # launches
    x[ids].sum().tolist()                                                   # a read back
    for i in range(300):                                                    # the index's Python
        table[i % 97] = table.get(i % 89, 0) + 1


def timed(steps: int) -> tuple[float, float]:
    """(wall ms per step, thread CPU ms per step)."""
    x = torch.zeros(4096, device="cuda")
    table: dict = {}
    for _ in range(50):
        step(x, table)
    torch.cuda.synchronize()
    w0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        step(x, table)
    torch.cuda.synchronize()
    return ((time.perf_counter() - w0) * 1e3 / steps, (time.thread_time() - c0) * 1e3 / steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1907, help="host tier to pin")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.cuda.init()
    results: dict[str, list] = {}

    def measure(name: str) -> None:
        results[name] = [timed(a.steps) for _ in range(a.rounds)]

    measure("before")
    memory = HostMemory(SlabPool(a.mib << 20, 1 << 20, online=False))
    memory.start()                       # the cache's way: a background thread, portable
    assert memory.wait(120) and memory.error is None, memory.error
    memory.poll()
    measure("pinned")
    memory.close()
    measure("unpinned")
    # SGLang's HiCache way: on the calling thread, default flags
    from sglang.srt.mem_cache.storage.mmap import alloc_mmap

    buf = alloc_mmap((a.mib << 20,), torch.uint8)
    assert int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)) == 0
    measure("sglang-pinned")
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    del buf
    measure("after")
    print(f"{torch.cuda.get_device_name()}: {a.mib} MiB host tier, {a.steps} steps x {a.rounds} rounds")
    base = statistics.median(w for w, _ in results["before"])
    for name, runs in results.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(f"  {name:13s} {wall:7.3f} ms/step wall ({wall / base:4.2f}x), {cpu:7.3f} ms/step thread CPU")


if __name__ == "__main__":
    main()
