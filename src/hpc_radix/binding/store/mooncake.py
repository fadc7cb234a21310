"""The shared tier in Mooncake Store (kvcache-ai's distributed KV store: a master, a metadata
server and the clients' memory segments, over TCP or RDMA) for a cluster of servers.

Configured as SGLang's HiCache Mooncake backend is (``--hicache-storage-backend-extra-config``
style JSON: ``master_server_address``, ``metadata_server``, ``protocol``, ``device_name``,
``global_segment_size``, ``local_hostname``; parsed by SGLang's own ``MooncakeStoreConfig``),
plus ``local_buffer_size`` (the client's buffer a read lands in: at least the largest object).
An unreachable store is no error: the client connects lazily; a failed connection or call
(a write or a query) drops it, logs once, and a new one is tried after ``RECONNECT_S``;
meanwhile every write is dropped and every read a miss. Its calls block (a connection to an
unreachable master takes about 90 s to fail, holding the GIL: a TCP check of the master
comes first): they belong off the scheduler thread. The worker's read and write threads share
one client; connecting and dropping it take a lock.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable, Optional, Sequence

from . import ObjectStore

logger = logging.getLogger(__name__)

DEFAULT_LOCAL_BUFFER = 256 << 20


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
        if self._down_logged:
            logger.info("hybrid radix cache: shared tier %s reachable again", self.location)
        self._client, self._down_logged = client, False
        return client

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
            rc = client.upsert_parts(key, *parts)
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
