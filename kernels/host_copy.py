"""Copy byte runs between device memory and pinned host memory: one launch, a capped grid.

The host tier moves scattered records: a KV block is one run per full-attention layer and
plane, a state image one run per GDN layer tensor, split where a slab ends. One cudaMemcpy per
run is launch-bound, while a kernel that reads pinned memory directly reaches the link's
bandwidth with 8 or more programs (benchmarks/WHY.md). So: one Triton launch
over a table of (source, destination, length) items, a grid of ``programs`` (default 8) striding
over them.

Every place a run touches is addressed from one anchor pointer (snapshot_copy.py's technique):
offsets in units of the largest power of two (<= 16 bytes) dividing every address and length,
so the compiler can prove alignment. Pinned host memory and device memory share CUDA's virtual
address space, so offsets from a device anchor reach host pages too. Runs are split on the host
into items of at most ``block_bytes``.

Any resident block slows a concurrent persistent matmul by the share of the SMs it sits on, so
no grid meets the host tier's 5 % bound. ``copy_runs_dma`` moves the same runs on the copy
engines instead (CUDA 12.8's ``cuMemcpyBatchAsync``, one driver call), beside the matmul at
almost no cost (benchmarks/WHY.md). The host tier uses it where the driver has it.
"""
from __future__ import annotations

import bisect
import ctypes
import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from .snapshot_copy import MAX_ALIGN_BYTES, _anchor_view, _elem_dtype
from .upload import upload

DEFAULT_BLOCK_BYTES = 16384
DEFAULT_PROGRAMS = 8


# One compiled variant per (unit, block): the item count and the grid are runtime values, so
# tables of any length reuse it (a constexpr grid, or Triton's specialization of a count of 1
# or a multiple of 16, compiled anew for small restores in the first requests' time to first
# token).
@triton.jit(do_not_specialize=["n_items"])
def _copy_items_kernel(anchor_ptr, items_ptr, n_items, ELEMS_PER_UNIT: tl.constexpr,
                       BLOCK: tl.constexpr):
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        row = items_ptr + item * 3
        src = tl.load(row) * ELEMS_PER_UNIT
        dst = tl.load(row + 1) * ELEMS_PER_UNIT
        length = tl.load(row + 2) * ELEMS_PER_UNIT
        if ELEMS_PER_UNIT > 1:
            src = tl.multiple_of(src, ELEMS_PER_UNIT)
            dst = tl.multiple_of(dst, ELEMS_PER_UNIT)
        offs = tl.arange(0, BLOCK)
        mask = offs < length
        tl.store(anchor_ptr + dst + offs, tl.load(anchor_ptr + src + offs, mask=mask), mask=mask)


@dataclass(frozen=True)
class Run:
    """``length`` bytes from byte ``src_offset`` of tensor ``src`` to byte ``dst_offset`` of
    tensor ``dst`` (indices into the call's list of places)."""
    src: int
    src_offset: int
    dst: int
    dst_offset: int
    length: int


