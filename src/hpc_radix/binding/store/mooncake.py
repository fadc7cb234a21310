"""The shared tier in Mooncake Store (kvcache-ai's distributed KV store: a master, a metadata
server and the clients' memory segments, over TCP or RDMA) for a cluster of servers.

Configured as SGLang's HiCache Mooncake backend is (``--hicache-storage-backend-extra-config``
style JSON: ``master_server_address``, ``metadata_server``, ``protocol``, ``device_name``,
``global_segment_size``, ``local_hostname``; parsed by SGLang's own ``MooncakeStoreConfig``),
plus ``local_buffer_size`` (the client's own buffer; objects do not pass through it).
An unreachable store is no error: the client connects lazily; a failed connection or call
(a write or a query) drops it, logs once, and a new one is tried after ``RECONNECT_S``;
meanwhile every write is dropped and every read a miss. Its calls block (a connection to an
unreachable master takes about 90 s to fail, holding the GIL: a TCP check of the master
comes first): they belong off the scheduler thread. The worker's read and write threads share
one client; connecting and dropping it take a lock.

Objects go straight between the host tier's pinned slabs and the store, as SGLang's HiCache
Mooncake backend does: the slabs' chunks are registered with the client (RDMA needs it), a
write gathers an object from its head and slabs (``batch_put_from_multi_buffers``) and a read
scatters it into them (``batch_get_into_multi_buffers``); the client lets go of the GIL
meanwhile (``get`` holds it while it copies an object into Python, which stops the scheduler
thread for tens of ms per state: benchmarks/RESULTS.md). The small parts (heads, tokens) go
through a registered buffer of each thread's.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import socket
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np

from . import ObjectStore

logger = logging.getLogger(__name__)

DEFAULT_LOCAL_BUFFER = 256 << 20
NOT_FOUND = -704                  # Mooncake's OBJECT_NOT_FOUND
SCRATCH_BYTES = 1 << 20           # a thread's registered buffer for an object's small parts


class MooncakeStore(ObjectStore):
    name = "mooncake"
    RECONNECT_S = 10.0

    def __init__(self, config: dict):
        super().__init__()
        from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStoreConfig

        self.config = MooncakeStoreConfig.load_from_extra_config(config)
        self.local_buffer = int(config.get("local_buffer_size", DEFAULT_LOCAL_BUFFER))
        self.location = f"{self.config.master_server_address} (metadata {self.config.metadata_server})"
        self._client = None
        self._next_try = 0.0
        self._down_logged = False
        self._lock = threading.RLock()
        self._regions: dict = {}              # address -> bytes, registered with every client
        self._scratch = threading.local()

    def _connected(self):
        """The client, connected now or again; None while the store is unreachable."""
        if self._client is not None:
            return self._client
        with self._lock:
            return self._connect()

    def _connect(self):
        if self._client is not None:          # the other thread connected meanwhile
            return self._client
        if time.monotonic() < self._next_try:
            return None
        unreachable = self._unreachable()
        if unreachable:
            self._down(unreachable)
            return None
        from mooncake.store import MooncakeDistributedStore

        client, c = MooncakeDistributedStore(), self.config
        try:
            rc = client.setup(c.local_hostname, c.metadata_server, c.global_segment_size,
                              self.local_buffer, c.protocol, c.device_name,
                              c.master_server_address)
        except Exception as err:  # noqa: BLE001 - a tier fault: the server serves without it
            rc = err
        if rc != 0:
            self._down(f"cannot connect ({rc})")
            return None
        failed = [a for a, n in self._regions.items() if client.register_buffer(a, n) != 0]
        if failed:
            client.close()
            self._down(f"cannot register {len(failed)} buffers")
            return None
        if self._down_logged:
            logger.info("hybrid radix cache: shared tier %s reachable again", self.location)
        self._client, self._down_logged = client, False
        return client

    def use_memory(self, regions: Sequence[tuple[int, int]]) -> None:
        with self._lock:                  # (the worker's read and write threads both tell it)
            for address, nbytes in regions:
                if address not in self._regions:
                    self._register(address, nbytes)

    def _register(self, address: int, nbytes: int) -> None:
        with self._lock:
            self._regions[address] = nbytes
            if self._client is not None and self._client.register_buffer(address, nbytes) != 0:
                self._down("cannot register a buffer")

    def _unregister(self, address: int) -> None:
        with self._lock:
            self._regions.pop(address, None)
            if self._client is not None:
                self._client.unregister_buffer(address)

    def _buffers(self, parts: Sequence) -> tuple[list, list, Callable[[], None]]:
        """(addresses, sizes) of ``parts`` for the client, and what copies the small ones back
        after a read: numpy arrays (the host tier's slabs) as they lie, the others through this
        thread's registered buffer."""
        small = [memoryview(p).cast("B") for p in parts if not isinstance(p, np.ndarray)]
        scratch = self._scratch_of(sum(v.nbytes for v in small))
        base = ctypes.addressof(ctypes.c_char.from_buffer(scratch))
        addresses, sizes, staged, at = [], [], [], 0
        for p in parts:
            if not memoryview(p).nbytes:
                continue
            if isinstance(p, np.ndarray):
                addresses.append(p.ctypes.data)
                sizes.append(p.nbytes)
                continue
            v = memoryview(p).cast("B")
            scratch[at:at + v.nbytes] = v
            addresses.append(base + at)
            sizes.append(v.nbytes)
            staged.append((v, at))
            at += v.nbytes

        def copy_back() -> None:
            for v, at in staged:
                if not v.readonly:
                    v[:] = scratch[at:at + v.nbytes]
        return addresses, sizes, copy_back

    def _scratch_of(self, nbytes: int) -> mmap.mmap:
        scratch = getattr(self._scratch, "buffer", None)
        if scratch is None or len(scratch) < nbytes:
            if scratch is not None:                  # outgrown: let go of it first
                self._unregister(ctypes.addressof(ctypes.c_char.from_buffer(scratch)))
            scratch = mmap.mmap(-1, max(SCRATCH_BYTES, mmap.PAGESIZE * -(-nbytes // mmap.PAGESIZE)))
            self._scratch.buffer = scratch
            self._register(ctypes.addressof(ctypes.c_char.from_buffer(scratch)), len(scratch))
        return scratch

    def _unreachable(self) -> Optional[str]:
        """Why the master cannot be reached (a TCP connection to it, 2 s at most), or None.
        Asked first because the client's own connection attempt to a missing master retries
        for about 90 s holding Python's GIL, which would stop the scheduler thread too."""
        host, _, port = self.config.master_server_address.rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=2).close()
        except (OSError, ValueError) as err:
            return f"master {self.config.master_server_address} unreachable ({err})"
        return None

    def _down(self, why: str) -> None:
        with self._lock:
            try:
                self.close()              # else it keeps reconnecting in the background
            except Exception:  # noqa: BLE001
                pass
            self._next_try = time.monotonic() + self.RECONNECT_S
            if not self._down_logged:
                logger.warning("hybrid radix cache: shared tier %s: %s; serving from device and "
                               "host, trying again every %.0f s", self.location, why, self.RECONNECT_S)
                self._down_logged = True

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
            if client is not None:
                client.close()

    def put(self, key: str, parts: Sequence, unchanged: Optional[Callable[[], bool]] = None) -> bool:
        client = self._connected()
        if client is None:
            self._put_failed()
            return False
        try:
            addresses, sizes, _ = self._buffers(parts)
            rc = client.batch_put_from_multi_buffers([key], [addresses], [sizes])[0]
        except Exception as err:  # noqa: BLE001
            rc = err
        if rc != 0:
            self._put_failed()
            self._down(f"a write failed ({rc})")
            return False
        if unchanged is not None and not unchanged():
            self._take_back(client, key)
            return False
        return self._stored(sum(memoryview(p).nbytes for p in parts))

    def _take_back(self, client, key: str) -> None:
        """Remove an object written from bytes that changed under the write (a reader who got
        it meanwhile finds its checksum wrong: a miss)."""
        try:
            client.remove(key)
        except Exception as err:  # noqa: BLE001 - left for the store's eviction
            logger.info("hybrid radix cache: shared tier object %s not removed (%s)", key, err)

    def read_into(self, key: str, parts: Sequence) -> Optional[int]:
        client = self._connected()
        if client is None:
            self._found(None)
            return None
        try:
            addresses, sizes, copy_back = self._buffers(parts)
            size = client.batch_get_into_multi_buffers([key], [addresses], [sizes])[0] if addresses else -1
            if size >= 0:
                copy_back()
            elif size != NOT_FOUND:               # of another size (or a fault): say which
                size = client.get_size(key)
        except Exception as err:  # noqa: BLE001
            self._down(f"a read failed ({err})")
            size = None
        if size is not None and size < 0:
            if size != NOT_FOUND:
                self._down(f"a read failed ({size})")
            size = None
        self._found(size)
        return size

    def get(self, key: str) -> Optional[bytes]:
        client = self._connected()
        data = None
        if client is not None:
            try:
                data = client.get(key)
            except Exception as err:  # noqa: BLE001
                self._down(f"a read failed ({err})")
        return self._read(data)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        client = self._connected()
        if client is None or not keys:
            return [False] * len(keys)
        try:
            found = client.batch_is_exist(list(keys))
        except Exception as err:  # noqa: BLE001
            found = [err]
        if any(not isinstance(r, int) or r < 0 for r in found):
            self._down(f"a query failed ({found[0]})")
            return [False] * len(keys)
        return [r == 1 for r in found]
