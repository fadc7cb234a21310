"""The file tier's writes in a process of their own (design §5.6): the checksum and the file
calls of an object run there, reading the host slabs through the same shared memory, so none
of them waits for the scheduler's GIL or makes the scheduler wait for it.

In the scheduler's process every file call and every 1 MiB of a checksum lets go of the GIL
and takes it back at the next forced hand-over: at the 8 GiB server's write rate (~700 MB/s
of states and blocks) the scheduler's own Python ran 23 % slower on the 2-core machine beside
the put threads and not measurably slower beside a child process writing the same bytes
(benchmarks/micro/scheduler_beside_tier_writes.py). What stays here is a message out and one
back per object, and the publishing ``rename`` with its budget (``FileStore``).

The host tier's chunks are memfd mappings (SGLang's ``alloc_shm``); each connection sends a
chunk's descriptor with its first object in it. One connection per put thread (a
``SOCK_SEQPACKET`` socket pair: one message per object, no framing), served in the child by a
thread each. A child that died (killed, out of memory) fails the puts in flight, which the
put threads then write in their own process; it is started again at most every RESTART_S.
Objects are written exactly as ``persistence.pack_object`` and ``write_file`` write them in
process: the same bytes either way.
"""
from __future__ import annotations

import bisect
import errno
import logging
import mmap
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

logger = logging.getLogger(__name__)

MESSAGE_BYTES = 1 << 16     # an object's description at most (a few KB: its refs and head)
REPLY_BYTES = 1 << 10
RESTART_S = 10.0            # a writer that died is started again at most this often
EXIT_S = 5.0                # a writer told to stop is killed after this long


