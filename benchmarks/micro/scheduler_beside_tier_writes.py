"""What the scheduler thread loses beside the file tier's writes, at about the 8 GiB server's
write rate: its own Python work per second and the wall time of a unit of it, beside nothing,
beside the real ``StoreWorker`` writing states and their blocks from host slabs with the
objects' checksums and file calls in the scheduler's process (its put threads), and with them
in the tier's writer process (a message out and one back per object: no file call or
checksum part waits for the scheduler's GIL). With ``--mooncake``, also beside the worker's
put threads writing to Mooncake Store (a master started here, as the tests start one, over
TCP), each object gathered from the host slabs by the client.

The 8 GiB server's tier wrote 74 GB in a 94 s replay: ~10 states a second, each with ~28 new
blocks (``--rate``, ``--blocks``). Each arm runs ``--seconds``; the busy thread's units are
~1 ms of dict and list work alone.

    python benchmarks/micro/scheduler_beside_tier_writes.py [--seconds 15] [--rate 10]
        [--blocks 28] [--state-mb 38.5] [--store-mib 4096] [--repeats 1]
        [--own-core] [--mooncake]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from hpc_radix.binding.host.memory import HostMemory
from hpc_radix.binding.store.file import FileStore
from hpc_radix.binding.store.policy import TIER_SWITCH_INTERVAL_S
from hpc_radix.binding.store.worker import StoreWorker
from hpc_radix.binding.store.writer import WriterProcess
from hpc_radix.index.slabs import SlabPool
from tier_fill_beside_busy_thread import new_write     # (this script's own directory)

SLAB = 1 << 20


def unit() -> None:
    """About 1 ms of the scheduler's kind of Python: a dict of ints made and read (no
    containers in it: a unit that made thousands would time the collector's passes)."""
    d = {}
    for i in range(10000):
        d[i] = i + 1
    sum(d.values())


