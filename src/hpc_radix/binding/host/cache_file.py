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

from .memory import HostMemory
from .layout import TierLayout

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
        "weights": _weight_files(model),
        "load_format": load_format,
        "tokenizer": _file_digest(os.path.join(tokenizer, "tokenizer.json")),
        "page_size": page_size,
        "kv_planes": [[str(p.dtype), list(p.shape[1:])] for _, p in layout.kv_planes],
        "state": [[str(t.dtype), list(t[l, 0].shape)] for _, t, l in layout.image_parts],
        "slab_bytes": layout.slab_bytes,
        "host_bytes": host_bytes,
    }
    # (a dummy load's bytes follow from the config: SGLang 0.5.17 to 0.5.23 fill them from a
    # fixed seed of their own, not --random-seed, which each server draws unless given)
    if layout.draft_planes:            # the blocks hold a speculative draft model's KV too
        draft = os.path.abspath(getattr(server_args, "speculative_draft_model_path", None) or model)
        out["draft_model"] = [draft, _weight_files(draft)]
    return out


def weight_paths(model_dir: str) -> list[str]:
    """The model's weight files (safetensors or bin), sorted by name."""
    return sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))
                  + glob.glob(os.path.join(model_dir, "*.bin")), key=os.path.basename)


def _weight_files(model_dir: str) -> list:
    """Name, size and mtime of each weight file: a new checkpoint makes the saved KV stale."""
    return [[os.path.basename(f), os.path.getsize(f), os.stat(f).st_mtime_ns]
            for f in weight_paths(model_dir)]


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


def load(path: str, index, memory: HostMemory, fp: dict, ranks=None) -> int:
    """Rebuild what a previous server saved, host-only; returns how many snapshots. A missing,
    mismatched or damaged file loads nothing, with one warning saying why. Under TP
    (``ranks``, a RankAgreement) each rank reads its own file and the ranks load only the
    snapshots every rank can: should their files hold different snapshots, or one not load
    at all, every rank starts cold."""
    t0 = time.monotonic()
    try:
        records, usable = verified_records(path, memory, fp)
    except CacheFileError as err:
        records, usable, why = [], [], str(err)
    else:
        why = None
    if ranks is not None and not ranks.solo:
        if not ranks.same_everywhere(_records_digest(records) if why is None else 0):
            # one warning for the server, from its first rank
            (logger.warning if ranks.rank == 0 else logger.info)(
                "hybrid radix cache: prefix cache file %s not loaded (%s); every TP rank starts "
                "cold", path, why or "the TP ranks' cache files hold different snapshots")
            return 0
        if records:
            usable = [bool(ok) for ok in ranks.agree([int(ok) for ok in usable])]
    if why is not None:
        logger.warning("hybrid radix cache: prefix cache file not loaded (%s); starting cold", why)
        return 0
    loaded = 0
    for r, ok in zip(records, usable):
        if ok and _adopt(index, r):
            loaded += 1
    logger.info("hybrid radix cache: loaded %d of %d saved snapshots (%d dropped: slabs "
                "changed or inconsistent) from %s in %.2f s", loaded, len(records),
                len(records) - loaded, path, time.monotonic() - t0)
    return loaded


def verified_records(path: str, memory: HostMemory, fp: dict) -> tuple[list[SavedSnapshot], list[bool]]:
    """The records saved in ``path`` and, for each, whether every slab it uses still holds
    what was saved. Raises CacheFileError for a missing, damaged or mismatched file."""
    if not os.path.exists(path):
        raise CacheFileError(f"no file at {path}")
    saved_fp, records, sums = read_cache_file(path)
    diff = fingerprint_difference(saved_fp, fp)
    if diff is not None:
        raise CacheFileError(f"{path} was saved by another setup ({diff})")
    verified: dict[int, bool] = {}
    usable = []
    for r in records:
        slabs = [int(x) for x in r.node_slabs] + [int(x) for x in r.image_slabs] + \
            ([int(r.tail_slab)] if r.tail_slab >= 0 else [])
        usable.append(all(_verified(verified, memory, sums, slab) for slab in slabs))
    return records, usable


def _adopt(index, r: SavedSnapshot) -> bool:
    """Rebuild one saved snapshot; False when it does not fit what was rebuilt before it."""
    from hpc_radix.index import PromptKey

    media = [int(m) for m in r.media] if r.media is not None else None
    try:
        index.adopt_saved(
            PromptKey(r.tokens, r.namespace, media), r.frontier, SnapshotKind(r.kind), int(r.hits),
            [int(x) for x in r.node_slabs], [int(x) for x in r.image_slabs], int(r.tail_slab))
    except ValueError:
        return False
    return True


def _records_digest(records: list[SavedSnapshot]) -> int:
    """What the records hold, as an int64 (never 0): equal on ranks that saved alike."""
    h = xxhash.xxh64()
    for r in records:
        h.update(np.asarray(r.tokens).tobytes())
        h.update(repr((r.namespace, r.frontier, r.kind, len(r.node_slabs))).encode())
    return (h.intdigest() & (2**63 - 1)) or 1


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
