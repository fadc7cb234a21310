"""What the shared tier holds and how it is named (design §5.6): one object per KV block (its
host slab) and one per state image (its slabs and, off a block boundary, its tail's slab).

A key names the exact token path an object follows: a 128-bit xxh3 chain over the path's
blocks, seeded by the namespace (SGLang's ``extra_key``); a state's key is its anchor's digest
(64 bits: a listing names the anchors) and 64 of a hash of that digest with its tail; beside it
the digest of the setup whose bytes the object holds (the fingerprint: model, layout, TP rank,
format), so a server never reads another model's or layout's bytes. A block object also carries
its own tokens and a state object its tail's, checked on every read. Pure Python + numpy +
xxhash (persistence.pack_object writes the header and checksum).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional

import xxhash

from hpc_radix.errors import StoreObjectError
from hpc_radix.index import Role
from hpc_radix.index.keys import BLOCK_BYTES, TOKEN_BYTES
from hpc_radix.persistence import object_head_bytes, unpack_object

BLOCK, STATE = 1, 2                       # object kinds
KINDS = ("tap", "endpoint", "boundary")   # a state's snapshot kind, as the cache file names them
ROLES = tuple(r.value for r in Role)      # a state's role: 1 + its index here (0: not recorded)
_STATE = struct.Struct("<BBHI")           # snapshot kind, role, tail tokens, hits
ANCHOR_BYTES = 8                          # of a state's anchor digest, leading its key


def chain(tokens: bytes, namespace: Optional[str], blocks: int) -> list[bytes]:
    """The 16-byte chain digest of the path after 0, 1, ... ``blocks`` blocks of ``tokens``
    (entry b: the anchor of a state after b blocks; entry b + 1: block b's key)."""
    out = [xxhash.xxh3_128_digest(b"" if namespace is None else namespace.encode(), seed=1)]
    for b in range(blocks):
        out.append(xxhash.xxh3_128_digest(out[-1] + tokens[b * BLOCK_BYTES:(b + 1) * BLOCK_BYTES]))
    return out


def block_key(digest: bytes, fingerprint: int) -> str:
    return f"{digest.hex()}.b.{fingerprint:016x}"


def state_key(anchor: bytes, tail: bytes, fingerprint: int) -> str:
    """The state after the anchor's path (``anchor``: its chain digest) and ``tail`` (tokens
    of the next block, fewer than a block's). The key begins with the anchor's first
    ANCHOR_BYTES, so a listing of the store names the anchors it holds states on."""
    return (f"{anchor[:ANCHOR_BYTES].hex()}{xxhash.xxh3_64_hexdigest(anchor + tail)}"
            f".s.{fingerprint:016x}")


def anchor_prefix(key: str) -> Optional[bytes]:
    """The anchor prefix a state's key begins with; None for another object's key."""
    head, _, rest = key.partition(".")
    if not rest.startswith("s.") or len(head) != 32:
        return None
    try:
        return bytes.fromhex(head[:2 * ANCHOR_BYTES])
    except ValueError:
        return None


def block_head_bytes(key: str) -> int:
    """The bytes of a block object before its slab (read apart, into a host slab)."""
    return object_head_bytes(key) + BLOCK_BYTES


def unpack_block(head, slab, key: str, fingerprint: int, tokens: bytes) -> None:
    """Check a block object read as ``head`` and ``slab``: its tokens are ``tokens``, else
    StoreObjectError."""
    kind, payload = unpack_object(head, key, fingerprint, [slab])
    if kind != BLOCK or payload.nbytes != BLOCK_BYTES:
        raise StoreObjectError("not a block object")
    if bytes(payload) != tokens:
        raise StoreObjectError("a block of other tokens (hash collision)")


@dataclass
class StoredState:
    kind: str
    role: Optional[str]           # the role it had where it was written (None: not recorded)
    hits: int


def state_payload(kind: str, role: str, hits: int, tail: bytes, slabs: list) -> list:
    """A state object's payload (``ObjectStore.put_object`` packs it): its fields, its tail's
    tokens, its slabs. A block object's is its tokens and its slab."""
    head = _STATE.pack(KINDS.index(kind), 1 + ROLES.index(role), len(tail) // TOKEN_BYTES,
                       min(hits, 2**32 - 1))
    return [head, tail, *slabs]


def state_head_bytes(key: str, tail: bytes) -> int:
    """The bytes of a state object before its slabs (read apart, into host slabs)."""
    return object_head_bytes(key) + _STATE.size + len(tail)


def unpack_state(head, slabs: list, key: str, fingerprint: int, tail: bytes,
                 image_slabs: int) -> StoredState:
    """Check a state object read as ``head`` and ``slabs`` (its image's, then its tail's): its
    fields, and its tail is ``tail``, else StoreObjectError."""
    kind, payload = unpack_object(head, key, fingerprint, slabs)
    if kind != STATE or payload.nbytes != _STATE.size + len(tail):
        raise StoreObjectError("not a state object of this tail's length")
    snap_kind, role, tail_tokens, hits = _STATE.unpack_from(payload)
    if (snap_kind >= len(KINDS) or role > len(ROLES) or tail_tokens != len(tail) // TOKEN_BYTES
            or len(slabs) != image_slabs + (1 if tail_tokens else 0)):
        raise StoreObjectError("a state of another layout (fields or size)")
    if bytes(payload[_STATE.size:]) != tail:
        raise StoreObjectError("a state of another tail (hash collision)")
    return StoredState(KINDS[snap_kind], ROLES[role - 1] if role else None, hits)


def read_and_check(read_into, head_bytes: int, slabs: list, check: tuple) -> Optional[StoredState]:
    """Read an object with ``read_into(buffers)`` (its size, or None without one) into a head
    of ``head_bytes`` and ``slabs``, and check it: ``check`` is ("state", key, fingerprint,
    tail, image slabs) or ("block", key, fingerprint, tokens). The state's fields (None for a
    block); StoreObjectError when it is gone, torn or not usable. The one check of a
    read-back, by the server's threads or by the file tier's writer process."""
    head = bytearray(head_bytes)
    want = head_bytes + sum(memoryview(s).nbytes for s in slabs)
    size = read_into([head, *slabs])
    if size is None:
        raise StoreObjectError("gone since the query")
    if size != want:
        raise StoreObjectError(f"torn or of another layout: {size} bytes, not {want}")
    kind, key, fingerprint, *expected = check
    if kind == "state":
        return unpack_state(head, slabs, key, fingerprint, *expected)
    unpack_block(head, slabs[0], key, fingerprint, *expected)
    return None