def measure(seconds: float, own_core: bool = False) -> tuple[float, float, float]:
    """(units a second, median ms, p99 ms, CPU ms a unit) of the busy thread over ``seconds``
    (its time not on the CPU: waits for the GIL, mostly; ``own_core``:
    on core 0, which nothing else of this process was let onto)."""
    if own_core:
        os.sched_setaffinity(0, {0})
        try:
            return measure(seconds)
        finally:
            os.sched_setaffinity(0, set(range(1, os.cpu_count())))
    times, end, cpu = [], time.perf_counter() + seconds, time.thread_time()
    while (now := time.perf_counter()) < end:
        unit()
        times.append(time.perf_counter() - now)
    cpu = time.thread_time() - cpu
    times.sort()
    return (len(times) / seconds, 1e3 * times[len(times) // 2], 1e3 * times[int(0.99 * len(times))],
            1e3 * cpu / len(times))


def paced(rate: float, submit, stop: threading.Event) -> threading.Thread:
    def loop() -> None:
        due = time.monotonic()
        while not stop.is_set():
            submit()
            due += 1 / rate
            stop.wait(max(0.0, due - time.monotonic()))
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def file_store(a, root: str, in_process: bool):
    """What makes the file tier over a host tier's memory (its objects written by its put
    threads ``in_process``, else by its writer process)."""
    return lambda memory: FileStore(os.path.join(root, f"tier{int(in_process)}"), a.store_mib << 20,
                                    None if in_process else WriterProcess(memory.shared))


def beside_worker(a, image_slabs: int, make_store, shared: bool):
    """The busy thread's figures beside the real worker's writes to ``make_store(memory)``
    (``shared``: host chunks the writer process reaches); the states written."""
    pool = SlabPool(2 * (a.blocks + image_slabs + 1) * SLAB, SLAB, online=False)
    memory = HostMemory(pool, pin=False, shared=shared)
    memory.start()
    assert memory.wait(60)
    memory.poll()
    worker = StoreWorker(make_store(memory), memory, image_slabs, 7)
    slabs = pool.alloc(a.blocks + image_slabs + 1)
    for s in slabs:
        memory.view(s).numpy()[:] = ord(os.urandom(1))
    stop = threading.Event()
    thread = paced(a.rate, lambda: worker.submit(new_write(worker, a.blocks, image_slabs, slabs)), stop)
    figures = measure(a.seconds, a.own_core)
    stop.set()
    thread.join()
    counts = collections.Counter(worker.counters())
    worker.cancel()
    worker.close()
    memory.close()
    return figures, (f"{counts['store_states_written']} states written, "
                     f"{counts['store_writes_dropped']} dropped; CPU ms in process "
                     f"{counts['store_write_cpu_ms']:.0f}, writer process "
                     f"{counts.get('store_writer_process_cpu_ms', 0):.0f}")


def beside_mooncake(a, image_slabs: int):
    """``beside_worker`` writing to Mooncake Store, a master started here for it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "binding"))
    from test_store_mooncake import Master, _free_port, config   # (loads the libs it links)
    from hpc_radix.binding.store.mooncake import MooncakeStore

    written = int(1.2 * a.rate * a.seconds * (image_slabs + a.blocks + 1)) * SLAB
    with tempfile.TemporaryFile("w") as log:
        master = Master(_free_port(), _free_port(), log)
        try:
            return beside_worker(a, image_slabs, lambda memory: MooncakeStore(
                {**config(master), "global_segment_size": written}), shared=False)
        finally:
            master.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=15)
    ap.add_argument("--rate", type=float, default=10, help="writes (a state and its blocks) a second")
    ap.add_argument("--blocks", type=int, default=28)
    ap.add_argument("--state-mb", type=float, default=38.5)
    ap.add_argument("--store-mib", type=int, default=4096)
    ap.add_argument("--own-core", action="store_true",
                    help="the busy thread alone on core 0, the tier's threads and process on the "
                         "others (as on a many-core host, where they take no core from it)")
    ap.add_argument("--repeats", type=int, default=1, help="the arms, this many times in turn")
    ap.add_argument("--mooncake", action="store_true", help="also beside writes to Mooncake Store")
    a = ap.parse_args()
    sys.setswitchinterval(TIER_SWITCH_INTERVAL_S)
    if a.own_core:              # what this thread starts from now on stays off core 0
        os.sched_setaffinity(0, set(range(1, os.cpu_count())))
    image_slabs = -(-int(a.state_mb * 1e6) // SLAB)
    print(f"{a.rate:g} writes a second of a {image_slabs} MiB state and {a.blocks} blocks of 1 MiB "
          f"({a.rate * (image_slabs + a.blocks):.0f} MiB/s); {os.cpu_count()} cores; switch "
          f"interval {TIER_SWITCH_INTERVAL_S * 1e3:.1f} ms; {a.seconds:g} s each")
    arms = []
    for _ in range(a.repeats):
        arms.append(("alone", measure(a.seconds, a.own_core), ""))
        for label, in_process in (("puts in process", True), ("writer process", False)):
            with tempfile.TemporaryDirectory(dir="/var/tmp" if os.path.isdir("/var/tmp") else None) as root:
                arms.append((label, *beside_worker(a, image_slabs, file_store(a, root, in_process),
                                                   shared=not in_process)))
        if a.mooncake:
            arms.append(("Mooncake puts", *beside_mooncake(a, image_slabs)))
    alone = arms[0][1]
    for label, (rate, median, p99, cpu), note in arms:
        print(f"{label:16} {rate:5.0f} units/s ({rate / alone[0]:4.2f}x), median {median:4.2f} ms "
              f"({median / alone[1]:4.2f}x), p99 {p99:5.2f} ms ({p99 / alone[2]:4.2f}x), CPU "
              f"{cpu:4.2f} ms a unit, {1 - cpu * rate / 1e3:4.0%} of the time not running  {note}")


if __name__ == "__main__":
    main()
