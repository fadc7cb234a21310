#!/usr/bin/env python3
"""The prefix cache file at a full host tier: save and load time, file sizes, what survives.

Fills a host tier of ``--mib`` with conversations (``--blocks`` KV blocks each and an endpoint
with a tail) through PrefixIndex and HostMemory (pinned where CUDA is) mirrored in PATH.slabs,
as the cache does with ``--prefix-cache-file PATH``; writes their bytes to the file as the
background writer does while serving; saves the index as a graceful shutdown does; then, as a
restart does, reads the file into a fresh host tier and loads the index. Prints the write and
save times, the restart's read and load times, both files' sizes and the share of host slabs and
snapshots that came back. Slab and image sizes default to the large dummy-weight Qwen3.5 of
tests/gpu/tiny_qwen.py (``--large --layers 16``).

    python benchmarks/micro/cache_file_bench.py --dir /var/tmp [--mib 8192] [--blocks 32]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from hpc_radix.binding.host import cache_file
from hpc_radix.binding.host.memory import HostMemory
from hpc_radix.index import FreeDevice, PrefixIndex, PromptKey, SlabPool, SnapshotKind, check_invariants
from hpc_radix.persistence import FORMAT_VERSION

# the large dummy model: 4 full-attention layers x K,V x 64 tokens x 4 heads x 256 x bf16;
# 12 GDN layers x (conv 10240 x 3 bf16 + state 48 x 128 x 128 fp32)
LARGE_SLAB_KIB = 4 * 2 * 64 * 4 * 256 * 2 >> 10
LARGE_IMAGE_BYTES = 12 * (10240 * 3 * 2 + 48 * 128 * 128 * 4)


def host_tier(path: str, mib: int, slab_bytes: int) -> tuple[HostMemory, float]:
    memory = HostMemory(SlabPool(mib << 20, slab_bytes, online=False),
                        backing_file=cache_file.data_file(path))
    t0 = time.monotonic()
    memory.start()
    memory.wait()
    memory.poll()
    if not memory.complete:
        raise RuntimeError("the host tier did not come online in full")
    return memory, time.monotonic() - t0


def fill(idx: PrefixIndex, memory: HostMemory, blocks: int, rng) -> int:
    """Conversations until the next one would need an eviction; returns how many."""
    need = blocks + idx.host.image_slabs + 1
    tokens_each = blocks * 64 + 10                       # an endpoint with a 10-token tail
    page = n = 0
    while idx.host.slabs.num_free >= need:
        seq, _ = idx.begin(PromptKey(rng.integers(0, 150_000, tokens_each, dtype=np.int32)))
        idx.commit(seq, tokens_each, list(range(page, page + blocks)))
        page += blocks + 1
        got = idx.acquire_slot(seq, tokens_each, SnapshotKind.ENDPOINT)
        slot = got.slot if got and got.slot is not None else n
        s, _ = idx.publish(seq, tokens_each, SnapshotKind.ENDPOINT, device_slot=slot, tail_page=page - 1)
        path = list(seq.path)
        idx.release(seq)
        slabs = []
        for write in (*idx.writes.write_through(path), *idx.writes.write_image(s)):
            if isinstance(write, FreeDevice):
                continue
            for slab in write.slabs:
                memory.view(slab).fill_(slab % 251)
            idx.landed(write)
            slabs += write.slabs
        memory.written(slabs)                                      # as a landed write-through
        n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="where the cache file and its data file go")
    ap.add_argument("--mib", type=int, default=8192, help="host tier size")
    ap.add_argument("--blocks", type=int, default=32, help="KV blocks per conversation")
    ap.add_argument("--slab-kib", type=int, default=LARGE_SLAB_KIB)
    ap.add_argument("--image-bytes", type=int, default=LARGE_IMAGE_BYTES)
    a = ap.parse_args(argv)
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, "bench.hpc")
    for f in (path, cache_file.data_file(path)):
        if os.path.exists(f):
            os.remove(f)
    slab_bytes = a.slab_kib << 10
    fp = {"format": FORMAT_VERSION, "bench": [a.mib, a.blocks, slab_bytes, a.image_bytes]}

    memory, t_map = host_tier(path, a.mib, slab_bytes)
    idx = PrefixIndex(image_bytes=a.image_bytes, device_snapshot_slots=64, host=memory.slabs,
                      block_bytes=slab_bytes)
    t0 = time.monotonic()
    conversations = fill(idx, memory, a.blocks, np.random.default_rng(0))
    t_fill = time.monotonic() - t0
    used = memory.slabs.num_used
    t0 = time.monotonic()
    memory.file.flush()            # what the background writer does while serving
    t_write = time.monotonic() - t0
    t0 = time.monotonic()
    cache_file.save(path, idx, memory, fp)
    t_save = time.monotonic() - t0
    memory.close()

    memory2, t_remap = host_tier(path, a.mib, slab_bytes)
    idx2 = PrefixIndex(image_bytes=a.image_bytes, device_snapshot_slots=64, host=memory2.slabs,
                       block_bytes=slab_bytes)
    t0 = time.monotonic()
    loaded = cache_file.load(path, idx2, memory2, fp)
    t_load = time.monotonic() - t0
    used2 = memory2.slabs.num_used
    check_invariants(idx2)
    memory2.close()

    mib = 1 << 20
    print(f"host tier {a.mib} MiB ({memory.slabs.num_slabs} slabs of {a.slab_kib} KiB, an image "
          f"{idx.host.image_slabs} slabs), {'pinned' if memory.pin else 'not pinned (no CUDA)'}")
    print(f"filled: {conversations} conversations of {a.blocks} blocks + endpoint, {used} slabs "
          f"({used * slab_bytes / mib:.0f} MiB) in {t_fill:.1f} s (tier allocated in {t_map:.1f} s)")
    print(f"background write of the filled slabs to the data file (while serving): {t_write:.1f} s "
          f"({used * slab_bytes / max(t_write, 1e-9) / 1e9:.2f} GB/s, fsync included)")
    print(f"save (graceful shutdown): {t_save:.2f} s; index file {os.path.getsize(path) / 1024:.0f} KiB, "
          f"data file {os.path.getsize(cache_file.data_file(path)) / mib:.0f} MiB")
    print(f"restart: read the data file into the tier {t_remap:.1f} s, load the index {t_load:.2f} s")
    print(f"survived: {loaded} of {idx.sizes.snapshots} snapshots, {used2} of {used} slabs "
          f"({100 * used2 / max(used, 1):.1f} %)")
    return 0 if loaded == idx.sizes.snapshots and used2 == used else 1


if __name__ == "__main__":
    sys.exit(main())
