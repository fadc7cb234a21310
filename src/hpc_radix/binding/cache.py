"""HybridRadixCache: SGLang 0.5.17's prefix-cache contract over hpc_radix.index.PrefixIndex.

Device tier. KV pages are 64 tokens, one page per tree node; identical blocks share one page.
Snapshot images live in slots of SGLang's own mamba pool (at most D = device_snapshot_slots of
them); a tail (the partial last page of a snapshot off a page boundary: an endpoint, a tap at
the end of a prompt or after an unaligned resume) is a private page owned by the snapshot.

Host tier (``--host-cache-mib``, binding/host/): released paths and published snapshots are
written through to one pinned slab pool; the index evicts there by GDSF. A match whose best
source needs host data reports it as a host hit; SGLang's PrefillAdder then calls
``init_load_back``, which gives the host-only blocks device pages, restores them (and the image
into the working slot, the tail into a private page) on the restore stream; the pass built
next waits for the copies, at each layer for that layer's bytes (``--host-restore-wait``).

The index decides; every action it returns runs in the executor (binding/executor.py). The
parts that hold the index are built in one place (``_build_parts``): at construction, once
every pool is known (``attach_draft_kv``) and at each flush.

Where states come from (the overlap scheduler stays on):
- taps (binding/device/taps.py): planned per request; captured inside the GDN prefill pass into
  reserved slots (zero-split), or, as a fallback, at chunk ends the prefill is split at.
- chunk ends: SGLang's extra_buffer tracking copies the exact fp32 state at the end of every
  extend whose length is a multiple of 64 from an aligned base into a ping-pong slot;
  ``cache_unfinished_req`` donates that slot as a snapshot. States tracked from the chunk
  kernel's bf16 ``h`` buffer (any other position) are never published: not exact.
- endpoints: at finish the working slot itself becomes the snapshot. SGLang counts a token as
  committed when its forward is *launched* (kv_committed_len grows in prepare_for_decode), so
  once every launched forward has run, the working slot holds exactly the state after
  kv_committed_len tokens. The slot is never written again and every later reader (a COW into
  another request) runs on the forward stream after those forwards, so the endpoint is exact
  under overlap too. Speculative decoding counts accepted tokens only when
  their step's result is processed: without overlap scheduling the working slot is then the
  endpoint as above; with it, the next step's verify is already queued when a request finishes
  and moves the working slot on, so the endpoint is the state extra_buffer tracked last, at a
  multiple of --mamba-track-interval (RequestCommits.verify_ahead).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Optional

import torch

from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InitLoadBackParams,
    MatchPrefixParams,
    MatchResult,
)

from hpc_radix.errors import RestoreRefused
from hpc_radix.hooks import SchedulerHooks
from hpc_radix.index import (
    BLOCK_TOKENS,
    CostModel,
    FreeDevice,
    PrefixIndex,
    TapSettings,
    check_invariants,
    sanity_check,
)
from hpc_radix.kernels.upload import page_slots, to_device
from hpc_radix.options import diagnostic, raw_options_from_env, resolve_options

from hpc_radix import sglang_version
from hpc_radix.sglang_version import drop_prefix, load_back_labels, prefix_len, req_slots

from . import warm_up
from .device.coalesce import Coalescer
from .prefixes import load_back_result, match_result, prefix_indices, replace_prefix
from .device.commits import RequestCommits
from .device.ids import IdReader
from .device.leases import Lease, Leases, lease_of
from .device.pages import DevicePages
from .device.pool import DevicePool, state_image_bytes
from .device.requests import prompt_key, record_of
from .device.taps import PassTaps, Taps
from .executor import Executor
from .hints import markers_from_tokenizer_dir
from .host.policy import HostPolicy, build_host_tier, host_fingerprint
from .ranks import RankAgreement, index_state
from .store.policy import StorePolicy, build_store_worker
from .report import BY_KIND, CacheReport, CallTimer
from .server_args import speculates

logger = logging.getLogger(__name__)
IDLE_REFUSAL_LOG_S = 10.0   # a request refused with nothing running: logged again after this


def _timed(method):
    """A call SGLang or the patches make into the cache: timed (CallTimer), and when the
    outermost one returns, whatever the index freed during it is back in SGLang's allocators.
    One place hands back what index calls let go during any call, so no path keeps it."""
    timed = CallTimer.wrap(method)

    @functools.wraps(method)
    def call(cache, *args, **kwargs):
        try:
            return timed(cache, *args, **kwargs)
        finally:
            if not cache.call_timer.inside_call and not cache.disable and cache.pool.has_freed:
                cache.pool.hand_back()
    return call


def _full_check(cache) -> None:
    """The index's invariants after each caching call, with HPC_CACHE_FULL_CHECK (tests)."""
    if cache.full_check:
        check_invariants(cache.index)


