"""How SGLang learns where a request's prefix lies, under either cache contract
(``contract.py`` says how they differ): the request's lease remembers the prefix's token slots
(``device_indices``); up to 0.5.22 ``MatchResult`` and ``req.prefix_indices`` carry them, from
0.5.23 ``MatchResult`` carries their number and SGLang asks ``prefix_device_indices``."""
from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchResult

from hpc_radix.sglang_version import checkpoints, drop_prefix, prefix_len, req_slots

from .device.leases import Lease, lease_of


def match_result(indices: torch.Tensor, node: Any, protected: int = 0, **kwargs) -> MatchResult:
    """What ``match_prefix`` returns for a prefix at ``indices`` on device, ``node`` its
    handle (a Lease, or the shared root); ``protected``: the tokens of its whole blocks, which
    the cache owns (a snapshot's tail page is the request's own copy once admitted, and
    SGLang frees a request's slots from there on)."""
    if isinstance(node, Lease) and not node.is_root:
        node.device_indices = indices
    return MatchResult(len(indices) if checkpoints() else indices, node, node, node,
                       cache_protected_len=protected, **kwargs)


def load_back_result(req, lease: Lease, indices: torch.Tensor, protected: int):
    """``init_load_back``'s answer once the prefix is at ``indices``: all of it, since blocks
    matched on device may have gone meanwhile and come back with the rest, so the prefix
    SGLang adds it to is emptied first (``protected`` as for ``match_result``)."""
    drop_prefix(req, indices.device)
    req_slots(req).cache_protected_len = protected
    lease.device_indices = indices
    return (len(indices) if checkpoints() else indices), lease


def prefix_indices(req, lease: Lease) -> torch.Tensor:
    """The token slots of ``req``'s prefix, as SGLang will write them into its row."""
    if checkpoints():
        return lease.device_indices[:prefix_len(req)]
    return req.prefix_indices


def replace_prefix(req, indices: torch.Tensor) -> None:
    """``req``'s admitted prefix is at ``indices`` now (its tail in a private page)."""
    lease = lease_of(req)
    if lease is not None:
        lease.device_indices = indices
    if not checkpoints():
        req.prefix_indices = indices
