"""A read-back of the file tier into host slabs beside a thread that keeps the GIL busy, as
SGLang's scheduler loop does: the real ``StoreWorker`` probe and fill over a real ``FileStore``,
its objects read one at a time and ``FILL_THREADS`` at a time.

Each file call of a fill lets go of the GIL and waits for it back while the busy thread runs
Python (up to the switch interval the tier sets), so a fill of one state and its blocks pays a
wait per call in turn; read several at a time, the waits overlap. Prints the median fill time
of each, alone and beside the busy thread (defaults: a large16 state of 38.5 MB and 48 KV
blocks of 1 MiB, about a continuing turn of 3,000 tokens). With ``--beside-writes``, also
beside the worker writing such states and blocks without end (its puts WRITE_THREADS at a
time), with no put starting while the fill runs (``READS_FIRST_S``, the worker's way) and with
puts free to start. With ``--checks``, also each way of checking what was read: through
xxhash's update, which lets go of the GIL at each slab, or keeping the GIL
(``persistence._HeldDigest``, the worker's way). With ``--process``, also read and checked by
the file tier's writer process (``--cache-store-writer process``, the default), one message
out and one back. With ``--mooncake``, also from Mooncake Store (a master started here, as the
tests start one, over TCP): read straight into the slabs (the backend's way) and through the
client's ``get``, which copies each object into Python holding the GIL (before).

    python benchmarks/micro/tier_fill_beside_busy_thread.py [--blocks 48] [--state-mb 38.5]
        [--threads 1,4,8] [--beside-writes] [--checks] [--process] [--mooncake]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

from hpc_radix import persistence
from hpc_radix.binding.host.memory import HostMemory
from hpc_radix.binding.store import ObjectStore
from hpc_radix.binding.store.file import FileStore
from hpc_radix.binding.store.policy import TIER_SWITCH_INTERVAL_S
from hpc_radix.binding.store import worker as worker_module
from hpc_radix.binding.store.worker import FILL_THREADS, Probe, StoreWorker, Write
from hpc_radix.binding.store.writer import WriterProcess
from hpc_radix.index.keys import BLOCK_BYTES, TOKEN_BYTES
from hpc_radix.index.slabs import SlabPool
from tier_io_beside_busy_thread import busy_thread, running     # (this script's own directory)

SLAB = 1 << 20


def file_store(root: str, by_process: bool = False):
    """What makes a fresh file tier over a host tier's memory (its reads and writes
    ``by_process``: the file tier's writer process, else threads)."""
    return lambda memory: FileStore(os.path.join(root, f"tier{int(by_process)}"), 1 << 40,
                                    WriterProcess(memory.shared) if by_process else None)


def stored_worker(make_store, blocks: int, image_slabs: int,
                  shared: bool = False) -> tuple[StoreWorker, bytes]:
    """A worker over a fresh tier (``make_store(memory)``) holding one state after ``blocks``
    blocks and a tail; ``shared``: host chunks the writer process reaches."""
    slabs = SlabPool(4 * (blocks + image_slabs + 1) * SLAB, SLAB, online=False)
    memory = HostMemory(slabs, pin=False, shared=shared)
    memory.start()
    assert memory.wait(60)
    memory.poll()
    worker = StoreWorker(make_store(memory), memory, image_slabs, 7)
    write = new_write(worker, blocks, image_slabs)
    worker.submit(write)
    assert worker.drain() and worker.stats["store_states_written"] == 1
    slabs.free(write.node_slabs + write.state_slabs)
    return worker, write.path + write.tail


def new_write(worker: StoreWorker, blocks: int, image_slabs: int, slabs=None) -> Write:
    """A write of a state of fresh tokens after ``blocks`` blocks (into ``slabs``: new ones)."""
    pool = worker.memory.slabs
    tokens = os.urandom(blocks * BLOCK_BYTES + 10 * TOKEN_BYTES)
    path, tail = tokens[:blocks * BLOCK_BYTES], tokens[blocks * BLOCK_BYTES:]
    if slabs is None:
        slabs = pool.alloc(blocks + image_slabs + 1)
        for s in slabs:
            worker.memory.view(s).numpy()[:] = ord(os.urandom(1))
    return Write(None, path, tail, "endpoint", "prompt_tail", 1, slabs[:blocks], slabs[blocks:],
                 [pool.generation(s) for s in slabs])


@contextlib.contextmanager
def writing(worker: StoreWorker, blocks: int, image_slabs: int):
    """The worker writing fresh states (and their blocks) one after another meanwhile."""
    slabs = worker.memory.slabs.alloc(blocks + image_slabs + 1)

    def write_one() -> None:
        worker.submit(new_write(worker, blocks, image_slabs, slabs))
        worker.drain()
    try:
        with running(write_one):
            yield
    finally:
        worker.memory.slabs.free(slabs)


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


