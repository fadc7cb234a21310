"""The SGLang releases hpc_radix is tested with, what it does beside another one, and the
SGLang surfaces whose names moved between releases (docs/sglang-versions.md).

The one place that answers the version question (docs/operations.md, "SGLang versions"):
inside the tested range the startup log names the release, and warns where the GPU suite and
benchmarks did not run on it; above it the server starts with a warning naming the range (a
newer release may have moved a hook; each hook that does not apply names itself and its
fallback in the startup log); below it ``--radix-cache hybrid`` refuses to start, naming the
release.
"""
from __future__ import annotations

import functools
import re
from importlib import metadata
from typing import Optional

from hpc_radix.errors import HybridConfigError

TESTED = ("0.5.17", "0.5.23")   # the releases CI runs the whole CPU suite on, oldest first
GPU_TESTED = ("0.5.17",)        # those the GPU suite and the benchmarks ran on (the GPU
                                # machine's torch 2.11 runs no later release)

_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
# Hook targets (by their 0.5.17 names) that a later release calls otherwise, from that release
# on. patches/ asks ``target`` for every name it hooks, so a move is written here only.
MOVED = {
    # where an admission takes the request's tree lock
    f"{_ADDER}._req_inc_lock_ref": ((0, 5, 23), f"{_ADDER}._commit_prefill_admission"),
    # where the server arguments are resolved (RECORDS)
    f"{_SERVER_ARGS}.__post_init__": ((0, 5, 23), f"{_SERVER_ARGS}.resolve_once"),
}

# Patches whose SGLang surface a release changed and that are not ported to it yet, from that
# release on: the scheduler keeps SGLang's own way there, and the startup log says so. 0.5.23
# builds the GDN tracking tables from ForwardBatch.mamba_track_aligned_lens.
NOT_PORTED = {"batch_syncs": (0, 5, 23)}

# From this release on, ServerArgs is a sealed record of the operator's input: resolve_once runs
# a pipeline that declares each resolved value beside the input (resolution_result reads it),
# and a plugin's choices are declared the same way (record_foreign_defaults).
RECORDS = (0, 5, 23)


# From this release on, BasePrefixCache is the redesigned contract (docs/sglang-0.5.23-contract.md):
# SGLang asks for a request's prefix by its length (req.prefix_len) and the cache's
# prefix_device_indices, caches a request at its checkpoints, and keeps a request's KV row,
# mamba slot and their bookkeeping (req_pool_idx, mamba_pool_idx, mamba_cow_src_index,
# mamba_needs_clear, the ping-pong track fields, cache_protected_len, kv_committed_len) in its
# ``kv`` (ReqKvInfo), not on the request. (0.5.17's requests have a ``kv`` too: two other
# fields, None until the row is allocated.)
CHECKPOINTS = (0, 5, 23)


@functools.cache
def _installed_from(first: tuple[int, ...]) -> bool:
    return release(installed()) >= first


def checkpoints(version: Optional[str] = None) -> bool:
    """Whether the installed SGLang (or ``version``) has the redesigned cache contract."""
    return _installed_from(CHECKPOINTS) if version is None else release(version) >= CHECKPOINTS


def ported(patch: str) -> bool:
    """Whether ``patch`` (a module of patches/) runs on the installed SGLang (NOT_PORTED)."""
    first = NOT_PORTED.get(patch)
    return first is None or not _installed_from(first)


def req_slots(req, version: Optional[str] = None):
    """What holds ``req``'s KV row and mamba slot fields: the request itself, or its ``kv``
    under the redesigned contract."""
    return req.kv if checkpoints(version) else req


def prefix_len(req) -> int:
    """How many of ``req``'s tokens its matched (and loaded) prefix covers."""
    return req.prefix_len if checkpoints() else len(req.prefix_indices)


def extend_start(req) -> int:
    """Where ``req``'s extend (its prefill chunk) begins, as its checkpoint sees it."""
    if checkpoints():
        return req.prefix_len           # SGLang advances it after the checkpoint
    return req.extend_range.start if req.extend_range is not None else 0


def drop_prefix(req, device) -> None:
    """``req`` starts from nothing after all (its source went, or comes back whole)."""
    req_slots(req).cache_protected_len = 0
    if checkpoints():
        req.prefix_len = 0
    else:
        import torch

        req.prefix_indices = torch.empty((0,), dtype=torch.int64, device=device)


