"""The host tier's memory (spec §5.4): page-locked host memory behind the index's SlabPool.

One budget (``--host-cache-mib``) for KV blocks, snapshot images and tails alike, in chunks of
at most 4 GiB of whole slabs. Each chunk is an anonymous shared mapping filled page by page and
then registered with CUDA (SGLang's ``alloc_mmap`` + ``cudaHostRegister``; torch's pinned
allocator rounds up to a power of two), by a background thread: startup does not wait for
8 GiB × 0.5 s/GiB. The scheduler thread, the index's only writer, brings finished chunks online
in ``poll``. Without CUDA the memory is the same mapping, unpinned. With a backing file (the
prefix cache file's data, ``--prefix-cache-file``) the chunks map that file instead, shared: what
the tier writes reaches the file through the page cache, and what the file held is read back.
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from typing import Optional

import torch

from hpc_radix.index import SlabPool
from hpc_radix.options import OptionError

logger = logging.getLogger(__name__)

HOST_MEMORY_RESERVE_BYTES = 10 << 30   # left to the rest of the machine, as SGLang's HiCache does
_PORTABLE = 1                          # cudaHostRegisterPortable


def check_host_budget(host_cache_mib: int, image_bytes: int, slab_bytes: int,
                      available_bytes: Optional[int] = None) -> None:
    """Refuse a host tier below one snapshot plus one block, or above what can be pinned."""
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
    can_pin = available_bytes - HOST_MEMORY_RESERVE_BYTES
    if budget > can_pin:
        raise OptionError(
            f"--host-cache-mib={host_cache_mib}: {available_bytes >> 20} MiB of host memory are "
            f"available and {HOST_MEMORY_RESERVE_BYTES >> 20} MiB stay free for the rest of the "
            f"machine, so at most {max(can_pin, 0) >> 20} MiB can be pinned")


class HostMemory:
    """The bytes of a SlabPool built with ``online=False``."""

    def __init__(self, slabs: SlabPool, pin: Optional[bool] = None, device: Optional[int] = None,
                 backing_file: Optional[str] = None):
        self.slabs = slabs
        self.backing_file = backing_file
        self.pin = torch.cuda.is_available() if pin is None else pin
        # the fill thread pins for the scheduler's GPU (a new thread starts on device 0)
        if device is None and self.pin and torch.cuda.is_available():
            device = torch.cuda.current_device()
        self.device = device
        self.chunks: list[torch.Tensor] = []           # uint8, one per ready chunk, in order
        self.error: Optional[BaseException] = None
        self.started_at = self.finished_at = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self.started_at = time.monotonic()
        self._thread = threading.Thread(target=self._fill, name="hpc-host-tier", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        from sglang.srt.mem_cache.storage.mmap.mmap_allocator import alloc_mmap

        fd = None
        try:
            if self.pin and self.device is not None:
                torch.cuda.set_device(self.device)
            if self.backing_file is not None:
                fd = os.open(self.backing_file, os.O_RDWR | os.O_CREAT, 0o600)
                if os.fstat(fd).st_size != self.slabs.num_slabs * self.slabs.slab_bytes:
                    os.ftruncate(fd, self.slabs.num_slabs * self.slabs.slab_bytes)   # sparse
            offset = 0
            for size in self.slabs.chunk_sizes:
                if self._stop.is_set():
                    return
                if fd is None:
                    chunk = alloc_mmap((size,), torch.uint8)
                else:
                    chunk = torch.frombuffer(mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                                       offset=offset), dtype=torch.uint8)
                offset += size
                if self.pin:       # portable: every context reaches it through the same pointer
                    err = torch.cuda.cudart().cudaHostRegister(chunk.data_ptr(), size, _PORTABLE)
                    if int(err) != 0:
                        raise RuntimeError(f"cudaHostRegister of {size >> 20} MiB failed ({err})")
                with self._lock:
                    self.chunks.append(chunk)
        except BaseException as err:       # reported by poll(); the chunks pinned so far serve
            self.error = err
        finally:
            if fd is not None:
                os.close(fd)
            self.finished_at = time.monotonic()

    def poll(self) -> int:
        """Bring the chunks pinned since the last call online (scheduler thread). Returns how
        many came online."""
        with self._lock:
            ready = len(self.chunks)
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
        if slab >= self.slabs.online_chunks * self.slabs.slabs_per_chunk:
            raise IndexError(f"slab {slab} is not online")
        chunk, offset = self.slabs.locate(slab)
        return self.chunks[chunk][offset:offset + self.slabs.slab_bytes]

    def close(self) -> None:
        """Stop the fill, unregister and drop the mappings (graceful shutdown)."""
        self._stop.set()
        self.wait()
        with self._lock:
            chunks, self.chunks = self.chunks, []
        if self.pin:
            for chunk in chunks:
                torch.cuda.cudart().cudaHostUnregister(chunk.data_ptr())