def write_file(path: str, parts: Sequence) -> None:
    """``parts`` into a new file at ``path`` with one ``writev`` (each system call waits for
    the GIL beside a busy thread)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        views = [memoryview(p).cast("B") for p in parts]
        while views:
            done = os.writev(fd, views)
            while views and done >= views[0].nbytes:
                done -= views.pop(0).nbytes
            if views:
                views[0] = views[0][done:]
    finally:
        os.close(fd)


@dataclass
class SharedObject:
    """An object to write whose payload lies (mostly) in shared host memory: ``refs`` names
    each part as bytes or (chunk, offset, nbytes); ``payload``, the same parts as buffers,
    for a write in this process."""
    key: str
    kind: int
    fingerprint: int
    payload: list
    refs: list


class SharedChunks:
    """Where buffers lie in the host tier's shared chunks: (base address, size, descriptor)
    of each, added as they come online (by the thread that maps them)."""

    def __init__(self):
        self._bases: list = []            # sorted
        self._chunks: dict = {}           # base -> (chunk, size)
        self.fds: list = []               # by chunk
        self._lock = threading.Lock()

    def add(self, base: int, size: int, fd: int) -> None:
        with self._lock:
            self._chunks[base] = (len(self.fds), size)
            self.fds.append(fd)
            bisect.insort(self._bases, base)

    def close(self) -> None:
        with self._lock:
            fds, self.fds, self._bases, self._chunks = self.fds, [], [], {}
        for fd in fds:
            os.close(fd)

    def refs(self, parts: Sequence, small: int = 1 << 16) -> Optional[list]:
        """Each part as (chunk, offset, nbytes) where it lies in a chunk, as bytes where it
        is small; None when a large one lies elsewhere (written in process)."""
        out = []
        for part in parts:
            view = memoryview(part).cast("B")
            if view.nbytes <= small:
                out.append(bytes(view))
                continue
            address = _address(part)
            base, chunk = self._find(address)
            if chunk is None or address + view.nbytes > base + chunk[1]:
                return None
            out.append((chunk[0], address - base, view.nbytes))
        return out

    def _find(self, address: int):
        with self._lock:
            i = bisect.bisect_right(self._bases, address) - 1
            return (self._bases[i], self._chunks[self._bases[i]]) if i >= 0 else (0, None)


def _address(part) -> int:
    import numpy as np

    array = part if isinstance(part, np.ndarray) else np.frombuffer(part, np.uint8)
    return array.__array_interface__["data"][0]


class WriterUnavailable(OSError):
    """The writer process is not running: the put writes in its own process."""


class WriterProcess:
    """The parent's side: ``write(path, obj)`` has the child write ``obj`` to ``path``."""

    def __init__(self, chunks: SharedChunks, connections: int):
        self.chunks = chunks
        self.connections = connections
        self.cpu_ms = 0.0                  # the child's CPU time on the objects it wrote
        self.restarts = 0
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._process: Optional[subprocess.Popen] = None
        self._started_at = -RESTART_S
        self._lock = threading.Lock()
        self._start()

    @property
    def pid(self) -> Optional[int]:
        return self._process.pid if self._process else None

    def _start(self) -> None:
        self._started_at = time.monotonic()
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(self.connections)]
        ends = [theirs.fileno() for _, theirs in pairs]
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", __name__, *map(str, ends)], pass_fds=ends,
                stdin=subprocess.DEVNULL)
        except OSError as err:
            logger.warning("hybrid radix cache: shared tier writer process not started (%s): "
                           "objects are written by the scheduler's process", err)
            self._process = None
        finally:
            for _, theirs in pairs:
                theirs.close()
        for mine, _ in pairs:
            self._free.put(_Connection(mine, self._process))

    def _restart_if_gone(self, process) -> None:
        """The child ``process`` was found gone: start another (at most every RESTART_S)."""
        with self._lock:
            if (self._process is not process or time.monotonic() - self._started_at < RESTART_S
                    or (process is not None and process.poll() is None)):     # (still running)
                return
            self.restarts += 1
            (logger.warning if self.restarts == 1 else logger.info)(
                "hybrid radix cache: shared tier writer process %s ended (%s); starting another "
                "(%d so far; its objects are written by the scheduler's process meanwhile)",
                process and process.pid, process and process.poll(), self.restarts)
            self._start()

    def write(self, path: str, obj: SharedObject) -> None:
        """Write ``obj`` to ``path`` in the child; OSError as a write in process would raise,
        WriterUnavailable when the child is gone."""
        try:
            conn = self._free.get_nowait()
            while conn.process is not self._process:   # of a child started before this one
                conn.sock.close()
                conn = self._free.get_nowait()
        except queue.Empty:                            # (gone, and not started again yet)
            self._restart_if_gone(self._process)
            raise WriterUnavailable(errno.EPIPE, "no writer process connection") from None
        try:
            reply = conn.ask(self.chunks, path, obj)
        except OSError:
            conn.broken = True
        finally:
            if conn.broken:
                conn.sock.close()
                self._restart_if_gone(conn.process)
            else:
                self._free.put(conn)
        if conn.broken:
            raise WriterUnavailable(errno.EPIPE, "the writer process is gone")
        status, code, detail, cpu_ms = reply
        with self._lock:
            self.cpu_ms += cpu_ms
        if status != "ok":
            raise OSError(code, detail)

    def close(self) -> None:
        """Close the connections (the child ends at their end) and wait for it."""
        with self._lock:
            process, self._process = self._process, None
        while not self._free.empty():
            self._free.get().sock.close()
        if process is not None:
            try:
                process.wait(EXIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class _Connection:
    def __init__(self, sock: socket.socket, process):
        self.sock, self.process = sock, process
        self.shared: set = set()          # chunks whose descriptor went out on it
        self.broken = process is None

    def ask(self, chunks: SharedChunks, path: str, obj: SharedObject):
        if self.broken:
            raise OSError(errno.EPIPE, "no writer process")
        new = sorted({r[0] for r in obj.refs if isinstance(r, tuple)} - self.shared)
        message = pickle.dumps((path, obj.key, obj.kind, obj.fingerprint, obj.refs, new))
        socket.send_fds(self.sock, [message], [chunks.fds[c] for c in new])
        self.shared.update(new)
        reply = self.sock.recv(REPLY_BYTES)
        if not reply:
            raise OSError(errno.EPIPE, "the writer process closed its end")
        return pickle.loads(reply)


# ---- the child ---------------------------------------------------------------------------------
def _serve(sock: socket.socket, maps: dict, lock: threading.Lock) -> None:
    """One connection's objects until the parent closes it."""
    from hpc_radix.persistence import pack_object

    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, MESSAGE_BYTES, 64)
        except OSError:
            return
        if not message:
            return
        cpu = time.thread_time()
        path, key, kind, fingerprint, refs, new = pickle.loads(message)
        with lock:
            for chunk, fd in zip(new, fds):
                maps[chunk] = memoryview(mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED))
                os.close(fd)
        try:
            parts = [r if isinstance(r, bytes) else maps[r[0]][r[1]:r[1] + r[2]] for r in refs]
            write_file(path, pack_object(key, kind, fingerprint, parts))
            reply = ("ok", 0, "", 0.0)
        except OSError as err:
            reply = ("error", err.errno or errno.EIO, str(err), 0.0)
        except Exception as err:  # noqa: BLE001 - told to the parent, which drops the object
            reply = ("error", errno.EIO, repr(err), 0.0)
        reply = (*reply[:3], 1e3 * (time.thread_time() - cpu))
        try:
            sock.send(pickle.dumps(reply))
        except OSError:
            return


def main(fds: list) -> None:
    maps, lock = {}, threading.Lock()
    threads = [threading.Thread(target=_serve, args=(socket.socket(fileno=fd), maps, lock))
               for fd in fds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


if __name__ == "__main__":
    main([int(fd) for fd in sys.argv[1:]])