def copy_runs(places: Sequence[torch.Tensor], runs, *,
              block_bytes: int = DEFAULT_BLOCK_BYTES, programs: int = DEFAULT_PROGRAMS,
              num_warps: int = 4, validate: bool = True) -> None:
    """Copy every run, in one launch on the current stream. ``runs``: ``Run``s, or an int64
    array with a row (src, src_offset, dst, dst_offset, length) per run. ``places[0]`` is the
    anchor: on a GPU, a CUDA tensor (the host places pinned memory). No destination may overlap
    another run's destination or source: programs run in no defined order."""
    if len(runs) == 0:
        return
    if block_bytes < MAX_ALIGN_BYTES or block_bytes & (block_bytes - 1):
        raise ValueError(f"block_bytes={block_bytes}: must be a power of two >= {MAX_ALIGN_BYTES}")
    ptrs, rows = _absolute_rows(places, runs, validate)
    anchor = places[0]
    unit = math.gcd(int(np.gcd.reduce(rows, axis=None)), MAX_ALIGN_BYTES, int(ptrs[0]))
    elem_size = min(unit, 4)
    block_units = block_bytes // unit
    src, dst, total = (rows - [ptrs[0], ptrs[0], 0]).T // unit
    pieces = -(-total // block_units)               # items per run
    run_of = np.repeat(np.arange(len(runs)), pieces)
    start = (np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * block_units
    items = np.stack([src[run_of] + start, dst[run_of] + start,
                      np.minimum(block_units, total[run_of] - start)], axis=1)
    if not len(items):
        return
    table = torch.from_numpy(np.ascontiguousarray(items))
    if anchor.is_cuda:
        table = upload(table, anchor.device)
    grid = min(programs, len(items))
    _copy_items_kernel[(grid,)](
        _anchor_view(anchor, _elem_dtype(elem_size)), table, len(items),
        ELEMS_PER_UNIT=unit // elem_size, BLOCK=block_bytes // elem_size, num_warps=num_warps)


def _absolute_rows(places: Sequence[torch.Tensor], runs, validate: bool):
    """The places' addresses, and one row per run: absolute source, destination, length."""
    if not isinstance(runs, np.ndarray):
        runs = np.array([(r.src, r.src_offset, r.dst, r.dst_offset, r.length) for r in runs],
                        dtype=np.int64)
    if validate:
        _check_runs(places, [Run(*map(int, row)) for row in runs])
    ptrs = np.array([p.data_ptr() for p in places], dtype=np.int64)
    rows = np.stack([ptrs[runs[:, 0]] + runs[:, 1], ptrs[runs[:, 2]] + runs[:, 3], runs[:, 4]], axis=1)
    return ptrs, rows


# ---- the copy engines ---------------------------------------------------------------------------
class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):         # CUmemcpyAttributes (cuda.h, 12.8)
    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_hint", _MemLocation),
                ("dst_loc_hint", _MemLocation), ("flags", ctypes.c_uint)]


_SRC_ACCESS_ORDER_STREAM = 1          # the sources are read in stream order
_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
_ABI_VERSION = 12080                  # the ABI asked for: 12.8's (13.0 dropped ``failIdx``)
_U64P, _SIZEP = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t)
_BatchFn = ctypes.CFUNCTYPE(ctypes.c_int, _U64P, _U64P, _SIZEP, ctypes.c_size_t,
                            ctypes.POINTER(_MemcpyAttributes), _SIZEP, ctypes.c_size_t, _SIZEP,
                            ctypes.c_void_p)


@functools.lru_cache(maxsize=None)
def _batch_memcpy() -> tuple[Optional[_BatchFn], str]:
    """The driver's cuMemcpyBatchAsync, or None and why not."""
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        return None, f"the CUDA driver library did not load ({err})"
    version, fn, status = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_int()
    driver.cuDriverGetVersion(ctypes.byref(version))
    name = f"CUDA driver {version.value // 1000}.{version.value % 1000 // 10}"
    get = getattr(driver, "cuGetProcAddress_v2", None)
    if get is None or get(b"cuMemcpyBatchAsync", ctypes.byref(fn), ctypes.c_int(_ABI_VERSION),
                          ctypes.c_uint64(0), ctypes.byref(status)) != 0 or not fn.value:
        return None, f"the {name} has no cuMemcpyBatchAsync (needs 12.8)"
    return _BatchFn(fn.value), f"cuMemcpyBatchAsync, {name}"


def copy_engine_path() -> tuple[bool, str]:
    """Whether ``copy_runs_dma`` can run here, and what it uses or why not (startup log)."""
    fn, why = _batch_memcpy()
    return fn is not None, why


class CopyRefused(RuntimeError):
    """The driver refused a batched copy; ``parts_done`` parts before it were queued."""

    def __init__(self, message: str, parts_done: int):
        super().__init__(message)
        self.parts_done = parts_done