class HybridRadixCache(BasePrefixCache, SchedulerHooks):
    def __init__(self, ctx):
        params = ctx.params
        self.call_timer = CallTimer(profile=diagnostic("profile"))
        self.full_check = diagnostic("full_check")
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        self.disable = params.disable
        if self.page_size != BLOCK_TOKENS:
            raise ValueError(f"--page-size={self.page_size}: the hybrid radix cache needs {BLOCK_TOKENS}")
        if not getattr(params, "enable_mamba_extra_buffer", False):
            raise ValueError("the hybrid radix cache needs --mamba-radix-cache-strategy extra_buffer")
        self.device = self.token_to_kv_pool_allocator.device
        self._cuda = torch.device(self.device).type == "cuda"
        self.mamba_pool = self.req_to_token_pool.mamba_pool
        self.mamba_allocator = self.req_to_token_pool.mamba_allocator
        self.kvcache = self.token_to_kv_pool_allocator.get_kvcache()
        tp_worker = getattr(ctx, "tp_worker", None)
        self._runner = runner = getattr(tp_worker, "model_runner", None)
        self.forward_stream = getattr(runner, "forward_stream", None)
        self.server_args = server_args = ctx.server_args
        self.running = getattr(server_args, "max_running_requests", None) or self.req_to_token_pool.size
        tp_size, tp_rank = getattr(ctx, "tp_size", 1) or 1, getattr(ctx, "tp_rank", 0) or 0
        dp_rank = getattr(getattr(runner, "ps", None), "dp_rank", None)
        options = resolve_options(
            raw_options_from_env(), from_env=True, max_running_requests=self.running,
            mamba_slots=self.mamba_pool.size,
            tp_rank=tp_rank, tp_size=tp_size, dp_size=getattr(server_args, "dp_size", 1) or 1,
            dp_rank=dp_rank if dp_rank is not None else (torch.device(self.device).index or 0))
        self.ranks = RankAgreement.of_group(params.tp_cache_group if tp_size > 1 else None,
                                            check=diagnostic("tp_check"))
        self.ranks.check_layout(kv_pages=self.token_to_kv_pool_allocator.size // self.page_size,
                                mamba_slots=self.mamba_pool.size,
                                snapshot_slots=options.device_snapshot_slots)
        self.image_bytes = state_image_bytes(self.mamba_pool)
        if getattr(params, "enable_metrics", False):
            self.init_metrics_collector()       # SGLang's eviction and load-back series
        self.report = CacheReport(self.metrics_collector.labels if self.metrics_collector else None)
        # the chunk SGLang prefills in (None: chunking off), as every release passes it
        self.chunk_tokens = params.chunked_prefill_size
        self.cost = CostModel(chunk_tokens=max(self.chunk_tokens or 8192, BLOCK_TOKENS))
        tokenizer_dir = getattr(server_args, "tokenizer_path", None) or getattr(server_args, "model_path", None)
        self.markers = markers_from_tokenizer_dir(tokenizer_dir) if tokenizer_dir else None
        if self.markers is None:
            logger.info("hybrid radix cache: no ChatML special tokens found; only chunk-end, "
                        "branch-point and ladder taps are planned")
        from hpc_radix.patches import batch_syncs, decode_pages, gdn_taps, state_copy

        state_copy.activate()
        self.batch_build = f"{batch_syncs.activate()}; {decode_pages.activate()}"
        self.zero_split, self.tap_path = gdn_taps.zero_split_path(options.cache_zero_split, runner)
        if options.cache_coalesce == "on" and not self.zero_split:
            logger.warning("hybrid radix cache: --cache-coalesce on needs zero-split taps (%s): "
                           "coalescing is off", self.tap_path)
            options = dataclasses.replace(options, cache_coalesce="off")
        if options.cache_store != "off" and tp_size > 1:
            # each rank would read back on its own clock and the ranks' indexes part ways
            logger.warning("hybrid radix cache: --cache-store %s is off under --tp %d: the TP "
                           "ranks do not agree on the shared tier's reads yet", options.cache_store,
                           tp_size)
            options = dataclasses.replace(options, cache_store="off")
        self.options = options
        # Every pool the cache copies: a speculative draft model's KV pool, which SGLang builds
        # after this cache, joins at attach_draft_kv; the host tier (a block's slab holds the
        # draft's KV too) and the parts that hold the index are built once it is known.
        self.kv_pools = [self.kvcache]
        self.host = self.host_policy = self.fingerprint = None
        self.store_worker = self.store = None    # the shared tier (store/), with a host tier
        self._epoch = 0                          # builds of the parts (a flush starts one)
        self.taps = None
        self.verify_ahead = False
        self.speculative = False               # a draft model's KV pool attached
        self._pools_pending = True
        self._build_parts()
        if not speculates(getattr(server_args, "speculative_algorithm", None)):
            self.attach_draft_kv(None)
        warm_up.at_startup(self, self.running)
        logger.info(
            "hybrid radix cache on %s: %d KV pages of %d tokens, %d mamba slots, %d device "
            "snapshot slots of %.1f MiB, %d taps per request; %s", sglang_version.describe(),
            self.token_to_kv_pool_allocator.size // self.page_size, self.page_size,
            self.mamba_pool.size, options.device_snapshot_slots, self.image_bytes / 2**20,
            options.cache_taps_per_request, options.describe())
        logger.info("hybrid radix cache: taps %s (%s); %s",
                    "captured inside the prefill pass (zero-split)" if self.zero_split
                    else "split the prefill chunk", self.tap_path, self.batch_build)

    def _build_parts(self) -> None:
        """Every part that holds the index, built fresh, each given what it uses: at
        construction, once every pool is known (``attach_draft_kv``) and at each flush, when
        the host tier's transfers are drained first and its slabs all free again."""
        options, slabs = self.options, None
        if self.host is not None:
            self.host.drain()
            if self.store_worker is not None:
                self.store_worker.cancel()    # nothing may copy into a slab once cleared
            slabs = self.host.memory.slabs
            slabs.clear()
        self.ids = IdReader(self.device, self.call_timer, check=self.full_check,
                            settled=options.cache_settled_reads == "on")
        self.pool = DevicePool(self.token_to_kv_pool_allocator, self.mamba_allocator, self.ids,
                               self.page_size, self.kv_pools, self.forward_stream,
                               slot_count=self.mamba_pool.size)
        self.index = PrefixIndex(
            image_bytes=self.image_bytes, device_snapshot_slots=options.device_snapshot_slots,
            cost=self.cost, host=slabs, block_bytes=self.host.layout.slab_bytes if self.host else 0,
            taps=TapSettings(options.cache_taps_per_request, options.cache_tap_ladder,
                             options.cache_tap_min_gap, tail_at_end=self.zero_split),
            host_write_threshold=options.host_write_threshold if self.host else None,
            page_use=self.pool.page_use)
        self._epoch += 1
        if self.store_worker is not None:
            self.store = StorePolicy(self.store_worker, self.index,
                                     options.cache_store_wait_ms / 1e3, self._epoch,
                                     options.cache_store_sync_ms / 1e3)
        self.run = Executor(self.index, self.pool, self.host,
                            self.store.offer if self.store is not None else None)
        self.pages = DevicePages(self.pool, self.index, self.run, self.ids, options.cache_spare_pages,
                                 spare_slots=self.zero_split, running=self.req_to_token_pool.size)
        warmed_up = self.taps is not None and self.taps.warmed_up   # kernels compiled once
        self.taps = Taps(self.pages, self.index, self.run, self.req_to_token_pool, self.markers,
                         self.chunk_tokens, self.zero_split, self.tap_path, self.report.counts,
                         warmed_up)
        self.leases = Leases(self.pages, self.ids, self.index)
        self.commits = RequestCommits(self.req_to_token_pool, self.ids, self.pages, self.index,
                                      self.run, self.taps, verify_ahead=self.verify_ahead)
        self.coalescer = Coalescer(self.ids, self.report.counts) if options.cache_coalesce == "on" else None
        if self.host is not None:
            self.host_policy = HostPolicy(self.host, self.index, self.run, self.pages, options,
                                          self.ranks, self.fingerprint)
        self.root_node = self.leases.root

    def release_host_resources(self) -> None:
        """Graceful shutdown: finish the copies, the shared tier's writes (a while at most),
        save the cache file's index, unpin."""
        if self.store is not None:
            self.host.drain()
            self._poll_host(flush=False)          # the last snapshots landed go to the store
            self.store_worker.close()
        if self.host_policy is not None:
            self.host_policy.save_file(save=not self.disable)

    def _poll_host(self, flush: bool = True) -> None:
        """Launch the queued write-throughs (``flush``), finish the landed transfers."""
        if self.host is not None:
            self.host.poll(flush)
        if self.store is not None:      # (timed apart: what the tier costs the scheduler)
            self.run(self.call_timer.run("shared tier poll", self.store.poll))
        self._update_report()

    def _update_report(self, force: bool = False) -> None:
        def figures() -> tuple[dict, dict]:
            """(running totals, gauges), computed only when the report is due."""
            totals = {**self.index.stats, **self.report.counts,
                      BY_KIND: self.index.kind_totals(),
                      "scheduler_ms": 1e3 * self.call_timer.total,
                      "device_read_ms": 1e3 * self.call_timer.waited}
            gauges = {}
            if self.host is not None:
                totals.update(self.host.stats)
                slabs = self.host.memory.slabs
                gauges = {"write_backlog": len(self.host.in_flight) + len(self.host.queued),
                          "host_online_bytes": slabs.num_online * slabs.slab_bytes,
                          "host_used_bytes": slabs.num_used * slabs.slab_bytes}
            if self.store_worker is not None:
                totals.update(self.store_worker.counters())
            return totals, gauges
        self.report.update(figures, force=force)

    # ---- contract basics -----------------------------------------------------------------
    def reset(self) -> None:
        self._update_report(force=True)       # the log says what the cache did before the flush
        self.leases.log_holds_at_flush(self.available_and_evictable_str())
        if self.call_timer.calls:
            logger.info("hybrid radix cache: scheduler time in cache calls since the last flush: %s",
                        self.call_timer.take_summary())
        # SGLang clears its pools right after (flush_cache): the spares held go with them
        self._build_parts()
        if self.host is not None and self.host.timing is not None:
            logger.info("hybrid radix cache: host transfers since the last flush (GPU time): %s",
                        self.host.timing.take_summary() or "none")

    def supports_mamba(self) -> bool:
        return True

    def is_root(self, node: Any) -> bool:
        return isinstance(node, Lease) and node.candidate is None and node.seq is None

    def root_node_handle(self, extra_key: Optional[str] = None) -> Any:
        return self.root_node

    # ---- lookup --------------------------------------------------------------------------
    @_timed
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key, req = params.key, params.req
        empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        if self.disable or len(key) == 0:
            return match_result(empty, self.root_node)
        self._poll_host()
        if (params.cow_mamba and req is not None and self.store is not None
                and self.store.holds_back(record_of(req))):
            # it waits in the queue this round (coalesce_wait): no walk of its prompt (the
            # patches skip this call altogether, held_back; a SGLang they miss comes here)
            return match_result(empty, self.root_node)
        if params.cow_mamba and req is not None:
            # spares for this request's captures: after a flush none are held, and a prompt
            # that fits one pass would capture before any other call refills them
            self.pages.refill_spares()
        pkey = prompt_key(key, req)
        match = self.index.match(pkey, limit=len(key))
        cand = match.chosen if match.chosen.snapshot is not None else None
        restorable = (params.cow_mamba and req is not None
                      and not record_of(req).restore_refused)
        if cand is not None and cand.host_bytes and not restorable:
            cand = match.device         # a bare lookup cannot restore, a refused one is not retried
        lease = Lease(pkey, cand, req if params.cow_mamba else None)
        if self.ranks.checking:
            self.ranks.note("match", getattr(req, "rid", None), len(key),
                            cand.frontier if cand is not None else 0, lease.needs_restore)
        if params.cow_mamba and req is not None:
            record = record_of(req)
            if not record.observed:       # SGLang matches a waiting request again
                record.observed = True
                self.index.observe(match)
                if self.store is not None:    # once per request: the shared tier goes deeper?
                    record.store_probe, made_room = self.store.probe(pkey, match, len(key))
                    self.run(made_room)
                    answered, made_room = self.store.answer_now(record.store_probe, self.ids.epoch)
                    self.run(made_room)
                    if answered:                          # what it read is in the index now
                        return self.match_prefix(params)
                    if self.store.holds_back(record):     # as every match while it waits
                        return match_result(empty, self.root_node)
            lease.taps = self.taps.plan(req, match, cand)
            kv = req_slots(req)
            if cand is None and kv.mamba_pool_idx is not None:
                # a working slot from an earlier round's match: start it from zero now
                kv.mamba_cow_src_index = None
                kv.mamba_needs_clear = True
        if cand is None:
            return match_result(empty, lease)
        s = cand.snapshot
        if lease.needs_restore:
            # Everything comes back at admission (init_load_back): until then the request
            # holds only its working slot, cleared should the restore not happen.
            self.leases.working_slot(req, s)
            req_slots(req).mamba_needs_clear = True
            # SGLang's PrefillAdder budgets a host hit as the prefix on device plus
            # host_hit_length tokens loaded back: the leading blocks still on device go in the
            # first, all after them in the second (counted as new, a host hit that is mostly on
            # device would wait for pages it has). init_load_back hands back the whole prefix.
            lead = lease.lead_pages = self.leases.device_lead_pages(s)
            return match_result(page_slots(lead, self.page_size, self.device), lease,
                                protected=cand.frontier - s.tail_len,
                                host_hit_length=cand.frontier - len(lead) * self.page_size,
                                mamba_host_hit_length=int(not s.image_on_device))
        pages = [n.device_page for n in s.anchor.path()]
        if s.tail:
            pages.append(s.tail_page)       # replaced by a private copy once admitted
        indices = page_slots(pages, self.page_size, self.device)[:cand.frontier]
        if params.cow_mamba and req is not None:
            self.leases.stage_state_cow(req, s)
        return match_result(indices, lease, protected=cand.frontier - s.tail_len)

    @_timed
    def init_load_back(self, params: InitLoadBackParams):
        """Admission of a request whose source needs host data (SGLang calls this under the
        PrefillAdder's lock, its budget counting the restored tokens as new): device pages for
        the host-only blocks, then the restore; the forward stream waits for it. Returns the
        prefix's token slots and the lease. A quote gone stale (evicted meanwhile) or a pool
        without room falls back to a cold prefill, or, where SGLang's budget counted some of
        the source's blocks as cached, raises ``RestoreRefused``."""
        lease, req = params.best_match_node, params.req
        s = lease.candidate.snapshot
        # SGLang appends what this returns to the prefix matched on device (the leading
        # blocks, match_prefix): the whole prefix is returned instead, since an earlier
        # admission may have evicted some of those blocks since (they are restored then)
        drop_prefix(req, self.device)
        self.leases.release_hold(lease)         # the budget was checked; begin_restore pins the source
        try:
            restore, tail_page, settled = self.leases.begin_restore(lease, req)
        except (ValueError, RuntimeError) as err:
            self.report.counts["restores_dropped"] += 1
            if lease.lead_pages:
                record_of(req).restore_refused = True
                logger.warning("hybrid radix cache: host restore of %d tokens dropped (%s); the "
                               "request waits a round and goes without it", lease.candidate.frontier, err)
                raise RestoreRefused(str(err)) from err
            logger.info("hybrid radix cache: host restore of %d tokens dropped (%s); cold prefill",
                        lease.candidate.frontier, err)
            self.leases.start_cold(lease)
            req.host_hit_length = 0
            return load_back_result(req, lease, torch.empty((0,), dtype=torch.int64, device=self.device), 0)
        if s.image_on_device:
            self.leases.stage_state_cow(req, s)
        else:
            req_slots(req).mamba_needs_clear = False
        if tail_page >= 0:                # the tail comes straight into its private copy
            lease.tail_cow_done = True
        if restore:                       # none: an earlier restore brought all of it meanwhile
            after = None        # the restore waits for the pass in flight, unless:
            if settled and self.options.host_restore_overlap == "on":
                after = self.ids.build_event
                if after is not None or self.host.restore_stream is None:   # (no CUDA: inline)
                    self.report.counts["restores_overlapped"] += 1
            transfer = self.run(restore, restore_after=after, for_pass=True)
            if tail_page >= 0:            # the request's page once admitted (on_admitted)
                lease.restored_tail = (tail_page, transfer)
        host_tokens = self.leases.host_tokens(lease.candidate)
        req.host_hit_length = host_tokens     # SGLang's cached-token breakdown: what came from host
        self.report.counts["host_hits"] += 1
        self.report.counts["host_hit_tokens"] += host_tokens
        if self.metrics_collector is not None:
            self.metrics_collector.increment_load_back_num_tokens(host_tokens, **load_back_labels())
        pages = [n.device_page for n in s.anchor.path()]
        if s.tail:
            pages.append(tail_page if tail_page >= 0 else s.tail_page)
        indices = page_slots(pages, self.page_size, self.device)[:lease.candidate.frontier]
        return load_back_result(req, lease, indices, lease.candidate.frontier - s.tail_len)

    @property
    def splits_prefill(self) -> bool:
        """Split fallback: exact taps end prefill chunks (read by the PrefillAdder hooks)."""
        return not self.disable and not self.taps.zero_split

    def chunk_cap(self, req) -> Optional[int]:
        """Split fallback: tokens the next extend may take so it ends at the next exact tap."""
        return self.taps.chunk_cap(req)

    @_timed
    def batch_built(self, layered: bool = True) -> None:
        """The ForwardBatch hook: a batch was built and is about to launch (every batch);
        ``layered``: its pass reads KV and state through the pools layer by layer (an extend)."""
        self.ids.batch_built()
        if self.host is not None and self.host.layer_waits is not None:
            self.host.layer_waits.batch_built(layered)
        if self._cuda and torch.cuda.is_current_stream_capturing():
            return                          # a CUDA graph's capture: every rank captures alike
        if self.ranks.checking:
            self.ranks.end_step(index_state(self.index, self.pool))
        if self.host is not None:
            self.host_policy.agree()
            # the batch's pages are allocated: a burst that fills the device opens host writes
            # here, before the next admission round can evict what the device holds
            self.host_policy.writes_due()
            self.host.flush_writes()

    @_timed
    def reserve_taps(self, batch) -> Optional[PassTaps]:
        """Zero-split: slots for the taps the coming prefill pass of ``batch`` captures. Called
        by the ForwardBatch hook, after the batch is final (mixed decode rows included)."""
        if self.disable:
            return None
        rows = [(req, start, start + n)
                for req, start, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens)]
        return self.taps.reserve(rows)

    @_timed
    def release_written_pages(self, short_tokens: int, idle_req=None) -> bool:
        """SGLang's admission of a request is ``short_tokens`` short. Pages that write-throughs
        pin join the LRU once written (a copy of about a millisecond behind the pass it
        follows); when they would cover the shortfall, wait for the writes and release them,
        rather than leave the request queued until a running one finishes. ``idle_req``: the
        request, refused with nothing running, where no request's end would bring SGLang
        0.5.17's admission back (patches/scheduler_hooks.py): every write is waited for then;
        where that frees nothing, the refusal is logged with what holds the pages (once per
        request and ``IDLE_REFUSAL_LOG_S``). Returns whether pages were freed (the caller
        tries again)."""
        def room() -> int:
            return self.full_evictable_size() + self.token_to_kv_pool_allocator.available_size()
        before = room()
        if self.host_policy is not None and self.host_policy.release_written_pages(
                short_tokens, every=idle_req is not None):
            self._poll_host(flush=False)
        freed = room() - before
        if idle_req is not None and not freed:
            record, now = record_of(idle_req), time.monotonic()
            if now >= record.idle_refusal_logged + IDLE_REFUSAL_LOG_S:
                record.idle_refusal_logged = now
                logger.warning(
                    "hybrid radix cache: nothing runs and a request of %d tokens (%d matched on "
                    "device, %d from host) is refused, %d tokens short, with no host write to "
                    "wait for; it stays queued; %s", len(idle_req.origin_input_ids),
                    prefix_len(idle_req), idle_req.host_hit_length, short_tokens,
                    self.available_and_evictable_str())
        return freed > 0

    @_timed
    def held_back(self, req) -> bool:
        """Whether ``req`` still waits in the queue for the shared tier's answer to its probe:
        SGLang's loop matches every queued request at every turn, thousands of times while a
        read-back is on its way, and each skipped match saves the scheduler that work. Polls
        the tier only (not the host copies), so an answer that came ends the wait here."""
        record = record_of(req)
        if self.store is None or not record.waits_for_store:
            return False
        self.run(self.store.poll())
        return self.store.holds_back(record)

    @_timed
    def coalesce_wait(self, req) -> bool:
        """The PrefillAdder hook, before SGLang admits ``req`` (just matched): whether it waits
        in the queue instead, for the shared tier's read-back of its prefix (§5.6) or for a
        sibling's snapshot (§12.2). A waiting request gives its working slot back, as SGLang
        does for a request it cannot admit."""
        if not (record_of(req).waits_for_store
                or (self.coalescer is not None and self.coalescer.should_wait(req))):
            return False
        kv = req_slots(req)
        kv.mamba_cow_src_index = None
        kv.mamba_needs_clear = False
        if kv.mamba_pool_idx is not None and not getattr(req, "session", None):
            self.mamba_allocator.free(kv.mamba_pool_idx.unsqueeze(-1))
            kv.mamba_pool_idx = None
        return True

    @_timed
    def on_admitted(self, req) -> None:
        """The request was admitted (PrefillAdder took its permanent lock): give it a private
        copy of its source's tail page, which the allocator keeps filling. Its pass may read
        blocks a prefetch is still copying: the forward stream waits for that copy first."""
        if self.coalescer is not None:
            self.coalescer.admitted(req)
        if self.host_policy is not None:
            self.host_policy.wait_for_prefetch(self.forward_stream)
        lease = lease_of(req)
        if lease is not None:
            lease.restored_tail = None
        if lease is None or lease.candidate is None or lease.tail_cow_done:
            return
        s = lease.candidate.snapshot
        lease.tail_cow_done = True
        if not s.tail:
            return
        tail_len = s.tail_len
        src = page_slots([s.tail_page], self.page_size, self.device)[:tail_len]
        dst = self.pages.private_page(src)[:tail_len]
        replace_prefix(req, torch.cat([prefix_indices(req, lease)[:-tail_len], dst.to(torch.int64)]))

    @_timed
    def prefetch_head(self, req, room_tokens: int) -> int:
        """§6.6: ``req``, at the head of the queue, was refused for want of pages and SGLang's
        budget has ``room_tokens`` left: the host-only blocks its admission would restore are
        copied to device meanwhile (HostPolicy.prefetch_head). Returns the blocks prefetched
        (--host-prefetch on; 0 otherwise)."""
        if self.disable or self.host_policy is None or self.options.host_prefetch != "on":
            return 0
        self._poll_host(flush=False)
        count = self.host_policy.prefetch_head(lease_of(req), room_tokens)
        if count:
            self.report.counts["prefetches"] += 1
            self.report.counts["prefetched_blocks"] += count
        return count

    def attach_draft_kv(self, pool, overlapped: bool = False) -> None:
        """SGLang built its draft worker (``pool``: the draft model's KV pool, over the
        target's slots; None without one; ``overlapped``: scheduled with overlap). The cache
        keeps the draft's KV wherever it keeps the target's (tail copies, host tier, cache
        file), so a resumed request drafts as a cold one. Every pool the cache copies is known
        now: the host tier opens, the parts are built over it, the cache file's snapshots come
        back, then the spare pages and slots are taken."""
        if pool is not None:
            self.kv_pools.append(pool)
            self.speculative = True
            # under overlap scheduling a finishing request's next verify is already queued:
            # its endpoint is the state tracked last (RequestCommits)
            self.verify_ahead = overlapped
            logger.info("hybrid radix cache: speculative decoding: the draft "
                        "model's KV is cached with the target's%s; %s",
                        " on device and host" if self._pools_pending and self.options.host_tier else "",
                        "overlap scheduling: a finished request's endpoint is the state tracked last, "
                        f"at a multiple of --mamba-track-interval ({self.server_args.mamba_track_interval}; "
                        "64 keeps it within a page of the end)" if overlapped
                        else "a finished request's endpoint is its exact last state")
        if not self._pools_pending:
            if pool is None:                  # SGLang's hook calls in with no draft too
                return
            # built without speculative decoding (SGLang builds its draft worker before serving):
            # the host tier is built already, so the draft's KV goes only with the tail copies
            self.pool.give_back_spares()      # the new parts take their own
            self._build_parts()
            if not self.disable:
                self.pages.refill_spares(at_startup=True)
            return
        self._pools_pending = False
        if self.options.host_tier:
            self.host = build_host_tier(self.options, self.kvcache, self.req_to_token_pool,
                                        self.page_size, self.device, self.forward_stream,
                                        self._runner, self.ranks, self.server_args,
                                        self.kv_pools[1:])
            self.fingerprint = host_fingerprint(self.server_args, self.host, self.page_size,
                                                self.options, self.ranks)
            self.store_worker = build_store_worker(self.options, self.host.memory,
                                                   self.host.layout.image_slabs, self.fingerprint)
        self._build_parts()                 # nothing is cached yet: the parts gain the tier
        if self.host is not None and not self.disable:
            self.host_policy.load_file(self._poll_host)
        if not self.disable:
            self.pages.refill_spares(at_startup=True)

    def passed_over(self, req) -> None:
        """SGLang's PrefillAdder did not take ``req`` this round, possibly after init_load_back
        restored its prefix (its chunk budget rounded down to nothing): the blocks restored
        stay cached, but the page its host-only tail came back into was to be its own. It goes
        back once every later pass waits for that copy (a later owner writes after it)."""
        lease = lease_of(req)
        if lease is None or lease.restored_tail is None:
            return
        (page, transfer), lease.restored_tail = lease.restored_tail, None
        self.host.wait_on(transfer, self.forward_stream)
        self.pool.free_pages([page])
        self.report.counts["restored_tails_dropped"] += 1

    def on_idle(self) -> None:
        """No request runs: every page is free, spare, cached or taken to hand back, and no
        lease holds pages back. Anything else is a bug; rather than let SGLang's idle check
        stop the server on it, it is put right here with a warning that says where it was."""
        if self.disable:
            return
        if self.store is not None:
            self._poll_host()           # what landed on host goes on to the shared tier
        if self.leases.held_pages:
            logger.warning("hybrid radix cache: idle with %d pages still held back by %d leases; "
                           "released", self.leases.held_pages, len(self.leases.holding))
            for lease in list(self.leases.holding):
                self.leases.release_hold(lease)
        lost = self.pages.recover_lost(self.req_to_token_pool.req_to_token)
        if lost:
            self.report.counts["pages_recovered"] += len(lost)
            logger.warning("hybrid radix cache: idle with %d KV pages owned by no request, the cache "
                           "nor the allocator (a leak): given back; %s", len(lost), "; ".join(lost))

    # ---- locks ---------------------------------------------------------------------------
    @_timed
    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        if self.disable or not isinstance(node, Lease) or node is self.root_node:
            return IncLockRefResult()
        node.locks += 1
        if node.seq is not None:
            return IncLockRefResult()
        if not node.needs_restore:
            try:
                node.seq, restore = self.index.begin(node.key, node.candidate, count_hit=False)
                if restore:   # the source left the device since the match: its copy is gone
                    self.index.release(node.seq)
                    node.seq = None
                    raise ValueError("its image or tail left the device")
            except ValueError as err:
                self.leases.stale_quote(node, err)
        elif node.held_source is None and not node.held_pages:
            self.leases.hold_for_restore(node)
        return IncLockRefResult()

    @_timed
    def dec_lock_ref(self, node: Any, params=None) -> DecLockRefResult:
        if self.disable or not isinstance(node, Lease) or node is self.root_node:
            return DecLockRefResult()
        node.locks -= 1
        assert node.locks >= 0, "dec_lock_ref without inc_lock_ref"
        self.leases.release_hold(node)          # the adder's check under its lock is done
        if node.locks == 0 and node.seq is not None:
            self.index.release(node.seq)
            node.seq = None
        return DecLockRefResult()

    # ---- caching requests ----------------------------------------------------------------
    @_timed
    def cache_unfinished_req(self, req, chunked: bool = False, *, up_to: Optional[int] = None) -> None:
        """A request's prefill chunk or prefill ended. ``up_to``: where it ended, under the
        checkpoint contract, where SGLang keeps the prefix's length itself (contract.py)."""
        if self.disable:
            if up_to is None:
                req.prefix_indices = self.req_to_token_pool.req_to_token[
                    req_slots(req).req_pool_idx, :req.extend_range.end].to(torch.int64, copy=True)
            return
        self._poll_host(flush=False)          # the batch's results go to host in one launch
        lease, seq = self.leases.seq_of(req)
        kv = req_slots(req)
        committed = kv.kv_committed_len if up_to is None else up_to
        self.commits.commit(req, seq, committed)
        self.taps.publish(req, lease.taps, seq, committed)
        self.commits.publish_tracked_tap(req, seq, committed)
        self.index.source_used(seq)
        if up_to is None:
            row = self.req_to_token_pool.req_to_token[kv.req_pool_idx, :committed]
            req.prefix_indices = row.to(dtype=torch.int64, copy=True)
        kv.cache_protected_len = len(seq.path) * self.page_size
        self.pages.refill_spares()            # (what the index let go goes back first)
        _full_check(self)

    @_timed
    def cache_finished_req(self, req, is_insert: bool = True, *, kv_len_to_handle: int,
                           sglang_frees: bool = False) -> None:
        """A request finished (or, not ``is_insert``, was let go). ``sglang_frees``: the
        checkpoint contract's finish, after which SGLang frees the pages from
        ``cache_protected_len`` on and releases the request's lock itself (contract.py)."""
        row = self.req_to_token_pool.req_to_token[req_slots(req).req_pool_idx]
        if self.disable:
            if not sglang_frees:
                self.token_to_kv_pool_allocator.free_segment(row[:kv_len_to_handle], start_pos=0)
            self.req_to_token_pool.free_mamba_cache(req)
            return
        self._poll_host(flush=False)          # the batch's results go to host in one launch
        if self.coalescer is not None:
            self.coalescer.finished(req)
        lease, seq = self.leases.seq_of(req)
        committed = kv_len_to_handle
        ids = self.commits.read_finish_ids(req, seq, committed)
        self.commits.commit(req, seq, committed, ids["blocks"])
        kept_slot, tail_page_kept = None, False
        freed_slots: list[int] = []         # mamba slots to free, in one call at the end
        if is_insert:
            self.taps.publish(req, lease.taps, seq, committed)
        self.taps.drop(lease.taps)
        # A grammar cuts a speculative step's accepted tokens after the state took them all
        if (is_insert and committed == req_slots(req).kv_committed_len and committed > 0
                and not (self.speculative and getattr(req, "grammar", None) is not None)):
            kept_slot, tail_page_kept = self.commits.publish_endpoint(req, seq, committed, ids, freed_slots)
            if kept_slot is not None:
                self.taps.endpoint_published(lease.taps)
        # Free what the request still owns privately: pages after its committed full blocks.
        first_private = len(seq.path) * self.page_size + (self.page_size if tail_page_kept else 0)
        if sglang_frees:
            req_slots(req).cache_protected_len = first_private
        elif first_private < committed:
            self.token_to_kv_pool_allocator.free_segment(row[first_private:committed], start_pos=first_private)
        self.commits.free_request_slots(req, kept_slot, ids, freed_slots)
        self.index.source_used(seq)
        if not sglang_frees:
            lease.locks = 0
        self.run(self.index.release(seq, write_through=is_insert))
        lease.seq = None
        # A retracted request starts over and may sample other tokens: hash it anew.
        record_of(req).key = None
        self.pool.take(FreeDevice([], freed_slots))
        self.pages.refill_spares()            # (what the index let go goes back first)
        _full_check(self)

    # ---- eviction and sizes ----------------------------------------------------------------
    @_timed
    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable:
            return EvictResult()
        self._poll_host()
        t0 = time.perf_counter()
        pages = -(-params.num_tokens // self.page_size) if params.num_tokens > 0 else 0
        pending = self.pool.num_freed_pages      # handed back below, counted as evictable
        freed_pages = pending + (self.pages.evict_pages(pages - pending) if pages > pending else 0)
        freed_slots = self.pages.evict_slots(params.mamba_num) if params.mamba_num > 0 else 0
        if self.ranks.checking:
            self.ranks.note("evict", pages, params.mamba_num, freed_pages, freed_slots)
        self.update_eviction_metrics(freed_pages * self.page_size, t0)
        return EvictResult(num_tokens_evicted=freed_pages * self.page_size, mamba_num_evicted=freed_slots)

    def full_evictable_size(self) -> int:
        # pages held back under a restore's lock may exceed the evictable ones: SGLang's
        # PrefillAdder adds this to the free pages, so the sum is what stays true. Pages the
        # index freed and the binding has not handed back yet are as good as evictable (an
        # evict hands them back first), and SGLang's idle check counts every page.
        return (self.index.sizes.evictable_pages + self.pool.num_freed_pages + self.pool.spares.held
                - self.leases.held_pages) * self.page_size

    def full_protected_size(self) -> int:
        sizes = self.index.sizes
        return (sizes.device_pages - sizes.evictable_pages) * self.page_size

    def evictable_size(self) -> int:
        return self.full_evictable_size()

    def protected_size(self) -> int:
        return self.full_protected_size()

    def mamba_evictable_size(self) -> int:
        return self.index.sizes.evictable_slots + self.pool.spare_slots.held

    def mamba_protected_size(self) -> int:
        sizes = self.index.sizes
        return sizes.device_images - sizes.evictable_slots

    def total_size(self):
        return self.index.sizes.device_pages * self.page_size, self.index.sizes.device_images

    # ---- diagnostics ---------------------------------------------------------------------
    def sanity_check(self) -> None:
        if not self.disable:
            self._poll_host()                     # landed copies release their pins
            sanity_check(self.index)
            _full_check(self)

    def pretty_print(self) -> None:
        print(self.available_and_evictable_str())

    def available_and_evictable_str(self) -> str:
        host = ""
        if self.host is not None:
            slabs = self.host.memory.slabs
            host = (f"; host slabs {slabs.num_used} of {slabs.num_slabs} used "
                    f"({slabs.online_chunks}/{slabs.num_chunks} chunks online), "
                    f"{len(self.host.in_flight)} transfers in flight, {len(self.host.queued)} "
                    f"writes queued, {self.host.stats}")
        return f"hybrid radix cache: {self.pages.describe()}, held back {self.leases.held_pages}{host}"

    def all_values_flatten(self) -> torch.Tensor:
        return page_slots(self.index.device_page_ids(), self.page_size, self.device)

    def all_mamba_values_flatten(self) -> torch.Tensor:
        return to_device(self.index.device_slot_ids(), self.device)
