"""SGLang's device allocators as the cache holds them (design §6.3, §9.1, §9.2): the KV pages and
mamba slots it gives back, the spare ids it takes ahead, and the KV copies between its pages.

- Giving back: what the index lets go reaches ``take`` (through the executor) and is held until
  ``hand_back`` passes it to the allocators, a call each: the one place pages and slots go back.
- Spare ids (``--cache-settled-reads``): pages and slots taken ahead, whose ids are known on the
  host by the time a tail copy, a restore or a tap capture needs them (``SpareIds``).
- KV copies: a page's KV copied on the forward stream, after the passes that wrote it (a
  snapshot tail a request resumes from and then writes on, a duplicate block's sharing).
"""
from __future__ import annotations

from typing import Sequence

import torch
from sglang.srt.mem_cache.memory_pool import move_kv_cache_native

from hpc_radix.index import FreeDevice, ShareBlocks
from hpc_radix.kernels.upload import page_slots, to_device
from hpc_radix.sglang_version import kv_move_kwargs

from .ids import IdReader, SpareIds, free_units


class DevicePool:
    def __init__(self, allocator, mamba_allocator, ids: IdReader, page_size: int, kv_pools: Sequence,
                 forward_stream=None, slot_count: int = 0):
        """``kv_pools``: every KV pool the cache copies (the target's, and a speculative
        draft model's over the same slots); ``slot_count``: the mamba pool's slots."""
        self.allocator = allocator
        self.mamba_allocator = mamba_allocator
        self.page_size = page_size
        self.device = allocator.device
        self.kv_pools = list(kv_pools)
        self.forward_stream = forward_stream
        self.mamba_slots = slot_count
        # a slot id as a device tensor is a view of this: no upload (see slot_tensor)
        self._slot_ids = torch.arange(slot_count + 1, dtype=torch.int64, device=self.device)
        self.spares = SpareIds(ids, allocator, self.device, unit=page_size)   # pages
        self.spare_slots = SpareIds(ids, mamba_allocator, self.device)          # tap captures
        self.freed = FreeDevice([], [])       # what index calls let go, until hand_back

    @property
    def total(self) -> int:
        return self.allocator.size // self.page_size

    @property
    def free(self) -> int:
        return self.allocator.available_size() // self.page_size

    def page_use(self) -> float:
        """The share of the KV pages in use: neither free nor held as spares."""
        return (self.total - self.free - self.spares.held) / self.total

    def slot_tensor(self, slot: int) -> torch.Tensor:
        """``[slot]`` on the device without an upload (on a GPU host each costs the scheduler
        thread ~0.1 ms): a view of a resident arange, read only, as SGLang reads the ids it
        is handed (it copies them into its own tensors)."""
        return self._slot_ids[slot:slot + 1]

    # ---- giving back -----------------------------------------------------------------------
    def take(self, freed: FreeDevice) -> None:
        """Hold what an index call let go until ``hand_back``."""
        self.freed.pages.extend(freed.pages)
        self.freed.slots.extend(freed.slots)

    @property
    def num_freed_pages(self) -> int:
        """Pages taken and not handed back yet: read on SGLang's every scheduling round."""
        return len(self.freed.pages)

    @property
    def has_freed(self) -> bool:
        return not self.freed.empty

    def hand_back(self) -> None:
        """Give SGLang's allocators what index calls let go, a call each."""
        (pages, slots), self.freed = self.freed, FreeDevice([], [])
        if pages:
            self.free_pages(pages)
        if slots:
            self.mamba_allocator.free(to_device(slots, self.device))

    def give_back_spares(self) -> None:
        """Every spare page and slot back to the allocators, with what is held to hand back."""
        self.spares.release(self.spares.held)
        self.spare_slots.release(self.spare_slots.held)
        self.hand_back()

    def free_pages(self, pages) -> None:
        """Give whole pages back to SGLang's allocator."""
        free_units(self.allocator, page_slots(pages, self.page_size, self.device), self.page_size)

    def free_slot(self, slot: int) -> None:
        self.mamba_allocator.free(self.slot_tensor(slot))

    # ---- copies ----------------------------------------------------------------------------
    def share_blocks(self, row: torch.Tensor, action: ShareBlocks) -> None:
        """The request's token ``row`` maps the tree's pages of the duplicate blocks (block
        b's slots are b * 64 + 0..63, as a page's are): one upload and one write for all of
        them; its own pages go back at once."""
        where, slots = page_slots([*action.blocks, *action.tree_pages], self.page_size,
                                  row.device).view(2, -1)
        row[where] = slots.to(row.dtype)
        self.free_pages(list(action.own_pages))

    def copy_kv(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the KV of token slots ``src`` into ``dst`` on the forward stream, after the
        passes launched there: every full-attention layer (K, V and any scales) byte for byte,
        in the target's pool and any draft model's."""
        self._on_forward_stream(lambda: self._copy_kv(dst, src), dst, src)

    def _copy_kv(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # SGLang's pool-level move_kv_cache needs a copy kernel servers do not initialise
        paged = kv_move_kwargs(self.page_size)
        for kvcache in self.kv_pools:
            pool = full_kv_pool(kvcache)
            move_kv_cache_native(pool.k_buffer, pool.v_buffer, dst, src, **paged)
            if getattr(pool, "k_scale_buffer", None) is not None:
                move_kv_cache_native(pool.k_scale_buffer, pool.v_scale_buffer, dst, src, **paged)

    def _on_forward_stream(self, fn, *inputs: torch.Tensor) -> None:
        """Run ``fn`` on the forward stream, after the passes launched there. The scheduler
        computes index tensors on its own stream: the forward stream first waits for those
        (``inputs``), which also stay allocated until it has read them."""
        if self.forward_stream is None or not torch.cuda.is_available():
            fn()
            return
        self.forward_stream.wait_stream(torch.cuda.current_stream())
        for t in inputs:
            t.record_stream(self.forward_stream)
        with torch.cuda.stream(self.forward_stream):
            fn()


def full_kv_pool(kv_pool):
    """The pool holding the full-attention buffers (a hybrid pool wraps one)."""
    return getattr(kv_pool, "full_kv_pool", kv_pool)


def state_image_bytes(mamba_pool) -> int:
    """Bytes of one slot's recurrent and conv states (a snapshot image)."""
    cache = mamba_pool.mamba_cache
    return sum(t.nbytes // t.shape[1] for t in [*cache.conv, cache.temporal])
