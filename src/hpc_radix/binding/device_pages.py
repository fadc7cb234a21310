"""The device pages and mamba slots the cache takes from SGLang's allocators and gives back
(design §6.3, §9.1, §9.2).

- Taking: a page or slot comes from the allocator; when it is dry the cache's eviction runs
  first (the index's LRU, spare ids), then the allocator is asked again.
- Spare pages (``--cache-settled-reads``): pages taken ahead, whose ids are known on the host
  by the time a tail copy or a restore needs them (``SpareIds``).
- Giving back: what an index call frees (the ``FreeDevice`` it returns) is held here
  (``take``) until ``hand_back`` passes it to the allocators, a call each: the one place pages
  and slots go back.
- Private pages: a copy of a page's KV made on the forward stream, after the passes that
  wrote it (a snapshot tail a request resumes from and then writes on).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from sglang.srt.mem_cache.memory_pool import move_kv_cache_native

from hpc_radix.index import FreeDevice, SlotGrant
from hpc_radix.kernels.upload import page_slots, to_device

from .id_reader import IdReader, SpareIds, free_units
from .transfers import full_kv_pool


class DevicePages:
    SPARES_RELEASED_AT_ONCE = 8   # at least this many above the floor go back per eviction

    def __init__(self, allocator, mamba_allocator, ids: IdReader, page_size: int,
                 spare_base: int, forward_stream=None, slot_count: int = 0):
        self.allocator = allocator
        self.mamba_allocator = mamba_allocator
        self.ids = ids
        self.page_size = page_size
        self.device = allocator.device
        self.kvcache = allocator.get_kvcache()
        self.kv_pools = [self.kvcache]        # and a speculative draft's (attach_draft_kv)
        self.forward_stream = forward_stream
        self.spare_base = spare_base          # --cache-spare-pages
        self.index = None                     # the cache's PrefixIndex (replaced at a flush)
        self.slot_spares = None               # the taps' spare capture slots (Taps)
        # with settled reads, pages whose ids are known ahead (tail copies, restores)
        self.spares = SpareIds(ids, allocator, self.device, unit=page_size)
        # a slot id as a device tensor is a view of this: no upload (see slot_tensor)
        self.mamba_slots = slot_count
        self._slot_ids = torch.arange(slot_count + 1, dtype=torch.int64, device=self.device)
        self.freed = FreeDevice([], [])       # what index calls let go, until hand_back

    @property
    def total(self) -> int:
        return self.allocator.size // self.page_size

    @property
    def free(self) -> int:
        return self.allocator.available_size() // self.page_size

    def slot_tensor(self, slot: int) -> torch.Tensor:
        """``[slot]`` on the device without an upload (on a GPU host each costs the scheduler
        thread ~0.1 ms): a view of a resident arange, read only, as SGLang reads the ids it
        is handed (it copies them into its own tensors)."""
        return self._slot_ids[slot:slot + 1]

    # ---- taking ----------------------------------------------------------------------------
    def new_pages(self, count: int, demand: bool = True) -> tuple[list[int], bool]:
        """New pages whose ids the index needs now, and whether every one was a spare taken
        before the last batch build (no pass launched since uses it: a copy into them waits
        for that build's event, not for the pass in flight). Spare pages when enough are known
        (settled reads), else from the allocator, read back (the spares stay for smaller
        needs, unless the allocator needs them back). ``demand``: whether the spares held
        ahead should grow for needs like this one."""
        if not count:
            return [], True
        spares = self.spares
        if demand:
            spares.note_demand(count)
        spares.settle()
        if len(spares.known) >= count:
            pages = [spares.take() for _ in range(count)]
            return pages, all(spares.taken_before_last_build(p) for p in pages)
        pages = self.alloc_pages(count)
        return [loc // self.page_size for loc in self.ids.read(pages[::self.page_size])], False

    def at_hand(self) -> int:
        """Pages ``new_pages`` gives without evicting: the known spares, or the free pages."""
        return max(len(self.spares.known), self.free)

    def alloc_pages(self, count: int) -> torch.Tensor:
        # spares count as evictable in SGLang's budget: a restore it admitted may need them
        return self._alloc(self.allocator.alloc, count * self.page_size, self.evict_pages, count,
                           "KV page")

    def alloc_slots(self, count: int) -> torch.Tensor:
        return self._alloc(self.mamba_allocator.alloc, count, self.evict_slots, count, "mamba slot")

    def _alloc(self, alloc, need: int, evict, count: int, what: str) -> torch.Tensor:
        """``alloc(need)``, evicting ``count`` cache entries first when the pool is dry."""
        out = alloc(need)
        if out is None:
            evict(count)
            self.hand_back()
            out = alloc(need)
        if out is None:
            raise RuntimeError(f"hybrid radix cache: no free {what} ({self.describe()})")
        return out

    def copy_tail(self, row: torch.Tensor, frontier: int) -> Optional[int]:
        """A private page holding the KV of [frontier // 64 * 64, frontier) of a request's token
        row ``row``: the tail of a tap there. None when no page can be had."""
        first = frontier - frontier % self.page_size
        src = row[first:frontier].to(torch.int64)
        try:
            (page,), _ = self.new_pages(1)
        except RuntimeError:
            return None
        self.private_page(src, page_slots([page], self.page_size, self.device))
        return page

    def private_page(self, src_tokens: torch.Tensor, page: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A new page (or ``page``'s token slots) whose first tokens are a copy of
        ``src_tokens``' KV (on the forward stream, after the passes that wrote it). Returns the
        page's token slots."""
        page = self.alloc_pages(1) if page is None else page
        dst = page[:len(src_tokens)]
        self._on_forward_stream(lambda: self._copy_kv(dst, src_tokens), dst, src_tokens)
        return page

    # ---- spares ----------------------------------------------------------------------------
    def refill_spares(self, at_startup: bool = False) -> None:
        """The taps' spare slots and the spare pages back to their targets."""
        self.slot_spares.refill_spares(at_startup)
        if self.ids.settled:
            target, floor = self.spare_bounds()
            short = floor - self.spares.held
            if short > 0 and not at_startup:
                short -= self.free
                if short > 0:
                    self.take(self.index.device.evict_pages(short))
                    self.hand_back()
            self.spares.refill(target, at_startup, floor=floor)

    def spare_bounds(self) -> tuple[int, int]:
        """(target, floor) of the spare pages, none without settled reads. Tail copies take
        one page, a host restore one per host-only block: hold what one batch's admissions
        took at most lately, within a quarter of the pool. A full pool (the cache keeps every
        page it can) has none to spare: the floor is evicted for ahead (up to 1/16 of the
        pool), or a page needed beyond the spares waits for the pass in flight to read its id.
        Beyond the floor, only free pages become spares."""
        if not self.ids.settled:
            return 0, 0
        target = self.spares.target(self.spare_base, self.total // 4)
        return target, min(target, max(self.spare_base, self.total // 16))

    # ---- giving back -----------------------------------------------------------------------
    def evict_pages(self, pages: int) -> int:
        """Free ``pages`` device pages (given back at ``hand_back``); returns how many. Spares
        beyond the floor first (free pages), then the LRU, the floor's spares last: taking
        those would only make the next refill evict the LRU for them again. Spares go back a
        few at a time even when fewer are asked for: they are free pages, and SGLang calls
        evict whenever its own free count is short (a decode page every 64 steps)."""
        above_floor = max(0, self.spares.held - self.spare_bounds()[1])
        freed = self.spares.release(min(max(pages, self.SPARES_RELEASED_AT_ONCE), above_floor))
        freed += len(self.take(self.index.device.evict_pages(pages - freed)).pages) if pages > freed else 0
        freed += self.spares.release(pages - freed) if pages > freed else 0
        return freed

    def evict_slots(self, count: int) -> int:
        """Free ``count`` mamba slots: spare capture slots first, then snapshot images."""
        freed = self.slot_spares.release_spares(count)
        return freed + len(self.take(self.index.device.evict_slots(count - freed)).slots)

    def take(self, freed: FreeDevice) -> FreeDevice:
        """Hold what an index call let go until ``hand_back``; returns it."""
        self.freed.pages.extend(freed.pages)
        self.freed.slots.extend(freed.slots)
        return freed

    def granted_slot(self, grant: Optional[SlotGrant]) -> Optional[int]:
        """The slot an ``acquire_slot`` or ``reclaim_slot`` grant reclaimed (None: take a fresh
        one, or none was granted), holding what reclaiming it let go."""
        if grant is None:
            return None
        self.take(grant.freed)
        return grant.slot

    @property
    def num_freed_pages(self) -> int:
        """Pages taken and not handed back yet: read on SGLang's every scheduling round."""
        return len(self.freed.pages)

    @property
    def has_freed(self) -> bool:
        return not self.freed.empty

    def hand_back(self, more_slots: Sequence[int] = ()) -> None:
        """Give SGLang's allocators what index calls let go (and ``more_slots``), a call each."""
        (pages, slots), self.freed = self.freed, FreeDevice([], [])
        if pages:
            self.free_pages(pages)
        if slots or more_slots:
            self.mamba_allocator.free(to_device([*slots, *more_slots], self.device))

    def free_pages(self, pages) -> None:
        """Give whole pages back to SGLang's allocator."""
        free_units(self.allocator, page_slots(pages, self.page_size, self.device), self.page_size)

    def free_slot_and_page(self, slot: int, page: int) -> None:
        self.mamba_allocator.free(self.slot_tensor(slot))
        if page >= 0:
            self.free_pages([page])

    # ---- accounting ------------------------------------------------------------------------
    def unaccounted(self) -> list[int]:
        """With every request finished: the page ids neither free in SGLang's allocator, held as
        spares, owned by the index nor taken to hand back (a leak); [] without reading the device
        when the counts add up."""
        index, spares, unit = self.index, self.spares, self.page_size
        if self.free + spares.held + index.device_pages + self.num_freed_pages == self.total:
            return []
        seen = set(torch.cat((self.allocator.free_pages, self.allocator.release_pages)).tolist())
        seen.update(spares.known)
        for _, got in spares.pending:
            seen.update((got[::unit] // unit).tolist())
        seen.update(n.device_page for n in index.tree.nodes() if n.device_page >= 0)
        seen.update(s.tail_page for s in index.snapshots.values() if s.tail_page >= 0)
        seen.update(self.freed.pages)
        return [p for p in range(1, self.total + 1) if p not in seen]

    def recover_lost(self, req_to_token: torch.Tensor) -> list[str]:
        """With no request running: give every page nobody owns (``unaccounted``) back to the
        allocator, so that SGLang's idle check, which stops the server on a lost page, holds.
        Returns, per page, where it last sat in a request row (rows keep their ids after the
        request ended): what the warning names to find the path that lost it."""
        lost = self.unaccounted()
        if not lost:
            return []
        row_pages, where = req_to_token // self.page_size, []
        for page in lost:
            hits = (row_pages == page).nonzero()
            rows = sorted({(int(r), int(c) // self.page_size) for r, c in hits.tolist()})
            where.append(f"page {page} at {', '.join(f'row {r} block {b}' for r, b in rows[:4]) or 'no request row'}")
        self.free_pages(lost)
        return where

    def describe(self) -> str:
        index = self.index
        return (f"available pages {self.free}, evictable {index.evictable_pages}, spare "
                f"{self.spares.held}, cached {index.device_pages}, nodes {index.tree.num_nodes}, "
                f"snapshots {len(index.snapshots)} ({index.device_images} on device, "
                f"{index.evictable_slots} evictable)")

    # ---- copies ----------------------------------------------------------------------------
    def _copy_kv(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy token slots of every full-attention layer (K, V and any scales) byte for byte,
        in the target's pool and any draft model's. SGLang's pool-level move_kv_cache needs a
        copy kernel servers do not initialise."""
        for kvcache in self.kv_pools:
            pool = full_kv_pool(kvcache)
            move_kv_cache_native(pool.k_buffer, pool.v_buffer, dst, src, page_size=self.page_size)
            if getattr(pool, "k_scale_buffer", None) is not None:
                move_kv_cache_native(pool.k_scale_buffer, pool.v_scale_buffer, dst, src,
                                     page_size=self.page_size)

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


def state_image_bytes(mamba_pool) -> int:
    """Bytes of one slot's recurrent and conv states (a snapshot image)."""
    cache = mamba_pool.mamba_cache
    return sum(t.nbytes // t.shape[1] for t in [*cache.conv, cache.temporal])
