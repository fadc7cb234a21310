"""Connects SGLang scheduler events to the hybrid cache through HookRegistry (no core patch).

- ``PrefillAdder._req_inc_lock_ref`` (AFTER): the point where a request is definitely admitted;
  the cache then gives it a private copy of its source snapshot's tail page.
"""
from __future__ import annotations

ADMIT_TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder._req_inc_lock_ref"


def _after_admit(result, adder, req, *args, **kwargs):
    on_admitted = getattr(adder.tree_cache, "on_admitted", None)
    if on_admitted is not None:
        on_admitted(req)
    return result


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(ADMIT_TARGET, _after_admit, HookType.AFTER)
