"""Extend batches built and launched without waiting for the forward pass in flight (hybrid
cache only).

SGLang 0.5.17's extend-batch build synchronizes the scheduler thread with the GPU:

- ``HybridReqToTokenPool.alloc`` writes the mamba id mappings at a Python list of request rows,
  which torch copies to the GPU with a blocking copy;
- ``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend`` reads each request's
  tracking slot back with ``.item()``;
- ``ScheduleBatch.prepare_for_extend`` builds ``mamba_track_{indices,mask,seqlens}`` with
  ``torch.tensor(list, device=cuda)``, a blocking copy.

Each waits for the forward pass in flight (the scheduler's stream waits for it after every
launch), so a prefill batch is launched only after the GPU went idle (benchmarks/WHY.md).
While the hybrid cache is active they become queued uploads and one
gather on the device:

- ``alloc`` (AROUND): the two mappings are written through ``_RowsUploaded``;
- ``_mamba_radix_cache_v2_req_prepare_for_extend`` (AROUND): the tracking buffer is not read;
  the request's ping-pong position is noted instead (the entry's ``track_index`` is -1);
- ``prepare_for_extend`` (AROUND): ``torch.tensor(..., device=cuda)`` inside it uploads
  through the pinned ring (the module's ``torch`` is swapped for ``_QueuedTorch`` for the
  call), and afterwards ``mamba_track_indices`` is gathered on the device from the ping-pong
  mapping at the noted positions, as SGLang's ``set_mamba_track_indices_from_reqs`` does for
  decode batches. Each tensor uploaded there keeps its host values (``HOST_ATTR``).

With the build no longer waiting, the wait moved to the launch: ``GDNAttnBackend.init_forward_metadata`` tests ``mamba_track_mask.any()``, selects
rows with the device mask and reads six tensors back with ``.cpu()`` to build the tracking
tables. Its hook (AROUND) builds the same tables from the host values of the mask and the
tracked lengths and the batch's host extend lengths, in one upload and three gathers on the
device; a batch without those host values (a mixed or padded batch) goes SGLang's way.
"""
from __future__ import annotations

import itertools

import torch

from hpc_radix.patches.gdn_taps import METADATA_TARGET  # the taps' tables hook it too
from hpc_radix.patches.state import STATE
from hpc_radix.sglang_version import installed, mamba_cache_chunk_size, ported, req_slots

_POOL = "sglang.srt.mem_cache.memory_pool.HybridReqToTokenPool"
_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
ALLOC_TARGET = f"{_POOL}.alloc"
TRACK_TARGET = f"{_BATCH}._mamba_radix_cache_v2_req_prepare_for_extend"
PREPARE_TARGET = f"{_BATCH}.prepare_for_extend"
TARGETS = (ALLOC_TARGET, TRACK_TARGET, PREPARE_TARGET, METADATA_TARGET)
HOST_ATTR = "hpc_host"               # on a queued upload: the values it was built from

NOT_READ = -1                        # the track_index of an entry whose slot was not read


def activate(on: bool = True) -> str:
    """Called by HybridRadixCache: its scheduler builds extend batches this way from now on.
    Returns what the startup log says (a hook that did not apply leaves its wait in place;
    any combination builds the same batch)."""
    if on and not ported("batch_syncs"):
        STATE.batch_syncs = False
        return (f"extend batches built by SGLang {installed()} itself, waiting for the GPU "
                "(the host-side build is not ported to it)")
    STATE.batch_syncs = on
    from hpc_radix.patches.scheduler_hooks import unapplied

    missing = unapplied(TARGETS)
    if not missing:
        return "extend batches built and launched without waiting for the GPU"
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
    if not STATE.batch_syncs or not held:
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
    kv = req_slots(req)
    buffer = kv.mamba_ping_pong_track_buffer
    if STATE.track_positions is None or buffer is None:
        return orig(batch, req, *args, **kwargs)
    STATE.track_positions.append(kv.mamba_next_track_idx)
    kv.mamba_ping_pong_track_buffer = _Unread()
    try:
        return orig(batch, req, *args, **kwargs)
    finally:
        kv.mamba_ping_pong_track_buffer = buffer


