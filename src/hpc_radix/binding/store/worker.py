"""The shared tier's background threads (design §5.6): every call into the store runs there,
never on the scheduler thread (a store call can block: a full disk, an unreachable master).

Two threads, one for the reads and one for the writes, so a read never waits behind a write
(a state image is tens of MB, a long path's existence queries a file call per block). Three jobs:
- ``Probe``: a waiting request's prompt. One batched existence query over its blocks beyond
  what the cache holds, a second over the states those blocks can end in; the deepest found
  is the answer, with the blocks to read with it.
- ``Fill``: what a probe found, read straight into the host slabs the scheduler allocated for
  it and checked (key, fingerprint, checksum, tokens), several objects at a time (a small pool
  beside the read thread); a bad object leaves them unfilled. A probe that came with slabs
  enough for what it found (``Probe.reserved``) is filled at once, in the same job.
- ``Write``: a snapshot that landed on host, with its path: the state and each block the
  store lacks, several objects at a time (a second small pool). The bytes go to the store
  straight from the host slabs; a slab let go meanwhile (its generation changed) drops its
  object before it is published, so nothing written over is stored.
The scheduler thread takes finished jobs with ``take_done``. Writes go newest first: a write
reads its bytes from host slabs when its turn comes, and under a backlog the oldest are the
likeliest to find theirs let go (overtaken) by then. The write queue is bounded: when it is
full the oldest write is dropped and counted; the scheduler never waits on the tier.
"""
from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from hpc_radix.errors import StoreObjectError
from hpc_radix.index.keys import BLOCK_BYTES, BLOCK_TOKENS, TOKEN_BYTES

from ..host.memory import HostMemory
from . import ObjectStore
from .writer import WriterUnavailable
from .directory import StateDirectory
from .objects import (
    ANCHOR_BYTES, BLOCK, STATE, StoredState, block_head_bytes, block_key, chain, read_and_check,
    state_head_bytes, state_key, state_payload,
)

logger = logging.getLogger(__name__)

MAX_WRITES = 256            # snapshots queued for the store at most; the oldest are dropped
KNOWN_BLOCKS = 1 << 20      # block keys remembered as stored (not asked about again while
                            # the store's eviction horizon has not passed them)
FULL_TAIL_ANCHORS = 4       # the deepest anchors probed at every tail length, the rest at 0
FIRST_BATCH = 8             # blocks in a probe's first existence query (then 16, 32, ...)
RELIST_S = 5.0              # the write thread takes the store's listing this often, idle too
JOURNALS_S = 0.25           # the read thread reads the other servers' journals this often
# A fill's objects (a state image, tens of 1 MiB blocks) are read this many at a time: each file
# call lets go of the GIL and waits for it back while the scheduler thread runs Python, so one
# thread reading them in turn waits at every call. Beside a busy thread a 37 MiB state and 48
# blocks took 195 ms read in turn, 80 ms four at a time, 65 ms eight or sixteen (a 16-core GPU
# host; on 2 cores eight read as fast as four): benchmarks/micro/tier_fill_beside_busy_thread.py
FILL_THREADS = 8
# A write's objects (its state, the blocks the store lacks) go out this many at a time, for the
# same reason: on the H100 one writer thread, an object at a time, kept up with ~1 GB/s of the
# 8 GiB server's write-through and lost 105 states whose slabs were let go before their turn.
WRITE_THREADS = 4
# While a fill runs no object put starts (for this long at most): on the H100 the fills took 26
# ms beside the puts four at a time against 19 with one (the page cache, the GIL), and a request
# waits for its fill, while nobody waits for a write.
READS_FIRST_S = 0.1


@dataclass
class Write:
    namespace: Optional[str]
    path: bytes                   # the anchor's tokens (whole blocks)
    tail: bytes
    kind: str
    role: str
    hits: int
    node_slabs: list
    state_slabs: list             # the image's slabs, then the tail's
    generations: list             # of node_slabs + state_slabs when offered

    @property
    def state_generations(self) -> list:
        return self.generations[len(self.node_slabs):]


