"""Copy recurrent-state images between mamba-pool slots: many pairs, one launch.

SGLang's ``MambaPool`` keeps per-layer stacked state tensors, each shaped
``[n_layers, n_slots, ...]`` with one contiguous run of bytes per (layer, slot):
``conv[i]`` ``[L, size+1, conv_dim, K-1]`` (bf16) and ``temporal``
``[L, size+1, HV, V, K]`` (fp32 or bf16), plus whatever else a configuration
adds. ``copy_state_slots`` copies, for every tensor, every layer and every
(src, dst) pair, the slot's bytes from ``src`` to ``dst`` in ONE Triton launch.

How one launch covers several tensors: Triton takes one typed base pointer per
argument, so every tensor is addressed relative to an *anchor* (the tensor at
the lowest address), through a small int64 table of offsets and strides in
units of the largest power of two (<= 16 bytes) dividing every address, stride
and row size. Offsets are multiplied by a compile-time factor, which lets the
compiler prove 16-byte alignment and emit 128-bit loads and stores.

Grid: axis 0 walks the chunks (``block_bytes`` each) of every (tensor, layer)
row, tensor after tensor; axis 1 is the pair. A program finds its tensor by
comparing its chunk index with the table's chunk starts.

Pairs are checked on the host (``validate=True``): destinations must be
distinct, and no slot may be both a source and a destination in one call,
since programs run in no defined order. Repeated sources are fine.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence, Union

import torch
import triton
import triton.language as tl

from .upload import to_device

Slots = Union[torch.Tensor, Sequence[int]]

DEFAULT_BLOCK_BYTES = 16384
MAX_ALIGN_BYTES = 16
_MAX_PAIRS = 65535  # CUDA's limit on grid axis 1


# Index pointers unspecialized: SGLang passes slices whose alignment varies, and each
# alignment would compile a variant in some request's prefill.
@triton.jit(do_not_specialize=["meta_ptr", "src_ptr", "dst_ptr"])
def _copy_state_slots_kernel(
    anchor_ptr,  # typed pointer: the lowest-addressed tensor, viewed as ELEM
    meta_ptr,  # int64 [n_tensors, 6]: base, layer stride, slot stride, row size (units),
    #            chunks per row, first chunk
    src_ptr,  # int64 [n_pairs]
    dst_ptr,  # int64 [n_pairs]
    N_TENSORS: tl.constexpr,
    ELEMS_PER_UNIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    chunk_id = tl.program_id(0)
    pair = tl.program_id(1)

    # the program's tensor: how many later tensors start at or before this chunk
    # (an unrolled loop rather than tl.sum, so the interpreter also runs it when
    # triton was first imported in compiled mode)
    t = 0
    for i in tl.static_range(1, N_TENSORS):
        t += (tl.load(meta_ptr + i * 6 + 5) <= chunk_id).to(tl.int32)

    row = meta_ptr + t * 6
    base = tl.load(row)
    layer_stride = tl.load(row + 1)
    slot_stride = tl.load(row + 2)
    row_elems = tl.load(row + 3) * ELEMS_PER_UNIT
    chunks_per_row = tl.load(row + 4)
    local = chunk_id - tl.load(row + 5)
    layer = local // chunks_per_row
    chunk = local - layer * chunks_per_row

    src = tl.load(src_ptr + pair)
    dst = tl.load(dst_ptr + pair)
    layer_base = base + layer * layer_stride
    src_start = (layer_base + src * slot_stride) * ELEMS_PER_UNIT
    dst_start = (layer_base + dst * slot_stride) * ELEMS_PER_UNIT
    if ELEMS_PER_UNIT > 1:
        src_start = tl.multiple_of(src_start, ELEMS_PER_UNIT)
        dst_start = tl.multiple_of(dst_start, ELEMS_PER_UNIT)

    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_elems
    values = tl.load(anchor_ptr + src_start + offs, mask=mask)
    tl.store(anchor_ptr + dst_start + offs, values, mask=mask)


# ---------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[2:]) * t.element_size()


def _slot_is_contiguous(t: torch.Tensor) -> bool:
    expected = 1
    for dim in range(t.dim() - 1, 1, -1):
        if t.shape[dim] != 1 and t.stride(dim) != expected:
            return False
        expected *= t.shape[dim]
    return True


def _check_tensor(t: torch.Tensor, i: int) -> None:
    if t.dim() < 2:
        raise ValueError(f"state tensor {i}: expected [layers, slots, ...], got shape {tuple(t.shape)}")
    if not _slot_is_contiguous(t):
        raise ValueError(f"state tensor {i}: each (layer, slot) must be contiguous, strides {t.stride()}")
    if t.shape[1] > 1 and t.stride(1) * t.element_size() < _row_bytes(t):
        raise ValueError(f"state tensor {i}: slots overlap, strides {t.stride()}")


def _check_tensors(tensors: Sequence[torch.Tensor]) -> None:
    if not tensors:
        raise ValueError("no state tensors")
    device = tensors[0].device
    for i, t in enumerate(tensors):
        _check_tensor(t, i)
        if t.device != device:
            raise ValueError(f"state tensor {i} is on {t.device}, tensor 0 on {device}")


def _as_index_list(slots: Slots) -> list[int]:
    if isinstance(slots, torch.Tensor):
        return [int(s) for s in slots.reshape(-1).tolist()]
    return [int(s) for s in slots]


def check_pairs(src: list[int], dst: list[int], n_slots: int) -> None:
    """Refuse pairs the one-launch copy cannot order (ValueError naming the slot)."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source slots but {len(dst)} destination slots")
    for slot in src + dst:
        if not 0 <= slot < n_slots:
            raise ValueError(f"slot {slot} is out of range [0, {n_slots})")
    seen: set[int] = set()
    for slot in dst:
        if slot in seen:
            raise ValueError(f"destination slot {slot} appears more than once")
        seen.add(slot)
    both = seen.intersection(src)
    if both:
        raise ValueError(f"slot {min(both)} is both a source and a destination")


