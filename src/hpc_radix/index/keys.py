"""Block keys: exact token bytes plus chained xxh3_64 lookup hashes (design §5.1).

A prompt is kept as one ``bytes`` object of little-endian int32 tokens, so a block's exact key
is a 256-byte slice and a whole path compares with one memcmp. Lookup hashes are chained by
seeding each block's xxh3_64 with the previous hash; the chain starts from the namespace (SGLang's
``extra_key``: LoRA id, cache salt), and a block's media key (0 for text) is mixed into its seed.
Hashes only select candidates: equality is always decided on the bytes.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import xxhash

BLOCK_TOKENS = 64
TOKEN_BYTES = 4
BLOCK_BYTES = BLOCK_TOKENS * TOKEN_BYTES
_SEED = 0x9E3779B97F4A7C15

_xxh3 = xxhash.xxh3_64_intdigest


def namespace_seed(namespace: Optional[str]) -> int:
    return _SEED if namespace is None else _xxh3(namespace.encode(), _SEED)


def token_bytes(tokens) -> bytes:
    """int32 little-endian bytes of a token sequence (list, array or bytes)."""
    if isinstance(tokens, bytes):
        return tokens
    return np.ascontiguousarray(tokens, dtype="<i4").tobytes()


class PromptKey:
    """The exact identity of a token sequence and its block hashes, computed once.

    ``media`` gives a nonzero key for every block that a media item overlaps (or an earlier
    one does, since media shift later positions); text blocks are 0.
    """

    __slots__ = ("buf", "namespace", "media", "hashes")

    def __init__(self, tokens, namespace: Optional[str] = None,
                 media: Optional[Sequence[int]] = None):
        self.buf = token_bytes(tokens)
        self.namespace = namespace
        self.media = list(media) if media is not None and any(media) else None
        self.hashes: list[int] = []
        self._hash_blocks(0)

    def __len__(self) -> int:
        return len(self.buf) // TOKEN_BYTES

    @property
    def num_blocks(self) -> int:
        return len(self.buf) // BLOCK_BYTES

    def block(self, b: int) -> bytes:
        return self.buf[b * BLOCK_BYTES:(b + 1) * BLOCK_BYTES]

    def media_key(self, b: int) -> int:
        return self.media[b] if self.media is not None and b < len(self.media) else 0

    def tokens(self, start: int, end: int) -> bytes:
        return self.buf[start * TOKEN_BYTES:end * TOKEN_BYTES]

    def extend(self, tokens) -> None:
        """Append tokens (decode output); hashes only the blocks that became full."""
        self.buf += token_bytes(tokens)
        self._hash_blocks(len(self.hashes))

    def _hash_blocks(self, start: int) -> None:
        buf, hashes = self.buf, self.hashes
        h = hashes[-1] if hashes else namespace_seed(self.namespace)
        if self.media is None:
            for off in range(start * BLOCK_BYTES, self.num_blocks * BLOCK_BYTES, BLOCK_BYTES):
                h = _xxh3(buf[off:off + BLOCK_BYTES], h)
                hashes.append(h)
        else:
            for b in range(start, self.num_blocks):
                h = _xxh3(self.block(b), h ^ self.media_key(b))
                hashes.append(h)


def shared_blocks(a: PromptKey, b: PromptKey) -> int:
    """How many leading blocks two keys share (their chained hashes agree up to there: a
    binary search). Keys with media share none: placeholder tokens are equal for different
    media."""
    if a.media is not None or b.media is not None or a.namespace != b.namespace:
        return 0
    lo, hi = 0, min(len(a.hashes), len(b.hashes))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a.hashes[mid - 1] == b.hashes[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
