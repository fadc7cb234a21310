"""Device ids (KV pages, mamba slots) read back to the host for the index, waiting as little as
the data allows.

A plain read synchronizes the current stream, and in SGLang's overlap scheduler that stream
waits for the forward pass in flight after every launch (``Scheduler._apply_war_barrier``): a
read can hold the scheduler until the pass ends. Ids that were written before the last batch
was built are final once an event recorded when it was built has completed (in
``ForwardBatch.init_new`` the forward stream has already waited for everything the scheduler
queued), and that happens long before the pass in flight ends. ``read_settled`` reads such ids
on a side stream that waits for that event only (``--cache-settled-reads``, on by default);
with ``HPC_CACHE_FULL_CHECK`` every settled read is compared with a plain one.
"""
from __future__ import annotations

import math
import time

import torch

from hpc_radix.kernels.upload import page_slots


class IdReader:
    """The one place the binding reads device ids back; every read is timed (the report's
    ``device_read_ms``; "device reads" and "settled reads" in the flush breakdown)."""

    def __init__(self, device, timer, settled: bool, check: bool):
        self.settled = settled            # the epoch rules apply on any device (tests: CPU)
        self.check = check
        self.epoch = 0                    # batches built so far
        self._timer = timer
        self._event = None
        cuda = self._cuda = torch.device(device).type == "cuda"
        self._stream = torch.cuda.Stream(device) if settled and cuda else None
        self._stage = HostStage(pinned=cuda)
        self.riders: list["SpareIds"] = []   # their settled ids join every read: one wait, not two

    def batch_built(self) -> None:
        """A forward batch was built and is about to launch (the ForwardBatch hook)."""
        self.epoch += 1
        if self._stream is not None and not torch.cuda.is_current_stream_capturing():
            event = torch.cuda.Event()
            event.record()
            self._event = event

    @property
    def build_event(self):
        """The event recorded when the last batch was built (None before the first, and
        without CUDA): once it has completed, no pass launched before that build runs."""
        return self._event

    def read(self, ids: torch.Tensor) -> list[int]:
        """A plain read: waits for everything queued on the current stream."""
        return self._plain(ids)

    def read_settled(self, ids) -> list[int]:
        """``ids`` (a tensor, or a list of tensors read as one) that were written before the
        last batch build (the caller knows). A list is joined on the reading stream, after
        the build's event: joined on the current stream, the read would not wait for it."""
        if not self.settled or self._event is None:
            return self._plain(ids)
        t0 = time.perf_counter()
        parts, riders = self._with_riders(ids)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._event)
            values = self._stage.read(parts, self._stream)
        self._timer.add("settled reads", time.perf_counter() - t0, waited=True)
        if self.check:
            plain = _flat(parts).tolist()
            if values != plain:
                raise RuntimeError(f"hybrid radix cache: settled read {values} but the ids are "
                                   f"{plain}: they were written after the last batch build")
        return self._hand_out(values, riders)

    def _with_riders(self, ids) -> tuple[list, list]:
        """The tensors of a read of ``ids`` followed by the riders' ids taken before the last
        build (final then, whichever way the read waits), and (rider, count) for each."""
        parts = list(ids) if isinstance(ids, (list, tuple)) else [ids]
        riders = []
        for spares in self.riders:
            taken = spares.take_settled()
            if taken:
                parts.extend(taken)
                riders.append((spares, sum(t.numel() for t in taken)))
        return parts, riders

    @staticmethod
    def _hand_out(values: list[int], riders: list) -> list[int]:
        """The riders' share of ``values`` to them; the caller's share back."""
        end = len(values) - sum(count for _, count in riders)
        at = end
        for spares, count in riders:
            spares.learned(values[at:at + count])
            at += count
        return values[:end]

    def read_settled_parts(self, parts: dict) -> dict:
        """``read_settled`` of several tensors (None: skipped) in one read; {name: ids or None}."""
        given = {k: t for k, t in parts.items() if t is not None}
        out = dict.fromkeys(parts)
        if not given:
            return out
        values, at = self.read_settled(list(given.values())), 0
        for k, t in given.items():
            out[k], at = values[at:at + t.numel()], at + t.numel()
        return out

    def _plain(self, ids) -> list[int]:
        t0 = time.perf_counter()
        parts, riders = self._with_riders(ids)
        if riders and self._event is not None:
            # the riders are final once the build's event is: on a stream of its own, the
            # allocator's tensors they came from may not be ordered before this one
            torch.cuda.current_stream().wait_event(self._event)
        try:
            values = self._stage.read(parts, torch.cuda.current_stream() if self._cuda else None)
        finally:
            self._timer.add("device reads", time.perf_counter() - t0, waited=True)
        return self._hand_out(values, riders)


