"""The prefix cache file (design §5.5): what of the host tier survives a restart.

The host tier's slabs are mirrored in a data file (``PATH.slabs``), written in the background
while serving. Saving writes this index: which retained snapshots the slabs hold, with the
token path, kind and hits of each and a checksum of every slab they use. A save goes to ``PATH.tmp``, is fsynced and renamed, so a
save killed half way leaves the previous file in place; slabs reused since that file was written
fail its checksums and are dropped, never loaded wrong.

Layout, little-endian: the header (magic, format version, section count), then sections, each
``kind u32, reserved u32, length u64, xxh64 u64`` and its payload:
  1 fingerprint  JSON: everything that makes states and KV meaningful (model, shapes, page
                 size, tokenizer, this format); a mismatch starts cold
  2 namespaces   JSON list of the namespaces (SGLang's extra_key) snapshots use
  3 snapshots    records (see ``_RECORD``), each followed by its arrays
  4 slab sums    (slab, xxh64) pairs, uint64
Every length is checked against what remains before anything is read from it.

Pure Python + numpy + xxhash: imports neither torch nor sglang.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import xxhash

from hpc_radix.errors import CacheFileError, StoreObjectError
from hpc_radix.index.keys import BLOCK_TOKENS

MAGIC = b"HPCRADIX"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sII")                  # magic, version, sections
_SECTION = struct.Struct("<IIQQ")                 # kind, reserved, length, xxh64
# namespace id, kind, hits, frontier, media blocks, image slabs, tail slab
_RECORD = struct.Struct("<iBxxxIIIIq")
FINGERPRINT, NAMESPACES, SNAPSHOTS, SLAB_SUMS = 1, 2, 3, 4
MAX_FRONTIER = 1 << 24                            # tokens: no prompt comes near
KINDS = ("tap", "endpoint", "boundary")


@dataclass
class SavedSnapshot:
    """One retained snapshot and the path it resumes through, as the file keeps it."""
    namespace: Optional[str]
    tokens: np.ndarray                            # int32 [frontier]
    media: Optional[np.ndarray]                   # int64 [blocks + 1] or None (text only)
    kind: str
    hits: int
    node_slabs: np.ndarray                        # int64 [frontier // BLOCK_TOKENS]
    image_slabs: np.ndarray                       # int64 [image slabs]
    tail_slab: int                                # -1 without a tail

    @property
    def frontier(self) -> int:
        return len(self.tokens)


def write_cache_file(path: str, fingerprint: dict, snapshots: Sequence[SavedSnapshot],
                     slab_sums: dict[int, int]) -> int:
    """Write the index to ``path`` crash-safely (temp file, fsync, rename). Returns its size."""
    namespaces = sorted({s.namespace for s in snapshots if s.namespace is not None})
    ns_id = {ns: i for i, ns in enumerate(namespaces)}
    records = []
    for s in snapshots:
        media = s.media if s.media is not None else np.zeros(0, dtype=np.int64)
        records.append(_RECORD.pack(ns_id.get(s.namespace, -1), KINDS.index(s.kind), s.hits,
                                    s.frontier, len(media), len(s.image_slabs), s.tail_slab))
        for array, dtype in ((s.tokens, "<i4"), (media, "<i8"), (s.node_slabs, "<i8"),
                             (s.image_slabs, "<i8")):
            records.append(np.ascontiguousarray(array, dtype=dtype).tobytes())
    sums = np.array(sorted(slab_sums.items()), dtype="<u8").reshape(-1, 2)
    sections = [(FINGERPRINT, json.dumps(fingerprint, sort_keys=True).encode()),
                (NAMESPACES, json.dumps(namespaces).encode()),
                (SNAPSHOTS, struct.pack("<Q", len(snapshots)) + b"".join(records)),
                (SLAB_SUMS, sums.tobytes())]
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(_HEADER.pack(MAGIC, FORMAT_VERSION, len(sections)))
        for kind, payload in sections:
            f.write(_SECTION.pack(kind, 0, len(payload), xxhash.xxh64_intdigest(payload)))
            f.write(payload)
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    return size


def read_cache_file(path: str) -> tuple[dict, list[SavedSnapshot], dict[int, int]]:
    """(fingerprint, snapshots, slab sums) of a file, or CacheFileError naming the damage."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise CacheFileError(f"cannot read {path}: {err.strerror}") from None
    if len(data) < _HEADER.size:
        raise CacheFileError(f"{len(data)} bytes: shorter than the header")
    magic, version, count = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CacheFileError("not a prefix cache file (magic)")
    if version != FORMAT_VERSION:
        raise CacheFileError(f"format version {version}, this build reads {FORMAT_VERSION}")
    sections, at = {}, _HEADER.size
    for _ in range(count):
        if at + _SECTION.size > len(data):
            raise CacheFileError(f"truncated at the header of section {len(sections) + 1}")
        kind, reserved, length, digest = _SECTION.unpack_from(data, at)
        at += _SECTION.size
        if reserved:
            raise CacheFileError(f"section {kind}: reserved field set")
        if length > len(data) - at:
            raise CacheFileError(f"section {kind}: {length} bytes, {len(data) - at} remain")
        payload = data[at:at + length]
        at += length
        if xxhash.xxh64_intdigest(payload) != digest:
            raise CacheFileError(f"section {kind}: checksum mismatch")
        if kind in sections:
            raise CacheFileError(f"section {kind} twice")
        sections[kind] = payload
    if at != len(data):
        raise CacheFileError(f"{len(data) - at} bytes after the last section")
    missing = {FINGERPRINT, NAMESPACES, SNAPSHOTS, SLAB_SUMS} - set(sections)
    if missing:
        raise CacheFileError(f"sections {sorted(missing)} missing")
    fingerprint = _json(sections[FINGERPRINT], dict, "fingerprint")
    namespaces = _json(sections[NAMESPACES], list, "namespaces")
    if not all(isinstance(ns, str) for ns in namespaces):
        raise CacheFileError("namespaces: not all strings")
    sums = sections[SLAB_SUMS]
    if len(sums) % 16:
        raise CacheFileError("slab sums: not whole (slab, sum) pairs")
    pairs = np.frombuffer(sums, dtype="<u8").reshape(-1, 2)
    return fingerprint, _snapshots(sections[SNAPSHOTS], namespaces), {int(a): int(b) for a, b in pairs}