def _pairs(tensors: Sequence[torch.Tensor], src: Slots, dst: Slots, validate: bool):
    if not validate:
        return src, dst, len(src)
    src_list, dst_list = _as_index_list(src), _as_index_list(dst)
    check_pairs(src_list, dst_list, min(t.shape[1] for t in tensors))
    return src_list, dst_list, len(src_list)


def _elem_dtype(unit: int) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16}.get(unit, torch.int32)


def _layout_key(tensors: Sequence[torch.Tensor]) -> tuple:
    return tuple(
        (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size(), str(t.device))
        for t in tensors
    )


@functools.lru_cache(maxsize=64)
def _plan(layout: tuple, block_bytes: int, device: str):
    """Metadata table (on the tensors' device) and launch constants for one layout."""
    ptrs = [entry[0] for entry in layout]
    unit = MAX_ALIGN_BYTES
    for ptr, shape, stride, size, _ in layout:
        row = math.prod(shape[2:]) * size
        for value in (ptr, stride[0] * size, stride[1] * size, row):
            unit = math.gcd(unit, value)
    elem_size = min(unit, 4)
    block_elems = block_bytes // elem_size
    anchor = min(range(len(ptrs)), key=ptrs.__getitem__)
    rows, first_chunk = [], 0
    for ptr, shape, stride, size, _ in layout:
        row_units = math.prod(shape[2:]) * size // unit
        chunks = max(1, -(-row_units * (unit // elem_size) // block_elems))
        rows.append([
            (ptr - ptrs[anchor]) // unit,
            stride[0] * size // unit,
            stride[1] * size // unit,
            row_units,
            chunks,
            first_chunk,
        ])
        first_chunk += chunks * shape[0]
    meta = to_device(rows, device)
    return meta, anchor, unit, elem_size, block_elems, first_chunk


def _anchor_view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 1-element view of ``t``'s first byte as ``dtype`` (the kernel's base pointer)."""
    storage = t.untyped_storage()
    offset_bytes = t.data_ptr() - storage.data_ptr()
    view = torch.empty(0, dtype=dtype, device=t.device)
    return view.set_(storage, offset_bytes // view.element_size(), (1,), (1,))


def _device_indices(src: Slots, dst: Slots, device: torch.device):
    """int64 src and dst on ``device``; host lists go up in one asynchronous copy."""
    if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor):
        return (src.to(device=device, dtype=torch.int64).reshape(-1).contiguous(),
                dst.to(device=device, dtype=torch.int64).reshape(-1).contiguous())
    both = to_device([_as_index_list(src), _as_index_list(dst)], device)
    return both[0], both[1]


def _check_block_bytes(block_bytes: int) -> None:
    if block_bytes < MAX_ALIGN_BYTES or block_bytes & (block_bytes - 1):
        raise ValueError(f"block_bytes={block_bytes}: must be a power of two >= {MAX_ALIGN_BYTES}")


def copy_state_slots(
    tensors: Sequence[torch.Tensor],
    src: Slots,
    dst: Slots,
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    num_warps: int = 4,
    validate: bool = True,
) -> None:
    """For every tensor, layer and pair i: ``t[:, dst[i]] = t[:, src[i]]``, in one launch.

    ``src``/``dst`` are int sequences or int tensors. With ``validate`` (the
    default) they are checked on the host, which reads device tensors back
    (a sync); pass lists (copied up asynchronously through pinned memory), or
    device tensors with ``validate=False`` when the caller guarantees distinct
    destinations that are not also sources.
    """
    tensors = list(tensors)
    _check_tensors(tensors)
    _check_block_bytes(block_bytes)
    src, dst, n_pairs = _pairs(tensors, src, dst, validate)
    if n_pairs == 0:
        return
    if n_pairs > _MAX_PAIRS:
        raise ValueError(f"{n_pairs} pairs: at most {_MAX_PAIRS} per call")
    device = tensors[0].device
    meta, anchor, unit, elem_size, block_elems, n_chunks = _plan(
        _layout_key(tensors), block_bytes, str(device)
    )
    src_index, dst_index = _device_indices(src, dst, device)
    _copy_state_slots_kernel[(n_chunks, n_pairs)](
        _anchor_view(tensors[anchor], _elem_dtype(elem_size)),
        meta,
        src_index,
        dst_index,
        N_TENSORS=len(tensors),
        ELEMS_PER_UNIT=unit // elem_size,
        BLOCK=block_elems,
        num_warps=num_warps,
    )


def copy_state_slots_reference(
    tensors: Sequence[torch.Tensor], src: Slots, dst: Slots
) -> None:
    """The same copy in plain torch (gather, then scatter), with the same checks."""
    tensors = list(tensors)
    _check_tensors(tensors)
    src_list, dst_list, n_pairs = _pairs(tensors, src, dst, validate=True)
    if n_pairs == 0:
        return
    src_index, dst_index = _device_indices(src_list, dst_list, tensors[0].device)
    for t in tensors:
        t[:, dst_index] = t[:, src_index].clone()


def moved_bytes(tensors: Sequence[torch.Tensor], n_pairs: int) -> int:
    """Bytes read plus bytes written by one call with ``n_pairs`` pairs."""
    return 2 * n_pairs * sum(t.shape[0] * _row_bytes(t) for t in tensors)