@dataclass
class Probe:
    tokens: bytes                 # the prompt up to what a match may resume at
    namespace: Optional[str]
    local_blocks: int             # blocks the cache holds on this path
    local_frontier: int           # the deepest state it holds on it
    epoch: int
    started: float = field(default_factory=time.monotonic)
    answered_at: float = 0.0      # when the probe was answered (the fill waits from then)
    fill_started: float = 0.0
    # host slabs the scheduler gave with the question (the directory named the anchor): the
    # fill follows the answer at once when they are enough, into their first ``slab_count``
    reserved: list = field(default_factory=list)
    # found: the deepest stored state it continues, and the blocks to read with it
    frontier: int = 0
    first_block: int = 0          # the first block read with it (those before: the cache's)
    state_key: Optional[str] = None
    block_keys: list = field(default_factory=list)  # of blocks first_block .. its anchor
    slab_count: int = 0           # host slabs it needs: the blocks, the image, the tail
    # the host slabs the scheduler gave it, whether the read went into them, and what the
    # state object says
    slabs: list = field(default_factory=list)
    filled: bool = False
    kind: str = ""
    role: Optional[str] = None
    hits: int = 0
    answered: bool = False        # (the scheduler's) the request waits no longer
    finished: threading.Event = field(default_factory=threading.Event)   # the worker's job is done


