"""Route MambaPool.copy_from (the deferred copy-on-write of a snapshot image into a request's
working slot) through hpc_radix's one-launch Triton kernel while the hybrid cache is active.

Only plain pools: ReplaySSM pools keep a ring cursor that copy_from also resets, so they keep
SGLang's own path. ``HPC_SNAPSHOT_KERNEL=0`` turns the kernel off.
"""
from __future__ import annotations

import logging

from hpc_radix.options import diagnostic
from hpc_radix.patches.state import STATE

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.mem_cache.memory_pool.MambaPool.copy_from"


def activate() -> None:
    """Called by HybridRadixCache: the kernel serves copies in this process from now on."""
    STATE.state_copy = diagnostic("snapshot_kernel")


def _around_copy_from(orig, pool, src_indices, dst_indices):
    if not STATE.state_copy or getattr(pool, "replayssm_write_pos", None) is not None or not src_indices.is_cuda:
        return orig(pool, src_indices, dst_indices)
    from hpc_radix.kernels.snapshot_copy import copy_state_slots

    cache = pool.mamba_cache
    try:
        copy_state_slots([*cache.conv, cache.temporal], src_indices, dst_indices, validate=False)
    except ValueError as err:       # a layout the kernel does not take: SGLang's path, for good
        STATE.state_copy = False
        logger.warning("hpc_radix snapshot kernel disabled (%s); using MambaPool.copy_from", err)
        orig(pool, src_indices, dst_indices)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, _around_copy_from, HookType.AROUND)
