"""The file tier's I/O beside a thread that keeps the GIL busy, as SGLang's scheduler loop does.

Each of the tier thread's system calls lets go of the GIL; a busy Python thread takes it at
once, and the tier's thread gets it back only when the interpreter's switch interval forces a
hand-over (5 ms by default). So every file call of the tier costs up to that interval while
the scheduler thread runs Python, and the writer falls behind the host tier's turnover. This
prints the time of the same puts and gets (the real FileStore, 2 MiB objects: about a large16
KV block) alone, beside a busy thread at the default interval, and beside it at the interval
the shared tier sets (``store.policy.TIER_SWITCH_INTERVAL_S``), as ratios to alone.

    python benchmarks/micro/tier_io_beside_busy_thread.py [--objects 20] [--mib 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

from hpc_radix.binding.store.file import FileStore
from hpc_radix.binding.store.policy import TIER_SWITCH_INTERVAL_S


def io_ms(store: FileStore, blob: bytes, objects: int) -> float:
    start = time.perf_counter()
    for i in range(objects):
        key = f"{i:064x}"
        assert store.put(key, [blob]) and store.get(key) is not None
    return (time.perf_counter() - start) * 1e3


def median_ms(store, blob, objects, runs=5) -> float:
    times = sorted(io_ms(store, blob, objects) for _ in range(runs))
    return times[runs // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=20)
    ap.add_argument("--mib", type=int, default=2)
    a = ap.parse_args()
    blob = os.urandom(a.mib << 20)
    default = sys.getswitchinterval()
    with tempfile.TemporaryDirectory(prefix="tier-io-") as d:
        store = FileStore(d, 1 << 40)
        io_ms(store, blob, a.objects)                      # the files exist, the cache is warm
        alone = median_ms(store, blob, a.objects)
        stop = threading.Event()

        def busy() -> None:
            x = 0
            while not stop.is_set():
                x += 1
        thread = threading.Thread(target=busy, daemon=True)
        thread.start()
        try:
            beside = median_ms(store, blob, a.objects)
            sys.setswitchinterval(TIER_SWITCH_INTERVAL_S)
            beside_short = median_ms(store, blob, a.objects)
        finally:
            sys.setswitchinterval(default)
            stop.set()
            thread.join()
    print(f"{a.objects} puts and gets of {a.mib} MiB objects (median of 5 runs):")
    print(f"  alone                                        {alone:8.1f} ms  1.00x")
    print(f"  beside a busy thread, switch interval {default * 1e3:4.1f} ms {beside:8.1f} ms  "
          f"{beside / alone:.2f}x")
    print(f"  beside a busy thread, switch interval {TIER_SWITCH_INTERVAL_S * 1e3:4.1f} ms "
          f"{beside_short:8.1f} ms  {beside_short / alone:.2f}x")


if __name__ == "__main__":
    main()
