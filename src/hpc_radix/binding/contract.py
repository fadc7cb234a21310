"""The cache as each SGLang release's ``BasePrefixCache`` contract asks for it: the one place
the binding tells the two apart (``sglang_version.checkpoints`` says which one runs).

- Up to 0.5.22, ``MatchResult`` carries the prefix's token slots and SGLang keeps them in
  ``req.prefix_indices``; ``cache_unfinished_req`` and ``cache_finished_req`` cache a request,
  and the latter frees what the request still owns and ends its lock.
- From 0.5.23 (docs/sglang-0.5.23-contract.md), ``MatchResult`` carries the prefix's length
  and SGLang asks ``prefix_device_indices`` when it allocates; ``checkpoint`` caches a request
  at each checkpoint and at its finish, after which SGLang frees what the cache did not take
  (from ``cache_protected_len`` on), releases the request's lock and calls ``on_release``.

How SGLang learns where a request's prefix lies, under either: ``prefixes.py``.
"""
from __future__ import annotations

from typing import Any

import torch

from hpc_radix.sglang_version import checkpoints

from .cache import HybridRadixCache
from .device.leases import lease_of
from .device.requests import record_of


class CheckpointCache(HybridRadixCache):
    """``HybridRadixCache`` under the checkpoint contract (SGLang 0.5.23 on)."""

    def __init__(self, ctx):
        super().__init__(ctx)
        # SGLang calls the draft-registration hook only with HiCache from 0.5.23 on: the cache
        # finishes its setup here (host tier, cache file, spares); speculative decoding, whose
        # draft pools come another way there, is refused at startup (plugin.py)
        self.attach_draft_kv(None)

    def path_device_indices(self, node: Any) -> torch.Tensor:
        indices = getattr(node, "device_indices", None)
        return indices if indices is not None else torch.empty((0,), dtype=torch.int64, device=self.device)

    def prefix_device_indices(self, req) -> torch.Tensor:
        return self.path_device_indices(req.last_node)[:req.prefix_len]

    def load_back_is_cache_owned(self) -> bool:
        """SGLang would count the whole loaded prefix as the cache's; its tail page is the
        request's own copy (``init_load_back`` sets what the cache owns)."""
        return False

    def checkpoint(self, req, *, up_to: int, **kwargs) -> None:
        """A prefill chunk's or prefill's end (``up_to``: the extend's end), or the finish."""
        if req.finished():
            self.cache_finished_req(req, kv_len_to_handle=up_to, sglang_frees=True)
        else:
            self.cache_unfinished_req(req, up_to=up_to)

    def on_release(self, req, *, checkpointed: bool) -> None:
        """SGLang let go of a request it did not cache as finished (an abort, a retraction):
        its pages past ``cache_protected_len`` are freed and its lock released already; its
        working and tracking slots, planned taps and sequence go here."""
        if checkpointed or self.disable:
            return
        if self.coalescer is not None:      # its siblings wait for it no longer
            self.coalescer.finished(req)
        self.req_to_token_pool.free_mamba_cache(req)
        lease = lease_of(req)
        if lease is not None:
            self.taps.drop(lease.taps)
            if lease.seq is not None:       # a cold request's own (SGLang locked the root)
                self.run(self.index.release(lease.seq))
                lease.seq = None
        record_of(req).key = None
        self.pages.refill_spares()


def cache_class() -> type:
    return CheckpointCache if checkpoints() else HybridRadixCache
