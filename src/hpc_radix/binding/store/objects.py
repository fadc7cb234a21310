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
from hpc_radix.index.keys import BLOCK_BYTES, BLOCK_TOKENS, TOKEN_BYTES
from hpc_radix.persistence import pack_object, unpack_object

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


def pack_block(key: str, fingerprint: int, tokens: bytes, slab) -> list:
    return pack_object(key, BLOCK, fingerprint, [tokens, slab])


def unpack_block(data, key: str, fingerprint: int, tokens: bytes, slab_bytes: int) -> memoryview:
    """The slab bytes of a block object whose tokens are ``tokens``, else StoreObjectError."""
    kind, payload = unpack_object(data, key, fingerprint)
    if kind != BLOCK or payload.nbytes != BLOCK_BYTES + slab_bytes:
        raise StoreObjectError(f"not a block of {slab_bytes}-byte slabs")
    if bytes(payload[:BLOCK_BYTES]) != tokens:
        raise StoreObjectError("a block of other tokens (hash collision)")
    return payload[BLOCK_BYTES:]


@dataclass
class StoredState:
    kind: str
    role: Optional[str]           # the role it had where it was written (None: not recorded)
    hits: int
    slabs: memoryview             # the image's slabs, then the tail's


def pack_state(key: str, fingerprint: int, kind: str, role: str, hits: int, tail: bytes,
               slabs: list) -> list:
    head = _STATE.pack(KINDS.index(kind), 1 + ROLES.index(role), len(tail) // TOKEN_BYTES,
                       min(hits, 2**32 - 1))
    return pack_object(key, STATE, fingerprint, [head, tail, *slabs])


def unpack_state(data, key: str, fingerprint: int, tail: bytes, slab_bytes: int,
                 image_slabs: int) -> StoredState:
    kind, payload = unpack_object(data, key, fingerprint)
    if kind != STATE or payload.nbytes < _STATE.size:
        raise StoreObjectError("not a state object")
    snap_kind, role, tail_tokens, hits = _STATE.unpack_from(payload)
    at = _STATE.size + tail_tokens * TOKEN_BYTES
    slabs = image_slabs + (1 if tail_tokens else 0)
    if (snap_kind >= len(KINDS) or role > len(ROLES) or tail_tokens >= BLOCK_TOKENS
            or payload.nbytes != at + slabs * slab_bytes):
        raise StoreObjectError("a state of another layout (fields or size)")
    if bytes(payload[_STATE.size:at]) != tail:
        raise StoreObjectError("a state of another tail (hash collision)")
    return StoredState(KINDS[snap_kind], ROLES[role - 1] if role else None, hits, payload[at:])