class _QueuedTorch:
    """``torch`` for one module, except that ``torch.tensor(data, device=<cuda>)`` uploads
    through the pinned ring instead of a blocking copy."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(data, *args, device=None, **kwargs):
        if device is None or isinstance(data, torch.Tensor):
            return torch.tensor(data, *args, device=device, **kwargs)
        if torch.device(device).type != "cuda" or torch.cuda.is_current_stream_capturing():
            out = torch.tensor(data, *args, device=device, **kwargs)
        else:
            from hpc_radix.kernels.upload import upload

            out = upload(torch.tensor(data, *args, **kwargs), device)
        setattr(out, HOST_ATTR, data)
        return out


_QUEUED_TORCH = _QueuedTorch()


def _around_prepare(orig, batch, *args, **kwargs):
    if not STATE.batch_syncs:
        return orig(batch, *args, **kwargs)
    from sglang.srt.managers import schedule_batch

    STATE.track_positions = []
    schedule_batch.torch = _QUEUED_TORCH
    try:
        out = orig(batch, *args, **kwargs)
        positions = STATE.track_positions
    finally:
        schedule_batch.torch = torch
        STATE.track_positions = None
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


def _around_metadata(orig, backend, forward_batch, *args, **kwargs):
    mask = forward_batch.mamba_track_mask
    host = _host_tracking(backend, forward_batch) if STATE.batch_syncs else None
    if host is None:
        return orig(backend, forward_batch, *args, **kwargs)
    forward_batch.mamba_track_mask = None      # SGLang's metadata without its tracking tables
    try:
        out = orig(backend, forward_batch, *args, **kwargs)
    finally:
        forward_batch.mamba_track_mask = mask
    set_track_metadata(backend.forward_metadata, *host, forward_batch.mamba_track_indices,
                       chunk=mamba_cache_chunk_size(),
                       conv_len=backend.conv_states_shape[-1])
    return out


def _host_tracking(backend, forward_batch):
    """(mask, tracked lengths, extend lengths, prefix lengths) on the host, one per row, when
    this is a plain extend batch whose tracking tensors came from ``prepare_for_extend``."""
    mode = forward_batch.forward_mode
    dispatcher = getattr(backend, "kernel_dispatcher", None)
    checkpoints = getattr(dispatcher, "extend_uses_state_checkpoints", True)
    if (forward_batch.mamba_track_mask is None or not mode.is_extend() or mode.is_target_verify()
            or mode.is_draft_extend_v2() or checkpoints):
        return None
    mask = getattr(forward_batch.mamba_track_mask, HOST_ATTR, None)
    seqlens = getattr(forward_batch.mamba_track_seqlens, HOST_ATTR, None)
    lens, prefix = forward_batch.extend_seq_lens_cpu, forward_batch.extend_prefix_lens_cpu
    bs = forward_batch.batch_size
    if mask is None or seqlens is None or lens is None or prefix is None:
        return None
    if not len(mask) == len(seqlens) == len(lens) == len(prefix) == bs:
        return None
    return mask, seqlens, lens, prefix


def set_track_metadata(metadata, mask, track_seqlens, extend_lens, prefix_lens, track_indices,
                       *, chunk: int, conv_len: int) -> None:
    """The tracking tables SGLang's GDN metadata builds (``_init_track_conv_indices``,
    ``_init_track_ssm_indices``, the mask's row indices and their conv destinations), from
    host values: a row's state at its last ``chunk`` boundary goes to its tracking slot, from
    the final state when that boundary ends the extend, else from the kernel's ``h``."""
    rows = [i for i, tracked in enumerate(mask) if tracked]
    metadata.has_mamba_track_mask = bool(rows)
    if not rows:
        return
    starts = list(itertools.accumulate(extend_lens, initial=0))
    last = starts[-1] - 1
    h_starts = list(itertools.accumulate(((n - 1) // chunk + 1 for n in extend_lens), initial=0))
    conv, final_rows, h_rows, h_src = [], [], [], []
    for i in rows:
        tracked = track_seqlens[i] - prefix_lens[i]
        first = starts[i] + tracked // chunk * chunk - conv_len
        conv.extend(min(max(first + k, 0), last) for k in range(conv_len))
        if tracked % chunk == 0:
            final_rows.append(i)
        else:
            h_rows.append(i)
            h_src.append(h_starts[i] + tracked // chunk)
    from hpc_radix.kernels.upload import to_device

    parts = (rows, final_rows, h_rows, h_src, conv)
    flat = to_device([v for part in parts for v in part], track_indices.device)
    rows_d, final_d, h_rows_d, h_src_d, conv_d = flat.split([len(part) for part in parts])
    metadata.track_conv_indices = conv_d.view(len(rows), conv_len)
    metadata.track_ssm_h_src = h_src_d
    metadata.track_ssm_h_dst = track_indices[h_rows_d]
    metadata.track_ssm_final_src = metadata.mamba_cache_indices[final_d]
    metadata.track_ssm_final_dst = track_indices[final_d]
    metadata.mamba_track_mask_indices = rows_d
    metadata.conv_states_mask_indices = track_indices[rows_d]


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(ALLOC_TARGET, _around_alloc, HookType.AROUND)
    HookRegistry.register(TRACK_TARGET, _around_track, HookType.AROUND)
    HookRegistry.register(PREPARE_TARGET, _around_prepare, HookType.AROUND)
    HookRegistry.register(METADATA_TARGET, _around_metadata, HookType.AROUND)
