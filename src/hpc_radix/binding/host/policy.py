"""When the cache uses its host tier (design §5.5, §6.6, §7.6, §9.3, §12.3): building it,
asking the index at each batch build whether write-through opens, waiting for the writes an
admission needs, prefetching for a blocked head, the TP ranks' agreement on what has arrived,
and the cache file at startup and shutdown. ``HostTier`` moves the bytes; the index decides
what goes where (and when writing opens); the executor runs what it decides."""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional

import torch

from hpc_radix.index import Actions, PrefixIndex, SlabPool

from ..device.pages import DevicePages
from ..ranks import RankAgreement
from . import cache_file
from .layout import TierLayout
from .memory import ON_DEMAND_CHUNK_BYTES, HostMemory, check_host_budget
from .transfers import HostTier, Transfer, choose_copy_path, restore_wait_path

logger = logging.getLogger(__name__)


def build_host_tier(options, kvcache, req_pool, page_size: int, device, forward_stream, runner,
                    ranks: RankAgreement, server_args, draft_kv_pools=()) -> HostTier:
    """The pinned slab pool (filled in the background) and its transfers; a bad option or a
    budget that cannot be pinned is refused before anything is pinned."""
    cuda = torch.device(device).type == "cuda"
    copy_engine, what = choose_copy_path(options.host_copy, cuda)
    pools = (kvcache, req_pool)
    by_layer, why = restore_wait_path(options.host_restore_wait, copy_engine, cuda, runner, pools)
    layout = TierLayout(kvcache, req_pool.mamba_pool, page_size, draft_kv_pools)
    check_host_budget(options.host_cache_mib, layout.image_bytes, layout.slab_bytes,
                      **_host_memory_seen(ranks, server_args))
    on_demand = options.host_cache_pin == "on-demand" and options.host_write_threshold > 0
    small = {"max_chunk_bytes": max(ON_DEMAND_CHUNK_BYTES, layout.slab_bytes)} if on_demand else {}
    slabs = SlabPool(options.host_cache_bytes, layout.slab_bytes, online=False, **small)
    path = options.prefix_cache_file
    if path:
        logger.warning("hybrid radix cache: --prefix-cache-file is deprecated and goes in a later "
                       "release: --cache-store-dir DIR keeps what reaches the host tier across "
                       "restarts and crashes too, and shares it between servers (docs/operations.md, "
                       "\"From --prefix-cache-file\"); %s is still read and written", path)
    memory = HostMemory(slabs, backing_file=cache_file.data_file(path) if path else None,
                        paced=on_demand, shared=options.cache_store == "file"
                        and options.cache_store_writer == "process")
    if on_demand:
        when = (f"pinned in the background once the device cache is "
                f"{options.host_write_threshold / 2:g}% full (--host-cache-pin on-demand)")
    else:
        memory.start()
        when = "pinned in the background"
    logger.info("hybrid radix cache: host tier of %d MiB: %d slabs of %d KiB%s in %d chunks, "
                "%s; a state image takes %d slabs", options.host_cache_mib, slabs.num_slabs,
                layout.slab_bytes >> 10, " (a block with its draft model's KV)"
                if layout.draft_planes else "", slabs.num_chunks, when, layout.image_slabs)
    logger.info("hybrid radix cache: host copies by %s", what)
    host = HostTier(layout, memory, forward_stream, copy_engine=copy_engine, by_layer=by_layer,
                    ranks_agree=not ranks.solo)
    ranks.check_layout(host_slabs=slabs.num_slabs, slab_bytes=layout.slab_bytes,
                       image_slabs=layout.image_slabs)
    if by_layer:
        for pool in pools:            # as HiCache registers its LayerDoneCounter
            pool.register_layer_transfer_counter(host.layer_waits)
    logger.info("hybrid radix cache: a prefill pass waits for its host restores %s (%s)",
                "layer by layer" if by_layer else "whole, before its first layer", why)
    return host


