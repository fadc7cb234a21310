"""The file tier's writes and read-backs in a process of their own (design §5.6,
``--cache-store-writer process``): a write's objects are checked for in the directory,
checksummed, written and published there, and a read-back's read into host slabs and checked,
through the same shared memory, so none of those file calls and checksum parts waits for the
scheduler's GIL or makes the scheduler wait for it.

In the scheduler's process every file call and every 1 MiB of a checksum lets go of the GIL
and takes it back at the next forced hand-over, which the scheduler thread waits for. Here a
write (a state and the blocks under it) costs the scheduler's process two messages out and two
back: one to have the objects the directory lacks written to temporary files (those it holds
are marked used instead), one to publish those whose slabs were not let go meanwhile (the
generations are the scheduler's: ``FileStore.put_new`` checks them in between). A read-back
(a state and the blocks read with it) is one message and its answer: each object's size and
its fields, or why it is not usable.

The host tier's chunks are memfd mappings (SGLang's ``alloc_shm``); a chunk's descriptor goes
out with the first message that names it. A child that died (killed, out of memory) fails the
job in flight, which is then done in the scheduler's process; it is started again at most
every RESTART_S. Objects are the bytes ``persistence.pack_object`` and ``write_file`` make in
process.
"""
from __future__ import annotations

import concurrent.futures
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
from typing import Optional, Sequence

logger = logging.getLogger(__name__)

PACKET_BYTES = 1 << 16      # a message goes in packets of at most this (a long prompt's tokens
                            # in one object make a message of hundreds of KB)
BATCH = 64                  # objects per message (each ~0.4 KB past its tokens: key, slab refs)
OBJECT_THREADS = 4          # the child writes a message's objects this many at a time
FILL_THREADS = 8            # and reads a fill's this many at a time
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


def send_message(sock: socket.socket, message, fds: Sequence[int] = ()) -> None:
    """``message`` pickled, in packets whose first byte says whether more follow; the
    descriptors go with the first."""
    data = memoryview(pickle.dumps(message))
    step = PACKET_BYTES - 1
    for at in range(0, max(len(data), 1), step):
        packet = [b"\1" if at + step < len(data) else b"\0", data[at:at + step]]
        socket.send_fds(sock, packet, fds if at == 0 else [])


def recv_message(sock: socket.socket):
    """(the message, the descriptors that came with it), or None once the other end closed."""
    parts, fds = [], []
    while True:
        packet, new, flags, _ = socket.recv_fds(sock, PACKET_BYTES, 64)
        fds += new
        if not packet:
            for fd in fds:             # (the other end closed mid-message)
                os.close(fd)
            return None
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise OSError(errno.EMSGSIZE, "a packet did not fit")
        parts.append(packet[1:])
        if packet[0] == 0:
            return pickle.loads(b"".join(parts)), fds


class SharedChunks:
    """The host tier's chunks the writer process can read: chunk index -> memfd."""

    def __init__(self):
        self.fds: dict = {}

    def add(self, chunk: int, fd: int) -> None:
        self.fds[chunk] = fd

    def close(self) -> None:
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            os.close(fd)


class WriterUnavailable(OSError):
    """The writer process is not running: the write goes on in the scheduler's process."""


class WriterProcess:
    """The scheduler's side. ``write(items)``: each item (tmp path, final path, key, kind,
    fingerprint, payload refs: bytes or (chunk, offset, nbytes)) written to its tmp path unless
    its final path exists (then marked used): per item "written", "present" or an error;
    with ``state_first`` a present first item skips the rest. ``publish(renames, discards)``."""

    def __init__(self, chunks: SharedChunks, connections: int = 2):
        """``connections``: jobs in flight at once (the worker's write and read threads each
        have one: a fill never finds none free behind a write)."""
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
            self._process = subprocess.Popen([sys.executable, "-m", __name__, *map(str, ends)],
                                             pass_fds=ends, stdin=subprocess.DEVNULL)
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

    def write(self, items: list, state_first: bool) -> list:
        results = []
        for at in range(0, len(items), BATCH):
            results += self._ask(("write", items[at:at + BATCH], state_first and at == 0))
            if results[0] == "present" and state_first:
                return results + ["skipped"] * (len(items) - len(results))
        return results

    def fill(self, items: list) -> list:
        """Read each object into host slabs and check it, all at once: ``items`` are (path,
        head bytes, refs of the slabs its rest goes to, ("state", key, fingerprint, tail,
        image slabs) or ("block", key, fingerprint, tokens)). Per item (its size or None,
        the state's ``StoredState`` or None for a block, or why it is not usable)."""
        return self._ask(("fill", items))

    def publish(self, renames: list, discards: list) -> list:
        """Rename each (tmp, final) and remove each of ``discards``: per rename True or False."""
        out = []
        for at in range(0, max(len(renames), len(discards)), BATCH):
            out += self._ask(("publish", renames[at:at + BATCH], discards[at:at + BATCH]))
        return out

    def _ask(self, message) -> list:
        try:
            conn = self._free.get_nowait()
            while conn.process is not self._process:   # of a child started before this one
                conn.sock.close()
                conn = self._free.get_nowait()
        except queue.Empty:                            # (gone, and not started again yet)
            self._restart_if_gone(self._process)
            raise WriterUnavailable(errno.EPIPE, "no writer process connection") from None
        try:
            results, cpu_ms = conn.ask(self.chunks, message)
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
        with self._lock:
            self.cpu_ms += cpu_ms
        if isinstance(results, tuple):                 # ("error", why): a fault of the child's
            logger.warning("hybrid radix cache: shared tier writer process failed a job (%s); "
                           "the scheduler's process does it", results[1])
            raise WriterUnavailable(errno.EIO, results[1])
        return results

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

    def ask(self, chunks: SharedChunks, message):
        if self.broken:
            raise OSError(errno.EPIPE, "no writer process")
        refs = {"write": 5, "fill": 2}.get(message[0])          # where an item names its slabs
        used = {r[0] for item in message[1] for r in item[refs] if isinstance(r, tuple)} if refs else set()
        new = sorted(used - self.shared)
        send_message(self.sock, (*message, new), [chunks.fds[c] for c in new])
        self.shared.update(new)
        reply = recv_message(self.sock)
        if reply is None:
            raise OSError(errno.EPIPE, "the writer process closed its end")
        return reply[0]


