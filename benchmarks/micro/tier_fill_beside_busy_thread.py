"""A read-back of the file tier into host slabs beside a thread that keeps the GIL busy, as
SGLang's scheduler loop does: the real ``StoreWorker`` probe and fill over a real ``FileStore``,
its objects read one at a time and ``FILL_THREADS`` at a time.

Each file call of a fill lets go of the GIL and waits for it back while the busy thread runs
Python (up to the switch interval the tier sets), so a fill of one state and its blocks pays a
wait per call in turn; read several at a time, the waits overlap. Prints the median fill time
of each, alone and beside the busy thread (defaults: a large16 state of 38.5 MB and 48 KV
blocks of 1 MiB, about a continuing turn of 3,000 tokens).

    python benchmarks/micro/tier_fill_beside_busy_thread.py [--blocks 48] [--state-mb 38.5]
        [--threads 1,4,8]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import sys
import tempfile
import time

from hpc_radix.binding.host.memory import HostMemory
from hpc_radix.binding.store.file import FileStore
from hpc_radix.binding.store.policy import TIER_SWITCH_INTERVAL_S
from hpc_radix.binding.store.worker import FILL_THREADS, Probe, StoreWorker, Write
from hpc_radix.index.keys import BLOCK_BYTES, TOKEN_BYTES
from hpc_radix.index.slabs import SlabPool
from tier_io_beside_busy_thread import busy_thread     # (this script's own directory)

SLAB = 1 << 20


def stored_worker(root: str, blocks: int, image_slabs: int) -> tuple[StoreWorker, bytes]:
    """A worker over a fresh tier holding one state after ``blocks`` blocks and a tail."""
    slabs = SlabPool(2 * (blocks + image_slabs + 1) * SLAB, SLAB, online=False)
    memory = HostMemory(slabs, pin=False)
    memory.start()
    assert memory.wait(60)
    memory.poll()
    worker = StoreWorker(FileStore(os.path.join(root, "tier"), 1 << 40), memory, image_slabs, 7)
    tokens = os.urandom(blocks * BLOCK_BYTES + 10 * TOKEN_BYTES)
    path, tail = tokens[:blocks * BLOCK_BYTES], tokens[blocks * BLOCK_BYTES:]
    node_slabs, state_slabs = slabs.alloc(blocks), slabs.alloc(image_slabs + 1)
    for s in node_slabs + state_slabs:
        memory.view(s).numpy()[:] = ord(os.urandom(1))
    worker.submit(Write(None, path, tail, "endpoint", "prompt_tail", 1, node_slabs, state_slabs,
                        [slabs.generation(s) for s in node_slabs + state_slabs]))
    assert worker.drain() and worker.stats["store_states_written"] == 1
    slabs.free(node_slabs + state_slabs)
    return worker, tokens


def fill_ms(worker: StoreWorker, tokens: bytes) -> float:
    p = Probe(tokens, None, 0, 0, 0)
    worker._probe(p)
    p.slabs = worker.memory.slabs.alloc(p.slab_count)
    start = time.perf_counter()
    worker._fill(p)
    took = (time.perf_counter() - start) * 1e3
    assert p.filled
    worker.memory.slabs.free(p.slabs)
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--state-mb", type=float, default=38.5)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", default=f"1,{FILL_THREADS}",
                    help="objects read at a time, a comma list (default %(default)s)")
    a = ap.parse_args()
    sys.setswitchinterval(TIER_SWITCH_INTERVAL_S)
    image_slabs = -(-int(a.state_mb * 1e6) // SLAB)
    with tempfile.TemporaryDirectory(dir="/var/tmp" if os.path.isdir("/var/tmp") else None) as root:
        worker, tokens = stored_worker(root, a.blocks, image_slabs)
        pools = {f"{n} at a time": n for n in map(int, a.threads.split(","))}
        print(f"a fill of one state ({image_slabs} MiB) and {a.blocks} blocks of 1 MiB; "
              f"switch interval {TIER_SWITCH_INTERVAL_S * 1e3:.1f} ms; median of {a.runs}")
        for beside in ("alone", "beside a busy thread"):
            with busy_thread() if beside != "alone" else contextlib.nullcontext():
                for label, threads in pools.items():
                    worker._object_reads = concurrent.futures.ThreadPoolExecutor(threads)
                    times = sorted(fill_ms(worker, tokens) for _ in range(a.runs))
                    print(f"{beside:22} {label:14} {times[len(times) // 2]:7.1f} ms")
        worker.close()


if __name__ == "__main__":
    main()
