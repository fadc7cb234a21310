"""The shared tier seen from the scheduler thread (design §5.6): what goes to the store, which
waiting request asks it, and what it read back joins the index as a host-only snapshot, which
the request's next match restores like any host hit.

- Write-through: a snapshot whose image landed on host (``offer``) is written once its path is
  on host too, if requests here resume from its role's snapshots often enough; the worker
  copies the bytes, so this thread only names the slabs.
- Read-back: a request matched for admission whose prompt goes on past the deepest state the
  cache holds asks the store (``probe``, once per request); it waits in the queue (``waiting``)
  until the answer is in or ``--cache-store-wait-ms`` passed. What was found is read into host
  slabs the index makes room for (``host_slabs_for_read``: with the question where the
  directory names the anchor, else once the answer came), then adopted. A restarted server
  warms this way, a request at a time.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import Optional

import xxhash

from hpc_radix.index import BLOCK_TOKENS, Actions, PrefixIndex, PromptKey, Role, SnapshotKind
from hpc_radix.index.keys import TOKEN_BYTES
from hpc_radix import persistence

from ..host.cache_file import weight_paths
from .worker import Probe, StoreWorker, Write

logger = logging.getLogger(__name__)

# snapshots on host waiting for their path to land there (it does within a launch or two): at
# most this many, this long; their paths are walked at a poll after a write-through landed
OFFERS_KEPT = 64
OFFER_WAIT_S = 10.0
# A state goes to the store only while its role serves at least this share of its snapshots
# here (roles.RoleStats; every role until it was seen often enough): a state image weighs as
# much as ~36 KV blocks, and the roles the traffic never resumes from (endpoints where clients
# do not echo outputs) would take the store's bandwidth and budget from those it does. Low,
# since a replica sees only its share of the hits: on two replicas of Mooncake's trace 2 %
# wrote 41 % fewer states for 0.3 % less reuse, 5 % cost 14 % of it (benchmarks/WHY.md).
STORE_MIN_PRIOR = 0.02
# Each file call of the tier's threads lets go of the GIL, and the scheduler thread, running
# Python, keeps it until the interpreter's switch interval forces a hand-over (5 ms by default):
# beside a busy thread 20 puts and gets of 2 MiB took 12x as long as alone, 2.3x at 0.5 ms
# (benchmarks/micro/tier_io_beside_busy_thread.py). With a tier, the scheduler's process
# hands over at most this late.
TIER_SWITCH_INTERVAL_S = 0.0005


class _Offer:
    """A snapshot on host waiting for its path (root to anchor; a node's path never changes)
    to land there. Paths land from the root down, mostly: a walk goes on from the first node
    the last one found not on host; once it reaches the anchor, the nodes above where it began
    are checked again before the write (one may have left host since)."""
    __slots__ = ("snapshot", "path", "until", "landed")

    def __init__(self, snapshot, path, until: float):
        self.snapshot, self.path, self.until, self.landed = snapshot, path, until, 0

    def path_on_host(self) -> bool:
        path, began = self.path, self.landed
        i = began
        while i < len(path) and path[i].on_host:
            i += 1
        self.landed = i
        if i < len(path):
            return False
        if all(n.on_host for n in path[:began]):
            return True
        self.landed = 0                  # a node above left host meanwhile: walk again
        return False


class StorePolicy:
    def __init__(self, worker: StoreWorker, index: PrefixIndex, wait_s: float, epoch: int,
                 sync_s: float = 0.0):
        """``epoch``: this build of the cache's parts (a flush starts a new one): what a probe
        of an earlier one read is dropped, its slabs freed with the whole pool; ``sync_s``:
        --cache-store-sync-ms, in seconds."""
        self.worker = worker
        self.index = index
        self.wait_s = wait_s
        self.sync_s = sync_s
        self._sync_round, self._sync_left = -1, 0.0
        self.epoch = epoch
        self.slabs = worker.memory.slabs
        self.stats = worker.stats
        self._offered: list = []
        self._walked_at = -1          # HostMemory.landed at the last walk

    # ---- write-through ---------------------------------------------------------------------
    def offer(self, s) -> None:
        """``s``'s image landed on host (the executor tells): to the store once its path has."""
        if self.index.resume_rate(s) < STORE_MIN_PRIOR:
            self.stats["store_writes_unvalued"] += 1
            return
        if not s.tail_media and not s.anchor.path_media:     # media: hashes of placeholders
            self._offered.append(_Offer(s, s.anchor.path(), time.monotonic() + OFFER_WAIT_S))

    def _write_landed(self) -> None:
        waiting, now = [], time.monotonic()
        for o in self._offered:
            s = o.snapshot
            if not self.index.is_live(s) or not s.complete_on_host or now > o.until:
                self.stats["store_writes_gone"] += 1       # evicted or deleted meanwhile
                continue
            if o.path_on_host():
                self._submit_write(s, o.path)
            else:
                waiting.append(o)
        if len(waiting) > OFFERS_KEPT:
            self.stats["store_writes_dropped"] += len(waiting) - OFFERS_KEPT
            waiting = waiting[-OFFERS_KEPT:]
        self._offered = waiting

    def _submit_write(self, s, path) -> None:
        node_slabs = [n.host_slab for n in path]
        state_slabs = s.host_slab_ids
        self.stats["store_writes_queued"] += 1
        self.worker.submit(Write(
            s.anchor.namespace, s.anchor.buf[:s.anchor.end * TOKEN_BYTES], s.tail, s.kind.value,
            s.role.value, s.hits, node_slabs, state_slabs,
            [self.slabs.generation(x) for x in node_slabs + state_slabs]))

    # ---- read-back ---------------------------------------------------------------------------
    def probe(self, key: PromptKey, match, limit: int) -> tuple[Optional[Probe], Actions]:
        """Ask the store for the deepest state of ``key`` (up to ``limit`` tokens) beyond what
        ``match`` found here, when that could save a block or more; and what making room let
        go on device. Where the directory names the deepest anchor the store holds a state on,
        host slabs for it go with the question, so the worker reads the state as soon as it
        found it, without a turn of the scheduler's loop (about half a pass) in between."""
        local = match.deepest.frontier if match.deepest is not None else 0
        if key.media is not None or limit - local < BLOCK_TOKENS:
            return None, []
        anchor = self.worker.directory.deepest_anchor(key.buf, key.namespace, local, limit)
        if anchor == 0:
            self.stats["store_probes_skipped"] += 1       # nothing there to wait for
            return None, []
        local_blocks = match.matched_tokens // BLOCK_TOKENS
        p = Probe(key.buf[:limit * TOKEN_BYTES], key.namespace, local_blocks, local, self.epoch)
        actions = []
        if anchor is not None:        # the blocks to it past the cache's, the image, a tail
            count = anchor - min(local_blocks, anchor) + self.index.host_image_slabs + 1
            p.reserved, actions = self.index.host_slabs_for_read(count)
        self.stats["store_probes"] += 1
        self.worker.submit(p)
        return p, actions

    def answer_now(self, p: Optional[Probe], round_id: int) -> tuple[bool, Actions]:
        """With --cache-store-sync-ms: wait on this thread, up to what is left of it in this
        scheduler round (``round_id``: the batch builds so far), for ``p``'s answer and
        read-back, so that the request is admitted in the round it arrived instead of a later
        one (a pass or more later: the rounds of an overlapped scheduler are as long as the
        passes). The tier's threads run free of the GIL meanwhile. Returns whether ``p`` was
        answered meanwhile (then what it read is in the index) and what the polls let go."""
        if p is None or p.answered or not self.sync_s:
            return False, []
        if round_id != self._sync_round:
            self._sync_round, self._sync_left = round_id, self.sync_s
        began, actions = time.monotonic(), []
        deadline = began + self._sync_left
        while not p.answered and p.finished.wait(max(0.0, deadline - time.monotonic())):
            actions += self.poll()            # adopts it, or gives slabs for its read (then again)
        waited = time.monotonic() - began
        self._sync_left -= waited
        self.stats["store_sync_ms"] += 1e3 * waited
        return p.answered, actions

    def holds_back(self, record) -> bool:
        """Whether the request of ``record`` (device.requests.ReqRecord) waits in the queue
        this round for the answer to its probe; decided at the round's match and kept for the
        adder's ``coalesce_wait``. SGLang matches every queued request again every round: the
        match of one held back skips the walk of its prompt, the costliest part of a match."""
        record.waits_for_store = self.waiting(record.store_probe)
        return record.waits_for_store

    def waiting(self, p: Optional[Probe]) -> bool:
        """Whether a request whose probe is ``p`` waits in the queue for it this round."""
        if p is None or p.answered:
            return False
        if time.monotonic() - p.started < self.wait_s:
            self.stats["store_waits"] += 1
            return True
        p.answered = True
        self.stats["store_wait_timeouts"] += 1
        return False

    def poll(self) -> Actions:
        """The scheduler's poll: writes whose path landed go out; probes answered are read
        into host slabs, reads that landed there are adopted. Returns what making room let go
        on device, for the executor."""
        landed = self.worker.memory.landed
        if self._offered and landed != self._walked_at:    # a path can have landed since
            self._walked_at = landed
            self._write_landed()
        actions = []
        for p in self.worker.take_done():
            if p.epoch != self.epoch:                 # read before a flush: dropped
                p.answered = True
            else:
                actions += self._answered(p)
        return actions

    def _answered(self, p: Probe) -> Actions:
        """A probe or a fill the worker finished: what it read is adopted, the slabs nothing
        was read into go back; a state found without slabs for it gets them now (read next)."""
        if p.filled:
            self.index.release_read(p.reserved[len(p.slabs):])
            self._adopt(p)
            return []
        tried = bool(p.slabs)                         # the read failed (logged by the worker)
        self.index.release_read(p.reserved or p.slabs)
        p.reserved, p.slabs = [], []
        if tried:
            p.answered = True
            return []
        return self._make_room(p)

    def _make_room(self, p: Probe) -> Actions:
        if p.state_key is None:                       # nothing (deeper) stored
            p.answered = True
            return []
        slabs, actions = self.index.host_slabs_for_read(p.slab_count)
        if not slabs:
            self.stats["store_reads_dropped"] += 1
            p.answered = True
        else:
            p.slabs = slabs
            p.finished.clear()                        # the fill is a job of its own
            self.worker.submit(p)
        return actions

    def _adopt(self, p: Probe) -> None:
        p.answered = True
        blocks = p.frontier // BLOCK_TOKENS - p.first_block
        image = self.index.host_image_slabs
        node_slabs, rest = p.slabs[:blocks], p.slabs[blocks:]
        tail_slab = rest[image] if len(rest) > image else -1
        key = PromptKey(p.tokens[:p.frontier * TOKEN_BYTES], p.namespace)
        try:
            self.index.adopt_fetched(key, p.frontier, SnapshotKind(p.kind), p.role and Role(p.role),
                                     p.hits, p.first_block, node_slabs, rest[:image], tail_slab)
        except ValueError as err:                     # the cache changed meanwhile
            self.index.release_read(p.slabs)
            self.stats["store_reads_stale"] += 1
            logger.debug("hybrid radix cache: shared tier read not adopted: %s", err)
            return
        self.stats["store_states_read"] += 1
        self.stats["store_read_tokens"] += p.frontier - p.local_frontier


def build_store_worker(options, memory, image_slabs: int, fingerprint: dict) -> Optional[StoreWorker]:
    """The backend ``--cache-store`` names and its worker thread (None: off); the startup log
    says where it keeps its objects."""
    if options.cache_store == "off":
        return None
    if options.cache_store == "file":
        from .file import FileStore
        from .writer import WriterProcess

        writer = WriterProcess(memory.shared) if memory.shared_wanted else None
        store = FileStore(options.cache_store_dir, options.cache_store_mib << 20, writer)
        free = store.fit_to_disk()
        if store.budget < options.cache_store_mib << 20:
            logger.warning("hybrid radix cache: --cache-store-mib %d is more than %s can hold "
                           "(%d MiB free): the shared tier keeps %d MiB", options.cache_store_mib,
                           store.location, free >> 20, store.budget >> 20)
        budget = (f"a budget of {store.budget >> 20} MiB ({store.used >> 20} MiB there now), "
                  + (f"written by process {writer.pid}" if writer else "written by threads of this process"))
    else:
        import json

        from .mooncake import MooncakeStore

        store = MooncakeStore(json.loads(options.cache_store_config))
        budget = "Mooncake's own segments"
    from hpc_radix.patches.scheduler_hooks import NEXT_ROUND_TARGET, unapplied

    rematched = (" (matched again at every scheduler turn meanwhile: the hook on "
                 "Req.init_next_round_input did not apply)" if unapplied([NEXT_ROUND_TARGET]) else "")
    interval = min(sys.getswitchinterval(), TIER_SWITCH_INTERVAL_S)
    sys.setswitchinterval(interval)
    logger.info("hybrid radix cache: shared tier: %s at %s, %s; a request waits up to %d ms "
                "for its read-back%s; the interpreter hands the GIL over every %.1f ms (the "
                "tier's threads wait for it at each file call)", store.name, store.location,
                budget, options.cache_store_wait_ms, rematched, interval * 1e3)
    return StoreWorker(store, memory, image_slabs,
                       persistence.fingerprint_digest(store_fingerprint(fingerprint)))


def store_fingerprint(host_fingerprint: dict) -> dict:
    """What makes an object's bytes mean the same on another server: the host tier's
    fingerprint without what is this server's own (its host tier's size, where the model
    lies, when its weight files were copied there), with the weights' contents sampled
    instead (a fine-tune keeps the names and sizes of its base's files), and the objects'
    format: every key names it, so an earlier release's objects are never asked about,
    refreshed or taken as present (the budget evicts them)."""
    model = host_fingerprint.get("model", "")
    fp = {k: v for k, v in host_fingerprint.items() if k not in ("host_bytes", "model", "weights")}
    fp["object_format"] = persistence.OBJECT_VERSION
    fp["weights"] = weights_digest(model)
    if not fp["weights"]:             # not a local directory (a hub id): its path must match
        fp["model"] = model
    if "draft_model" in fp:
        fp["draft_model"] = weights_digest(fp["draft_model"][0])
    return fp


WEIGHT_SAMPLES, SAMPLE_BYTES = 16, 64 << 10


def weights_digest(model_dir: str) -> list:
    """Name, size and a digest of 16 evenly spaced 64 KiB samples of each weight file: cheap at
    startup, and any retraining changes the bytes of (nearly) every tensor."""
    out = []
    for path in weight_paths(model_dir):
        size, h = os.path.getsize(path), xxhash.xxh64()
        with open(path, "rb") as f:
            for i in range(WEIGHT_SAMPLES):
                f.seek(size * i // WEIGHT_SAMPLES)
                h.update(f.read(SAMPLE_BYTES))
        out.append([os.path.basename(path), size, h.hexdigest()])
    return out