def checks(worker: StoreWorker, tokens: bytes, runs: int) -> None:
    """The fill's median and a state's checksum by itself (its 1 MiB slabs), alone and beside
    a busy thread, checked each way."""
    held = persistence._held_digest
    slab_ids = worker.memory.slabs.alloc(worker.image_slabs)
    slabs = [worker._view(s) for s in slab_ids]
    try:
        for beside in ("alone", "beside a busy thread"):
            with busy_thread() if beside != "alone" else contextlib.nullcontext():
                for label, digest in (("update", None), ("GIL kept", held)):
                    persistence._held_digest = digest
                    fills = sorted(fill_ms(worker, tokens) for _ in range(runs))
                    sums = sorted(checksum_ms(digest or persistence._digest, slabs)
                                  for _ in range(runs))
                    print(f"{beside:22} checked: {label:9} fill {fills[runs // 2]:7.1f} ms, "
                          f"the state's checksum {sums[runs // 2]:5.1f} ms")
    finally:
        persistence._held_digest = held
        worker.memory.slabs.free(slab_ids)


def mooncake_fills(blocks: int, image_slabs: int, runs: int) -> None:
    """The fill from Mooncake Store, read into the slabs and through ``get``, alone and beside
    a busy thread."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "binding"))
    from test_store_mooncake import Master, _free_port, config   # (loads the libs it links)
    from hpc_radix.binding.store.mooncake import MooncakeStore

    with tempfile.TemporaryFile("w") as log:
        master = Master(_free_port(), _free_port(), log)
        try:
            objects = (blocks + image_slabs + 2) * SLAB
            make = lambda memory: MooncakeStore({**config(master), "global_segment_size": 2 * objects,  # noqa: E731
                                                 "local_buffer_size": objects})
            worker, tokens = stored_worker(make, blocks, image_slabs)
            store = worker.store
            for way in ("into the slabs", "through get"):
                if way == "through get":
                    store.read_into = functools.partial(ObjectStore.read_into, store)
                times = sorted(fill_ms(worker, tokens) for _ in range(runs))
                print(f"{'alone':22} {'Mooncake, ' + way:30} {times[runs // 2]:7.1f} ms")
                gaps, last = [0.0], [time.perf_counter()]

                def step() -> None:          # the busy thread: how long it was kept from running
                    now = time.perf_counter()
                    gaps.append(now - last[0])
                    last[0] = now
                with running(step):
                    times = sorted(fill_ms(worker, tokens) for _ in range(runs))
                print(f"{'beside a busy thread':22} {'Mooncake, ' + way:30} {times[runs // 2]:7.1f} ms;"
                      f" the busy thread stopped up to {1e3 * max(gaps):.1f} ms at once")
            worker.close()
        finally:
            master.stop()


def checksum_ms(digest, slabs: list) -> float:
    start = time.perf_counter()
    digest(slabs)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--state-mb", type=float, default=38.5)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", default=f"1,{FILL_THREADS}",
                    help="objects read at a time, a comma list (default %(default)s)")
    ap.add_argument("--beside-writes", action="store_true",
                    help="also beside the worker's writes, reads first and not")
    ap.add_argument("--process", action="store_true",
                    help="also read by the file tier's writer process (--cache-store-writer process)")
    ap.add_argument("--mooncake", action="store_true",
                    help="also from Mooncake Store: into the slabs and through get")
    ap.add_argument("--checks", action="store_true",
                    help="also with the objects checked keeping the GIL and not")
    a = ap.parse_args()
    sys.setswitchinterval(TIER_SWITCH_INTERVAL_S)
    image_slabs = -(-int(a.state_mb * 1e6) // SLAB)
    with tempfile.TemporaryDirectory(dir="/var/tmp" if os.path.isdir("/var/tmp") else None) as root:
        worker, tokens = stored_worker(file_store(root), a.blocks, image_slabs)
        pools = {f"{n} at a time": n for n in map(int, a.threads.split(","))}
        print(f"a fill of one state ({image_slabs} MiB) and {a.blocks} blocks of 1 MiB; "
              f"switch interval {TIER_SWITCH_INTERVAL_S * 1e3:.1f} ms; median of {a.runs}")
        for beside in ("alone", "beside a busy thread"):
            with busy_thread() if beside != "alone" else contextlib.nullcontext():
                for label, threads in pools.items():
                    worker._object_reads = concurrent.futures.ThreadPoolExecutor(threads)
                    times = sorted(fill_ms(worker, tokens) for _ in range(a.runs))
                    print(f"{beside:22} {label:14} {times[len(times) // 2]:7.1f} ms")
        worker._object_reads = concurrent.futures.ThreadPoolExecutor(FILL_THREADS)
        if a.process:
            by_process, tokens_p = stored_worker(file_store(root, True), a.blocks, image_slabs, shared=True)
            for beside in ("alone", "beside a busy thread"):
                with busy_thread() if beside != "alone" else contextlib.nullcontext():
                    times = sorted(fill_ms(by_process, tokens_p) for _ in range(a.runs))
                    print(f"{beside:22} {'writer process':14} {times[len(times) // 2]:7.1f} ms")
            by_process.close()
        if a.mooncake:
            mooncake_fills(a.blocks, image_slabs, a.runs)
        if a.checks:
            checks(worker, tokens, a.runs)
        for reads_first in (True, False) if a.beside_writes else ():
            worker_module.READS_FIRST_S = 0.1 if reads_first else 0.0
            with writing(worker, a.blocks, image_slabs):
                times = sorted(fill_ms(worker, tokens) for _ in range(a.runs))
            label = "reads first" if reads_first else "puts free"
            print(f"{'beside writes':22} {label:14} {times[len(times) // 2]:7.1f} ms "
                  f"({FILL_THREADS} at a time)")
        worker.close()


if __name__ == "__main__":
    main()