# ---- the child ---------------------------------------------------------------------------------
class _Child:
    def __init__(self):
        self.maps: dict = {}
        self.dirs: set = set()
        self.lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(OBJECT_THREADS)
        self.reads = concurrent.futures.ThreadPoolExecutor(FILL_THREADS)   # a request waits for them

    def serve(self, sock: socket.socket) -> None:
        """One connection's messages until the parent closes it."""
        while True:
            try:
                received = recv_message(sock)
            except OSError:
                return
            if received is None:
                return
            cpu = time.process_time()
            (kind, *args, new), fds = received
            with self.lock:
                for chunk, fd in zip(new, fds):
                    self.maps[chunk] = memoryview(mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED))
                    os.close(fd)
            try:
                results = getattr(self, kind)(*args)
            except Exception as err:  # noqa: BLE001 - the parent does the job itself; we go on
                results = ("error", repr(err))
            try:
                send_message(sock, (results, 1e3 * (time.process_time() - cpu)))
            except OSError:
                return

    def write(self, items: list, state_first: bool) -> list:
        if state_first and mark_used(items[0][1]):
            return ["present"] + ["skipped"] * (len(items) - 1)
        return list(self.pool.map(self.write_one, items))

    def write_one(self, item):
        from hpc_radix.persistence import pack_object

        tmp, final, key, kind, fingerprint, refs = item
        if mark_used(final):
            return "present"
        try:
            parts = [r if isinstance(r, bytes) else self.maps[r[0]][r[1]:r[1] + r[2]] for r in refs]
            write_file(tmp, pack_object(key, kind, fingerprint, parts))
            return "written"
        except OSError as err:
            remove_file(tmp)
            return (err.errno or errno.EIO, str(err))
        except Exception as err:  # noqa: BLE001 - told to the parent, which drops the object
            remove_file(tmp)
            return (errno.EIO, repr(err))

    def fill(self, items: list) -> list:
        return list(self.reads.map(self.fill_one, items))

    def fill_one(self, item):
        from hpc_radix.errors import StoreObjectError
        from .objects import read_and_check

        path, head_bytes, refs, check = item
        sizes = []

        def read(parts: list) -> Optional[int]:
            sizes.append(read_file_into(path, parts))
            return sizes[0]
        try:
            fields = read_and_check(read, head_bytes, [self.maps[c][at:at + n] for c, at, n in refs], check)
            return sizes[0], fields
        except StoreObjectError as err:
            return (sizes[0] if sizes else None), str(err)

    def publish(self, renames: list, discards: list) -> list:
        done = []
        for tmp, final in renames:
            try:
                folder = os.path.dirname(final)
                if folder not in self.dirs:
                    os.makedirs(folder, exist_ok=True)
                    self.dirs.add(folder)
                os.replace(tmp, final)
                done.append(True)
            except OSError:
                self.dirs.discard(os.path.dirname(final))
                remove_file(tmp)
                done.append(False)
        for tmp in discards:
            remove_file(tmp)
        return done


def read_file_into(path: str, parts: list) -> Optional[int]:
    """The object at ``path`` read straight into ``parts`` (writable buffers) with one
    ``preadv`` when its size is theirs (shorter: torn, found so), and marked just used
    (evicted last): five system calls, no copy; its size, or None without one."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size == sum(memoryview(p).nbytes for p in parts):
                size = os.preadv(fd, parts, 0)
            os.utime(fd)
        finally:
            os.close(fd)
    except OSError:
        return None
    return size


def mark_used(path: str) -> bool:
    """Whether the object is there, marked just used (evicted last) if so."""
    try:
        os.utime(path)
        return True
    except OSError:
        return False


def remove_file(path: str) -> bool:
    """Remove ``path`` if it is there; whether it was (another server may have removed it)."""
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def main(fds: list) -> None:
    child = _Child()
    threads = [threading.Thread(target=child.serve, args=(socket.socket(fileno=fd),)) for fd in fds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    child.pool.shutdown()


if __name__ == "__main__":
    main([int(fd) for fd in sys.argv[1:]])
