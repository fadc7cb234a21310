"""The prefix cache file's format: round trips, crash safety and damaged files."""
from __future__ import annotations

import os
import random
import signal
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hpc_radix.persistence import (
    CacheFileError, SavedSnapshot, fingerprint_difference, read_cache_file, write_cache_file,
)

FP = {"format": 1, "model": "/models/qwen", "page": 64, "shapes": [[2, 64, 2, 8]]}


def snapshots(seed=0, n=5):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        frontier = int(rng.integers(1, 700))
        blocks = frontier // 64
        media = None if i % 2 else rng.integers(0, 5, blocks + 1).astype(np.int64)
        out.append(SavedSnapshot(
            namespace=None if i % 3 else f"ns{i}", tokens=rng.integers(0, 50000, frontier).astype(np.int32),
            media=media, kind=("tap", "endpoint", "boundary")[i % 3], hits=i,
            node_slabs=np.arange(10 * i, 10 * i + blocks, dtype=np.int64),
            image_slabs=np.array([200 + 2 * i, 201 + 2 * i], dtype=np.int64),
            tail_slab=300 + i if frontier % 64 else -1))
    return out


def same(a: SavedSnapshot, b: SavedSnapshot):
    return (a.namespace == b.namespace and np.array_equal(a.tokens, b.tokens)
            and (a.media is None) == (b.media is None)
            and (a.media is None or np.array_equal(a.media, b.media)) and a.kind == b.kind
            and a.hits == b.hits and np.array_equal(a.node_slabs, b.node_slabs)
            and np.array_equal(a.image_slabs, b.image_slabs) and a.tail_slab == b.tail_slab)


def test_round_trip(tmp_path):
    path = str(tmp_path / "cache.bin")
    snaps = snapshots()
    sums = {7: 123, 200: 2 ** 63 + 5}
    size = write_cache_file(path, FP, snaps, sums)
    assert size == os.path.getsize(path) and not os.path.exists(path + ".tmp")
    fp, got, got_sums = read_cache_file(path)
    assert fp == FP and got_sums == sums
    assert len(got) == len(snaps) and all(same(a, b) for a, b in zip(snaps, got))


def test_fingerprint_difference_names_the_field():
    assert fingerprint_difference(FP, dict(FP)) is None
    assert fingerprint_difference(FP, {**FP, "page": 16}) == \
        "page: the file has 64, this server 16"


def damaged_files(data: bytes, rng: random.Random):
    """Truncations at every section boundary and elsewhere, flipped bytes, bad lengths,
    random files."""
    bounds, at = [], 16
    while at + 24 <= len(data):
        length = struct.unpack_from("<Q", data, at + 8)[0]
        bounds += [at, at + 24, at + 24 + length]
        at += 24 + length
    for cut in sorted(set(bounds)) + [0, 8, 15, 16, len(data) - 1]:
        yield data[:cut]
    for _ in range(700):
        b = bytearray(data)
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
        yield bytes(b)
    for _ in range(150):                       # a section length set to something else
        b = bytearray(data)
        at = rng.choice(bounds[::3])
        struct.pack_into("<Q", b, at + 8, rng.choice([0, 1, 2 ** 63, rng.randrange(len(data) * 2)]))
        yield bytes(b)
    for _ in range(150):
        yield bytes(rng.randrange(256) for _ in range(rng.randrange(0, 400)))
    yield data + b"\0"


def test_damaged_files_never_load(tmp_path):
    good = str(tmp_path / "good.bin")
    write_cache_file(good, FP, snapshots(1, 8), {1: 2, 3: 4})
    data = open(good, "rb").read()
    rng = random.Random(0)
    path = str(tmp_path / "bad.bin")
    count = 0
    for damaged in damaged_files(data, rng):
        if damaged == data:
            continue
        with open(path, "wb") as f:
            f.write(damaged)
        with pytest.raises(CacheFileError):
            read_cache_file(path)
        count += 1
    assert count >= 1000


def test_a_missing_file_is_a_cache_file_error(tmp_path):
    with pytest.raises(CacheFileError, match="cannot read"):
        read_cache_file(str(tmp_path / "nothing.bin"))


def test_a_save_killed_mid_write_keeps_the_previous_file(tmp_path):
    path = str(tmp_path / "cache.bin")
    write_cache_file(path, FP, snapshots(2), {5: 6})
    before = open(path, "rb").read()
    # a second save that writes slowly and is killed with SIGKILL half way
    code = textwrap.dedent(f"""
        import os, sys, time
        import numpy as np
        import hpc_radix.persistence as p
        real_fsync = os.fsync
        def slow(fd):
            print("writing", flush=True)
            time.sleep(60)
        os.fsync = slow
        snaps = [p.SavedSnapshot(None, np.arange(100000, dtype=np.int32), None, "tap", 0,
                                 np.arange(100000 // 64, dtype=np.int64), np.array([1, 2]), 3)]
        p.write_cache_file({path!r}, {{"other": 1}}, snaps, {{}})
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert open(path, "rb").read() == before
    fp, got, _ = read_cache_file(path)
    assert fp == FP and len(got) == 5
