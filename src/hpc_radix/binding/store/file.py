"""The shared tier in a directory (local disk or a shared filesystem): one file per object.

A write goes to a private temporary file and is published by ``rename``, so a reader or a
crashed server never sees half an object, and two servers writing one key leave one whole
object (the later rename wins). No fsync: a killed process's writes are in the page cache
already, and what a power loss tears is caught by the object's checksum and read as a miss,
while the writer must keep up with the host tier's turnover (on the GPU, with 8 GB of host,
most states were let go before their turn to be written) and an fsync costs a disk flush per
1 MiB block. The directory is the index: a restart, or another server,
finds what is there. A byte budget is kept by evicting the least recently used objects (a read
refreshes an object's time): every server sharing the directory evicts by the same order, so
they agree on what goes instead of fighting over it; a file another server removed meanwhile
is skipped. Each server recounts the directory every few seconds, since the others' writes
count against the same budget, and none fills the disk beyond a floor of free space.

Every file call of the tier's threads lets go of the GIL, and gets it back only at the
interpreter's next forced hand-over while the scheduler thread runs Python: a recount that
stats each object in Python keeps a tier thread seconds where it takes milliseconds alone.
So the directory is listed by ``find`` in a child process (benchmarks/micro/
tier_io_beside_busy_thread.py gives the figures), the disk's free space is asked twice a
second rather than at every write, and the object subdirectories once. Reads and writes come
from the worker's threads, the writes several at a time: they count their bytes under a lock,
before writing them, so that puts side by side make room for each other (what is being
written cannot be evicted, so the directory may pass its budget by those objects while they
are; the last of them to be published brings it back within).
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from typing import Callable, Optional, Sequence

from hpc_radix.persistence import object_head_bytes

from . import ObjectStore
from .writer import (
    WriterProcess, WriterUnavailable, mark_used, read_file_into, remove_file, write_file,
)

logger = logging.getLogger(__name__)

TMP_STALE_S = 600          # a temporary file (or a journal) this old is a stopped writer's: removed
JOURNAL_MAX = 1 << 20      # a server's journal starts afresh, under a new name, past this size
DISK_RECHECK_S = 0.5       # the disk's free space is asked again this often (a call per write
                           # is one more wait for the GIL), or sooner when this server's writes
                           # since could have taken half the room left above the floor


class FileStore(ObjectStore):
    name = "file"
    EVICT_TO = 0.9         # an eviction pass frees down to this share of the budget
    RESCAN_S = 5.0         # how old this server's count of the directory's bytes may get
    MIN_FREE = 0.05        # the share of the disk a write never takes (logs, other files)

    def __init__(self, directory: str, budget_bytes: int, writer: Optional[WriterProcess] = None):
        super().__init__()
        self.writer = writer           # writes objects of shared host memory out of process
        self.location = os.path.abspath(directory)
        self.budget = budget_bytes
        self._objects = os.path.join(self.location, "objects")
        self._tmp = os.path.join(self.location, "tmp")
        self._journals = os.path.join(self.location, "journal")
        for d in (self._objects, self._tmp, self._journals):
            os.makedirs(d, exist_ok=True)
        self._journal, self._journal_bytes = None, 0      # this server's, from its first state
        self._subdirs: set = set()     # object subdirectories known to exist
        self._disk_at, self._disk_total, self._disk_free, self._written_since = -1e9, 0, 0, 0
        self._tailed: dict = {}        # the others' journals: name -> (bytes read, partial line)
        self._drop_stale_tmp()
        self._horizon = 0.0
        self._budgeting = threading.RLock()   # the byte count, the recount and the evictions
        self._in_flight = 0            # bytes of the puts counted but not yet published
        # temporary files named without a system call per put (a pid and a random word once):
        # each call lets go of the GIL and waits for it back beside the scheduler thread
        self._tmp_prefix = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self._tmp_names = itertools.count()
        self._listed_by_find = True     # until find is missing or cannot print what is needed
        self._count()
        self._failing = False

    def path_of(self, key: str) -> str:
        """Where ``key``'s object lies (the writer process reads it there)."""
        return os.path.join(self._objects, key[:2], key)

    # ---- writes --------------------------------------------------------------------------
    def put(self, key: str, parts: Sequence, unchanged: Optional[Callable[[], bool]] = None) -> bool:
        size = sum(memoryview(p).nbytes for p in parts)
        if size > self.budget:
            self._put_failed()
            return False
        with self._budgeting:                 # the worker puts several objects at a time
            if not self._make_room(size):
                self._failed(OSError(errno.ENOSPC, f"less than {self.MIN_FREE:.0%} of the disk free"))
                return False
            self.used += size                 # counted from now: the other puts make room for it
            self._in_flight += size           # (and a recount, which cannot see it yet, too)
            self._written_since += size
        tmp = self._tmp_path(key)
        published = False
        try:
            self._write(tmp, parts)
            if unchanged is None or unchanged():
                final = self.path_of(key)
                if key[:2] not in self._subdirs:
                    os.makedirs(os.path.dirname(final), exist_ok=True)
                    self._subdirs.add(key[:2])
                with self._budgeting:
                    os.replace(tmp, final)    # published whole, or not at all
                    self._in_flight -= size
                    if self.used > self.budget:   # passed by puts side by side: back within
                        self._make_room(0)
                published = True
        except OSError as err:
            self._subdirs.discard(key[:2])
            self._failed(err)
        if not published:
            remove_file(tmp)
            with self._budgeting:
                self.used -= size
                self._in_flight -= size
            return False
        self._failing = False
        return self._stored(size)

    def put_new(self, objects: list, unchanged: list) -> list:
        """One write's objects by the writer process (``objects``: (key, kind, fingerprint,
        payload refs), its state first): those the directory lacks written,
        those it holds marked used, each published if ``unchanged[i]()`` once written. Per
        object "written", "present", "skipped" (the state was there: nothing else asked),
        "dropped" (its slabs let go meanwhile) or "failed". WriterUnavailable when the process
        is gone (what it wrote is removed: the caller writes them in process)."""
        sizes = [object_head_bytes(key) + sum(len(r) if isinstance(r, bytes) else r[2] for r in refs)
                 for key, _, _, refs in objects]
        size = sum(sizes)
        with self._budgeting:
            if size > self.budget or not self._make_room(size):
                self._failed(OSError(errno.ENOSPC, f"{size} bytes do not fit the budget or the disk"))
                return ["failed"] * len(objects)
            self.used += size                 # counted from now, as a put's
            self._in_flight += size
            self._written_since += size
        items = [(self._tmp_path(key), self.path_of(key), key, kind, fp, refs)
                 for key, kind, fp, refs in objects]
        results = ["failed"] * len(items)
        try:
            results = self.writer.write(items, state_first=True)
            written = [i for i, r in enumerate(results) if r == "written"]
            publish = [i for i in written if unchanged[i]()]
            for i in set(written) - set(publish):
                results[i] = "dropped"
            with self._budgeting:
                done = self.writer.publish([items[i][:2] for i in publish],
                                           [items[i][0] for i in written if i not in publish])
                for i, ok in zip(publish, done):
                    results[i] = "written" if ok else "failed"
        except WriterUnavailable:
            for item in items:
                remove_file(item[0])
            results = ["unwritten"] * len(items)     # (written in process next: no failure)
            raise
        finally:
            self._settle(results, sizes)
        return results

    def fill(self, items: list) -> list:
        """Objects read into host slabs and checked by the writer process (``items``: (path,
        head bytes, slab refs, what to check: ``WriterProcess.fill``): per object (its size or
        None, its state's fields or why it is not usable)."""
        results = self.writer.fill(items)
        for size, _ in results:
            self._found(size)
        return results

    def _settle(self, results: list, sizes: list) -> None:
        """Count one write's objects as they ended: the bytes of those not published leave
        the count; a budget passed by puts side by side is kept again."""
        with self._budgeting:
            self._in_flight -= sum(sizes)
            self.used -= sum(n for r, n in zip(results, sizes) if r != "written")
            if self.used > self.budget:
                self._make_room(0)
        for r, n in zip(results, sizes):
            if r == "written":
                self._stored(n)
            elif isinstance(r, tuple) or r == "failed":
                self._failed(OSError(*r) if isinstance(r, tuple) else OSError(errno.EIO, "not published"))
        if "written" in results:
            self._failing = False

    def _tmp_path(self, key: str) -> str:
        return os.path.join(self._tmp, f"{key}.{self._tmp_prefix}.{next(self._tmp_names)}")

    def counters(self) -> dict:
        writer = {} if self.writer is None else {"store_writer_process_cpu_ms": self.writer.cpu_ms}
        return {**super().counters(), **writer}

    def _write(self, path: str, parts: Sequence) -> None:
        write_file(path, parts)

    def _failed(self, err: OSError) -> None:
        """A write failed (a full disk, a lost mount): counted, logged once per run of them."""
        self._put_failed()
        if not self._failing:
            logger.warning("hybrid radix cache: shared tier %s: a write failed (%s); objects are "
                           "dropped until writes succeed again", self.location, err)
        self._failing = True

    # ---- reads ---------------------------------------------------------------------------
    def get(self, key: str) -> Optional[bytes]:
        path = self.path_of(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
            os.utime(path)                    # recently used: evicted last
        except OSError:
            data = None
        return self._read(data)

    def read_into(self, key: str, parts: Sequence) -> Optional[int]:
        """Straight into ``parts`` with one ``preadv``: no copy, no fresh memory (tens of MB
        of it cost more than the read: benchmarks/micro/tier_io_cpu.py)."""
        size = read_file_into(self.path_of(key), parts)
        return size if self._found(size) else None

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [os.path.exists(self.path_of(k)) for k in keys]

    def refresh(self, keys: Sequence[str]) -> list[bool]:
        return [mark_used(self.path_of(k)) for k in keys]

    # ---- the budget --------------------------------------------------------------------------
    def _make_room(self, size: int) -> bool:
        """Evict until ``size`` more bytes keep the directory within the budget and the disk
        above its floor of free space; False when the disk stays short (others filled it)."""
        self._count_if_stale()                # the other servers' writes since
        total, free = self._disk()
        short = int(self.MIN_FREE * total) - (free - size)
        over = self.used + size - self.budget
        if over > 0 or short > 0:
            freed = self._evict(max(self.used + size - int(self.EVICT_TO * self.budget), short))
            return short - freed <= 0
        return True

    def _disk(self) -> tuple[int, int]:
        """(size, free bytes) of the disk, less what this server wrote since it last asked."""
        room = self._disk_free - self.MIN_FREE * self._disk_total
        if (time.monotonic() - self._disk_at > DISK_RECHECK_S
                or 2 * self._written_since > room):
            disk = shutil.disk_usage(self._objects)
            self._disk_at, self._disk_total, self._disk_free = time.monotonic(), disk.total, disk.free
            self._written_since = 0
        return self._disk_total, self._disk_free - self._written_since

    def _count(self) -> list:
        """Scan the directory: what it holds now (``used``), and the eviction horizon it shows
        (anything older than what survives was evicted, by whichever server); its objects."""
        with self._budgeting:
            began = time.monotonic()
            objects = self._scan()
            self.used = sum(size for _, size, _ in objects) + self._in_flight
            self._counted = time.monotonic()
            self._listing = (began, [(os.path.basename(path), t / 1e9) for path, _, t in objects])
            if objects:
                self._horizon = max(self._horizon, min(t for _, _, t in objects) / 1e9)
            return objects

    def _count_if_stale(self) -> None:
        if time.monotonic() - self._counted > self.RESCAN_S:
            self._count()

    def listing(self) -> tuple[float, list]:
        self._count_if_stale()
        return self._listing

    # ---- the journals: which states each server stored, for the others' directories -----------
    def journal(self, key: str) -> None:
        line = f"{key}\n".encode()
        if self._journal is None or self._journal_bytes + len(line) > JOURNAL_MAX:
            old, self._journal_bytes = self._journal, 0
            self._journal = os.path.join(
                self._journals, f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            if old is not None:
                remove_file(old)
        try:
            fd = os.open(self._journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
            self._journal_bytes += len(line)
        except OSError:               # the others learn of it at their next listing instead
            pass

    def journaled(self) -> list[str]:
        keys, seen, now = [], set(), time.time()
        try:
            entries = list(os.scandir(self._journals))
        except OSError:
            return keys
        for entry in entries:
            if entry.path == self._journal:
                continue
            try:
                st = entry.stat()
                if now - st.st_mtime > TMP_STALE_S:       # a server stopped without removing it
                    remove_file(entry.path)
                    continue
                seen.add(entry.name)
                offset, partial = self._tailed.get(entry.name, (0, b""))
                if st.st_size > offset:
                    with open(entry.path, "rb") as f:
                        f.seek(offset)
                        data = f.read()
                    lines = (partial + data).split(b"\n")
                    partial = lines.pop()                 # a line still being written
                    keys += [line.decode("ascii", "replace") for line in lines if line]
                    offset += len(data)
                self._tailed[entry.name] = (offset, partial)
            except OSError:           # removed meanwhile
                continue
        for name in set(self._tailed) - seen:
            del self._tailed[name]
        return keys

    def close(self) -> None:
        if self._journal is not None:
            remove_file(self._journal)
        if self.writer is not None:
            self.writer.close()

    def fit_to_disk(self) -> int:
        """Cut the budget to what the directory holds plus 90 % of the disk's free space (the
        rest is someone's too); the free bytes seen, for the caller's warning."""
        free = shutil.disk_usage(self.location).free
        self.budget = min(self.budget, self.used + int(0.9 * free))
        return free

    def eviction_horizon(self) -> float:
        """Every server evicts the least recently used first: an object this server knows of,
        stored after the oldest one the directory still held at its last count, is there
        (up to RESCAN_S stale)."""
        self._count_if_stale()
        return self._horizon

    def _scan(self) -> list:
        """(path, size, last use in ns) of every object, as the directory holds them now."""
        if self._listed_by_find:
            listed = self._find()
            if listed is not None:
                return listed
            self._listed_by_find = False
            logger.warning("hybrid radix cache: shared tier %s: find cannot list the objects; "
                           "they are counted in Python (slower beside a busy scheduler)", self.location)
        return list(self._walk())

    def _find(self) -> Optional[list]:
        """The directory's objects listed by GNU find in a child process (None: not there)."""
        try:
            run = subprocess.run(
                ["find", self._objects, "-mindepth", "2", "-maxdepth", "2", "-type", "f",
                 "-printf", "%s %T@ %p\\0"], capture_output=True, timeout=600)
        except (OSError, subprocess.SubprocessError):
            return None
        if run.returncode and not run.stdout:      # (a file removed meanwhile: rc 1, output)
            return None
        listed = []
        for record in run.stdout.split(b"\0")[:-1]:
            size, mtime, path = record.split(b" ", 2)
            seconds, _, fraction = mtime.partition(b".")
            ns = int(seconds) * 10**9 + int((fraction + b"000000000")[:9])
            listed.append((os.fsdecode(path), int(size), ns))
        return listed

    def _walk(self):
        for sub in os.scandir(self._objects):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                try:
                    st = entry.stat()
                except FileNotFoundError:     # another server removed it meanwhile
                    continue
                yield entry.path, st.st_size, st.st_mtime_ns

    def _evict(self, want: int) -> int:
        """Free at least ``want`` bytes, least recently used first (the whole directory is
        scanned: several servers may share it); the bytes freed."""
        objects = sorted(self._count(), key=lambda o: o[2])
        freed = 0
        for path, size, last_use in objects:
            if freed >= want:
                break
            if remove_file(path):
                freed += size
                self.used -= size
                self.stats["store_evicted"] += 1
                self._horizon = max(self._horizon, last_use / 1e9)
        return freed

    def _drop_stale_tmp(self) -> None:
        now = time.time()
        for entry in os.scandir(self._tmp):
            try:
                if now - entry.stat().st_mtime > TMP_STALE_S:
                    remove_file(entry.path)
            except FileNotFoundError:
                pass

