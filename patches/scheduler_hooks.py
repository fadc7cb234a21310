"""Connects SGLang scheduler events to the hybrid cache through HookRegistry (no core patch).

- ``PrefillAdder._req_inc_lock_ref`` (AFTER): the point where a request is definitely admitted;
  the cache then gives it a private copy of its source snapshot's tail page.
- ``PrefillAdder.add_one_req`` / ``add_chunked_req`` (AROUND): an exact tap splits the prefill
  chunk there (spec §7.1): the chunk budget is capped so the extend ends at the tap.
"""
from __future__ import annotations

_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
ADMIT_TARGET = f"{_ADDER}._req_inc_lock_ref"
ADD_TARGETS = (f"{_ADDER}.add_one_req", f"{_ADDER}.add_chunked_req")


def _after_admit(result, adder, req, *args, **kwargs):
    on_admitted = getattr(adder.tree_cache, "on_admitted", None)
    if on_admitted is not None:
        on_admitted(req)
    return result


def _around_add(orig, adder, req, *args, **kwargs):
    chunk_cap = getattr(adder.tree_cache, "chunk_cap", None)
    cap = chunk_cap(req) if chunk_cap is not None else None
    budget = adder.rem_chunk_tokens
    if cap is None or budget is None or cap >= budget:
        return orig(adder, req, *args, **kwargs)
    adder.rem_chunk_tokens = cap
    try:
        return orig(adder, req, *args, **kwargs)
    finally:
        # what the capped call consumed comes off the real budget ...
        adder.rem_chunk_tokens = budget - (cap - adder.rem_chunk_tokens)
        # ... and a request left chunked ends the batch's chunking, as a truncation by the
        # budget would: the scheduler keeps one chunked request at a time.
        if req in adder.can_run_list and req.extend_range.end < len(req.full_untruncated_fill_ids):
            adder.rem_chunk_tokens = 0


installed = False


def install() -> None:
    """Register the hooks; HookRegistry applies them when SGLang loads its plugins."""
    global installed
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(ADMIT_TARGET, _after_admit, HookType.AFTER)
    for target in ADD_TARGETS:
        HookRegistry.register(target, _around_add, HookType.AROUND)
    installed = True
