"""The device pages and mamba slots the cache takes (design §6.3, §9.1, §9.2): from SGLang's
allocators, evicting what the index holds when they are dry, and the spares held ahead.

- Taking: a page or slot comes from the allocator; when it is dry the cache's eviction runs
  first (spare ids, the index's LRU or slot victims), then the allocator is asked again.
- Spare pages and slots (``--cache-settled-reads``): how many to hold, refilled after each
  request is cached; under eviction, spares beyond the floor go back first.
- Private pages: a copy of a page's KV (a snapshot tail a request resumes from and writes on).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from hpc_radix.index import Actions, PrefixIndex, SlotGrant
from hpc_radix.kernels.upload import page_slots

from .ids import IdReader
from .pool import DevicePool


class DevicePages:
    SPARES_RELEASED_AT_ONCE = 8   # at least this many above the floor go back per eviction
    # Mamba slots taken ahead for captures: reserving right before a pass then touches no
    # allocator. (SGLang's allocator hands out device tensors: reading one back waits for the
    # GPU, and changing its free list from the forward stream would race with the scheduler's
    # stream.) Counted as evictable: SGLang's evictions get them back first.
    MIN_SPARE_SLOTS = 8

    def __init__(self, pool: DevicePool, index: PrefixIndex, run: Callable[[Actions], object],
                 ids: IdReader, spare_base: int, spare_slots: bool, running: int):
        """``run``: the executor of the index's actions; ``spare_base``: --cache-spare-pages;
        ``spare_slots``: whether tap captures take spare slots (zero-split taps); ``running``:
        the requests that may run at once."""
        self.pool = pool
        self.index = index
        self.run = run
        self.ids = ids
        self.page_size = pool.page_size
        self.spare_base = spare_base
        self.spare_slots = spare_slots
        self.slot_floor = max(self.MIN_SPARE_SLOTS, 2 * running)

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
        spares = self.pool.spares
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
        return max(len(self.pool.spares.known), self.pool.free)

    def alloc_pages(self, count: int) -> torch.Tensor:
        # spares count as evictable in SGLang's budget: a restore it admitted may need them
        return self._alloc(self.pool.allocator.alloc, count * self.page_size, self.evict_pages,
                           count, "KV page")

    def alloc_slots(self, count: int) -> torch.Tensor:
        return self._alloc(self.pool.mamba_allocator.alloc, count, self.evict_slots, count,
                           "mamba slot")

    def _alloc(self, alloc, need: int, evict, count: int, what: str) -> torch.Tensor:
        """``alloc(need)``, evicting ``count`` cache entries first when the pool is dry."""
        out = alloc(need)
        if out is None:
            evict(count)
            self.pool.hand_back()
            out = alloc(need)
        if out is None:
            raise RuntimeError(f"hybrid radix cache: no free {what} ({self.describe()})")
        return out

    def granted_slot(self, grant: Optional[SlotGrant]) -> Optional[int]:
        """The slot an ``acquire_slot`` or ``reclaim_slot`` grant reclaimed (None: take a fresh
        one, or none was granted), after running what reclaiming it let go."""
        if grant is None:
            return None
        self.run(grant.actions)
        return grant.slot

    def copy_tail(self, row: torch.Tensor, frontier: int) -> Optional[int]:
        """A private page holding the KV of [frontier // 64 * 64, frontier) of a request's token
        row ``row``: the tail of a tap there. None when no page can be had."""
        first = frontier - frontier % self.page_size
        src = row[first:frontier].to(torch.int64)
        try:
            (page,), _ = self.new_pages(1)
        except RuntimeError:
            return None
        self.pool.copy_kv(page_slots([page], self.page_size, self.pool.device)[:len(src)], src)
        return page

    def private_page(self, src_tokens: torch.Tensor) -> torch.Tensor:
        """A new page whose first tokens are a copy of ``src_tokens``' KV. Returns the page's
        token slots."""
        page = self.alloc_pages(1)
        self.pool.copy_kv(page[:len(src_tokens)], src_tokens)
        return page

    # ---- spares ----------------------------------------------------------------------------
    def refill_spares(self, at_startup: bool = False) -> None:
        """What the index let go back to the allocators, then the spare slots and pages back
        to their targets."""
        self.pool.hand_back()
        if self.spare_slots:
            self.pool.spare_slots.refill(self.spare_slot_target(), at_startup)
        if self.ids.settled:
            target, floor = self.spare_bounds()
            short = floor - self.pool.spares.held
            if short > 0 and not at_startup:
                short -= self.pool.free
                if short > 0:
                    self.run(self.index.evict_pages(short))
                    self.pool.hand_back()
            self.pool.spares.refill(target, at_startup, floor=floor)

    def spare_slot_target(self) -> int:
        """Spare slots to hold: twice what one pass's captures took from them at most lately
        (ids taken after a build are read without waiting only after the next one), at least
        the floor, within a quarter of the mamba pool."""
        return self.pool.spare_slots.target(self.slot_floor, self.pool.mamba_slots // 4, per_batch=2)

    def spare_bounds(self) -> tuple[int, int]:
        """(target, floor) of the spare pages, none without settled reads. Tail copies take
        one page, a host restore one per host-only block: hold what one batch's admissions
        took at most lately, within a quarter of the pool. A full pool (the cache keeps every
        page it can) has none to spare: the floor is evicted for ahead (up to 1/16 of the
        pool), or a page needed beyond the spares waits for the pass in flight to read its id.
        Beyond the floor, only free pages become spares."""
        if not self.ids.settled:
            return 0, 0
        total = self.pool.total
        target = self.pool.spares.target(self.spare_base, total // 4)
        return target, min(target, max(self.spare_base, total // 16))

    # ---- eviction --------------------------------------------------------------------------
    def evict_pages(self, pages: int) -> int:
        """Free ``pages`` device pages (given back at ``hand_back``); returns how many. Spares
        beyond the floor first (free pages), then the LRU, the floor's spares last: taking
        those would only make the next refill evict the LRU for them again. Spares go back a
        few at a time even when fewer are asked for: they are free pages, and SGLang calls
        evict whenever its own free count is short (a decode page every 64 steps)."""
        spares = self.pool.spares
        above_floor = max(0, spares.held - self.spare_bounds()[1])
        freed = spares.release(min(max(pages, self.SPARES_RELEASED_AT_ONCE), above_floor))
        if pages > freed:
            before = self.pool.num_freed_pages
            self.run(self.index.evict_pages(pages - freed))
            freed += self.pool.num_freed_pages - before
        freed += spares.release(pages - freed) if pages > freed else 0
        return freed

    def free_backed(self, pages: int) -> None:
        """The device copies of up to ``pages`` host-backed cached blocks go back to the
        allocator now (never a block's last copy): room for a prefetch."""
        self.run(self.index.evict_pages(pages, backed_only=True))
        self.pool.hand_back()

    def evict_slots(self, count: int) -> int:
        """Free ``count`` mamba slots: spare capture slots first, then snapshot images."""
        freed = self.pool.spare_slots.release(count)
        before = len(self.pool.freed.slots)
        self.run(self.index.evict_slots(count - freed))
        return freed + len(self.pool.freed.slots) - before

    # ---- accounting ------------------------------------------------------------------------
    def unaccounted(self) -> list[int]:
        """With every request finished: the page ids neither free in SGLang's allocator, held as
        spares, owned by the index nor taken to hand back (a leak); [] without reading the device
        when the counts add up."""
        pool, spares, unit = self.pool, self.pool.spares, self.page_size
        if pool.free + spares.held + self.index.sizes.device_pages + pool.num_freed_pages == pool.total:
            return []
        allocator = pool.allocator
        seen = set(allocator.free_pages.tolist())
        if allocator.release_pages is not None:       # (0.5.23 frees into free_pages only)
            seen.update(allocator.release_pages.tolist())
        seen.update(spares.known)
        for _, got in spares.pending:
            seen.update((got[::unit] // unit).tolist())
        seen.update(self.index.device_page_ids())
        seen.update(pool.freed.pages)
        return [p for p in range(1, pool.total + 1) if p not in seen]

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
        self.pool.free_pages(lost)
        return where

    def describe(self) -> str:
        sizes = self.index.sizes
        return (f"available pages {self.pool.free}, evictable {sizes.evictable_pages}, spare "
                f"{self.pool.spares.held}, cached {sizes.device_pages}, nodes {sizes.nodes}, "
                f"snapshots {sizes.snapshots} ({sizes.device_images} on device, "
                f"{sizes.evictable_slots} evictable)")
