"""The shared third tier below the host tier (design §5.6): content-addressed objects that
outlive the process and that servers of the same model and layout share. One small interface
(``ObjectStore``) with two backends: a directory on local disk or a shared filesystem
(``file.FileStore``) and Mooncake Store for a cluster. A backend never raises for a fault of
the tier (disk full, store unreachable, a torn or foreign object): it counts it and answers
with a miss or a dropped write, so a fault costs reuse, never an output or the server."""
from __future__ import annotations

import abc
import threading
import time
from typing import Callable, Optional, Sequence


class ObjectStore(abc.ABC):
    """Objects by key (hex strings: the index's path hash with its namespace and fingerprint),
    each written whole or not at all."""

    name: str             # the backend, for the startup log
    location: str         # where it keeps its objects
    KEPT_FOR_S = 60.0     # without a better answer: an object written this long ago may be gone

    def __init__(self):
        self.stats = {"store_puts": 0, "store_put_bytes": 0, "store_put_failures": 0,
                      "store_gets": 0, "store_get_bytes": 0, "store_misses": 0,
                      "store_evicted": 0}
        self._counting = threading.Lock()     # reads and writes count from several threads at once

    def _stored(self, nbytes: int) -> bool:
        """Count a write that stored an object of ``nbytes``."""
        with self._counting:
            self.stats["store_puts"] += 1
            self.stats["store_put_bytes"] += nbytes
        return True

    def _put_failed(self) -> None:
        """Count a write that failed (the worker puts several objects at a time)."""
        with self._counting:
            self.stats["store_put_failures"] += 1

    def _read(self, data: Optional[bytes]) -> Optional[bytes]:
        """Count a read that found ``data`` (None or empty: a miss); returns it or None."""
        return data if self._found(len(data) if data else None) else None

    def _found(self, nbytes: Optional[int]) -> bool:
        """Count a read of ``nbytes`` (None or 0: a miss)."""
        with self._counting:
            if not nbytes:
                self.stats["store_misses"] += 1
                return False
            self.stats["store_gets"] += 1
            self.stats["store_get_bytes"] += nbytes
        return True

    @abc.abstractmethod
    def put(self, key: str, parts: Sequence, unchanged: Optional[Callable[[], bool]] = None) -> bool:
        """Store the object made of ``parts`` (buffers, in order) under ``key``, replacing any;
        whether it was stored. ``unchanged``, asked once the bytes are out: whether they were
        what they were when the write began (views of memory another thread may write over);
        when not, the object is not published (or taken back) and the put is no failure."""

    def use_memory(self, regions: Sequence[tuple[int, int]]) -> None:
        """The host tier's chunks, (address, bytes) each, which objects are written from and read
        into: a backend that must register such memory with its transport does (Mooncake)."""

    def counters(self) -> dict:
        """The backend's running counts (puts, bytes, evictions, ...)."""
        return dict(self.stats)

    def put_object(self, key: str, kind: int, fingerprint: int, payload: Sequence,
                   unchanged: Optional[Callable[[], bool]] = None) -> bool:
        """``put`` of the object ``persistence.pack_object`` makes of ``payload``; a backend
        that writes elsewhere packs it there (the file backend's writer process)."""
        from hpc_radix.persistence import pack_object

        return self.put(key, pack_object(key, kind, fingerprint, payload), unchanged)

    @abc.abstractmethod
    def get(self, key: str):
        """The object under ``key`` (a bytes-like object), or None."""

    def read_into(self, key: str, parts: Sequence) -> Optional[int]:
        """Read the object under ``key`` into ``parts`` (writable buffers, in order: the host
        slabs it goes to, past a small head) when its size is theirs; its size (another:
        nothing read, torn or not of this layout), or None without one. Backends that can
        read straight into the buffers do (the file backend); this copies from ``get``."""
        data = self.get(key)
        if data is None:
            return None
        view = memoryview(data).cast("B")
        views = [memoryview(p).cast("B") for p in parts]
        if view.nbytes == sum(v.nbytes for v in views):
            at = 0
            for v in views:
                v[:] = view[at:at + v.nbytes]
                at += v.nbytes
        return view.nbytes

    @abc.abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key holds an object, in one query."""

    def listing(self) -> Optional[tuple[float, list]]:
        """(when it began, on the monotonic clock; (key, last use in wall-clock seconds) of every
        object), listed within the last few seconds (the file backend's recount); None where
        the backend cannot list its objects (Mooncake)."""
        return None

    def journal(self, key: str) -> None:
        """Tell the other servers sharing the store that this one stored the state ``key``
        (the file backend's journal); nothing where the backend cannot."""

    def journaled(self) -> Optional[list[str]]:
        """The states the other servers told of since the last call; None where the backend
        keeps no journals."""
        return None

    def refresh(self, keys: Sequence[str]) -> list[bool]:
        """``exists``, marking the objects found as just used (a new path goes through them),
        where the backend's eviction follows use."""
        return self.exists(keys)

    def eviction_horizon(self) -> float:
        """A wall-clock time: an object stored (or seen stored) before it may have been evicted
        since, by this server or another one sharing the store; one stored after it is still
        there. Without a view of the store's evictions (Mooncake evicts without telling), the
        last minute."""
        return time.time() - self.KEPT_FOR_S

    def close(self) -> None:
        """Let go of the store (shutdown); its objects stay for the next server."""
