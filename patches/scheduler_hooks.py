"""Connects SGLang scheduler events to the hybrid cache through HookRegistry (no core patch).

- ``Req.init_next_round_input`` (AROUND): a queued request that still waits for what the cache
  fetches for it (``held_back``: the shared tier's read-back) is not matched again; its last
  match, empty, stands and the adder passes it over (``coalesce_wait``). SGLang's loop would
  otherwise match it at every turn while it waits.
- ``PrefillAdder._req_inc_lock_ref`` (AFTER): the point where a request is definitely admitted;
  the cache then gives it a private copy of its source snapshot's tail page.
- ``PrefillAdder.add_one_req`` (AROUND): with in-flight coalescing on, a request that waits for
  a sibling's snapshot (``coalesce_wait``) is passed over and stays queued. A request refused
  for want of pages that write-throughs pin for a moment is tried once more after the cache
  has waited for those writes (``release_written_pages``); with nothing running, after every
  host write has landed, and if still refused it stays queued
  without the batch marked full, which SGLang 0.5.17 clears only when a running request ends
  (0.5.23 does the same). A restore the cache refuses under
  the adder's lock (``RestoreRefused``) passes the request over for this round. A request
  still refused for want of pages heads the queue: the cache may prefetch its host-only
  blocks meanwhile (``prefetch_head``, design §6.6). A request passed over after its host
  restore ran gives back the page its tail was restored into (``passed_over``).
- ``PrefillAdder.add_one_req`` / ``add_chunked_req`` (AROUND): where taps cannot be captured
  inside the prefill pass (the cache's split fallback), an exact tap splits the prefill chunk
  there (design §7.1): the chunk budget is capped so the extend ends at the tap. Otherwise, and
  for other caches, SGLang's own admission runs untouched.
- ``kv_cache_builder.maybe_register_hicache_draft`` (AFTER): SGLang built the tree cache and
  any draft worker: with speculative decoding the cache gets the draft model's KV pool, so that
  its KV copies, host tier included, cover the draft's KV as well.
- ``Scheduler.on_idle`` (AROUND): once nothing runs, the cache checks that it accounts for
  every page before SGLang's idle check of the pools (which stops the server on a lost page):
  one it does not is given back with a warning naming where it was (``on_idle``).
"""
from __future__ import annotations

from hpc_radix.errors import RestoreRefused
from hpc_radix.hooks import hooks_of
from hpc_radix.patches.state import STATE
from hpc_radix.sglang_version import prefix_len, target

_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
NEXT_ROUND_TARGET = "sglang.srt.managers.schedule_batch.Req.init_next_round_input"
ADMIT_TARGET = target(f"{_ADDER}._req_inc_lock_ref")
ADD_ONE_TARGET = f"{_ADDER}.add_one_req"
ADD_CHUNKED_TARGET = f"{_ADDER}.add_chunked_req"
IDLE_TARGET = "sglang.srt.managers.scheduler.Scheduler.on_idle"
DRAFT_TARGET = "sglang.srt.mem_cache.kv_cache_builder.maybe_register_hicache_draft"



def _around_next_round(orig, req, tree_cache=None, *args, **kwargs):
    hooks = hooks_of(tree_cache) if tree_cache is not None else None
    if hooks is not None and hooks.held_back(req):
        return None
    return orig(req, tree_cache, *args, **kwargs)


def _after_admit(result, adder, req, *args, **kwargs):
    hooks = hooks_of(adder.tree_cache)
    if hooks is not None:
        hooks.on_admitted(req)
    return result


def _splits(adder) -> bool:
    """Whether the tree cache splits prefill chunks at taps (ours, on its split fallback)."""
    hooks = hooks_of(adder.tree_cache)
    return hooks is not None and hooks.splits_prefill


def _chunk_cap(adder, req):
    """Tokens to the request's next exact tap, or None."""
    return adder.tree_cache.chunk_cap(req) if _splits(adder) else None


def _capped(orig, adder, req, *args, **kwargs):
    """Run ``orig`` with the chunk budget capped at the request's next exact tap."""
    cap = _chunk_cap(adder, req)
    budget = adder.rem_chunk_tokens
    if cap is None or budget is None or cap >= budget:
        return orig(adder, req, *args, **kwargs)
    adder.rem_chunk_tokens = cap
    try:
        return orig(adder, req, *args, **kwargs)
    finally:
        # what the capped call consumed comes off the real budget; the rest stays usable
        adder.rem_chunk_tokens = budget - (cap - adder.rem_chunk_tokens)


