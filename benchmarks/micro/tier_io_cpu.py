#!/usr/bin/env python3
"""CPU: what each step of the shared tier's file writes and reads costs the thread doing it,
per GB, on this host's memory and disk.

The tier's writer and reader threads run beside the scheduler thread; what they spend in
copies, checksums and the kernel's page cache they take from it in memory bandwidth (on the
H100 at 453f17c the scheduler's cache calls ran 1.4x slower with a tier writing ~0.5 GB/s,
the writer's own CPU 1 ms per MB). This times each step on objects of one size (a large16
state image is 38.5 MB, a block 1 MiB), so a host's figures say which step to remove:

- ``copy into fresh memory``: a copy of the slabs into a new buffer (the writer before it
  wrote straight from the pinned slabs), ``copy into reused memory`` the same into one buffer;
- ``checksum``: xxh64 over the bytes (every write and read);
- ``write, page cache``: ``os.write`` into new files (first written pages), then over them again;
- ``write, O_DIRECT``: the same bypassing the page cache (where the file system allows it);
- ``read, fresh bytes``: ``f.read()`` (what ``FileStore.get`` did), ``read into reused
  memory``: ``readinto`` one buffer (from the page cache), ``read what O_DIRECT wrote``: the
  same from the disk.

    python benchmarks/micro/tier_io_cpu.py [--mb 38.5] [--objects 16] [--dir DIR]
"""
from __future__ import annotations

import argparse
import mmap
import os
import shutil
import tempfile
import time

import numpy as np
import xxhash


def timed(label: str, nbytes: int, step) -> None:
    cpu, wall = time.thread_time(), time.perf_counter()
    count = step()
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    gb = count * nbytes / 1e9
    print(f"{label:<30} {1e3 * cpu / gb:8.0f} ms CPU/GB {1e3 * wall / gb:8.0f} ms wall/GB")


def write_all(directory: str, name: str, buf, count: int, flags: int = 0) -> int:
    for i in range(count):
        fd = os.open(os.path.join(directory, f"{name}{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
        try:
            view = memoryview(buf)
            while view.nbytes:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=38.5, help="object size (a large16 state: 38.5)")
    ap.add_argument("--objects", type=int, default=16)
    ap.add_argument("--dir", default=None, help="where to write (default: the temp directory)")
    a = ap.parse_args()
    nbytes = int(a.mb * (1 << 20)) // 4096 * 4096          # O_DIRECT: whole pages
    src = mmap.mmap(-1, nbytes)                              # page-aligned, like pinned slabs
    src.write(os.urandom(1 << 20) * (nbytes >> 20) + bytes(nbytes % (1 << 20)))
    view = np.frombuffer(src, dtype=np.uint8)
    directory = tempfile.mkdtemp(prefix="tier-io-", dir=a.dir)
    n = a.objects
    print(f"{n} objects of {nbytes / 1e6:.1f} MB in {directory}")
    try:
        timed("copy into fresh memory", nbytes, lambda: [np.array(view) for _ in range(n)] and n)
        out = np.empty_like(view)
        timed("copy into reused memory", nbytes, lambda: [np.copyto(out, view) for _ in range(n)] and n)
        timed("checksum", nbytes, lambda: [xxhash.xxh64(view).intdigest() for _ in range(n)] and n)
        timed("write, page cache (new)", nbytes, lambda: write_all(directory, "p", src, n))
        timed("write, page cache (again)", nbytes, lambda: write_all(directory, "p", src, n))
        try:
            timed("write, O_DIRECT", nbytes, lambda: write_all(directory, "d", src, n, os.O_DIRECT))
        except OSError as err:
            print(f"write, O_DIRECT: not on this file system ({err})")

        def read_fresh():
            for i in range(n):
                with open(os.path.join(directory, f"p{i}"), "rb") as f:
                    f.read()
            return n

        def read_reused():
            for i in range(n):
                with open(os.path.join(directory, f"p{i}"), "rb", buffering=0) as f:
                    f.readinto(out)
            return n
        timed("read, fresh bytes", nbytes, read_fresh)
        timed("read into reused memory", nbytes, read_reused)

        def read_direct_written():              # not in the page cache: from the disk
            for i in range(n):
                with open(os.path.join(directory, f"d{i}"), "rb", buffering=0) as f:
                    f.readinto(out)
            return n
        if os.path.exists(os.path.join(directory, "d0")):
            timed("read what O_DIRECT wrote", nbytes, read_direct_written)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
