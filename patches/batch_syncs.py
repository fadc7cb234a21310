"""Extend batches built without waiting for the forward pass in flight (hybrid cache only).

SGLang 0.5.17's extend-batch build synchronizes the scheduler thread with the GPU:

- ``HybridReqToTokenPool.alloc`` writes the mamba id mappings at a Python list of request rows,
  which torch copies to the GPU with a blocking copy;
- ``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend`` reads each request's
  tracking slot back with ``.item()``;
- ``ScheduleBatch.prepare_for_extend`` builds ``mamba_track_{indices,mask,seqlens}`` with
  ``torch.tensor(list, device=cuda)``, a blocking copy.

Each waits for the forward pass in flight (the scheduler's stream waits for it after every
launch), so a prefill batch is launched only after the GPU went idle. On the H200 A/B the
first of these waits took 0.3-0.4 s of a 10 s replay for stock and hybrid alike (py-spy:
``memory_pool.py:1336``). While the hybrid cache is active they become queued uploads and one
gather on the device:

- ``alloc`` (AROUND): the two mappings are written through ``_RowsUploaded``;
- ``_mamba_radix_cache_v2_req_prepare_for_extend`` (AROUND): the tracking buffer is not read;
  the request's ping-pong position is noted instead (the entry's ``track_index`` is -1);
- ``prepare_for_extend`` (AROUND): ``torch.tensor(..., device=cuda)`` inside it uploads
  through the pinned ring (the module's ``torch`` is swapped for ``_QueuedTorch`` for the
  call), and afterwards ``mamba_track_indices`` is gathered on the device from the ping-pong
  mapping at the noted positions, as SGLang's ``set_mamba_track_indices_from_reqs`` does for
  decode batches.
"""
from __future__ import annotations

import torch

_POOL = "sglang.srt.mem_cache.memory_pool.HybridReqToTokenPool"
_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
ALLOC_TARGET = f"{_POOL}.alloc"
TRACK_TARGET = f"{_BATCH}._mamba_radix_cache_v2_req_prepare_for_extend"
PREPARE_TARGET = f"{_BATCH}.prepare_for_extend"
TARGETS = (ALLOC_TARGET, TRACK_TARGET, PREPARE_TARGET)

_active = False
_positions: list | None = None       # ping-pong positions noted during one prepare_for_extend
NOT_READ = -1                        # the track_index of an entry whose slot was not read


def activate(on: bool = True) -> str:
    """Called by HybridRadixCache: its scheduler builds extend batches this way from now on.
    Returns what the startup log says (a hook that did not apply leaves its wait in place;
    any combination builds the same batch)."""
    global _active
    _active = on
    from hpc_radix.patches.scheduler_hooks import unapplied

    missing = unapplied(TARGETS)
    if not missing:
        return "extend batches built without waiting for the GPU"
    return f"extend batches wait for the GPU where hooks did not apply: {', '.join(missing)}"


class _RowsUploaded:
    """A device tensor whose writes at a list of rows upload the list (no blocking copy)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __setitem__(self, rows, value) -> None:
        if isinstance(rows, (list, tuple)):
            from hpc_radix.kernels.upload import to_device

            rows = to_device(rows, self.tensor.device)
        self.tensor[rows] = value

    def __getitem__(self, rows):
        return self.tensor[rows]


def _around_alloc(orig, pool, reqs, *args, **kwargs):
    names = ("req_index_to_mamba_index_mapping", "req_index_to_mamba_ping_pong_track_buffer_mapping")
    held = {n: getattr(pool, n) for n in names if getattr(pool, n, None) is not None}
    if not _active or not held:
        return orig(pool, reqs, *args, **kwargs)
    for name, tensor in held.items():
        setattr(pool, name, _RowsUploaded(tensor))
    try:
        return orig(pool, reqs, *args, **kwargs)
    finally:
        for name, tensor in held.items():
            setattr(pool, name, tensor)


class _Unread:
    """Stands for a tracking buffer during ``_mamba_radix_cache_v2_req_prepare_for_extend``:
    its one read, ``buffer[i].item()``, gives ``NOT_READ`` instead of waiting for the GPU."""

    def __getitem__(self, i):
        return self

    def item(self) -> int:
        return NOT_READ


def _around_track(orig, batch, req, *args, **kwargs):
    buffer = req.mamba_ping_pong_track_buffer
    if _positions is None or buffer is None:
        return orig(batch, req, *args, **kwargs)
    _positions.append(req.mamba_next_track_idx)
    req.mamba_ping_pong_track_buffer = _Unread()
    try:
        return orig(batch, req, *args, **kwargs)
    finally:
        req.mamba_ping_pong_track_buffer = buffer


class _QueuedTorch:
    """``torch`` for one module, except that ``torch.tensor(data, device=<cuda>)`` uploads
    through the pinned ring instead of a blocking copy."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(data, *args, device=None, **kwargs):
        if (device is None or isinstance(data, torch.Tensor) or torch.device(device).type != "cuda"
                or torch.cuda.is_current_stream_capturing()):
            return torch.tensor(data, *args, device=device, **kwargs)
        from hpc_radix.kernels.upload import upload

        return upload(torch.tensor(data, *args, **kwargs), device)


_QUEUED_TORCH = _QueuedTorch()


def _around_prepare(orig, batch, *args, **kwargs):
    global _positions
    if not _active:
        return orig(batch, *args, **kwargs)
    from sglang.srt.managers import schedule_batch

    _positions = []
    schedule_batch.torch = _QUEUED_TORCH
    try:
        out = orig(batch, *args, **kwargs)
        positions = _positions
    finally:
        schedule_batch.torch = torch
        _positions = None
    if positions:
        gather_track_indices(batch, positions)
    return out


def gather_track_indices(batch, positions: list) -> None:
    """``batch.mamba_track_indices`` on the device: each row's ping-pong slot at ``positions``
    (what ``.item()`` would have read), from the mapping ``alloc`` wrote."""
    if len(positions) != len(batch.reqs):
        raise RuntimeError(f"{len(positions)} tracking positions noted for {len(batch.reqs)} "
                           "requests: a request of the batch has no tracking buffer")
    from hpc_radix.kernels.upload import to_device

    mapping = batch.req_to_token_pool.req_index_to_mamba_ping_pong_track_buffer_mapping
    rows = mapping[batch.req_pool_indices]                    # [bs, ping-pong size]
    at = to_device(positions, rows.device).unsqueeze(1)
    batch.mamba_track_indices = rows.gather(1, at).squeeze(1).to(torch.int64)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(ALLOC_TARGET, _around_alloc, HookType.AROUND)
    HookRegistry.register(TRACK_TARGET, _around_track, HookType.AROUND)
    HookRegistry.register(PREPARE_TARGET, _around_prepare, HookType.AROUND)
