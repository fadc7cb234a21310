"""Keeping the host tier across restarts (design §5.5, ``--prefix-cache-file PATH``).

The host tier's slabs are mirrored in ``PATH.slabs`` (host.SlabFile: read at startup, every
slab written through copied back by a background thread while serving). Saving, at SGLang's
graceful shutdown (``release_host_resources``, inside the 15 s before SIGKILL), lands the
transfers in flight, waits for the slabs still queued for the file and writes the index (hpc_radix.persistence): the retained
snapshots on host, their paths and a checksum of every slab they use. Loading happens at
startup, before the server reports healthy: the data file is read into the pinned tier, and each
saved snapshot whose slabs still match their checksums is rebuilt host-only; its first request
restores it like any host hit. A SIGKILL keeps the previous index: slabs written over since fail
their checksums and are dropped, never loaded wrong.
"""
from __future__ import annotations

import glob
import logging
import os
import time
from typing import Optional

import numpy as np
import xxhash

from hpc_radix.index import SnapshotKind
from hpc_radix.index.keys import TOKEN_BYTES
from hpc_radix.persistence import (
    FORMAT_VERSION, CacheFileError, SavedSnapshot, fingerprint_difference, read_cache_file,
    write_cache_file,
)

from .host import HostMemory
from .transfers import TierLayout

logger = logging.getLogger(__name__)


def data_file(path: str) -> str:
    return path + ".slabs"


def fingerprint(server_args, layout: TierLayout, page_size: int, host_bytes: int) -> dict:
    """Everything that makes the saved states and KV meaningful to this server."""
    model = os.path.abspath(getattr(server_args, "model_path", "") or "")
    tokenizer = os.path.abspath(getattr(server_args, "tokenizer_path", None) or model)
    load_format = str(getattr(server_args, "load_format", "auto"))
    out = {
        "format": FORMAT_VERSION,
        "model": model,
        "config": _file_digest(os.path.join(model, "config.json")),
        "weights": sorted([os.path.basename(f), os.path.getsize(f), os.stat(f).st_mtime_ns]
                          for f in glob.glob(os.path.join(model, "*.safetensors"))
                          + glob.glob(os.path.join(model, "*.bin"))),
        "load_format": load_format,
        "tokenizer": _file_digest(os.path.join(tokenizer, "tokenizer.json")),
        "page_size": page_size,
        "kv_planes": [[str(p.dtype), list(p.shape[1:])] for _, p in layout.kv_planes],
        "state": [[str(t.dtype), list(t[l, 0].shape)] for _, t, l in layout.image_parts],
        "slab_bytes": layout.slab_bytes,
        "host_bytes": host_bytes,
    }
    if load_format == "dummy":
        out["random_seed"] = getattr(server_args, "random_seed", None)
    return out


def save(path: str, index, memory: HostMemory, fp: dict) -> None:
    """Write the index of what the host tier holds (transfers must have landed), once the
    data file has every slab written through."""
    t0 = time.monotonic()
    if memory.file is not None:
        before = memory.file.bytes_written
        memory.file.flush()
        logger.info("hybrid radix cache: %s has every slab written through (%.1f MiB were "
                    "still queued at the stop; %.2f s)", memory.file.path,
                    (memory.file.bytes_written - before) / 2**20, time.monotonic() - t0)
    records, sums = [], {}
    for s, nodes in index.saved_snapshots():
        node_slabs = [n.host_slab for n in nodes]
        for slab in node_slabs + s.host_slab_ids:
            if slab not in sums:
                sums[slab] = _slab_digest(memory, slab)
        tokens = np.frombuffer(s.anchor.buf[:s.anchor.end * TOKEN_BYTES] + s.tail, dtype="<i4")
        media = [n.media for n in nodes] + [s.tail_media]
        records.append(SavedSnapshot(
            s.anchor.namespace, tokens, np.asarray(media, dtype=np.int64) if any(media) else None,
            s.kind.value, s.hits, np.array(node_slabs, dtype=np.int64),
            np.array(s.host_slabs, dtype=np.int64), s.tail_slab))
    size = write_cache_file(path, fp, records, sums)
    logger.info("hybrid radix cache: saved %d snapshots over %d slabs (%.1f MiB of host tier) to "
                "%s (%d KiB index) in %.2f s", len(records), len(sums),
                len(sums) * memory.slabs.slab_bytes / 2**20, path, size >> 10, time.monotonic() - t0)


def load(path: str, index, memory: HostMemory, fp: dict) -> int:
    """Rebuild what a previous server saved, host-only; returns how many snapshots. A missing,
    mismatched or damaged file loads nothing, with one warning saying why."""
    from hpc_radix.index import PromptKey

    t0 = time.monotonic()
    try:
        saved_fp, records, sums = read_cache_file(path)
    except CacheFileError as err:
        logger.warning("hybrid radix cache: prefix cache file not loaded (%s); starting cold", err)
        return 0
    diff = fingerprint_difference(saved_fp, fp)
    if diff is not None:
        logger.warning("hybrid radix cache: prefix cache file %s was saved by another setup "
                       "(%s); starting cold", path, diff)
        return 0
    verified: dict[int, bool] = {}
    loaded = dropped = 0
    for r in records:
        slabs = [int(x) for x in r.node_slabs] + [int(x) for x in r.image_slabs] + \
            ([int(r.tail_slab)] if r.tail_slab >= 0 else [])
        ok = all(_verified(verified, memory, sums, slab) for slab in slabs)
        try:
            if not ok:
                raise ValueError("its slabs changed since the save")
            media = [int(m) for m in r.media] if r.media is not None else None
            key = PromptKey(r.tokens, r.namespace, media)
            index.adopt_saved(key, r.frontier, SnapshotKind(r.kind), int(r.hits),
                              [int(x) for x in r.node_slabs], [int(x) for x in r.image_slabs],
                              int(r.tail_slab))
            loaded += 1
        except ValueError:
            dropped += 1
    logger.info("hybrid radix cache: loaded %d of %d saved snapshots (%d dropped: slabs "
                "changed or inconsistent) from %s in %.2f s", loaded, len(records), dropped, path,
                time.monotonic() - t0)
    return loaded


def _verified(done: dict, memory: HostMemory, sums: dict, slab: int) -> bool:
    if slab not in done:
        done[slab] = (0 <= slab < memory.slabs.num_online and slab in sums
                      and _slab_digest(memory, slab) == sums[slab])
    return done[slab]


def _slab_digest(memory: HostMemory, slab: int) -> int:
    return xxhash.xxh64_intdigest(memory.view(slab).numpy().data)


def _file_digest(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return xxhash.xxh64_hexdigest(f.read())
    except OSError:
        return None
