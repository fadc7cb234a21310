"""The host tier's memory (design §5.4): page-locked host memory behind the index's SlabPool.

One budget (``--host-cache-mib``) for KV blocks, snapshot images and tails alike, in chunks of
at most 4 GiB of whole slabs. Each chunk is a memfd mapping filled page by page and then
registered with CUDA (SGLang's ``alloc_shm`` + ``cudaHostRegister``: its descriptor lets the
shared tier's writer process read the slabs it writes out; torch's pinned
allocator rounds up to a power of two), by a background thread: startup does not wait for
8 GiB × 0.5 s/GiB. The scheduler thread, the index's only writer, brings finished chunks online
in ``poll``. Without CUDA the memory is the same mapping, unpinned.

With a backing file (the prefix cache file's data, ``--prefix-cache-file``) the chunks are read
from it as they are filled, and every slab written through is copied back to it by a background
thread (``SlabFile``). The chunks cannot map the file itself: Linux refuses long-term pins of
file-backed pages outside tmpfs and hugetlbfs, so cudaHostRegister fails on such a mapping
(as it did on ext4).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Optional

import torch

from hpc_radix.index import SlabPool
from hpc_radix.options import OptionError

from ..store.writer import SharedChunks

logger = logging.getLogger(__name__)

HOST_MEMORY_RESERVE_BYTES = 10 << 30   # left to the rest of the machine, as SGLang's HiCache does
_PORTABLE = 1                          # cudaHostRegisterPortable
# Chunks of a tier pinned while serving (--host-cache-pin on-demand). cudaHostRegister holds
# the CUDA driver while it runs, and every launch and read of the scheduler thread waits for it:
# a large chunk queues continuing turns behind it. A 64 MiB chunk holds it for tens of
# milliseconds, and the fill pauses after each as long as its registration took, so the
# scheduler gets the driver at least half of the time (benchmarks/WHY.md).
ON_DEMAND_CHUNK_BYTES = 64 << 20


def check_host_budget(host_cache_mib: int, image_bytes: int, slab_bytes: int,
                      available_bytes: Optional[int] = None, ranks_on_host: int = 1) -> None:
    """Refuse a host tier below one snapshot plus one block, or above what can be pinned
    (``ranks_on_host`` TP ranks each pin one)."""
    if host_cache_mib <= 0:
        return
    budget = host_cache_mib << 20
    smallest = (-(-image_bytes // slab_bytes) + 1) * slab_bytes
    if budget < smallest:
        raise OptionError(
            f"--host-cache-mib={host_cache_mib}: the host tier must hold at least one snapshot "
            f"and one block ({-(-smallest // (1 << 20))} MiB: a {image_bytes / 2**20:.1f} MiB "
            f"state image and a {slab_bytes / 2**10:.0f} KiB block)")
    if available_bytes is None:
        import psutil

        available_bytes = psutil.virtual_memory().available
    can_pin = (available_bytes - HOST_MEMORY_RESERVE_BYTES) // ranks_on_host
    if budget > can_pin:
        each = f" by each of the {ranks_on_host} TP ranks on this machine" if ranks_on_host > 1 else ""
        raise OptionError(
            f"--host-cache-mib={host_cache_mib}: {available_bytes >> 20} MiB of host memory are "
            f"available and {HOST_MEMORY_RESERVE_BYTES >> 20} MiB stay free for the rest of the "
            f"machine, so at most {max(can_pin, 0) >> 20} MiB can be pinned{each}")


class HostMemory:
    """The bytes of a SlabPool built with ``online=False``."""

    def __init__(self, slabs: SlabPool, pin: Optional[bool] = None, device: Optional[int] = None,
                 backing_file: Optional[str] = None, paced: bool = False, shared: bool = False):
        self.slabs = slabs
        self.shared_wanted = shared        # memfd chunks, for the file tier's writer process
        self.paced = paced                 # pinned while serving: pause after each registration
        self.backing_file = backing_file
        self.pin = torch.cuda.is_available() if pin is None else pin
        # the fill thread pins for the scheduler's GPU (a new thread starts on device 0)
        if device is None and self.pin and torch.cuda.is_available():
            device = torch.cuda.current_device()
        self.device = device
        self.chunks: list[torch.Tensor] = []           # uint8, one per ready chunk, in order
        self._mappings: list = []                      # the chunks' memfd mappings
        self.shared = SharedChunks()                   # their descriptors, for the tier's writer
        self.error: Optional[BaseException] = None
        self.landed = 0                                # write-throughs landed so far
        self.started_at = self.finished_at = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.file = SlabFile(backing_file, self) if backing_file else None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        self.started_at = time.monotonic()
        self._thread = threading.Thread(target=self._fill, name="hpc-host-tier", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:
            if self.pin and self.device is not None:
                torch.cuda.set_device(self.device)
            offset = 0
            for size in self.slabs.chunk_sizes:
                if self._stop.is_set():
                    return
                chunk, fd, mapping = self._map(size)
                if self.file is not None:
                    self.file.read_into(chunk, offset)
                offset += size
                if self.pin:
                    registered = time.monotonic()
                    if not self._register(chunk) and fd is not None:
                        logger.warning("hybrid radix cache: a shared host chunk could not be pinned; "
                                       "the host tier's chunks are private from here on (the file "
                                       "tier writes their objects in the scheduler's process)")
                        os.close(fd)
                        self.shared_wanted = False
                        chunk, fd, mapping = self._map(size)
                        if self.file is not None:
                            self.file.read_into(chunk, offset - size)
                        self._register(chunk, must=True)
                    if self.paced:
                        self._stop.wait(time.monotonic() - registered)
                with self._lock:
                    self.chunks.append(chunk)
                    self._mappings.append(mapping)
                if fd is not None:
                    self.shared.add(len(self.chunks) - 1, fd)
        except BaseException as err:       # reported by poll(); the chunks pinned so far serve
            self.error = err
        finally:
            self.finished_at = time.monotonic()

    def _map(self, size: int):
        """(chunk, its memfd or None, what keeps the mapping) of ``size`` bytes."""
        from sglang.srt.mem_cache.storage.mmap.mmap_allocator import alloc_mmap, alloc_shm

        if self.shared_wanted:
            return alloc_shm((size,), torch.uint8)
        return alloc_mmap((size,), torch.uint8), None, None

    def _register(self, chunk: torch.Tensor, must: bool = False) -> bool:
        """Pin ``chunk`` (portable: every context reaches it through the same pointer)."""
        err = torch.cuda.cudart().cudaHostRegister(chunk.data_ptr(), chunk.numel(), _PORTABLE)
        if int(err) != 0 and must:
            raise RuntimeError(f"cudaHostRegister of {chunk.numel() >> 20} MiB failed ({err})")
        return int(err) == 0

    @property
    def ready_chunks(self) -> int:
        """Chunks the background thread has pinned so far (online or not)."""
        with self._lock:
            return len(self.chunks)

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of each chunk pinned so far: the shared tier's transport reads and
        writes them in place."""
        with self._lock:
            return [(c.data_ptr(), c.numel()) for c in self.chunks]

    def poll(self, limit: Optional[int] = None) -> int:
        """Bring the chunks pinned since the last call online (scheduler thread), at most the
        first ``limit`` (what every TP rank has pinned). Returns how many came online."""
        ready = self.ready_chunks if limit is None else min(limit, self.ready_chunks)
        came = 0
        while self.slabs.online_chunks < ready:
            chunk = self.slabs.online_chunks
            self.slabs.bring_online(chunk)
            came += 1
            logger.info("hybrid radix cache: host tier chunk %d of %d online (%d MiB), %.1f s "
                        "after start", chunk + 1, self.slabs.num_chunks,
                        self.slabs.chunk_sizes[chunk] >> 20, time.monotonic() - self.started_at)
        if self.error is not None:
            logger.error("hybrid radix cache: host tier stopped at %d of %d chunks: %s",
                         self.slabs.online_chunks, self.slabs.num_chunks, self.error)
            self.error = None
        if self.file is not None:
            self.file.report_error()
        return came

    @property
    def complete(self) -> bool:
        return self.slabs.online_chunks == self.slabs.num_chunks

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the background fill ends (tests, shutdown)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    def view(self, slab: int) -> torch.Tensor:
        """The bytes of one online slab."""
        if slab >= self.slabs.num_online:
            raise IndexError(f"slab {slab} is not online")
        chunk, offset = self.slabs.locate(slab)
        return self.chunks[chunk][offset:offset + self.slabs.slab_bytes]

    def written(self, slabs) -> None:
        """Slabs whose write-through landed: the backing file gets them too; ``landed`` counts
        the write-throughs (the shared tier waits for paths to land)."""
        self.landed += 1
        if self.file is not None:
            self.file.written(slabs)

    def close(self) -> None:
        """Stop the fill and the file's writer, unregister and drop the mappings (graceful
        shutdown)."""
        self._stop.set()
        self.wait()
        if self.file is not None:
            self.file.close()
        with self._lock:
            chunks, self.chunks, self._mappings = self.chunks, [], []
        if self.pin:
            for chunk in chunks:
                torch.cuda.cudart().cudaHostUnregister(chunk.data_ptr())
        self.shared.close()