def copy_runs_dma(places: Sequence[torch.Tensor], runs, *, validate: bool = True,
                  ends: Sequence[int] = (), after_part: Optional[Callable[[int], None]] = None) -> None:
    """``copy_runs``' copies on the copy engines, no SM used: one ``cuMemcpyBatchAsync`` on the
    current stream, which must not be the legacy default stream (the driver refuses it). Pinned
    host places must be page-locked whole (a run may not straddle pinned and pageable memory).
    ``ends``: the runs in parts, part i ending before row ``ends[i]``: a call per part, each
    followed by ``after_part(i)`` (a caller records an event there), the addresses computed
    once. A refused call raises ``CopyRefused``."""
    if len(runs) == 0:
        return
    fn, why = _batch_memcpy()
    if fn is None:
        raise RuntimeError(f"copy engines unavailable: {why}")
    stream = torch.cuda.current_stream()
    if stream.cuda_stream == 0:
        raise ValueError("copy_runs_dma: the legacy default stream cannot take a batched copy; "
                         "run it on a side stream")
    _, rows = _absolute_rows(places, runs, validate)
    kept = rows[:, 2] > 0                          # (the driver refuses an empty copy)
    bounds = np.concatenate([[0], np.cumsum(kept)])[list(ends) or [len(rows)]]
    srcs, dsts, sizes = (np.ascontiguousarray(rows[kept, i].astype(np.uint64)) for i in range(3))
    attributes = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, _MemLocation(), _MemLocation(),
                                   _FLAG_PREFER_OVERLAP_WITH_COMPUTE)
    first = (ctypes.c_size_t * 1)(0)                # one attribute set, from the first copy on
    failed = ctypes.c_size_t(2**64 - 1)
    begin = 0
    for part, end in enumerate(bounds.tolist()):
        count = end - begin
        if count:
            at = 8 * begin                          # bytes into each 64-bit column
            result = fn(ctypes.cast(dsts.ctypes.data + at, _U64P),
                        ctypes.cast(srcs.ctypes.data + at, _U64P), ctypes.cast(sizes.ctypes.data + at, _SIZEP),
                        count, ctypes.byref(attributes), first, 1, ctypes.byref(failed),
                        ctypes.c_void_p(stream.cuda_stream))
            if result != 0:
                where = f" at copy {failed.value} of {count}" if failed.value < count else ""
                raise CopyRefused(f"cuMemcpyBatchAsync failed with CUresult {result}{where}", part)
        if after_part is not None:
            after_part(part)
        begin = end


def _check_runs(places: Sequence[torch.Tensor], runs: Sequence[Run]) -> None:
    for i, p in enumerate(places):
        if not p.is_contiguous():
            raise ValueError(f"place {i} is not contiguous")
    spans = []
    for r in runs:
        for which, offset in ((r.src, r.src_offset), (r.dst, r.dst_offset)):
            if not 0 <= which < len(places):
                raise ValueError(f"{r}: no place {which} ({len(places)} places)")
            size = places[which].numel() * places[which].element_size()
            if offset < 0 or r.length < 0 or offset + r.length > size:
                raise ValueError(f"{r} reaches past place {which} ({size} bytes)")
        start = places[r.dst].data_ptr() + r.dst_offset
        spans.append((start, start + r.length, r))
    spans.sort(key=lambda s: s[0])
    for (a0, a1, ra), (b0, b1, rb) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ValueError(f"destinations of {ra} and {rb} overlap")
    starts = [s[0] for s in spans]
    for r in runs:
        lo = places[r.src].data_ptr() + r.src_offset
        i = bisect.bisect_right(starts, lo + r.length - 1) - 1
        while i >= 0 and spans[i][1] > lo:        # a destination starting before the end
            if spans[i][0] < lo + r.length:
                raise ValueError(f"the source of {r} overlaps the destination of {spans[i][2]}")
            i -= 1


def copy_runs_reference(places: Sequence[torch.Tensor], runs: Sequence[Run]) -> None:
    """The same copies in torch, byte views, one run at a time."""
    _check_runs(places, runs)
    flat = [p.view(-1).view(torch.uint8) for p in places]
    for r in runs:
        flat[r.dst][r.dst_offset:r.dst_offset + r.length].copy_(
            flat[r.src][r.src_offset:r.src_offset + r.length])
