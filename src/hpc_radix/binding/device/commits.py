"""What a request's caching writes into the index (design §7.4, §7.6, §7.7): its full blocks
(duplicates swapped for the tree's page), the state SGLang's extra_buffer tracked at the end of
an extend (donated as a tap), the exact endpoint of a finished request, and the mamba slots it
frees. Device ids are read in one settled read where they were written before the last batch
build (``IdReader``)."""
from __future__ import annotations

from typing import Callable, Optional

from hpc_radix.index import Actions, PrefixIndex, Role, SnapshotKind
from hpc_radix.sglang_version import extend_start, req_slots

from .ids import IdReader
from .pages import DevicePages
from .requests import known_slot, record_of, req_prompt_key
from .taps import Taps


class RequestCommits:
    def __init__(self, req_pool, ids: IdReader, pages: DevicePages, index: PrefixIndex,
                 run: Callable[[Actions], object], taps: Taps, verify_ahead: bool = False):
        """``run``: the executor of the index's actions; ``taps``: which tracked states were
        planned taps. ``verify_ahead``: speculative decoding under overlap scheduling, where
        a finishing request's next verify is already queued and takes its working slot past
        the committed tokens, so its endpoint is the state SGLang tracked last."""
        self.req_pool = req_pool
        self.ids = ids
        self.pages = pages
        self.index = index
        self.run = run
        self.taps = taps
        self.unit = pages.page_size
        self.verify_ahead = verify_ahead

    def commit_range(self, req, seq, committed: int) -> tuple[int, int]:
        """(first, end) blocks that ``commit`` adds to the tree (none when end <= first)."""
        seq.key = req_prompt_key(req)
        return len(seq.path), min(committed, len(seq.key)) // self.unit

    def commit(self, req, seq, committed: int, locs: Optional[list[int]] = None) -> None:
        """Full blocks up to ``committed`` join the tree; duplicates are swapped for the tree's
        page and the request's own page freed (the index's ShareBlocks: identical blocks are
        one physical page). ``locs``: the first token slot of each new block, when already
        read."""
        first, n_full = self.commit_range(req, seq, committed)
        if n_full <= first:
            return
        row = self.req_pool.req_to_token[req_slots(req).req_pool_idx]
        if locs is None:  # written when the batches that computed these tokens were built: settled
            locs = self.ids.read_settled(row[first * self.unit:n_full * self.unit:self.unit])
        pages = [-1] * first + [loc // self.unit for loc in locs]
        self.run(self.index.commit(seq, n_full * self.unit, pages).actions, row=row)

    def tracking_slots(self, req) -> list[int]:
        """The request's ping-pong tracking slots: allocated at admission or by SGLang when the
        batch was built (settled), unless a donation rewrote one since the last build."""
        buf = req_slots(req).mamba_ping_pong_track_buffer
        if record_of(req).donation_epoch == self.ids.epoch:
            return self.ids.read(buf)
        return self.ids.read_settled(buf)

    def publish_tracked_tap(self, req, seq, committed: int) -> None:
        """Donate the extend's tracked state as a tap when it is the exact end-of-extend state
        at a page boundary (cache.py explains the tracking)."""
        kv = req_slots(req)
        tracked, kv.mamba_last_track_seqlen = kv.mamba_last_track_seqlen, None
        if (tracked is None or tracked != committed or tracked % self.unit
                or tracked // self.unit > len(seq.path)
                or self.index.find_snapshot(seq, tracked) is not None):
            return
        start = extend_start(req)
        if start % self.unit:
            return                          # tracking is relative to an unaligned base
        # Unplanned chunk ends are kept provisionally (the next snapshot of the request
        # supersedes them): a cancelled or retracted prefill still leaves its deepest state.
        planned = self.taps.tracked_kind(req, start, tracked)
        kind = planned or SnapshotKind.TAP
        grant = self.index.acquire_slot(seq, tracked, kind, provisional=planned is None)
        if grant is None:
            return
        reclaimed = self.pages.granted_slot(grant)
        if reclaimed is not None:
            new_slot = self.pages.pool.slot_tensor(reclaimed)
        else:
            try:
                new_slot = self.pages.alloc_slots(1)
            except RuntimeError:        # every slot is held: a provisional tap is optional
                self.index.unstage()
                return
        donated = self.tracking_slots(req)[self.req_pool.get_mamba_ping_pong_keep_idx(req)]
        self.req_pool.donate_mamba_ping_pong_slot(req, new_slot)
        record_of(req).donation_epoch = self.ids.epoch   # its tracking buffer changed just now
        # a provisional tap is superseded soon: the index does not write it to host
        self.run(self.index.publish(seq, tracked, kind, donated, provisional=planned is None).actions)

    def read_finish_ids(self, req, seq, committed: int) -> dict:
        """What a finishing request's caching reads from the device, in one settled read (each
        read is a wait of its own): the new blocks' first slots, the last token's slot, the
        working slot, the tracking slots. A value not needed or not settled is None."""
        kv = req_slots(req)
        row = self.req_pool.req_to_token[kv.req_pool_idx]
        first, n_full = self.commit_range(req, seq, committed)
        buf = kv.mamba_ping_pong_track_buffer
        parts = {
            "blocks": row[first * self.unit:n_full * self.unit:self.unit]
            if n_full > first else None,
            "tail": row[committed - 1:committed] if committed % self.unit else None,
            "slot": kv.mamba_pool_idx.view(1)
            if kv.mamba_pool_idx is not None and known_slot(req) is None else None,
            # a donation since the last build rewrote the buffer: not settled (tracking_slots)
            "tracking": buf if buf is not None
            and record_of(req).donation_epoch != self.ids.epoch else None,
        }
        return self.ids.read_settled_parts(parts)

    def publish_endpoint(self, req, seq, committed: int, ids: dict,
                         freed_slots: list[int]) -> tuple[Optional[int], bool]:
        """Publish the exact endpoint (§7.7): the working slot becomes the image, the partial
        last page the tail; under ``verify_ahead`` the state tracked last becomes it, at its
        length. Returns (the slot that became the image or None, tail page kept). ``ids``:
        what ``read_finish_ids`` read; a slot given up for the image goes to ``freed_slots``."""
        at, slot = committed, None
        if self.verify_ahead:
            at, slot = self._tracked_state(req, seq, committed, ids)
            if slot is None:
                return None, False
        # Any frontier past the deepest snapshot of this request is worth an exact endpoint: a
        # client echoing prompt + output resumes from it, not from a tap up to 63 tokens back.
        deepest = max((s.frontier for s in (seq.last_tap, seq.source) if s is not None), default=0)
        if at <= deepest or self.index.find_snapshot(seq, at) is not None:
            return None, False
        grant = self.index.acquire_slot(seq, at, SnapshotKind.ENDPOINT, role=Role.ENDPOINT)
        if grant is None:
            return None, False
        reclaimed = self.pages.granted_slot(grant)
        if reclaimed is not None:
            freed_slots.append(reclaimed)
        tail_page = -1
        if at % self.unit:
            tail_page = ids["tail"][0] // self.unit
        if slot is None:
            slot = self.working_slot_id(req, ids)
            assert slot is not None, "an endpoint's working slot was neither a spare nor read"
        self.run(self.index.publish(seq, at, SnapshotKind.ENDPOINT, slot, tail_page,
                                    role=Role.ENDPOINT).actions)
        return slot, tail_page >= 0

    def _tracked_state(self, req, seq, committed: int, ids: dict) -> tuple[int, Optional[int]]:
        """(length, slot) of the state SGLang's extra_buffer tracked last for the request: its
        keep ping-pong slot, exact after a multiple of --mamba-track-interval tokens. A verify
        still in flight never writes it (the interval is at least twice the draft tokens,
        plugin.py); (0, None) when no tracked state lies in the committed blocks."""
        at = req_slots(req).mamba_last_track_seqlen
        if at is None or not 0 < at <= committed or at % self.unit or at // self.unit > len(seq.path):
            return 0, None
        slot = self._finish_tracking(req, ids)[self.req_pool.get_mamba_ping_pong_keep_idx(req)]
        return (at, slot) if slot >= 0 else (0, None)

    def _finish_tracking(self, req, ids: dict) -> list[int]:
        """The request's tracking slots as its finish reads them: ``ids["tracking"]``, read now
        (once, kept in ``ids``) where it was not settled."""
        if ids["tracking"] is None:
            ids["tracking"] = self.tracking_slots(req)
        return ids["tracking"]

    def working_slot_id(self, req, ids: dict) -> Optional[int]:
        """The request's working slot id on the host: from a spare, or read by
        ``read_finish_ids`` (None when neither)."""
        known = known_slot(req)
        if known is None and ids["slot"] is not None:
            known, = ids["slot"]
        return known

    def free_request_slots(self, req, kept: Optional[int], ids: dict, freed_slots: list[int]) -> None:
        """Free the request's working slot and its ping-pong tracking slots, all but ``kept``
        (the one that became a snapshot): those known on the host (``ids``: what
        ``read_finish_ids`` read) go to ``freed_slots``."""
        kv = req_slots(req)
        if kv.mamba_pool_idx is None:
            return
        buf = kv.mamba_ping_pong_track_buffer
        working = self.working_slot_id(req, ids)
        if working is None:
            self.pages.pool.mamba_allocator.free(kv.mamba_pool_idx.view(1))
        elif working != kept:
            freed_slots.append(working)
        kv.mamba_pool_idx = None
        if buf is not None:
            freed_slots.extend(slot for slot in self._finish_tracking(req, ids) if slot >= 0 and slot != kept)
            kv.mamba_ping_pong_track_buffer = None
            kv.mamba_next_track_idx = None
