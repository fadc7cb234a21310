"""The file tier's I/O beside a thread that keeps the GIL busy, as SGLang's scheduler loop does.

Each of the tier thread's system calls lets go of the GIL; a busy Python thread takes it at
once, and the tier's thread gets it back only when the interpreter's switch interval forces a
hand-over (5 ms by default). So every file call of the tier costs up to that interval while
the scheduler thread runs Python. This prints, alone, beside a busy thread at the default
interval, and beside it at the interval the shared tier sets (``TIER_SWITCH_INTERVAL_S``):
- the same puts and gets through the real FileStore (2 MiB objects: about a large16 KV block);
- the recount of a directory of many objects, walked in Python (a ``stat`` per object) and
  listed by ``find`` in a child process, as ``FileStore`` does;
- the other way round, what the busy thread (the scheduler) loses beside a tier thread putting
  objects at a steady rate (``--rate``: the 8 GiB server's write-through wrote about 420 a
  second on the H100), at either interval: every hand-over to the tier's thread is time the
  scheduler waits. On the 2-core machine, 2 MiB objects: 1.02x at 5 ms, 0.96x at 0.5 ms.

    python benchmarks/micro/tier_io_beside_busy_thread.py [--objects 20] [--mib 2] [--listed 20000]
        [--rate 420]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from typing import Optional

from hpc_radix.binding.store.file import FileStore
from hpc_radix.binding.store.policy import TIER_SWITCH_INTERVAL_S


def io_ms(store: FileStore, blob: bytes, objects: int) -> float:
    start = time.perf_counter()
    for i in range(objects):
        key = f"{i:064x}"
        assert store.put(key, [blob]) and store.get(key) is not None
    return (time.perf_counter() - start) * 1e3


def median_ms(measure, runs=5) -> float:
    times = sorted(measure() for _ in range(runs))
    return times[runs // 2]


@contextlib.contextmanager
def running(step):
    """``step()`` over and over on a thread of its own meanwhile."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            step()
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def busy_thread():
    """A thread running Python without a pause, as the scheduler's loop does."""
    return running(lambda: None)


def three_ways(measure) -> tuple[float, float, float]:
    """(alone, beside a busy thread at the default interval, beside it at the tier's)."""
    default = sys.getswitchinterval()
    alone = median_ms(measure)
    with busy_thread():
        beside = median_ms(measure)
        sys.setswitchinterval(TIER_SWITCH_INTERVAL_S)
        try:
            beside_short = median_ms(measure)
        finally:
            sys.setswitchinterval(default)
    return alone, beside, beside_short


def fill(store: FileStore, count: int) -> None:
    """``count`` small objects written straight into the directory (listing costs per file)."""
    for i in range(count):
        path = store.path_of(f"{i * 2654435761 % (1 << 64):064x}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"x" * 4096)


def busy_rate(store: Optional[FileStore], blob: bytes, rate: float, seconds: float = 3.0) -> float:
    """Iterations a second of a busy Python loop on this thread while another puts ``rate``
    objects a second into ``store`` (none with ``store`` None)."""
    stop = threading.Event()

    def put() -> None:
        start, i = time.perf_counter(), 0
        while not stop.wait(max(0.0, start + i / rate - time.perf_counter())):
            store.put(f"{i:064x}", [blob])
            i += 1
    thread = threading.Thread(target=put, daemon=True)
    if store is not None:
        thread.start()
    x, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        x += 1
    elapsed = time.perf_counter() - start
    stop.set()
    if store is not None:
        thread.join()
    return x / elapsed


def show(title: str, times: tuple[float, float, float]) -> None:
    alone, beside, short = times
    default = sys.getswitchinterval()
    print(title)
    print(f"  alone                                        {alone:8.1f} ms  1.00x")
    print(f"  beside a busy thread, switch interval {default * 1e3:4.1f} ms {beside:8.1f} ms  "
          f"{beside / alone:.2f}x")
    print(f"  beside a busy thread, switch interval {TIER_SWITCH_INTERVAL_S * 1e3:4.1f} ms "
          f"{short:8.1f} ms  {short / alone:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=20)
    ap.add_argument("--mib", type=int, default=2)
    ap.add_argument("--listed", type=int, default=20000, help="objects in the recounted directory")
    ap.add_argument("--rate", type=float, default=420.0, help="puts a second beside the busy loop")
    a = ap.parse_args()
    blob = os.urandom(a.mib << 20)
    with tempfile.TemporaryDirectory(prefix="tier-io-") as d:
        store = FileStore(d, 1 << 40)
        io_ms(store, blob, a.objects)                      # the files exist, the cache is warm
        show(f"{a.objects} puts and gets of {a.mib} MiB objects (median of 5 runs):",
             three_ways(lambda: io_ms(store, blob, a.objects)))
    with tempfile.TemporaryDirectory(prefix="tier-list-") as d:
        store = FileStore(d, 1 << 40)
        fill(store, a.listed)

        def timed(listing):
            start = time.perf_counter()
            assert len(listing()) == a.listed
            return (time.perf_counter() - start) * 1e3
        show(f"recount of {a.listed:,} objects walked in Python, a stat each (median of 5 runs):",
             three_ways(lambda: timed(lambda: list(store._walk()))))
        show(f"recount of {a.listed:,} objects listed by find in a child process:",
             three_ways(lambda: timed(store._find)))
    print(f"a busy loop beside {a.rate:.0f} puts a second of {a.mib} MiB (its rate against alone):")
    default = sys.getswitchinterval()
    for interval in (default, TIER_SWITCH_INTERVAL_S):
        sys.setswitchinterval(interval)
        with tempfile.TemporaryDirectory(prefix="tier-rate-") as d:
            alone, beside = busy_rate(None, blob, a.rate), busy_rate(FileStore(d, 1 << 40), blob, a.rate)
        print(f"  switch interval {interval * 1e3:4.1f} ms: {beside / alone:.2f}x")
    sys.setswitchinterval(default)


if __name__ == "__main__":
    main()
