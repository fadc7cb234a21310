"""Host slab bookkeeping (design §5.4): one pinned pool cut into equal slabs, pinned in chunks.

A slab holds one KV block bundle; a snapshot image takes ceil(image_bytes / slab_bytes) slabs,
not necessarily contiguous. Slabs are whole inside a chunk (a chunk holds an integer number of
slabs), so no slab crosses a chunk. The free list is an index stack: O(1), no fragmentation,
capacity is simply the number of free slabs. A pool built with ``online=False`` starts empty and
grows a chunk at a time (``bring_online``) as its memory is pinned in the background.
"""
from __future__ import annotations

MAX_CHUNK_BYTES = 4 << 30


class SlabPool:
    def __init__(self, total_bytes: int, slab_bytes: int, max_chunk_bytes: int = MAX_CHUNK_BYTES,
                 online: bool = True):
        if slab_bytes <= 0 or slab_bytes % 4096:
            raise ValueError(f"slab_bytes={slab_bytes}: must be a positive multiple of 4096")
        if max_chunk_bytes < slab_bytes:
            raise ValueError(f"max_chunk_bytes={max_chunk_bytes} is smaller than one slab ({slab_bytes})")
        self.slab_bytes = slab_bytes
        self.slabs_per_chunk = max_chunk_bytes // slab_bytes
        self.num_slabs = total_bytes // slab_bytes
        # Lowest index on top, so allocation order is deterministic and starts at slab 0.
        self._free: list[int] = []
        self._used = bytearray(self.num_slabs)
        self._claimed: set[int] = set()    # slabs claimed while in _free: skipped when popped
        # times each slab was let go: a reader on another thread (the shared tier's writes)
        # knows the bytes it copied were not written over when this did not change meanwhile
        self._lets_go = [0] * self.num_slabs
        self.online_chunks = 0
        while online and self.online_chunks < self.num_chunks:
            self.bring_online(self.online_chunks)

    def clear(self) -> None:
        """Every slab free again, the chunks online staying online (a flush): as a new pool
        that brought them online one by one."""
        online = self.online_chunks
        self._free, self._used, self._claimed = [], bytearray(self.num_slabs), set()
        self._lets_go = [n + 1 for n in self._lets_go]
        self.online_chunks = 0
        while self.online_chunks < online:
            self.bring_online(self.online_chunks)

    @property
    def num_chunks(self) -> int:
        return -(-self.num_slabs // self.slabs_per_chunk)

    def bring_online(self, chunk: int) -> None:
        """Chunks come online in order; their slabs join the free list (used after the ones
        already free)."""
        if chunk != self.online_chunks:
            raise ValueError(f"chunk {chunk} brought online out of order ({self.online_chunks} next)")
        first = chunk * self.slabs_per_chunk
        last = min(self.num_slabs, first + self.slabs_per_chunk)
        self._free[:0] = range(last - 1, first - 1, -1)
        self.online_chunks += 1

    @property
    def num_free(self) -> int:
        return len(self._free) - len(self._claimed)

    @property
    def num_online(self) -> int:
        """Slabs brought online so far (slabs 0 .. num_online - 1)."""
        return min(self.num_slabs, self.online_chunks * self.slabs_per_chunk)

    @property
    def num_used(self) -> int:
        return self.num_online - self.num_free

    @property
    def chunk_sizes(self) -> list[int]:
        """Bytes of each pinned chunk: whole slabs, at most max_chunk_bytes each."""
        full, rest = divmod(self.num_slabs, self.slabs_per_chunk)
        return [self.slabs_per_chunk * self.slab_bytes] * full + ([rest * self.slab_bytes] if rest else [])

    def locate(self, slab: int) -> tuple[int, int]:
        """(chunk index, byte offset inside the chunk) of a slab."""
        chunk, i = divmod(slab, self.slabs_per_chunk)
        return chunk, i * self.slab_bytes

    def alloc(self, count: int) -> list[int]:
        """``count`` slabs, or an empty list when fewer are free (nothing is taken then)."""
        if count > self.num_free:
            return []
        out = []
        while len(out) < count:
            s = self._free.pop()
            if s in self._claimed:
                self._claimed.discard(s)
            else:
                out.append(s)
        for s in out:
            self._used[s] = 1
        return out

    def claim(self, slabs) -> None:
        """Take these particular free slabs (a reload puts saved content back where it was)."""
        want = set(slabs)
        if len(want) != len(slabs) or not all(0 <= s < self.num_slabs and not self._used[s] for s in want):
            raise ValueError(f"slabs {sorted(slabs)[:8]} are not all distinct, in range and free")
        if max(want, default=-1) >= self.num_online:
            raise ValueError("a claimed slab is not online")
        self._claimed |= want              # taken out of _free lazily: a reload claims many
        for s in want:
            self._used[s] = 1

    def free(self, slabs) -> None:
        for s in slabs:
            if not self._used[s]:
                raise ValueError(f"slab {s} freed twice")
            self._used[s] = 0
            self._lets_go[s] += 1
            if s in self._claimed:
                self._claimed.discard(s)   # its entry in _free is still there
            else:
                self._free.append(s)

    def generation(self, slab: int) -> int:
        """Changes whenever the slab is let go (freed, or the pool cleared)."""
        return self._lets_go[slab]

    def is_used(self, slab: int) -> bool:
        return bool(self._used[slab])