class StoreWorker:
    def __init__(self, store: ObjectStore, memory: HostMemory, image_slabs: int, fingerprint: int):
        self.store = store
        self.memory = memory
        self.image_slabs = image_slabs
        self.fingerprint = fingerprint
        self.stats = collections.Counter()
        self._cpu_counting = threading.Lock()     # the threads' CPU times, counted from several
        self._reads_first = threading.Condition()
        self._filling = 0             # fills running: no put starts meanwhile (READS_FIRST_S)
        self._known: collections.OrderedDict = collections.OrderedDict()   # key -> wall time seen
        self._horizon = 0.0           # the store's eviction horizon, as the write thread last saw it
        self._chunks_told = 0         # host chunks the store was told of (use_memory)
        self._cv = threading.Condition()
        self._reads: collections.deque = collections.deque()
        self._writes: collections.deque = collections.deque()
        self._done: collections.deque = collections.deque()
        self._busy = 0                # jobs running
        self._stop = False
        self.directory = StateDirectory()
        self._listing = None
        self._relist()
        self._read_journals()
        self._threads = [
            threading.Thread(target=self._run, name="hpc-shared-tier-reads", daemon=True,
                             args=(self._reads, self._reads.popleft, self._read_journals, JOURNALS_S)),
            threading.Thread(target=self._run, name="hpc-shared-tier-writes", daemon=True,
                             args=(self._writes, self._writes.pop, self._relist, RELIST_S))]
        self._object_reads = concurrent.futures.ThreadPoolExecutor(
            FILL_THREADS, thread_name_prefix="hpc-shared-tier-fill")
        self._object_writes = concurrent.futures.ThreadPoolExecutor(
            WRITE_THREADS, thread_name_prefix="hpc-shared-tier-put")
        for thread in self._threads:
            thread.start()

    # ---- the scheduler thread's side -----------------------------------------------------------
    def submit(self, job) -> None:
        """Queue a job; a write beyond MAX_WRITES queued drops the oldest."""
        with self._cv:
            if isinstance(job, Write):
                if len(self._writes) >= MAX_WRITES:
                    self._writes.popleft()
                    self.stats["store_writes_dropped"] += 1
                self._writes.append(job)
            else:
                self._reads.append(job)
            self._cv.notify_all()

    def counters(self) -> dict:
        """The tier's running counts: the backend's (puts, bytes, evictions) and its threads'."""
        return {**self.store.counters(), **self.stats}

    def take_done(self) -> list:
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until every queued job ran (tests, shutdown); whether it did in time."""
        end = time.monotonic() + timeout
        with self._cv:
            while self._reads or self._writes or self._busy:
                if not self._cv.wait(max(0.0, end - time.monotonic())):
                    return False
        return True

    def cancel(self, timeout: float = 60.0) -> None:
        """A flush: drop every queued job (their slabs are about to be cleared; a write of
        them would be overtaken anyway) and wait for the one running, which may be copying
        into host slabs."""
        with self._cv:
            self.stats["store_writes_dropped"] += len(self._writes)
            self._writes.clear()
            self._reads.clear()
        self.drain(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Finish the queued writes (at most ``timeout``), then let go of the store."""
        self.drain(timeout)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for thread in self._threads:
            thread.join(timeout)
        self._object_reads.shutdown(wait=False)
        self._object_writes.shutdown(wait=False)
        self.store.close()

    # ---- the threads -----------------------------------------------------------------------------
    def _run(self, queue: collections.deque, take, between, every: float) -> None:
        """One thread's loop: the jobs of ``queue``, each taken by ``take``; ``between`` after
        each job and every ``every`` seconds while idle."""
        while True:
            with self._cv:
                if not (queue or self._stop):
                    self._cv.wait(every)
                if self._stop:
                    return
                job = take() if queue else None
                self._busy += job is not None
            if job is not None:
                self._run_job(job)
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()
            between()

    def _relist(self) -> None:
        """The directory of states from the store's listing, when the backend listed anew."""
        try:
            listing = self.store.listing()
            self._horizon = self.store.eviction_horizon()
            if listing is not self._listing:
                self._listing = listing
                self.directory.relist(listing)
        except Exception:  # noqa: BLE001 - a tier fault: the directory stays as it was
            logger.exception("hybrid radix cache: shared tier listing failed")

    def _read_journals(self) -> None:
        """The states the other servers stored since the last read, into the directory."""
        try:
            keys = self.store.journaled()
            if keys is not None:
                self.directory.told(keys, journals_read=True)
        except Exception:  # noqa: BLE001 - a tier fault: the directory goes stale (incomplete)
            logger.exception("hybrid radix cache: shared tier journals not read")

    def _run_job(self, job) -> None:
        start, cpu = time.monotonic(), time.thread_time()
        write = isinstance(job, Write)
        try:
            self._do(job)
        except Exception:  # noqa: BLE001 - a tier fault never stops the thread or the server
            logger.exception("hybrid radix cache: shared tier job failed")
            self.stats["store_job_errors"] += 1
        finally:
            self._count_cpu(write, cpu)
            if not write:
                self._read_done(job, start)

    def _count_cpu(self, write: bool, since: float) -> None:
        """The thread CPU time since ``since`` of a tier thread (the worker's or a pool's):
        Python in it holds the GIL the scheduler thread waits for."""
        with self._cpu_counting:
            self.stats[f"store_{'write' if write else 'read'}_cpu_ms"] += 1e3 * (time.thread_time() - since)

    def _pooled(self, write: bool, fn, *args) -> concurrent.futures.Future:
        """``fn(*args)`` on the objects' pool of the writes or the reads, its CPU time counted."""
        def timed():
            cpu = time.thread_time()
            try:
                return fn(*args)
            finally:
                self._count_cpu(write, cpu)
        return (self._object_writes if write else self._object_reads).submit(timed)

    def _read_done(self, p: Probe, start: float) -> None:
        """Time a probe or a fill that began at ``start`` and hand it to the scheduler."""
        end = time.monotonic()
        self.stats["store_read_ms"] += 1e3 * (end - start)
        if p.slabs:                                   # the fill, into the scheduler's slabs
            self.stats["store_fill_ms"] += 1e3 * (end - p.fill_started)
            self.stats["store_fill_wait_ms"] += 1e3 * (p.fill_started - p.answered_at)
            self.stats["store_hit_answered_ms"] += 1e3 * (end - p.started)
        if p.slabs or p.state_key is None:            # a miss, or the fill: answered in full
            self.stats["store_answered_ms"] += 1e3 * (end - p.started)
        self._done.append(p)
        p.finished.set()

    def _do(self, job) -> None:
        chunks = self.memory.ready_chunks
        if chunks != self._chunks_told:             # (new chunks pinned since: a few times a run)
            self._chunks_told = chunks
            self.store.use_memory(self.memory.regions())
        if isinstance(job, Write):
            self._write(job)
        elif job.slabs:
            self._fill(job)
        else:
            self._probe(job)
            if job.state_key is not None and job.slab_count <= len(job.reserved):
                job.slabs = job.reserved[:job.slab_count]
                self._fill(job)

    # ---- writes ------------------------------------------------------------------------------
    def _write(self, w: Write) -> None:
        if self._overtaken(w.state_slabs, w.state_generations):   # queued too long: not its blocks either
            return
        blocks = len(w.path) // BLOCK_BYTES
        digests = chain(w.path, w.namespace, blocks)
        skey = state_key(digests[blocks], w.tail, self.fingerprint)
        keys = [block_key(d, self.fingerprint) for d in digests[1:]]
        # a block is known from a moment before its object was last stored or used: once the
        # store's eviction horizon passes that moment it may be gone, and is asked about again
        seen = time.time()
        self._horizon = horizon = self.store.eviction_horizon()
        unknown = [b for b, k in enumerate(keys) if not self._known_since(k, horizon)]
        try:
            write = self._write_by_process if self._by_process(w.node_slabs + w.state_slabs) else self._write_here
            done = write(w, skey, keys, unknown)
        except WriterUnavailable:                     # (the process is started again later)
            self.stats["store_writer_unavailable"] += 1
            done = self._write_here(w, skey, keys, unknown)
        if done is None:                              # the state was there
            self.stats["store_states_present"] += 1
            self.directory.told([skey])
            return
        state_written, puts, written = done
        self.stats["store_blocks_written"] += len(written)
        for b in unknown:
            if b in written or b not in puts:
                self._remember(keys[b], seen)
        if not state_written or len(written) < len(puts):
            self._overtaken(w.node_slabs + w.state_slabs, w.generations)   # (or a store fault)
            return
        self.stats["store_states_written"] += 1
        self.store.journal(skey)
        self.directory.told([skey])

    def _write_here(self, w: Write, skey: str, keys: list, unknown: list):
        """(whether the state was written, the blocks put, those written) by this process's
        threads; None when the state was there."""
        if self.store.exists([skey])[0]:
            return None
        missing = [b for b, present in zip(unknown, self.store.refresh([keys[b] for b in unknown]))
                   if not present]
        # The state and the blocks the store lacks go out WRITE_THREADS at a time. A state
        # stored before (or without) one of its blocks is not found until that block is: a
        # probe follows the stored blocks from the root and asks for states on them only.
        state = self._pooled(True, self._put_state, w, skey)
        puts = {b: self._pooled(True, self._put_block, w, b, keys[b]) for b in missing}
        return state.result(), set(puts), {b for b, put in puts.items() if put.result()}

    def _by_process(self, slabs: list) -> bool:
        """Whether the file tier's writer process reaches every one of host ``slabs``."""
        writer = getattr(self.store, "writer", None)
        if writer is None:
            return False
        shared, locate = writer.chunks.fds, self.memory.slabs.locate
        return all(locate(s)[0] in shared for s in slabs)

    def _write_by_process(self, w: Write, skey: str, keys: list, unknown: list):
        """``_write_here`` by the file tier's writer process: two messages to it and two back,
        none of its file calls in this process (WriterUnavailable when it is gone)."""
        objects = [(skey, STATE, self.fingerprint, self._state_payload(w, self._ref))]
        objects += [(keys[b], BLOCK, self.fingerprint, self._block_payload(w, b, self._ref)) for b in unknown]
        unchanged = [self._unchanged(w.state_slabs, w.state_generations)]
        unchanged += [self._unchanged([w.node_slabs[b]], [w.generations[b]]) for b in unknown]
        self._wait_for_fills()
        results = self.store.put_new(objects, unchanged)
        if results[0] == "present":
            return None
        puts = {b for b, r in zip(unknown, results[1:]) if r != "present"}
        return results[0] == "written", puts, {b for b, r in zip(unknown, results[1:]) if r == "written"}

    def _view(self, slab: int) -> np.ndarray:
        return self.memory.view(slab).numpy()

    def _state_payload(self, w: Write, part) -> list:
        """The payload of ``w``'s state object, ``part`` of each of its slabs (a view to write
        here, a ref for the writer process)."""
        return state_payload(w.kind, w.role, w.hits, w.tail, [part(s) for s in w.state_slabs])

    def _block_payload(self, w: Write, b: int, part) -> list:
        return [w.path[b * BLOCK_BYTES:(b + 1) * BLOCK_BYTES], part(w.node_slabs[b])]

    def _put_state(self, w: Write, key: str) -> bool:
        return self._put(key, STATE, self._state_payload(w, self._view), w.state_slabs,
                         w.state_generations)

    def _put_block(self, w: Write, b: int, key: str) -> bool:
        return self._put(key, BLOCK, self._block_payload(w, b, self._view), [w.node_slabs[b]],
                         [w.generations[b]])

    def _put(self, key: str, kind: int, payload: list, slabs: list, generations: list) -> bool:
        """Store the object of ``payload`` (views of host ``slabs``, a small head), unless one
        of the slabs is let go before it is published. Written straight from the pinned slabs
        (by the file tier's writer process, through the same shared memory): a copy first
        would cost a pass over tens of MB and fresh memory per state, which the scheduler
        thread beside it pays for in memory bandwidth; a slab written over meanwhile changes
        its generation, so the torn object is never published (and fails its checksum)."""
        self._wait_for_fills()
        return self.store.put_object(key, kind, self.fingerprint, payload,
                                     unchanged=self._unchanged(slabs, generations))

    def _wait_for_fills(self) -> None:
        """A request waits for a fill, no one for a write: a write starts once no fill runs
        (READS_FIRST_S at most)."""
        with self._reads_first:
            self._reads_first.wait_for(lambda: not self._filling, READS_FIRST_S)

    def _unchanged(self, slabs: list, generations: list):
        """Asked before an object of ``slabs`` is published: none of them let go since."""
        return lambda: not self._changed(slabs, generations)

    def _changed(self, slabs: list, generations: list) -> bool:
        pool = self.memory.slabs
        return any(pool.generation(s) != g for s, g in zip(slabs, generations))

    def _overtaken(self, slabs: list, generations: list) -> bool:
        """Whether one of ``slabs`` was let go since the write was offered (counted)."""
        if self._changed(slabs, generations):
            self.stats["store_writes_overtaken"] += 1
            return True
        return False

    def _remember(self, key: str, seen: float) -> None:
        self._known[key] = seen
        self._known.move_to_end(key)
        if len(self._known) > KNOWN_BLOCKS:
            self._known.popitem(last=False)

    # ---- reads -------------------------------------------------------------------------------
    def _probe(self, p: Probe) -> None:
        """The deepest state on ``p``'s path beyond what the cache holds, and the blocks to
        read with it (found by existence queries; read by the fill, into host slabs)."""
        limit = len(p.tokens) // TOKEN_BYTES
        digests = chain(p.tokens, p.namespace, limit // BLOCK_TOKENS)
        keys = [block_key(d, self.fingerprint) for d in digests[p.local_blocks + 1:]]
        top = p.local_blocks + self._stored_run(keys)
        found = self._deepest_state(p, digests, top, limit)
        p.answered_at = time.monotonic()
        if found is None:
            self.stats["store_probe_misses"] += 1
            return
        p.frontier, p.state_key = found
        anchor = p.frontier // BLOCK_TOKENS
        p.first_block = min(p.local_blocks, anchor)
        p.block_keys = keys[p.first_block - p.local_blocks:anchor - p.local_blocks]
        p.slab_count = len(p.block_keys) + self.image_slabs + (1 if p.frontier % BLOCK_TOKENS else 0)
        self.stats["store_probe_hits"] += 1

    def _stored_run(self, keys: list) -> int:
        """How many of ``keys``, from the first, the store holds: asked in batches that double
        from FIRST_BATCH, so a prompt the store knows nothing of costs one small query, not
        one per block of a long prompt. Blocks this server stored or found stored since the
        store's eviction horizon (as the write thread last saw it: the file backend's count
        is the write thread's) are not asked about; the fill checks them anyway."""
        run, batch, horizon = 0, FIRST_BATCH, self._horizon
        while run < len(keys):
            found = self._exists_unless_known(keys[run:run + batch], horizon)
            held = found.index(False) if False in found else len(found)
            run += held
            if held < len(found):
                break
            batch *= 2
        return run

    def _known_since(self, key: str, horizon: float) -> bool:
        """Whether this server stored or saw ``key`` stored after ``horizon`` (so it is there)."""
        return self._known.get(key, 0.0) > horizon

    def _exists_unless_known(self, keys: list, horizon: float) -> list[bool]:
        found = [self._known_since(k, horizon) for k in keys]
        ask = [i for i, held in enumerate(found) if not held]
        if ask:
            for i, held in zip(ask, self.store.exists([keys[i] for i in ask])):
                found[i] = held
        return found

    def _deepest_state(self, p: Probe, digests: list, top: int, limit: int):
        """(frontier, key) of the deepest stored state the prompt continues, past the cache's
        own deepest and on blocks the cache or the store holds; None without one. States lie
        anywhere in a block (endpoints, prompt tails); every tail length is asked for at the
        deepest anchors, where the blocks written with a state end, and block boundaries
        below them. Where the directory knows every state there, only those it names are
        asked about."""
        candidates, known, anchors = [], self.directory.known_states(), self.directory.anchors
        for anchor in range(top, p.local_frontier // BLOCK_TOKENS - 1, -1):
            if known is not None and digests[anchor][:ANCHOR_BYTES] not in anchors:
                continue                              # no state on it: no keys to make
            tails = range(BLOCK_TOKENS - 1, -1, -1) if anchor > top - FULL_TAIL_ANCHORS else (0,)
            for t in tails:
                frontier = anchor * BLOCK_TOKENS + t
                if p.local_frontier < frontier <= limit:
                    tail = p.tokens[anchor * BLOCK_BYTES:frontier * TOKEN_BYTES]
                    candidates.append((frontier, state_key(digests[anchor], tail, self.fingerprint)))
        if known is not None:
            candidates = [c for c in candidates if c[1] in known]
        if not candidates:
            return None
        for (frontier, key), present in zip(candidates, self.store.exists([k for _, k in candidates])):
            if present:
                return frontier, key
        return None

    def _fill(self, p: Probe) -> None:
        """Read what ``p`` found straight into the host slabs the scheduler gave it (the state's
        image and tail, then the blocks) and check every object; a vanished, torn, damaged or
        foreign one leaves it unfilled (a miss: the scheduler lets the slabs go). The objects
        are read FILL_THREADS at a time, and all of them are done before this returns: the
        slabs are the scheduler's again once it hears."""
        p.fill_started = time.monotonic()
        anchor = p.frontier // BLOCK_TOKENS
        tail = p.tokens[anchor * BLOCK_BYTES:p.frontier * TOKEN_BYTES]
        with self._reads_first:
            self._filling += 1
        try:
            try:
                fill = self._fill_by_process if self._by_process(p.slabs) else self._fill_here
                state = fill(p, tail)
            except WriterUnavailable:                 # (the process is started again later)
                self.stats["store_writer_unavailable"] += 1
                state = self._fill_here(p, tail)
        except StoreObjectError as err:
            self.stats["store_objects_refused"] += 1
            logger.info("hybrid radix cache: shared tier object not used (%s): a miss", err)
            return
        finally:
            with self._reads_first:
                self._filling -= 1
                self._reads_first.notify_all()
        p.kind, p.role, p.hits = state.kind, state.role, state.hits
        p.filled = True

    def _fill_items(self, p: Probe, tail: bytes, part) -> list:
        """(key, head bytes, ``part`` of each of its slabs, what ``read_and_check`` checks) of
        each object a fill reads: the state, then its blocks."""
        parts, blocks = [part(s) for s in p.slabs], len(p.block_keys)
        items = [(p.state_key, state_head_bytes(p.state_key, tail), parts[blocks:],
                  ("state", p.state_key, self.fingerprint, tail, self.image_slabs))]
        for i, key in enumerate(p.block_keys):
            b = p.first_block + i
            items.append((key, block_head_bytes(key), [parts[i]],
                          ("block", key, self.fingerprint, p.tokens[b * BLOCK_BYTES:(b + 1) * BLOCK_BYTES])))
        return items

    def _fill_here(self, p: Probe, tail: bytes) -> StoredState:
        """``_fill``'s reads and checks by this process's threads (StoreObjectError: a miss)."""
        reads = [self._pooled(False, read_and_check, functools.partial(self.store.read_into, key),
                              head, slabs, check)
                 for key, head, slabs, check in self._fill_items(p, tail, self._view)]
        concurrent.futures.wait(reads)
        for read in reads[1:]:
            read.result()
        return reads[0].result()

    def _fill_by_process(self, p: Probe, tail: bytes) -> StoredState:
        """``_fill_here`` by the file tier's writer process: one message out and one back,
        none of the reads, checksums or checks in this process (StoreObjectError: a miss;
        WriterUnavailable when the process is gone)."""
        results = self.store.fill([(self.store.path_of(key), head, refs, check)
                                   for key, head, refs, check in self._fill_items(p, tail, self._ref)])
        refused = next((why for _, why in results if isinstance(why, str)), None)
        if refused is not None:
            raise StoreObjectError(refused)
        return results[0][1]

    def _ref(self, slab: int) -> tuple:
        """Where the writer process finds host ``slab``: (chunk, offset, bytes)."""
        return (*self.memory.slabs.locate(slab), self.memory.slabs.slab_bytes)