def _around_add_one(orig, adder, req, has_chunked_req=False, *args, **kwargs):
    from sglang.srt.managers.schedule_policy import AddReqResult

    # In-flight coalescing (the cache's option): the request stays in the queue, the next one
    # is considered.
    hooks = hooks_of(adder.tree_cache)
    if hooks is None:
        return orig(adder, req, has_chunked_req, *args, **kwargs)
    if hooks.coalesce_wait(req):
        return AddReqResult.CONTINUE
    try:
        res = _add_one(orig, adder, req, has_chunked_req, *args, **kwargs)
        # Short of pages that write-throughs pin for a moment: SGLang would mark the batch full
        # and not try again until a running request finishes (with nothing running, never).
        idle = not adder.can_run_list and adder.running_batch.is_empty()
        if (res == AddReqResult.NO_TOKEN and not _taken(adder, req) and hooks.release_written_pages(
                _short_tokens(adder, req), idle_req=req if idle else None)):
            res = _add_one(orig, adder, req, has_chunked_req, *args, **kwargs)
        if not _taken(adder, req):
            hooks.passed_over(req)
            if res == AddReqResult.NO_TOKEN:   # it heads the queue until pages free up
                hooks.prefetch_head(req, adder.rem_total_tokens)
                if idle:
                    # SGLang would mark the batch full, which only a running request's end
                    # clears: with nothing running it would wait for ever. The request stays
                    # queued, tried again next round (SGLang's own rule from 0.5.23 on).
                    res = AddReqResult.OTHER
    except RestoreRefused:
        # raised under the adder's lock before it took the request or any budget: OTHER ends
        # this round without marking the batch full, and the request is matched again next
        return AddReqResult.OTHER
    return res


def _taken(adder, req) -> bool:
    return any(r is req for r in adder.can_run_list)


def _short_tokens(adder, req) -> int:
    """How many tokens ``add_one_req``'s first budget check finds missing for ``req``."""
    return needed_tokens(adder, req) - adder.rem_total_tokens + 1


def needed_tokens(adder, req) -> int:
    """The tokens ``add_one_req``'s budget check asks for ``req``."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    max_new = min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
    return (len(req.full_untruncated_fill_ids) - prefix_len(req) + max_new
            + adder.page_size + adder._mamba_gap_budget_for_req(req))


def _add_one(orig, adder, req, has_chunked_req, *args, **kwargs):
    from sglang.srt.managers.schedule_policy import AddReqResult

    # The scheduler runs one chunked request at a time. A split leaves chunk budget that
    # upstream truncation never leaves, so a request that would be chunked while another is
    # waits for the next round instead of becoming a second one.
    if not _splits(adder):
        return orig(adder, req, has_chunked_req, *args, **kwargs)
    budget = adder.rem_chunk_tokens
    if budget is not None and (has_chunked_req or adder.new_chunked_req is not None):
        cap = _chunk_cap(adder, req)
        need = adder.ceil_paged_tokens(len(req.full_untruncated_fill_ids) - prefix_len(req))
        if need > budget or (cap is not None and cap < need):
            return AddReqResult.OTHER
    return _capped(orig, adder, req, has_chunked_req, *args, **kwargs)


def _around_idle(orig, scheduler, *args, **kwargs):
    """The cache sets its accounting right before SGLang's idle check of the pools."""
    hooks = hooks_of(scheduler.tree_cache)
    if hooks is not None and scheduler.is_fully_idle():
        hooks.on_idle()
    return orig(scheduler, *args, **kwargs)


def _after_register_draft(result, *args, tree_cache=None, draft_worker=None, spec_algorithm=None,
                          server_args=None, **kwargs):
    """SGLang built its tree cache and any draft worker: the cache gets the draft's KV pool
    (None without one) and whether steps are scheduled with overlap."""
    from sglang.srt.mem_cache.kv_cache_builder import get_draft_kv_pool

    hooks = hooks_of(tree_cache)
    if hooks is not None:
        hooks.attach_draft_kv(get_draft_kv_pool(draft_worker=draft_worker,
                                                spec_algorithm=spec_algorithm,
                                                server_args=server_args),
                              overlapped=not server_args.disable_overlap_schedule)
    return result


def unapplied(targets) -> list[str]:
    """``Class.method`` of each hook target HookRegistry did not patch (it only logs those)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return [".".join(t.rsplit(".", 2)[-2:]) for t in targets if t not in HookRegistry._patched]


def install() -> None:
    """Register the hooks; HookRegistry applies them when SGLang loads its plugins."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(NEXT_ROUND_TARGET, _around_next_round, HookType.AROUND)
    HookRegistry.register(ADMIT_TARGET, _after_admit, HookType.AFTER)
    HookRegistry.register(ADD_ONE_TARGET, _around_add_one, HookType.AROUND)
    HookRegistry.register(ADD_CHUNKED_TARGET, _capped, HookType.AROUND)
    HookRegistry.register(IDLE_TARGET, _around_idle, HookType.AROUND)
    HookRegistry.register(DRAFT_TARGET, _after_register_draft, HookType.AFTER)
    STATE.hooks_installed = True
