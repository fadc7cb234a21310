"""Connects SGLang scheduler events to the hybrid cache through HookRegistry (no core patch).

- ``PrefillAdder._req_inc_lock_ref`` (AFTER): the point where a request is definitely admitted;
  the cache then gives it a private copy of its source snapshot's tail page.
- ``PrefillAdder.add_one_req`` / ``add_chunked_req`` (AROUND): an exact tap splits the prefill
  chunk there (spec §7.1): the chunk budget is capped so the extend ends at the tap.
"""
from __future__ import annotations

_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
ADMIT_TARGET = f"{_ADDER}._req_inc_lock_ref"
ADD_ONE_TARGET = f"{_ADDER}.add_one_req"
ADD_CHUNKED_TARGET = f"{_ADDER}.add_chunked_req"


def _after_admit(result, adder, req, *args, **kwargs):
    on_admitted = getattr(adder.tree_cache, "on_admitted", None)
    if on_admitted is not None:
        on_admitted(req)
    return result


def _capped(orig, adder, req, *args, **kwargs):
    """Run ``orig`` with the chunk budget capped at the request's next exact tap."""
    chunk_cap = getattr(adder.tree_cache, "chunk_cap", None)
    cap = chunk_cap(req) if chunk_cap is not None else None
    budget = adder.rem_chunk_tokens
    if cap is None or budget is None or cap >= budget:
        return orig(adder, req, *args, **kwargs)
    adder.rem_chunk_tokens = cap
    try:
        return orig(adder, req, *args, **kwargs)
    finally:
        # what the capped call consumed comes off the real budget; the rest stays usable
        adder.rem_chunk_tokens = budget - (cap - adder.rem_chunk_tokens)


def _shares_next_page(req, batch, page_size: int) -> bool:
    """Whether ``req``'s first uncached page is also prefilled by a request of this batch
    (at the same position): waiting one round then reuses it instead of computing it twice."""
    start = len(req.prefix_indices)
    mine = list(req.origin_input_ids[start:start + page_size])
    if len(mine) < page_size:
        return False
    return any(other is not req and list(other.origin_input_ids[start:start + page_size]) == mine
               for other in batch)


def _around_add_one(orig, adder, req, has_chunked_req=False, *args, **kwargs):
    # The scheduler runs one chunked request at a time, so while another request is chunked
    # (a split leaves chunk budget that upstream truncation never leaves), a request that
    # does not fit the budget waits for the next round. One that fits but has an exact tap
    # also waits when this batch prefills its next page (it reuses it next round); else it
    # is admitted whole, forgoing its splits this pass: one split per batch, batches full.
    budget = adder.rem_chunk_tokens
    if budget is not None and (has_chunked_req or adder.new_chunked_req is not None):
        from sglang.srt.managers.schedule_policy import AddReqResult

        need = adder.ceil_paged_tokens(len(req.full_untruncated_fill_ids) - len(req.prefix_indices))
        if need > budget:
            return AddReqResult.OTHER
        chunk_cap = getattr(adder.tree_cache, "chunk_cap", None)
        cap = chunk_cap(req) if chunk_cap is not None else None
        if cap is not None and cap < need:
            if _shares_next_page(req, adder.can_run_list, adder.page_size):
                return AddReqResult.OTHER
            adder.tree_cache.forgo_splits(req)
        return orig(adder, req, has_chunked_req, *args, **kwargs)
    return _capped(orig, adder, req, has_chunked_req, *args, **kwargs)


installed = False


def install() -> None:
    """Register the hooks; HookRegistry applies them when SGLang loads its plugins."""
    global installed
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(ADMIT_TARGET, _after_admit, HookType.AFTER)
    HookRegistry.register(ADD_ONE_TARGET, _around_add_one, HookType.AROUND)
    HookRegistry.register(ADD_CHUNKED_TARGET, _capped, HookType.AROUND)
    installed = True