def resolved(server_args, field: str):
    """The value SGLang resolved for ``field`` (the operator's input where nothing was
    resolved)."""
    if not _installed_from(RECORDS):
        return getattr(server_args, field)
    from sglang.srt.arg_groups.overrides import resolution_result

    return resolution_result(server_args, field)


def resolved_before(server_args) -> bool:
    """Whether SGLang resolved ``server_args`` already (RECORDS: a scheduler's copy of the
    launcher's record, whose resolution hooks fire again)."""
    return bool(getattr(server_args, "_resolution_finished", False))


def fill_server_args(server_args, choose, source: str) -> None:
    """Run ``choose(args)``, which writes the fields the operator left unset, before SGLang
    resolves the rest: on the record itself, or declared beside the input (RECORDS)."""
    if not _installed_from(RECORDS):
        choose(server_args)
        return
    from sglang.srt.arg_groups.overrides import record_foreign_defaults

    record_foreign_defaults(server_args, source, choose)


def mamba_cache_chunk_size() -> int:
    """The granularity of tracked mamba states, max(the model's mamba chunk, the page size), as
    this scheduler process resolved it."""
    from sglang.srt import runtime_context

    if _installed_from(RECORDS):
        return runtime_context.mamba_cache_chunk_size()
    return runtime_context.get_server_args().mamba_cache_chunk_size


def load_back_labels() -> dict:
    """The labels SGLang's load-back token series takes past the cache's own: from 0.5.23 the
    pool the tokens went to."""
    if not checkpoints():
        return {}
    from sglang.srt.mem_cache.hicache_storage import PoolName

    return {"pool": PoolName.KV.value}


def kv_move_kwargs(page_size: int) -> dict:
    """``move_kv_cache_native``'s keywords for a pool of ``page_size``-token pages: 0.5.23's
    pools are per-layer token rows only, and the function lost ``page_size``."""
    return {} if checkpoints() else {"page_size": page_size}


def installed() -> str:
    return metadata.version("sglang")


def release(version: str) -> tuple[int, ...]:
    """``0.5.17.post1`` and ``0.5.17rc0`` -> (0, 5, 17): the release a version belongs to."""
    m = re.match(r"\d+(?:\.\d+)*", version.strip())
    if m is None:
        raise HybridConfigError(f"SGLang version {version!r}: not a release number")
    return tuple(int(x) for x in m.group(0).split("."))


def tested_range() -> str:
    return TESTED[0] if len(TESTED) == 1 else f"{TESTED[0]} to {TESTED[-1]}"


def gpu_tested() -> str:
    """The releases the GPU suite and the benchmarks ran on, for messages."""
    return ", ".join(GPU_TESTED)


def check(version: Optional[str] = None) -> Optional[str]:
    """None for a release the GPU suite ran on; a warning above the tested range or for a
    release only the CPU suite ran on; below the range HybridConfigError."""
    version = version or installed()
    if release(version) < release(TESTED[0]):
        raise HybridConfigError(
            f"--radix-cache hybrid: SGLang {version} is older than the releases hpc_radix is "
            f"tested with ({tested_range()}); install one of those")
    if release(version) > release(TESTED[-1]):
        return (f"SGLang {version} is newer than the releases hpc_radix is tested with "
                f"({tested_range()}): the hybrid cache starts, and the startup log names each "
                "hook that did not apply and what it falls back to")
    if release(version) not in {release(v) for v in GPU_TESTED}:
        return (f"SGLang {version}: hpc_radix's CPU suite runs on it in CI, its GPU suite and "
                f"benchmarks ran on {gpu_tested()} only; the startup log names each "
                "hook that did not apply and what it falls back to")
    return None


def describe(version: Optional[str] = None) -> str:
    """What the startup log says: the release running and the tested range."""
    return (f"SGLang {version or installed()} (tested: {tested_range()}; "
            f"on GPUs: {gpu_tested()})")


def target(name: str, version: Optional[str] = None) -> str:
    """What the installed SGLang (or ``version``) calls the surface 0.5.17 calls ``name``."""
    moved = MOVED.get(name)
    if moved is not None and release(version or installed()) >= moved[0]:
        return moved[1]
    return name