def _host_memory_seen(ranks: RankAgreement, server_args) -> dict:
    """The host memory available to this rank's tier: every TP rank on the machine pins its
    own, and each takes the most any rank saw (one that already pins sees less), so all refuse
    a budget or none does."""
    import psutil

    (available,) = ranks.spread([psutil.virtual_memory().available])[1]
    nodes = getattr(server_args, "nnodes", 1) or 1
    return {"available_bytes": available, "ranks_on_host": max(1, ranks.size // nodes)}


def host_fingerprint(server_args, tier: HostTier, page_size: int, options,
                     ranks: RankAgreement) -> dict:
    """What makes a cache file this server's (cache_file.fingerprint): under TP a rank's file
    holds its shard of the heads."""
    fp = cache_file.fingerprint(server_args, tier.layout, page_size, options.host_cache_bytes)
    if not ranks.solo:
        fp["tp"] = [ranks.rank, ranks.size]
    return fp


class HostPolicy:
    def __init__(self, tier: HostTier, index: PrefixIndex, run: Callable[[Actions], object],
                 pages: DevicePages, options, ranks: RankAgreement, fingerprint: dict):
        """``run``: the executor of the index's actions."""
        self.tier = tier
        self.index = index
        self.run = run
        self.pages = pages
        self.options = options
        self.ranks = ranks
        self.fingerprint = fingerprint
        self.prefetch: Optional[Transfer] = None   # the prefetch in flight ...
        self.prefetch_unwaited = False    # ... that the forward stream has not waited for yet

    def agree(self) -> None:
        """A batch build: under TP, what every rank has seen arrive (chunks, copies) is what
        each acts on until the next (ranks.py)."""
        if not self.ranks.solo:
            self.tier.agreed = self.ranks.agree(self.tier.local_counts())

    # ---- write-through -----------------------------------------------------------------------
    def writes_due(self) -> None:
        """A batch build (a burst's pages are allocated by then): until write-through is open,
        the index is asked whether it opens now, which writes what the device holds at once,
        before the next admission round can evict it (the writes pin it; an admission short
        of pages that only those pins hold waits for them: ``release_written_pages``)."""
        if self.index.sizes.writes_open:
            return
        if not self.tier.memory.slabs.num_online:
            self.tier.bring_chunks_online()   # pinned on demand: writing waits for a chunk
        self.run(self.index.host_writes_due())

    def release_written_pages(self, short_tokens: int, every: bool = False) -> bool:
        """An admission is ``short_tokens`` short. Pages that write-throughs pin join the LRU
        once written (a copy of about a millisecond behind the pass it follows); when they
        would cover the shortfall, or whatever it is (``every``), wait for the writes, rather
        than leave the request queued until a running one finishes. Returns whether it
        waited (the caller polls to release them and tries the admission again)."""
        pinned = self.index.sizes.write_pinned_pages * self.pages.page_size
        if not pinned or (not every and not 0 < short_tokens <= pinned):
            return False
        self.tier.wait_writes()
        return True

    # ---- prefetch for the blocked head (§6.6) -------------------------------------------------
    def prefetch_head(self, lease, room_tokens: int) -> int:
        """``lease``'s request, at the head of the queue, was refused for want of pages;
        SGLang's budget has ``room_tokens`` left after this round's admissions. The host-only
        blocks of the source its admission would restore (as many as the index says fit) are
        copied into device pages now, while it waits: free pages, spares, and pages of
        host-backed cached blocks (least recently used first; never a block's last copy, never
        the request's own path). They are ordinary cached blocks once landed, so its admission
        finds them on device and restores only the rest. Until then they and the source are
        pinned. One prefetch at a time; the copy starts after the pass in flight (pages freed
        meanwhile may still be written by it), and the first admission after it makes the
        forward stream wait for it (``wait_for_prefetch``). Returns the blocks prefetched."""
        if (any(t is self.prefetch for t in self.tier.in_flight) or lease is None or lease.locks
                or not lease.needs_restore):
            return 0
        wanted = self.index.prefetch_size(lease.candidate, int(room_tokens) // self.pages.page_size)
        if wanted <= 0:
            return 0
        s = lease.candidate.snapshot
        self.index.pin_snapshot(s)        # evicting for its pages never takes the head's path
        try:
            short = wanted - self.pages.at_hand()
            if short > 0:
                self.pages.free_backed(short)
            count = min(wanted, self.pages.at_hand())
            if count <= 0:
                return 0
            pages, _ = self.pages.new_pages(count, demand=False)
            actions = self.index.prefetch(s, pages)
        finally:
            self.index.unpin_snapshot(s)
        self.prefetch = self.run(actions)
        self.prefetch_unwaited = True
        return count

    def wait_for_prefetch(self, stream) -> None:
        """An admission: its pass may read blocks the prefetch is still copying."""
        if self.prefetch_unwaited:
            self.tier.wait_on(self.prefetch, stream)
            self.prefetch_unwaited = False

    # ---- the cache file (§5.5) ------------------------------------------------------------------
    def load_file(self, poll) -> None:
        """A saved host tier comes back before the server reports healthy: the data file is
        read into the pinned tier, then the index rebuilt from the saved one. ``poll``: the
        cache's poll, which brings the chunks online."""
        path = self.options.prefix_cache_file
        if not path:
            return
        if not os.path.exists(path) and self.ranks.solo:
            logger.info("hybrid radix cache: no prefix cache file at %s yet; it is written at "
                        "shutdown", path)
            return
        t0 = time.monotonic()
        self.tier.memory.wait()
        self.agree()
        poll()
        loaded = cache_file.load(path, self.index, self.tier.memory, self.fingerprint, self.ranks)
        logger.info("hybrid radix cache: host tier ready with %d loaded snapshots %.1f s after "
                    "the cache was built", loaded, time.monotonic() - t0)

    def save_file(self, save: bool = True) -> None:
        """Graceful shutdown: finish the copies, save the cache file's index (``save``), unpin."""
        self.tier.drain()
        path = self.options.prefix_cache_file
        if path and save:
            try:
                cache_file.save(path, self.index, self.tier.memory, self.fingerprint)
            except OSError as err:
                logger.error("hybrid radix cache: could not save %s: %s", path, err)
        self.tier.memory.close()
