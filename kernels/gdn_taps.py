"""Zero-split taps: recurrent states at planned positions, captured inside a GDN prefill pass.

For each tap (row i of the batch, position p in (s_i, e_i] of that row's extend, destination
mamba-pool slot d) the pass writes into slot d of every GDN layer:
- the SSM state after p tokens, bit-identical to the final state of a separate
  ``chunk_gated_delta_rule`` call on the same inputs from s_i ending at p (fp32 pools; a bf16
  pool holds what a prefill chunked at the 64-token grid point below p, then at p, would);
- the conv state before p: the last ``W = kernel_width - 1`` pre-conv inputs, taken from the
  request's previous conv state where p - s_i < W.

How (the chunk kernel's grid starts at s_i and is 64 tokens wide):
1. ``fwd_h_with_taps``: a copy of SGLang's ``chunk_gated_delta_rule_fwd_kernel_h_blockdim64``
   (same arithmetic, same launch configuration) that also stores its fp32 state register at
   the top of chunk c into slot d when a tap lies in chunk c (table ``chunk_slots``).
2. A tap off that grid (p = b + r, b the grid point below, 0 < r < 64) is finished by one
   batched stock call over the rows [b, p) of every such tap, started from slot d: a
   partial-chunk call from the exact state at b gives the same bits as one call to p.
3. A tap at p = e_i is the working slot after the pass: a copy.
Every table, FLA's chunk table of the pass included, is built on the host from the batch's
lengths, so a pass never reads anything back from the GPU (SGLang's own call does, once per pass).

Everything here is torch + Triton; the planning (which taps, which slots) is the binding's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from sglang.kernels.ops.attention.fla.chunk_delta_h import (
    GDN_CHUNK_H_BV,
    GDN_CHUNK_H_NUM_STAGES,
    GDN_CHUNK_H_NUM_WARPS,
)
from sglang.kernels.ops.attention.fla.chunk_fwd import chunk_gated_delta_rule_fwd_intra
from sglang.kernels.ops.attention.fla.chunk_o import chunk_fwd_kernel_o
from sglang.kernels.ops.attention.fla.cumsum import chunk_local_cumsum
from sglang.kernels.ops.attention.fla.index import prepare_chunk_indices, prepare_chunk_offsets
from sglang.kernels.ops.attention.fla.l2norm import l2norm_fwd
from sglang.kernels.ops.attention.fla.op import exp, safe_exp

from .snapshot_copy import copy_state_slots
from .upload import to_device

CHUNK = 64  # the chunk kernel's grid (FLA's CHUNK_SIZE)


@triton.jit
def _store_state(base, b_h1, b_h2, b_h3, b_h4, i_v, K: tl.constexpr, V: tl.constexpr,
                 BV: tl.constexpr):
    p = tl.make_block_ptr(base, (V, K), (K, 1), (i_v * BV, 0), (BV, 64), (1, 0))
    tl.store(p, b_h1.to(p.dtype.element_ty), boundary_check=(0, 1))
    if K > 64:
        p = tl.make_block_ptr(base, (V, K), (K, 1), (i_v * BV, 64), (BV, 64), (1, 0))
        tl.store(p, b_h2.to(p.dtype.element_ty), boundary_check=(0, 1))
    if K > 128:
        p = tl.make_block_ptr(base, (V, K), (K, 1), (i_v * BV, 128), (BV, 64), (1, 0))
        tl.store(p, b_h3.to(p.dtype.element_ty), boundary_check=(0, 1))
    if K > 192:
        p = tl.make_block_ptr(base, (V, K), (K, 1), (i_v * BV, 192), (BV, 64), (1, 0))
        tl.store(p, b_h4.to(p.dtype.element_ty), boundary_check=(0, 1))


# SGLang 0.5.17's chunk_gated_delta_rule_fwd_kernel_h_blockdim64 for GDN (varlen, scalar gate g,
# no per-key gate), plus the tap stores marked TAP. Keep the rest line for line: the taps are
# exact only while this kernel computes what the stock one does.
@triton.jit(do_not_specialize=["T"])
def _fwd_h_taps_kernel(
    k, v, w, v_new, g, h, initial_state, initial_state_indices, stride_init_state,
    cu_seqlens, chunk_offsets, chunk_slots, T,
    H: tl.constexpr, Hg: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, HAS_TAPS: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int32), tl.load(cu_seqlens + i_n + 1).to(tl.int32)
    T = eos - bos
    NT = tl.cdiv(T, BT)
    boh = tl.load(chunk_offsets + i_n).to(tl.int32)

    b_h1 = tl.zeros([BV, 64], dtype=tl.float32)
    if K > 64:
        b_h2 = tl.zeros([BV, 64], dtype=tl.float32)
    else:
        b_h2 = b_h1
    if K > 128:
        b_h3 = tl.zeros([BV, 64], dtype=tl.float32)
    else:
        b_h3 = b_h1
    if K > 192:
        b_h4 = tl.zeros([BV, 64], dtype=tl.float32)
    else:
        b_h4 = b_h1

    h += ((boh * H + i_h) * V * K).to(tl.int64)
    v += ((bos * H + i_h) * V).to(tl.int64)
    k += ((bos * Hg + i_h // (H // Hg)) * K).to(tl.int64)
    w += ((bos * H + i_h) * K).to(tl.int64)
    v_new += ((bos * H + i_h) * V).to(tl.int64)
    stride_v = H * V
    stride_h = H * V * K
    stride_k = Hg * K
    stride_w = H * K

    index = tl.load(initial_state_indices + i_n).to(tl.int64)
    valid_state = index >= 0
    h0 = initial_state + index * stride_init_state + i_h * V * K
    ht = initial_state + index * stride_init_state + i_h * V * K

    if valid_state:
        p_h0_1 = tl.make_block_ptr(h0, (V, K), (K, 1), (i_v * BV, 0), (BV, 64), (1, 0))
        b_h1 += tl.load(p_h0_1, boundary_check=(0, 1)).to(tl.float32)
        if K > 64:
            p_h0_2 = tl.make_block_ptr(h0, (V, K), (K, 1), (i_v * BV, 64), (BV, 64), (1, 0))
            b_h2 += tl.load(p_h0_2, boundary_check=(0, 1)).to(tl.float32)
        if K > 128:
            p_h0_3 = tl.make_block_ptr(h0, (V, K), (K, 1), (i_v * BV, 128), (BV, 64), (1, 0))
            b_h3 += tl.load(p_h0_3, boundary_check=(0, 1)).to(tl.float32)
        if K > 192:
            p_h0_4 = tl.make_block_ptr(h0, (V, K), (K, 1), (i_v * BV, 192), (BV, 64), (1, 0))
            b_h4 += tl.load(p_h0_4, boundary_check=(0, 1)).to(tl.float32)

    for i_t in range(NT):
        if HAS_TAPS:  # TAP: the exact fp32 state at the top of chunk i_t
            slot = tl.load(chunk_slots + boh + i_t).to(tl.int64)
            if slot >= 0:
                _store_state(initial_state + slot * stride_init_state + i_h * V * K,
                             b_h1, b_h2, b_h3, b_h4, i_v, K, V, BV)
        p_h1 = tl.make_block_ptr(h + i_t * stride_h, (V, K), (K, 1), (i_v * BV, 0), (BV, 64), (1, 0))
        tl.store(p_h1, b_h1.to(p_h1.dtype.element_ty), boundary_check=(0, 1))
        if K > 64:
            p_h2 = tl.make_block_ptr(h + i_t * stride_h, (V, K), (K, 1), (i_v * BV, 64), (BV, 64), (1, 0))
            tl.store(p_h2, b_h2.to(p_h2.dtype.element_ty), boundary_check=(0, 1))
        if K > 128:
            p_h3 = tl.make_block_ptr(h + i_t * stride_h, (V, K), (K, 1), (i_v * BV, 128), (BV, 64), (1, 0))
            tl.store(p_h3, b_h3.to(p_h3.dtype.element_ty), boundary_check=(0, 1))
        if K > 192:
            p_h4 = tl.make_block_ptr(h + i_t * stride_h, (V, K), (K, 1), (i_v * BV, 192), (BV, 64), (1, 0))
            tl.store(p_h4, b_h4.to(p_h4.dtype.element_ty), boundary_check=(0, 1))

        p_w = tl.make_block_ptr(w, (T, K), (stride_w, 1), (i_t * BT, 0), (BT, 64), (1, 0))
        b_w = tl.load(p_w, boundary_check=(0, 1))
        b_v = tl.dot(b_w, tl.trans(b_h1).to(b_w.dtype))
        if K > 64:
            p_w = tl.make_block_ptr(w, (T, K), (stride_w, 1), (i_t * BT, 64), (BT, 64), (1, 0))
            b_w = tl.load(p_w, boundary_check=(0, 1))
            b_v += tl.dot(b_w, tl.trans(b_h2).to(b_w.dtype))
        if K > 128:
            p_w = tl.make_block_ptr(w, (T, K), (stride_w, 1), (i_t * BT, 128), (BT, 64), (1, 0))
            b_w = tl.load(p_w, boundary_check=(0, 1))
            b_v += tl.dot(b_w, tl.trans(b_h3).to(b_w.dtype))
        if K > 192:
            p_w = tl.make_block_ptr(w, (T, K), (stride_w, 1), (i_t * BT, 192), (BT, 64), (1, 0))
            b_w = tl.load(p_w, boundary_check=(0, 1))
            b_v += tl.dot(b_w, tl.trans(b_h4).to(b_w.dtype))
        p_v = tl.make_block_ptr(v, (T, V), (stride_v, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        b_v = tl.load(p_v, boundary_check=(0, 1)) - b_v

        p_v = tl.make_block_ptr(v_new, (T, V), (stride_v, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        tl.store(p_v, b_v.to(p_v.dtype.element_ty), boundary_check=(0, 1))

        last_idx = min((i_t + 1) * BT, T) - 1
        b_g_last = tl.load(g + bos * H + last_idx * H + i_h)
        p_g = tl.make_block_ptr(g + bos * H + i_h, (T,), (H,), (i_t * BT,), (BT,), (0,))
        b_g = tl.load(p_g, boundary_check=(0,))
        b_v = b_v * safe_exp(b_g_last - b_g)[:, None]
        b_g_last = exp(b_g_last)
        b_h1 = b_h1 * b_g_last
        if K > 64:
            b_h2 = b_h2 * b_g_last
        if K > 128:
            b_h3 = b_h3 * b_g_last
        if K > 192:
            b_h4 = b_h4 * b_g_last
        b_v = b_v.to(k.dtype.element_ty)

        p_k = tl.make_block_ptr(k, (K, T), (1, stride_k), (0, i_t * BT), (64, BT), (0, 1))
        b_k = tl.load(p_k, boundary_check=(0, 1))
        b_h1 += tl.trans(tl.dot(b_k, b_v))
        if K > 64:
            p_k = tl.make_block_ptr(k, (K, T), (1, stride_k), (64, i_t * BT), (64, BT), (0, 1))
            b_k = tl.load(p_k, boundary_check=(0, 1))
            b_h2 += tl.trans(tl.dot(b_k, b_v))
        if K > 128:
            p_k = tl.make_block_ptr(k, (K, T), (1, stride_k), (128, i_t * BT), (64, BT), (0, 1))
            b_k = tl.load(p_k, boundary_check=(0, 1))
            b_h3 += tl.trans(tl.dot(b_k, b_v))
        if K > 192:
            p_k = tl.make_block_ptr(k, (K, T), (1, stride_k), (192, i_t * BT), (64, BT), (0, 1))
            b_k = tl.load(p_k, boundary_check=(0, 1))
            b_h4 += tl.trans(tl.dot(b_k, b_v))

    if valid_state:
        _store_state(ht, b_h1, b_h2, b_h3, b_h4, i_v, K, V, BV)


def fwd_h_with_taps(k, w, u, g, initial_state, initial_state_indices, cu_seqlens,
                    chunk_slots: Optional[torch.Tensor] = None, *, chunk_indices=None,
                    chunk_offsets=None, block_v: int = GDN_CHUNK_H_BV):
    """SGLang's ``chunk_gated_delta_rule_fwd_h`` (varlen, scalar gate, in place) that also stores
    the fp32 state at the top of global chunk c into slot ``chunk_slots[c]`` (-1: none).
    Returns (h, v_new) like the stock function. ``chunk_indices``, ``chunk_offsets``: FLA's
    chunk table and per-sequence chunk offsets of ``cu_seqlens`` when known (else computed, a
    host sync the first time for a tensor)."""
    B, T, Hg, K = k.shape
    H, V = u.shape[-2], u.shape[-1]
    assert K <= 256 and B == 1 and cu_seqlens is not None
    N = len(cu_seqlens) - 1
    if chunk_offsets is None:
        chunk_offsets = prepare_chunk_offsets(cu_seqlens, CHUNK)
    if chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, CHUNK)
    NT = len(chunk_indices)
    h = k.new_empty(B, NT, H, V, K)
    v_new = torch.empty_like(u)
    if chunk_slots is not None and chunk_slots.numel() != NT:
        raise ValueError(f"chunk_slots has {chunk_slots.numel()} entries for {NT} chunks")
    _fwd_h_taps_kernel[(triton.cdiv(V, block_v), N * H)](
        k, u, w, v_new, g, h, initial_state, initial_state_indices, initial_state.stride(0),
        cu_seqlens, chunk_offsets, chunk_slots if chunk_slots is not None else chunk_offsets, T,
        H=H, Hg=Hg, K=K, V=V, BT=CHUNK, BV=block_v, HAS_TAPS=chunk_slots is not None,
        num_warps=GDN_CHUNK_H_NUM_WARPS, num_stages=GDN_CHUNK_H_NUM_STAGES,
    )
    return h, v_new


@dataclass
class TapTables:
    """One prefill pass's taps as device tables, shared by every GDN layer (see module doc).

    chunk_slots   int32 [total chunks]: slot receiving the state at the top of each chunk (-1: none;
                  None when no chunk has one)
    chunk_indices int32 [total chunks, 2]: FLA's chunk table of the pass, built on the host
                  (FLA's ``prepare_chunk_indices`` reads the lengths back: a wait for the GPU)
    chunk_offsets int64 [rows + 1]: each row's first chunk (FLA's ``prepare_chunk_offsets``
                  uploads with a blocking copy: a wait too)
    extend_lens   host ints: for the output kernel's own table of a pass under 64 tokens
    copy_src/dst  int64: a second tap in one chunk starts from a copy of the first's state
    part_rows     int64 [rows]: token rows [b, p) of every off-grid tap, in tap order
    part_cu       int32 [off-grid taps + 1], part_slots int32: their varlen layout and slots,
    part_chunks   int32 [.., 2]: FLA's chunk table of part_cu, built on the host (no sync)
    conv_rows     int64 [taps before the end, W]: token row of each conv column (clamped >= 0)
    conv_prev     int64 [.., W]: column of the previous conv state used where conv_from_prev
    conv_work/dst int64: the request's working slot (previous state) and the tap's slot
    end_work/dst  int64: taps at the end of their extend, copied from the working slot
    """
    chunk_slots: Optional[torch.Tensor]
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    extend_lens: tuple
    copy_src: Optional[torch.Tensor]
    copy_dst: Optional[torch.Tensor]
    part_rows: Optional[torch.Tensor]
    part_cu: Optional[torch.Tensor]
    part_slots: Optional[torch.Tensor]
    part_chunks: Optional[torch.Tensor]
    conv_rows: Optional[torch.Tensor]
    conv_prev: Optional[torch.Tensor]
    conv_from_prev: Optional[torch.Tensor]
    conv_work: Optional[torch.Tensor]
    conv_dst: Optional[torch.Tensor]
    end_work: Optional[torch.Tensor]
    end_dst: Optional[torch.Tensor]
    small_pass_chunks: Optional[tuple] = None     # (block, table) of the output kernel, once

    def output_chunks(self, tokens: int) -> tuple[int, torch.Tensor]:
        """(block, chunk table) FLA's ``chunk_fwd_o`` uses for a pass of ``tokens`` rows: its
        block shrinks to the next power of two (at least 16) under 64 tokens."""
        if tokens >= CHUNK:
            return CHUNK, self.chunk_indices
        block = max(16, triton.next_power_of_2(tokens))
        if self.small_pass_chunks is None or self.small_pass_chunks[0] != block:
            table = to_device(host_chunk_indices(self.extend_lens, block), self.chunk_indices.device,
                              torch.int32)
            self.small_pass_chunks = (block, table)
        return self.small_pass_chunks


def build_tap_tables(extend_starts: Sequence[int], extend_lens: Sequence[int],
                     taps: Sequence[tuple[int, int, int]], work_slots: torch.Tensor,
                     conv_width: int, device) -> TapTables:
    """Device tables for ``taps`` = (row, position relative to the row's extend start, slot),
    sorted by row then position, each 0 < position <= extend length. ``extend_starts`` are the
    rows' first token rows in the packed batch; ``work_slots`` the rows' working slots (device)."""
    chunk_base, total = [], 0
    for n in extend_lens:
        chunk_base.append(total)
        total += -(-n // CHUNK)
    chunk_offsets = chunk_base + [total]
    chunk_slots = [-1] * total
    copies, parts, part_cu, part_slots = [], [], [0], []
    conv_rows, conv_prev, conv_from_prev, conv_row_of, conv_dst = [], [], [], [], []
    end_row_of, end_dst = [], []
    for row, rel, slot in taps:
        n = extend_lens[row]
        if not 0 < rel <= n:
            raise ValueError(f"tap at {rel} outside the extend (0, {n}] of row {row}")
        if rel == n:
            end_row_of.append(row)
            end_dst.append(slot)
            continue
        c = rel // CHUNK
        g = chunk_base[row] + c
        if chunk_slots[g] < 0:
            chunk_slots[g] = slot
        else:
            copies.append((chunk_slots[g], slot))
        if rel % CHUNK:                   # one chunk of rel % 64 rows: FLA's table row (tap, 0)
            first = extend_starts[row] + c * CHUNK
            parts.extend(range(first, extend_starts[row] + rel))
            part_cu.append(len(parts))
            part_slots.append(slot)
        window = range(rel - conv_width, rel)
        conv_rows.append([extend_starts[row] + max(j, 0) for j in window])
        conv_prev.append([conv_width + j if j < 0 else 0 for j in window])
        conv_from_prev.append([j < 0 for j in window])
        conv_row_of.append(row)
        conv_dst.append(slot)

    def dev(values, dtype=torch.int64):
        return to_device(values, device, dtype) if values else None

    rows = lambda of: work_slots[dev(of)].to(torch.int64) if of else None  # noqa: E731
    in_kernel = any(slot >= 0 for slot in chunk_slots)     # else the kernel compiles no stores
    return TapTables(
        chunk_slots=dev(chunk_slots, torch.int32) if in_kernel else None,
        chunk_indices=dev(host_chunk_indices(extend_lens), torch.int32),
        chunk_offsets=dev(chunk_offsets), extend_lens=tuple(extend_lens),
        copy_src=dev([a for a, _ in copies]), copy_dst=dev([b for _, b in copies]),
        part_rows=dev(parts), part_cu=dev(part_cu if parts else [], torch.int32),
        part_slots=dev(part_slots, torch.int32),
        part_chunks=dev([[i, 0] for i in range(len(part_slots))], torch.int32),
        conv_rows=dev(conv_rows), conv_prev=dev(conv_prev),
        conv_from_prev=dev(conv_from_prev, torch.bool),
        conv_work=rows(conv_row_of), conv_dst=dev(conv_dst),
        end_work=rows(end_row_of), end_dst=dev(end_dst),
    )


def host_chunk_indices(lens: Sequence[int], chunk: int = CHUNK) -> list[list[int]]:
    """FLA's ``prepare_chunk_indices`` of sequences of ``lens`` tokens, from host lengths:
    (sequence, chunk) per chunk, the sequence numbered as FLA does (by sequences with chunks)."""
    out, seq = [], -1
    for n in lens:
        chunks = -(-n // chunk)
        seq += chunks > 0
        out.extend([seq, c] for c in range(chunks))
    return out


@triton.jit
def _conv_taps_kernel(mixed, conv, rows, prev, from_prev, work, dst, conv_dim,
                      stride_mt, stride_md, stride_cs, stride_cd, stride_cw,
                      W: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (tap, block of conv channels): conv[dst, d, w] = the previous conv state's
    column prev[w] of the working slot where from_prev[w], else mixed[rows[w], d]."""
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < conv_dim
    work_slot = tl.load(work + t)
    dst_slot = tl.load(dst + t)
    for w in tl.static_range(W):
        row = tl.load(rows + t * W + w)
        col = tl.load(prev + t * W + w)
        use_prev = tl.load(from_prev + t * W + w) != 0
        old = tl.load(conv + work_slot * stride_cs + d * stride_cd + col * stride_cw, mask=mask)
        new = tl.load(mixed + row * stride_mt + d * stride_md, mask=mask)
        x = tl.where(use_prev, old, new.to(old.dtype))
        tl.store(conv + dst_slot * stride_cs + d * stride_cd + w * stride_cw, x, mask=mask)


CONV_TAPS_BLOCK_D = 256


def capture_conv_taps(tables: TapTables, mixed_qkv: torch.Tensor, conv_states: torch.Tensor) -> None:
    """Before the conv kernel overwrites the working slots: each in-pass tap's conv state, the
    W pre-conv inputs before it (``mixed_qkv`` is [tokens, conv_dim]; ``conv_states`` is
    [slots, conv_dim, W]), in one launch (the torch ops of ``capture_conv_taps_reference``
    were six launches a layer, each costing the scheduler thread its own)."""
    if tables.conv_dst is None:
        return
    taps, width = tables.conv_rows.shape
    conv_dim = conv_states.shape[1]
    grid = (taps, triton.cdiv(conv_dim, CONV_TAPS_BLOCK_D))
    _conv_taps_kernel[grid](mixed_qkv, conv_states, tables.conv_rows, tables.conv_prev,
                            tables.conv_from_prev, tables.conv_work, tables.conv_dst, conv_dim,
                            mixed_qkv.stride(0), mixed_qkv.stride(1), conv_states.stride(0),
                            conv_states.stride(1), conv_states.stride(2),
                            W=width, BLOCK_D=CONV_TAPS_BLOCK_D)


def capture_conv_taps_reference(tables: TapTables, mixed_qkv: torch.Tensor,
                                conv_states: torch.Tensor) -> None:
    """``capture_conv_taps`` in torch ops (the tests' reference)."""
    if tables.conv_dst is None:
        return
    tokens = mixed_qkv[tables.conv_rows].transpose(1, 2)             # [taps, conv_dim, W]
    prev = conv_states[tables.conv_work]
    prev = prev.gather(2, tables.conv_prev[:, None, :].expand(-1, prev.shape[1], -1))
    window = torch.where(tables.conv_from_prev[:, None, :], prev, tokens.to(prev.dtype))
    conv_states[tables.conv_dst] = window


def copy_end_taps(tables: TapTables, states: Sequence[torch.Tensor]) -> None:
    """After the pass's last GDN layer: taps at the end of their extend are the working slots'
    states, every layer's, in one launch (``states``: the pool's [layers, slots, ...] tensors;
    a copy per layer and tensor cost the scheduler thread four launches a layer). Tap slots
    are fresh, never a working slot: no pair's destination is a source."""
    if tables.end_dst is not None:
        copy_state_slots(states, tables.end_work, tables.end_dst, validate=False)


def chunk_gated_delta_rule_with_taps(q, k, v, g, beta, *, initial_state, initial_state_indices,
                                     cu_seqlens, tables: TapTables):
    """SGLang's ``chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True)`` (varlen, state in
    place in ``initial_state``) with the SSM taps of ``tables``. Returns (o, None, h) as it does.
    Unlike it, the pass does not wait for the GPU: the chunk table comes from the host."""
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    scale = k.shape[-1] ** -0.5
    q_dtype = q.dtype
    q, k = l2norm_fwd(q), l2norm_fwd(k)
    chunk_indices = tables.chunk_indices
    g_cum = chunk_local_cumsum(g, chunk_size=CHUNK, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g_cum, beta=beta, cu_seqlens=cu_seqlens,
                                               chunk_indices=chunk_indices)
    h, v_new = fwd_h_with_taps(k, w, u, g_cum, initial_state, initial_state_indices, cu_seqlens,
                               tables.chunk_slots, chunk_indices=chunk_indices,
                               chunk_offsets=tables.chunk_offsets)
    o = _chunk_fwd_o(q, k, v_new, h, g_cum, scale, cu_seqlens, *tables.output_chunks(q.shape[1]))
    if tables.copy_dst is not None:
        initial_state[tables.copy_dst] = initial_state[tables.copy_src]
    if tables.part_rows is not None:
        _finish_off_grid_taps(tables, q, k, v, g, beta, initial_state)
    return o.to(q_dtype), None, h


def _chunk_fwd_o(q, k, v, h, g, scale, cu_seqlens, block, chunk_indices):
    """FLA's ``chunk_fwd_o`` (varlen) with its block and chunk table given
    (``TapTables.output_chunks``)."""
    B, T, Hg, K, V = *q.shape, v.shape[-1]
    H = v.shape[-2]
    o = torch.zeros_like(v)
    chunk_fwd_kernel_o[lambda meta: (triton.cdiv(V, meta["BV"]), len(chunk_indices), B * H)](
        q, k, v, h, g, o, cu_seqlens, chunk_indices, scale, T=T, H=H, Hg=Hg, K=K, V=V, BT=block,
        BK=128, BV=64, USE_G=True, IS_VARLEN=True, num_warps=4, num_stages=2)
    return o


def _finish_off_grid_taps(tables: TapTables, q, k, v, g, beta, pool) -> None:
    """Stock stages over the rows [b, p) of every off-grid tap, from the state at b in its slot
    (q, k already normalized; g raw). Only the final states are kept: no output pass."""
    rows, cu, chunks = tables.part_rows, tables.part_cu, tables.part_chunks
    k, v, beta = k[:, rows], v[:, rows], beta[:, rows]
    g_cum = chunk_local_cumsum(g[:, rows], chunk_size=CHUNK, cu_seqlens=cu, chunk_indices=chunks)
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g_cum, beta=beta, cu_seqlens=cu,
                                               chunk_indices=chunks)
    offsets = torch.arange(len(chunks) + 1, dtype=torch.int64, device=chunks.device)  # a chunk each
    fwd_h_with_taps(k, w, u, g_cum, pool, tables.part_slots, cu, chunk_indices=chunks,
                    chunk_offsets=offsets)