class SpareIds:
    """Ids (mamba slots, or KV pages of ``unit`` token slots) taken from one of SGLang's
    allocators before they are needed, so that the cache knows one on the host the moment it
    needs it. Taken ids are read once a batch was built after they were taken
    (``IdReader.read_settled``), or at once at startup and where reads are plain. Held ids
    count as evictable; the cache's eviction decides when they go back (``release``)."""

    def __init__(self, reader: IdReader, allocator, device, unit: int = 1):
        self.reader, self.allocator, self.device, self.unit = reader, allocator, device, unit
        self.known: list[int] = []
        self.pending: list[tuple[int, torch.Tensor]] = []   # (epoch taken, allocator's units)
        self._fresh_ids: set[int] = set()   # ids read plainly in _fresh_epoch (taken in it)
        self._fresh_epoch = -1
        self.demand_high_water = 0.0      # ids asked for between two batch builds, decaying
        self._demand_epoch, self._demand = -1, 0
        reader.riders.append(self)

    DEMAND_DECAY = 0.99                   # per batch build: forgets a burst in ~100 batches

    def note_demand(self, count: int) -> None:
        """``count`` ids are needed now (taken from the spares or not): refills aim at the
        most needed between two batch builds, since ids taken after one serve after the next."""
        epoch = self.reader.epoch
        if epoch != self._demand_epoch:
            gone = epoch - self._demand_epoch if self._demand_epoch >= 0 else 0
            self.demand_high_water *= self.DEMAND_DECAY ** min(gone, 1000)
            self._demand_epoch, self._demand = epoch, 0
        self._demand += count
        self.demand_high_water = max(self.demand_high_water, float(self._demand))

    def target(self, floor: int, cap: int, per_batch: int = 1) -> int:
        """Ids to hold: ``per_batch`` times the most asked for between two builds lately,
        within ``cap``, at least ``floor``."""
        return max(floor, min(cap, per_batch * math.ceil(self.demand_high_water)))

    @property
    def held(self) -> int:
        """Ids held, known or not yet."""
        return len(self.known) + sum(len(t) // self.unit for _, t in self.pending)

    def refill(self, target: int, at_startup: bool = False, floor: int = 0) -> None:
        """Hold ``target`` ids once fewer than half of them (or fewer than ``floor``) are held,
        taking at most half of what the allocator has free beyond the first ``floor``."""
        self.settle()
        held = self.held
        if held >= floor and 2 * held > target:
            return                  # top up in few large takes: each take costs a read
        free = self.allocator.available_size() // self.unit
        want = min(target - held, max(free // 2, min(floor - held, free)))
        if want <= 0:
            return
        got = self.allocator.alloc(want * self.unit)
        if got is None:
            return
        if self.reader.settled and not at_startup:
            self.pending.append((self.reader.epoch, got))
        else:
            self._learn(got, self.reader.read)

    def settle(self, need: int = 0) -> None:
        """Read the ids taken before the last batch build; then, while fewer than ``need``
        are known, newer ones with a plain read (a wait beats going without)."""
        firsts = self.take_settled()
        if firsts:                  # one read for all of them
            self.learned(self.reader.read_settled(firsts))
        while self.pending and len(self.known) < need:
            self._learn(self.pending.pop(0)[1], self.reader.read)

    def taken_before_last_build(self, spare: int) -> bool:
        """Whether ``spare`` (a known id) was taken before the last batch build: no pass
        launched since uses it, so once that build's event has completed nothing else does.
        Ids read plainly were taken since (``_learn``) until the next build."""
        return self._fresh_epoch < self.reader.epoch or spare not in self._fresh_ids

    def take_settled(self) -> list:
        """The first slots of the allocator's units taken before the last batch build, out of
        ``pending``: final, read settled (or along with any other read, ``IdReader.riders``)."""
        settled = 0
        while settled < len(self.pending) and self.pending[settled][0] < self.reader.epoch:
            settled += 1
        firsts = self._firsts([got for _, got in self.pending[:settled]])
        del self.pending[:settled]
        return firsts

    def learned(self, firsts: list[int]) -> None:
        """The first slots of units read back: known ids now."""
        self.known.extend(v // self.unit for v in firsts)

    def take(self):
        """A known id, or None."""
        return self.known.pop() if self.known else None

    def release(self, count: int) -> int:
        """Give up to ``count`` ids back to the allocator (eviction); returns how many."""
        n = min(count, len(self.known))
        if n:
            freed, self.known = self.known[-n:], self.known[:-n]
            free_units(self.allocator, page_slots(freed, self.unit, self.device), self.unit)
        while n < count and self.pending:            # ids not read yet: free their tensor
            epoch, got = self.pending.pop()
            k = min(count - n, len(got) // self.unit)
            cut = len(got) - k * self.unit
            free_units(self.allocator, got[cut:], self.unit)
            if cut:
                self.pending.append((epoch, got[:cut]))
            n += k
        return n

    def clear(self) -> None:
        """Forget every id (SGLang clears the pools they came from)."""
        self.known, self.pending, self._fresh_ids = [], [], set()

    def _learn(self, got, read) -> None:
        """Read the ids of the allocator's units ``got`` (a tensor or a list of them: their
        first slots) into ``known``: taken since the last build (pending ones older than it were
        read settled, ``take_settled``)."""
        before = len(self.known)
        self.learned(read(self._firsts(got if isinstance(got, list) else [got])))
        if self._fresh_epoch != self.reader.epoch:
            self._fresh_ids, self._fresh_epoch = set(), self.reader.epoch
        self._fresh_ids.update(self.known[before:])

    def _firsts(self, units: list) -> list:
        """Each tensor of allocator units as the units' first slots (what reads read)."""
        return [t[::self.unit] for t in units]


class HostStage:
    """Host memory that reads land in by DMA: each tensor read is copied as the contiguous span
    it lies in (page ids are every 64th slot of a row) by the copy engine, and picked out on the
    host. A gather or join kernel instead waits for SMs, which a long prefill pass holds
    (benchmarks/WHY.md)."""

    ALIGN = 64

    def __init__(self, pinned: bool, nbytes: int = 1 << 18):
        self.pinned = pinned
        self.buffer = self._new(nbytes)

    def _new(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def read(self, parts: list, stream) -> list[int]:
        """The values of ``parts`` (device tensors), in order, after queuing their copies on
        ``stream`` (None: no CUDA) and waiting for it."""
        spans = [_span(t) for t in parts]
        sizes = [-(-src.numel() * src.element_size() // self.ALIGN) * self.ALIGN for src, _ in spans]
        if sum(sizes) > len(self.buffer):
            self.buffer = self._new(max(sum(sizes), 2 * len(self.buffer)))
        staged, at = [], 0
        for (src, step), size in zip(spans, sizes):
            dst = self.buffer[at:at + src.numel() * src.element_size()].view(src.dtype)
            dst.copy_(src, non_blocking=self.pinned)
            staged.append(dst[::step])
            at += size
        if self.pinned:
            stream.synchronize()
        return [v for t in staged for v in t.tolist()]


def _span(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(a contiguous tensor covering ``t``'s elements, the step that picks them out of it)."""
    t = t.reshape(-1)
    if t.numel() <= 1 or t.stride(0) == 1:
        return t.contiguous(), 1
    step = t.stride(0)
    if step < 1:
        return t.contiguous(), 1      # (a kernel: not the layout of any id read)
    return t.as_strided(((t.numel() - 1) * step + 1,), (1,)), step


def _flat(ids) -> torch.Tensor:
    """A tensor, or a list of tensors joined (int64), as one flat tensor."""
    if not isinstance(ids, (list, tuple)):
        return ids.reshape(-1)
    if len(ids) == 1:
        return ids[0].reshape(-1)
    return torch.cat([t.reshape(-1).to(torch.int64) for t in ids])


def free_units(allocator, units: torch.Tensor, unit: int) -> None:
    """Give units (slots, or the token slots of whole pages of ``unit`` tokens, in page
    order) back to SGLang's allocator. Pages go through ``free_segment``, not ``free``: its
    ``torch.unique`` would synchronize the stream."""
    if unit == 1:
        allocator.free(units)
    else:
        allocator.free_segment(units, start_pos=0)
