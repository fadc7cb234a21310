"""The scheduler hooks a radix cache may answer (``patches/`` calls them; the cache implements
them). SGLang's ``BasePrefixCache`` has no such calls; the patches hook SGLang's PrefillAdder and
ForwardBatch and ask the tree cache through this interface, so they never look methods up by
name and work unchanged (doing nothing) for any other cache.
"""
from __future__ import annotations

import abc
from typing import Any, Optional


class SchedulerHooks(abc.ABC):
    # ---- Req (patches/scheduler_hooks.py) ----------------------------------------------------
    @abc.abstractmethod
    def held_back(self, req) -> bool:
        """Whether queued ``req`` still waits for what the cache fetches for it: SGLang's match
        of it this round is skipped (its last, empty, match stands)."""

    # ---- PrefillAdder (patches/scheduler_hooks.py) ------------------------------------------
    @abc.abstractmethod
    def on_admitted(self, req) -> None:
        """``req`` was admitted (its lock is held): from here it runs."""

    @property
    @abc.abstractmethod
    def splits_prefill(self) -> bool:
        """Whether exact taps end prefill chunks (the admission caps chunks at ``chunk_cap``)."""

    @abc.abstractmethod
    def chunk_cap(self, req) -> Optional[int]:
        """Tokens the next extend of ``req`` may take so it ends at its next exact tap."""

    @abc.abstractmethod
    def coalesce_wait(self, req) -> bool:
        """Whether ``req`` (just matched) waits in the queue for a sibling's snapshot."""

    @abc.abstractmethod
    def release_written_pages(self, short_tokens: int, idle_req=None) -> bool:
        """An admission is ``short_tokens`` short: whether pages were freed by waiting for the
        host writes pinning them (the admission is then tried again). ``idle_req``: the
        request refused, where nothing runs (every write is waited for then)."""

    @abc.abstractmethod
    def passed_over(self, req) -> None:
        """The adder did not take ``req`` this round (it stays queued and is matched again)."""

    @abc.abstractmethod
    def prefetch_head(self, req, room_tokens: int) -> int:
        """``req`` heads the queue, refused for want of pages: blocks prefetched meanwhile."""

    # ---- ForwardBatch (patches/gdn_taps.py) -------------------------------------------------
    @abc.abstractmethod
    def reserve_taps(self, batch) -> Any:
        """Slots for the taps the coming prefill pass of ``batch`` captures (None: none)."""

    @abc.abstractmethod
    def batch_built(self, layered: bool = True) -> None:
        """A batch was built and its pass is about to launch (every batch)."""

    # ---- Scheduler (patches/scheduler_hooks.py) ---------------------------------------------
    @abc.abstractmethod
    def attach_draft_kv(self, pool, overlapped: bool = False) -> None:
        """SGLang built its draft worker: its model's own KV pool, addressed by the same slots
        (None without speculative decoding); ``overlapped``: steps scheduled with overlap."""

    @abc.abstractmethod
    def on_idle(self) -> None:
        """No request runs or waits for the GPU: SGLang's idle check of its pools comes next."""


def hooks_of(cache) -> Optional[SchedulerHooks]:
    """The cache's hooks, None for a cache without them (SGLang's own)."""
    return cache if isinstance(cache, SchedulerHooks) else None