def _snapshots(payload: bytes, namespaces: list) -> list[SavedSnapshot]:
    if len(payload) < 8:
        raise CacheFileError("snapshots: no count")
    (count,), at, out = struct.unpack_from("<Q", payload), 8, []
    for i in range(count):
        if at + _RECORD.size > len(payload):
            raise CacheFileError(f"snapshot {i}: truncated record")
        ns, kind, hits, frontier, n_media, n_image, tail = _RECORD.unpack_from(payload, at)
        at += _RECORD.size
        if not (-1 <= ns < len(namespaces) and kind < len(KINDS) and 0 < frontier <= MAX_FRONTIER
                and n_media <= frontier // BLOCK_TOKENS + 1 and n_image <= MAX_FRONTIER and tail >= -1):
            raise CacheFileError(f"snapshot {i}: fields out of range")
        arrays = []
        for n, dtype in ((frontier, "<i4"), (n_media, "<i8"), (frontier // BLOCK_TOKENS, "<i8"), (n_image, "<i8")):
            size = n * np.dtype(dtype).itemsize
            if at + size > len(payload):
                raise CacheFileError(f"snapshot {i}: arrays run past the section")
            arrays.append(np.frombuffer(payload, dtype=dtype, count=n, offset=at))
            at += size
        tokens, media, node_slabs, image_slabs = arrays
        out.append(SavedSnapshot(namespaces[ns] if ns >= 0 else None, tokens,
                                 media if n_media else None, KINDS[kind], hits, node_slabs,
                                 image_slabs, tail))
    if at != len(payload):
        raise CacheFileError(f"snapshots: {len(payload) - at} bytes after the last record")
    return out


def _json(payload: bytes, kind: type, what: str):
    try:
        value = json.loads(payload.decode())
    except (UnicodeDecodeError, ValueError):
        raise CacheFileError(f"{what}: not JSON") from None
    if not isinstance(value, kind):
        raise CacheFileError(f"{what}: not a {kind.__name__}")
    return value


def fingerprint_difference(saved: dict, running: dict) -> Optional[str]:
    """None when equal, else the first difference in words (for the one warning)."""
    for key in sorted(set(saved) | set(running)):
        if saved.get(key) != running.get(key):
            return f"{key}: the file has {saved.get(key)!r}, this server {running.get(key)!r}"
    return None


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- objects of the shared tier ---------------------------------------------------------------
# One object per stored item (a run of KV blocks, a state image with its tail): a header
# naming what it is (its key, its kind, the fingerprint of the setup whose bytes it holds) and
# a checksum of the payload, which follows. A reader that finds anything else calls it a miss.
OBJECT_MAGIC = b"HPCRXOBJ"
OBJECT_VERSION = 2      # 2: the payload's checksum is xxh3_64 (1: xxh64, refused as a miss)
# magic, version, kind, key length, fingerprint digest, payload length, payload xxh3_64
_OBJECT = struct.Struct("<8sHHIQQQ")


def fingerprint_digest(fingerprint: dict) -> int:
    """The setup a stored object's bytes belong to (model, layout, format), as an int."""
    return xxhash.xxh64_intdigest(json.dumps(fingerprint, sort_keys=True).encode())


def pack_object(key: str, kind: int, fingerprint: int, payload: Sequence) -> list:
    """The buffers of one object, header first (``payload``: its parts, written in order)."""
    name = key.encode()
    views = [memoryview(part).cast("B") for part in payload]
    head = _OBJECT.pack(OBJECT_MAGIC, OBJECT_VERSION, kind, len(name), fingerprint,
                        sum(v.nbytes for v in views), _digest(views))
    return [head + name, *payload]


def _digest(parts: Sequence) -> int:
    """xxh3_64 of buffers in order through the hasher's update, which lets go of the GIL on a
    large one in every xxhash release (an object is MBs: the scheduler thread waits for no
    checksum). xxh3 hashes 3.4x as fast as xxh64 (22.7 against 6.6 GB/s on the CI machine):
    a read-back checks its state's tens of MB on the way to the request's first token."""
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    return digest.intdigest()


class _HeldDigest:
    """xxh3_64 of buffers in order through the C functions of xxhash's own extension, called
    keeping the GIL (``ctypes.PyDLL``): for a read-back, which a request waits for. Each of
    ``_digest``'s updates lets go of the GIL and waits to take it back while the scheduler
    thread runs Python, up to the interpreter's switch interval. Beside a busy thread on the
    2-core machine a 37 MiB state's checksum over its 1 MiB slabs took 3 or 24 ms by run that
    way, 6 or 7 this way, and its fill 16 or 38 ms against 16 or 18 (2 alone, fill 7: both
    ways; benchmarks/micro/tier_fill_beside_busy_thread.py --checks --blocks 0). The scheduler
    thread gives up about the hash's own time (the two take turns at the switch interval).
    Writes, which nobody waits for, keep ``_digest``. None where the extension does not export
    the functions."""

    def __init__(self):
        import ctypes
        from xxhash import _xxhash
        lib = ctypes.PyDLL(_xxhash.__file__)
        lib.XXH3_createState.restype = ctypes.c_void_p
        lib.XXH3_freeState.argtypes = [ctypes.c_void_p]
        lib.XXH3_64bits_reset.argtypes = [ctypes.c_void_p]
        lib.XXH3_64bits_update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.XXH3_64bits_digest.argtypes = [ctypes.c_void_p]
        lib.XXH3_64bits_digest.restype = ctypes.c_uint64
        self._lib = lib

    def __call__(self, parts: Sequence) -> int:
        lib = self._lib
        state = lib.XXH3_createState()
        try:
            lib.XXH3_64bits_reset(state)
            for part in parts:
                array = np.frombuffer(part, np.uint8)
                if array.size:
                    lib.XXH3_64bits_update(state, array.ctypes.data, array.size)
            return lib.XXH3_64bits_digest(state)
        finally:
            lib.XXH3_freeState(state)

    @classmethod
    def load(cls):
        """The digest, where it loads and agrees with ``_digest``; else None."""
        try:
            held = cls()
            sample = [b"hybrid", np.arange(70_000, dtype=np.uint16)]
            return held if held(sample) == _digest(sample) else None
        except (ImportError, OSError, AttributeError):
            return None


_held_digest = _HeldDigest.load()


def object_head_bytes(key: str) -> int:
    """The bytes of an object's header and key, before its payload."""
    return _OBJECT.size + len(key.encode())


def unpack_object(data, key: str, fingerprint: int, rest: Sequence = ()) -> tuple[int, memoryview]:
    """(kind, payload) of a stored object, or StoreObjectError saying why it is not usable.
    ``rest``: the object's last bytes where they were read apart (into host slabs): ``data``
    then holds the header and the payload's first part, and the checksum covers both."""
    view = memoryview(data).cast("B")
    if view.nbytes < _OBJECT.size:
        raise StoreObjectError(f"torn: {view.nbytes} bytes, shorter than the header")
    magic, version, kind, name_len, fp, size, digest = _OBJECT.unpack_from(view)
    if magic != OBJECT_MAGIC:
        raise StoreObjectError("not an object of this cache (magic)")
    if version != OBJECT_VERSION:
        raise StoreObjectError(f"object format {version}, this build reads {OBJECT_VERSION}")
    at = _OBJECT.size + name_len
    if bytes(view[_OBJECT.size:at]) != key.encode():
        raise StoreObjectError("another key's object")
    if fp != fingerprint:
        raise StoreObjectError("written by another model or layout (fingerprint)")
    rest = [memoryview(r).cast("B") for r in rest]
    got = view.nbytes - at + sum(r.nbytes for r in rest)
    if got != size:
        raise StoreObjectError(f"torn: {got} payload bytes of {size}")
    payload = view[at:]
    if (_held_digest or _digest)([payload, *rest]) != digest:
        raise StoreObjectError("damaged: checksum mismatch")
    return kind, payload