class SlabFile:
    """The host tier's slabs mirrored in a file: read into each chunk as it is filled; a slab
    written through is queued and written back by a background thread, so a graceful stop
    writes only what landed in the last moments (``flush``). A slab rewritten while its old
    bytes go out is queued again when the new copy lands, so the file ends up current."""

    SYNC_BYTES = 256 << 20                 # fdatasync this often: dirty page cache stays bounded

    def __init__(self, path: str, memory: HostMemory):
        self.path = path
        self.memory = memory
        size = memory.slabs.num_slabs * memory.slabs.slab_bytes
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as err:
            raise OptionError(f"--prefix-cache-file: cannot open its data file {path}: "
                              f"{err.strerror}") from None
        self.fresh = os.fstat(self.fd).st_size != size
        if self.fresh:                         # a new file, or another tier size: nothing to read
            os.ftruncate(self.fd, size)
        self.bytes_written = 0
        self.error: Optional[OSError] = None
        self._dirty: set[int] = set()
        self._busy = self._closed = self._failing = False
        self._unsynced = 0
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="hpc-slab-file", daemon=True)
        self._thread.start()

    def read_into(self, chunk: torch.Tensor, offset: int) -> None:
        if self.fresh:
            return
        view, done = memoryview(chunk.numpy()), 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"{self.path}: short read at byte {offset + done}")
            done += n

    def written(self, slabs) -> None:
        with self._cond:
            self._dirty.update(slabs)
            self._cond.notify()

    def flush(self) -> None:
        """Block until every queued slab is in the file, then fsync it (the transfers must
        have landed)."""
        with self._cond:
            while (self._dirty or self._busy) and self._thread.is_alive():
                self._cond.wait(0.1)
        os.fsync(self.fd)
        self.report_error()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        os.close(self.fd)

    def report_error(self) -> None:
        if self.error is not None:
            logger.error("hybrid radix cache: writing %s failed: %s; the slabs it missed fail "
                         "their checksums at the next load", self.path, self.error)
            self.error = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._dirty and not self._closed:
                    self._cond.wait()
                if not self._dirty:
                    return
                batch, self._busy = sorted(self._dirty), True
                self._dirty.clear()
            try:
                self._write(batch)
                self._failing = False
            except OSError as err:
                if not self._failing:          # logged once per run of failures
                    self.error = err
                self._failing = True
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, batch: list[int]) -> None:
        size = self.memory.slabs.slab_bytes
        for slab in batch:
            data, done = memoryview(self.memory.view(slab).numpy()), 0
            while done < size:
                done += os.pwrite(self.fd, data[done:], slab * size + done)
        self.bytes_written += len(batch) * size
        self._unsynced += len(batch) * size
        if self._unsynced >= self.SYNC_BYTES:
            os.fdatasync(self.fd)
            self._unsynced = 0
