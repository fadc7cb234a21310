"""The host tier's transfers (spec §6.4, §6.5, §7.6, §9.3, §11.1): the index decides which
nodes and snapshots go where; this moves their bytes and reports when they landed.

- Write-through (device -> host) runs on a write stream that first waits for the forward
  stream (the bytes were written by forward passes). A node or snapshot stays pinned as Filling
  until ``poll`` sees its copy land, so nothing frees a page a copy still reads. Writes queue
  until ``flush_writes`` (the cache calls it outside the result processing that releases
  requests): the requests a batch finishes are written in one launch, not one each (each
  launch cost the scheduler thread ~0.3 ms on the H200).
- Restores (host -> device) run on a restore stream in the order a forward pass reads them,
  layer by layer, in one launch; the forward stream waits for its event (no per-layer wait).
  A restore waits for the forward pass in flight, unless every page and slot it writes was a
  spare taken before the last batch build (``--host-restore-overlap on``): then it waits only
  for that build's event and runs beside the pass in flight.
- The bytes move on the GPU's copy engines (``--host-copy``, ``copy_engine_path``) where the
  driver can batch them, else by the Triton copy kernel, which takes SMs from the pass.

Without CUDA the copies run at once and land at the next ``poll``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from hpc_radix.index.actions import Restore, WriteBlocks, WriteImage
from hpc_radix.kernels.host_copy import copy_engine_path, copy_runs, copy_runs_dma

from . import warm_up
from .host import HostMemory
from .transfers import TierLayout, in_layer_order

logger = logging.getLogger(__name__)


@dataclass
class Transfer:
    """One launch of copies in flight: ``landed`` runs once its event has completed."""
    event: Optional[torch.cuda.Event] = None               # None: done inline (no CUDA)
    landed: Optional[Callable[[], None]] = None
    host_slabs: Sequence[int] = ()                         # written on host (write-through)
    to_host: bool = False

    def done(self) -> bool:
        return self.event is None or self.event.query()


def choose_copy_path(option: str, cuda: bool) -> tuple[bool, str]:
    """Whether the host tier copies on the copy engines (else by the Triton kernel), and what
    it uses and why (startup log). ``--host-copy copy-engine`` where they cannot run is refused."""
    if option == "kernel":
        return False, "the Triton copy kernel (--host-copy kernel)"
    usable, what = copy_engine_path() if cuda else (False, "no CUDA device")
    if usable:
        return True, f"the copy engines ({what})"
    if option == "copy-engine":
        raise ValueError(f"--host-copy=copy-engine: {what}")
    return False, f"the Triton copy kernel ({what})"


class HostTier:
    def __init__(self, index, layout: TierLayout, memory: HostMemory, forward_stream=None,
                 copy_engine: bool = False):
        self.index = index
        self.layout = layout
        self.memory = memory
        self.forward_stream = forward_stream
        cuda = torch.cuda.is_available() and layout.kv_planes[0][1].is_cuda
        self.copy_engine = copy_engine and cuda
        self.write_stream = torch.cuda.Stream() if cuda else None
        self.restore_stream = torch.cuda.Stream() if cuda else None
        self.in_flight: list[Transfer] = []
        self.queued: list[Transfer] = []       # writes not launched yet (no event)
        self._queued_runs: list[np.ndarray] = []   # their run tables, for one launch
        self.stats = {"blocks_written": 0, "images_written": 0, "blocks_restored": 0,
                      "images_restored": 0, "bytes_to_host": 0, "bytes_to_device": 0}
        self.timing = _TransferTiming() if cuda else None
        if cuda:
            device = layout.kv_planes[0][1].device
            try:
                warm_up.host_copy(device, self.copy_engine)
            except RuntimeError as err:
                if not self.copy_engine:
                    raise
                self._give_up_copy_engines(err)
                warm_up.host_copy(device, False)

    # ---- device -> host ------------------------------------------------------------------------
    def write_blocks(self, nodes: Sequence) -> bool:
        """Queue a copy of the device-only blocks among ``nodes`` (a released request's path)
        to host; whether there were any."""
        write = self.index.plan_write_through(nodes)
        if write is None:
            return False
        self.stats["blocks_written"] += len(write.nodes)
        self._queue_write(write, [self.layout.block_runs(self.memory, write.pages, write.slabs, to_host=True)])
        return True

    def write_image(self, s) -> bool:
        """Queue a copy of a snapshot's image (and tail page) to host, unless GDSF keeps it
        device-only; whether it was queued."""
        write = self.index.plan_image_write(s)
        if write is None:
            return False
        runs = [self.layout.image_runs(self.memory, s.device_slot, write.image_slabs, to_host=True)]
        if write.tail_slab >= 0:
            runs.append(self.layout.block_runs(self.memory, [s.tail_page], [write.tail_slab], to_host=True))
        self.stats["images_written"] += 1
        self._queue_write(write, runs)
        return True

    def _queue_write(self, write: WriteBlocks | WriteImage, runs: list[np.ndarray]) -> None:
        self.queued.append(Transfer(None, lambda: self.index.landed(write), write.slabs, to_host=True))
        self._queued_runs.extend(runs)

    def flush_writes(self) -> None:
        """Launch every queued write in one copy; each lands (``poll``) once it has run."""
        if not self.queued:
            return
        queued, runs = self.queued, self._queued_runs
        self.queued, self._queued_runs = [], []
        event = self._submit(self.write_stream, runs, "bytes_to_host")
        for t in queued:
            t.event = event
        self.in_flight.extend(queued)

    # ---- host -> device ------------------------------------------------------------------------
    def restore(self, restore: Restore, image_slot: Optional[int] = None, tail_page: int = -1,
                after_event: Optional[torch.cuda.Event] = None) -> Transfer:
        """Copy the restore's host blocks into the device pages they adopted, its snapshot's
        image into mamba slot ``image_slot`` and its tail into page ``tail_page`` (each when
        given), in one launch on the restore stream; the index hears when it has landed. (One
        launch per layer, for a wait per layer inside the pass, cost the scheduler thread
        ~0.15 ms a layer in table building and launching, while the pass waited for the last
        layer anyway: the per-layer wait is not built.) The copy starts after ``after_event``
        when given, else after the work queued on the forward stream."""
        snapshot = restore.snapshot
        runs = [self.layout.block_runs(self.memory, restore.pages, restore.slabs, to_host=False)]
        if image_slot is not None:
            runs.append(self.layout.image_runs(self.memory, image_slot, snapshot.host_slabs, to_host=False))
            self.stats["images_restored"] += 1
        if tail_page >= 0:
            runs.append(self.layout.block_runs(self.memory, [tail_page], [snapshot.tail_slab], to_host=False))
        self.stats["blocks_restored"] += len(restore.blocks)
        transfer = Transfer(self._submit(self.restore_stream, runs, "bytes_to_device", after_event),
                            lambda: self.index.landed(restore))
        self.in_flight.append(transfer)
        return transfer

    def wait_on(self, transfer: Transfer, stream) -> None:
        """``stream`` (the forward stream) waits until the transfer has landed."""
        if stream is not None and transfer.event is not None:
            stream.wait_event(transfer.event)

    # ---- bookkeeping ----------------------------------------------------------------------------
    def _submit(self, stream, runs: list[np.ndarray], counter: str,
                after_event=None) -> Optional[torch.cuda.Event]:
        """Copy the run tables ``runs`` in one launch on ``stream``, layer by layer, behind the
        forward stream (or ``after_event``); the event recorded after it (None without CUDA:
        done inline)."""
        ordered = in_layer_order(*runs)
        nbytes = int(ordered[:, 4].sum())
        queued = _record(stream, timing=True) if self.timing is not None else None
        with _on(stream, self.forward_stream, after_event):
            started = _record(stream, timing=True) if self.timing is not None else None
            places = self.layout.places(self.memory)
            if self.copy_engine:
                try:
                    copy_runs_dma(places, ordered, validate=False)
                except RuntimeError as err:     # the kernel copies the launch again, whole
                    self._give_up_copy_engines(err)
            if not self.copy_engine:
                copy_runs(places, ordered, validate=False)
            event = _record(stream, timing=self.timing is not None)
        if self.timing is not None:
            self.timing.launched(counter, nbytes, queued, started, event)
        self.stats[counter] += nbytes
        return event

    def _give_up_copy_engines(self, err: Exception) -> None:
        """The driver refused a batched copy (an error that leaves the context usable): the
        Triton kernel moves the host tier's bytes from now on."""
        logger.warning("hybrid radix cache: the copy engines refused a host copy (%s); the "
                       "Triton copy kernel moves the host tier's bytes from now on", err)
        self.copy_engine = False

    def poll(self, flush: bool = True) -> int:
        """Launch the queued writes (unless not ``flush``), bring pinned chunks online and
        finish the transfers that landed (scheduler thread). Returns how many transfers are
        still in flight."""
        if flush:
            self.flush_writes()
        self.memory.poll()
        if self.timing is not None:
            self.timing.poll()
        still, done = [], {}         # id(event) -> landed: a flush's writes share one event
        for t in self.in_flight:
            key = id(t.event)
            if key not in done:
                done[key] = t.done()
            if done[key]:
                self.memory.written(t.host_slabs)
                if t.landed is not None:
                    t.landed()
            else:
                still.append(t)
        self.in_flight = still
        return len(still)

    def wait_writes(self) -> None:
        """Launch the queued writes and wait until every write in flight has run (restores
        go on): the caller then polls to release what they pinned."""
        self.flush_writes()
        for t in self.in_flight:
            if t.to_host and t.event is not None:
                t.event.synchronize()

    def drain(self) -> None:
        """Wait for every transfer, then finish them (shutdown, tests)."""
        self.flush_writes()
        for t in self.in_flight:
            if t.event is not None:
                t.event.synchronize()
        self.poll()


class _on:
    """Run on ``stream`` after ``event`` if given, else after the work queued on ``after``
    (the forward stream), or inline."""

    def __init__(self, stream, after, event=None):
        self.stream, self.after, self.event = stream, after, event

    def __enter__(self):
        if self.stream is None:
            return None
        if self.event is not None:
            self.stream.wait_event(self.event)
        else:
            self.stream.wait_stream(self.after if self.after is not None else torch.cuda.current_stream())
        self._ctx = torch.cuda.stream(self.stream)
        return self._ctx.__enter__()

    def __exit__(self, *exc):
        if self.stream is not None:
            return self._ctx.__exit__(*exc)
        return False


def _record(stream, timing: bool = False):
    if stream is None:
        return None
    event = torch.cuda.Event(enable_timing=timing)
    event.record(stream)
    return event


class _TransferTiming:
    """GPU time of the launches, from CUDA events: how long each waited behind the forward
    pass in flight, and how long its copy ran (the flush log's transfer line)."""

    def __init__(self):
        self.pending: list[tuple] = []
        self.totals: dict[str, list[float]] = {}    # counter -> [launches, bytes, behind ms, copy ms]

    def launched(self, counter: str, nbytes: int, queued, started, done) -> None:
        self.pending.append((counter, nbytes, queued, started, done))

    def poll(self) -> None:
        still = []
        for item in self.pending:
            counter, nbytes, queued, started, done = item
            if not done.query():
                still.append(item)
                continue
            t = self.totals.setdefault(counter, [0, 0, 0.0, 0.0])
            t[0] += 1
            t[1] += nbytes
            t[2] += queued.elapsed_time(started)
            t[3] += started.elapsed_time(done)
        self.pending = still

    def take_summary(self) -> str:
        """'restores: N launches, X MiB, behind the pass Y ms, copying Z ms (W GB/s); ...'"""
        self.poll()
        names = {"bytes_to_device": "restores", "bytes_to_host": "writes"}
        parts = [f"{names.get(k, k)}: {int(n)} launches, {b / 2**20:.0f} MiB, behind the pass "
                 f"{behind:.0f} ms, copying {copy:.0f} ms ({b / max(copy, 1e-3) / 1e6:.1f} GB/s)"
                 for k, (n, b, behind, copy) in self.totals.items()]
        self.totals = {}
        return "; ".join(parts)

