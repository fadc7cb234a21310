"""The host tier's transfers (design §6.4, §6.5, §7.6, §9.3, §11.1): the index decides which
nodes and snapshots go where; this moves their bytes and reports when they landed.

- Write-through (device -> host) runs on a write stream that first waits for the forward
  stream (the bytes were written by forward passes). A node or snapshot stays pinned as Filling
  until ``poll`` sees its copy land, so nothing frees a page a copy still reads. Writes queue
  until ``flush_writes`` (the cache calls it outside the result processing that releases
  requests): the requests a batch finishes are written in one launch, not one each (each
  launch costs the scheduler thread; benchmarks/WHY.md).
- Restores (host -> device) run on a restore stream in the order a forward pass reads them,
  layer by layer. With ``--host-restore-wait layer`` (``restore_wait_path``) a restore is a few
  copies of consecutive layers, each followed by an event, and the pass built next waits at
  each layer for the part holding that layer's bytes only (``LayerWaits``, registered on SGLang's KV and mamba pools as HiCache registers
  its ``LayerDoneCounter``), so the restore overlaps the pass it feeds (design §6.5); else one
  copy, and the forward stream waits for all of it before the pass.
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

from hpc_radix.index import Restore, WriteBlocks, WriteImage
from hpc_radix.kernels.host_copy import copy_engine_path, copy_runs, copy_runs_dma

from .. import warm_up
from .layout import TierLayout, by_layer, in_layer_order, layer_parts
from .memory import HostMemory

logger = logging.getLogger(__name__)

# A restore the pass waits for by layer is copied in at most this many parts of consecutive
# layers, about equal in bytes, each a driver call and an event on the scheduler thread (a part
# per layer cost too much of it: benchmarks/WHY.md): the pass's first layers wait for the
# first part only.
RESTORE_PARTS = 4


@dataclass
class Transfer:
    """One launch of copies in flight: ``landed`` runs once its event has completed."""
    event: Optional[torch.cuda.Event] = None               # None: done inline (no CUDA)
    landed: Optional[Callable[[], None]] = None
    host_slabs: Sequence[int] = ()                         # written on host (write-through)
    to_host: bool = False
    seq: int = 0                                           # launch order in its direction

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


def restore_wait_path(option: str, copy_engine: bool, cuda: bool, model_runner,
                      pools: Sequence) -> tuple[bool, str]:
    """Whether the pass waits for a host restore layer by layer (else whole, before it), and
    why (startup log). ``--host-restore-wait layer`` where it cannot run is refused."""
    layered, why = _layer_wait_blocker(option, copy_engine, cuda, model_runner, pools)
    if option == "layer" and not layered:
        raise ValueError(f"--host-restore-wait=layer: {why}")
    return layered, why


def _layer_wait_blocker(option, copy_engine, cuda, model_runner, pools) -> tuple[bool, str]:
    if option == "pass":
        return False, "--host-restore-wait pass, the default"
    if not cuda:
        return False, "no CUDA device"
    from hpc_radix.patches import gdn_taps
    from hpc_radix.patches.scheduler_hooks import unapplied

    # the pass learns which restores it waits for when its batch is built
    if unapplied([gdn_taps.INIT_NEW_TARGET]):
        return False, "the ForwardBatch.init_new hook did not apply"
    if getattr(model_runner, "forward_stream", None) is None:
        return False, "no forward stream"
    # a captured pass skips the waits, which run in Python at each layer
    if getattr(getattr(model_runner, "prefill_cuda_graph_runner", None), "_is_full_backend", False):
        return False, "a full prefill CUDA graph runs the layers"
    for pool in pools:
        if not hasattr(pool, "register_layer_transfer_counter"):
            return False, f"{type(pool).__name__} takes no layer transfer counter"
        if getattr(pool, "layer_transfer_counter", None) is not None:
            return False, f"{type(pool).__name__} has a layer transfer counter already"
    return True, (f"copied in up to {RESTORE_PARTS} parts of consecutive layers, a "
                  f"{'batched copy' if copy_engine else 'kernel launch'} and an event each")


class LayerWaits:
    """SGLang's layer transfer counter (``wait_until(layer)``, called by its KV and mamba
    pools as a layer reads them) over the host tier's restores: the pass built next waits at
    each layer for the restores launched before its build, that layer's bytes only."""

    def __init__(self, forward_stream, stats: dict):
        self.forward_stream = forward_stream
        self.stats = stats                                  # the host tier's counters
        self._launched: dict[int, torch.cuda.Event] = {}   # model layer -> its last restore copy
        self._launched_last = None
        self._waits: dict[int, torch.cuda.Event] = {}      # what the pass being launched waits on
        self._waits_last = None

    def restored(self, layer: int, event) -> None:
        """A restore's copy of ``layer`` ends at ``event`` (the restore stream runs in order:
        it covers every earlier restore's copies too)."""
        self._launched[layer] = self._launched_last = event

    def batch_built(self, layered: bool) -> None:
        """A batch was built and its pass is about to launch; ``layered``: it reads each
        layer's KV and state through the pools (an extend), so it waits layer by layer.
        Otherwise it waits for every restore before it starts."""
        if self._waits_last is not None:
            # later passes stay behind the restores the last pass waited for, whatever it read
            self.forward_stream.wait_event(self._waits_last)
        self._waits, self._waits_last = {}, None
        if self._launched_last is None:
            return
        if layered:
            self._waits, self._waits_last = self._launched, self._launched_last
            self.stats["passes_waiting_by_layer"] += 1
        else:
            self.forward_stream.wait_event(self._launched_last)
        self._launched, self._launched_last = {}, None

    def wait_until(self, layer: int) -> None:
        event = self._waits.get(layer)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
            self.stats["restore_layer_waits"] += 1


class HostTier:
    def __init__(self, layout: TierLayout, memory: HostMemory, forward_stream=None,
                 copy_engine: bool = False, by_layer: bool = False, ranks_agree: bool = False):
        """``by_layer``: the pass waits for a restore layer by layer (``layer_waits``);
        ``ranks_agree``: TP ranks act on the transfers every rank has seen (``agreed``)."""
        self.layout = layout
        self.memory = memory
        self.forward_stream = forward_stream
        cuda = torch.cuda.is_available() and layout.kv_planes[0][1].is_cuda
        self.copy_engine = copy_engine and cuda
        self.write_stream = torch.cuda.Stream() if cuda else None
        self.restore_stream = torch.cuda.Stream() if cuda else None
        self.in_flight: list[Transfer] = []
        self.launched = [0, 0]                 # writes, restores queued so far (the next seq)
        # what every TP rank has seen (ranks.RankAgreement): chunks pinned, writes landed,
        # restores landed (nothing yet); None: one rank, whatever has happened here counts
        self.agreed: Optional[list[int]] = [0, 0, 0] if ranks_agree else None
        self.queued: list[Transfer] = []       # writes not launched yet (no event)
        self._queued_runs: list[np.ndarray] = []   # their run tables, for one launch
        self.stats = {"blocks_written": 0, "images_written": 0, "blocks_restored": 0,
                      "images_restored": 0, "bytes_to_host": 0, "bytes_to_device": 0,
                      "passes_waiting_by_layer": 0, "restore_layer_waits": 0}
        self.timing = _TransferTiming() if cuda else None
        # restores waited for by layer: registered on SGLang's pools as HiCache registers its
        # LayerDoneCounter
        self.layer_waits = LayerWaits(forward_stream, self.stats) if by_layer else None
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
    def write(self, write: WriteBlocks | WriteImage, landed: Callable[[], None]) -> None:
        """Queue a write-through's copy for the next launch (``flush_writes``); ``landed``
        runs once it has."""
        if isinstance(write, WriteBlocks):
            self.stats["blocks_written"] += len(write.nodes)
            runs = [self.layout.block_runs(self.memory, write.pages, write.slabs, to_host=True)]
        else:
            s = write.snapshot
            runs = [self.layout.image_runs(self.memory, s.device_slot, write.image_slabs, to_host=True)]
            if write.tail_slab >= 0:
                runs.append(self.layout.block_runs(self.memory, [s.tail_page], [write.tail_slab], to_host=True))
            self.stats["images_written"] += 1
        self.queued.append(Transfer(None, landed, write.slabs, to_host=True,
                                    seq=self._next_seq(to_host=True)))
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
    def restore(self, restore: Restore, landed: Callable[[], None],
                after_event: Optional[torch.cuda.Event] = None, for_pass: bool = False) -> Transfer:
        """Copy the restore's host blocks into the device pages they adopted, its snapshot's
        image into its ``image_slot`` and its tail into its ``tail_page`` (each when given), on
        the restore stream; ``landed`` runs once it has. The copy starts after ``after_event``
        when given, else after the work queued on the forward stream. ``for_pass``: the pass
        built next reads it, and waits for it, layer by layer with ``layer_waits`` (a copy per
        part of consecutive layers, ``RESTORE_PARTS``), else whole (one copy)."""
        snapshot = restore.snapshot
        runs = [self.layout.block_runs(self.memory, restore.pages, restore.slabs, to_host=False)]
        if restore.image_slot is not None:
            runs.append(self.layout.image_runs(self.memory, restore.image_slot, snapshot.host_slabs, to_host=False))
            self.stats["images_restored"] += 1
        if restore.tail_page >= 0:
            runs.append(self.layout.block_runs(self.memory, [restore.tail_page], [snapshot.tail_slab], to_host=False))
        self.stats["blocks_restored"] += len(restore.blocks)
        layers = self.layer_waits if for_pass else None
        transfer = Transfer(self._submit(self.restore_stream, runs, "bytes_to_device", after_event, layers),
                            landed, seq=self._next_seq(to_host=False))
        self.in_flight.append(transfer)
        if for_pass and layers is None:
            self.wait_on(transfer, self.forward_stream)
        return transfer

    def wait_on(self, transfer: Transfer, stream) -> None:
        """``stream`` (the forward stream) waits until the transfer has landed."""
        if stream is not None and transfer.event is not None:
            stream.wait_event(transfer.event)

    # ---- bookkeeping ----------------------------------------------------------------------------
    def _next_seq(self, to_host: bool) -> int:
        direction = 0 if to_host else 1
        self.launched[direction] += 1
        return self.launched[direction] - 1

    def local_counts(self) -> list[int]:
        """What this rank has seen: chunks pinned, and in each direction how many transfers
        have landed (each stream runs its copies in order: the landed ones are a prefix)."""
        first_pending = list(self.launched)
        if self.queued:                 # not launched yet
            first_pending[0] = self.queued[0].seq
        for t in self.in_flight:
            direction = 0 if t.to_host else 1
            if t.seq < first_pending[direction] and not t.done():
                first_pending[direction] = t.seq
        return [self.memory.ready_chunks, *first_pending]

    def bring_chunks_online(self) -> int:
        """The chunks pinned since the last call (every rank's, under TP) join the pool;
        returns how many."""
        return self.memory.poll(self.agreed[0] if self.agreed is not None else None)

    def _landed(self, t: Transfer, done: dict) -> bool:
        """Whether ``t`` has landed: on every rank under TP (``agreed``), else here (``done``:
        id(event) -> landed; a flush's writes share one event, queried once)."""
        if self.agreed is not None:
            return t.seq < self.agreed[1 if t.to_host else 2]
        key = id(t.event)
        if key not in done:
            done[key] = t.done()
        return done[key]

    def _submit(self, stream, runs: list[np.ndarray], counter: str, after_event=None,
                layers: Optional[LayerWaits] = None) -> Optional[torch.cuda.Event]:
        """Copy the run tables ``runs`` on ``stream``, layer by layer, behind the forward stream
        (or ``after_event``): in one launch, or with ``layers`` in parts of consecutive layers
        (``RESTORE_PARTS``), each part's layers noted there with its event. Returns the event
        recorded after all (None without CUDA: done inline)."""
        # a write, or a restore waited for whole, needs no layer bounds (writes are thousands
        # of runs, on the scheduler thread)
        layered = layers is not None and stream is not None
        ordered, layer_ends = by_layer(*runs) if layered else (in_layer_order(*runs), None)
        nbytes = int(ordered[:, 4].sum())
        queued = _record(stream, timing=True) if self.timing is not None else None
        with _on(stream, self.forward_stream, after_event):
            started = _record(stream, timing=True) if self.timing is not None else None
            places = self.layout.places(self.memory)
            if not layered:
                self._copy(places, ordered)
            else:
                parts = layer_parts(ordered, layer_ends, RESTORE_PARTS)

                def landed(part: int) -> None:
                    event = _record(stream)
                    for layer in parts[part][0]:
                        layers.restored(layer, event)
                self._copy(places, ordered, [end for _, end in parts], landed)
            event = _record(stream, timing=self.timing is not None)
        if self.timing is not None:
            self.timing.launched(counter, nbytes, queued, started, event)
        self.stats[counter] += nbytes
        return event

    def _copy(self, places, runs: np.ndarray, ends: Sequence[int] = (),
              after_part: Optional[Callable[[int], None]] = None) -> None:
        """Copy ``runs``: in one launch, or in parts ending before rows ``ends``, each followed
        by ``after_part(part)``. Should the copy engines refuse a part, the kernel copies it
        and the rest."""
        ends = list(ends) or [len(runs)]
        done = 0
        if self.copy_engine:
            try:
                copy_runs_dma(places, runs, validate=False, ends=ends, after_part=after_part)
                return
            except RuntimeError as err:
                done = getattr(err, "parts_done", 0)
                self._give_up_copy_engines(err)
        for part in range(done, len(ends)):
            copy_runs(places, runs[ends[part - 1] if part else 0:ends[part]], validate=False)
            if after_part is not None:
                after_part(part)

    def _give_up_copy_engines(self, err: Exception) -> None:
        """The driver refused a batched copy (an error that leaves the context usable): the
        Triton kernel moves the host tier's bytes from now on."""
        logger.warning("hybrid radix cache: the copy engines refused a host copy (%s); the "
                       "Triton copy kernel moves the host tier's bytes from now on", err)
        self.copy_engine = False

    def poll(self, flush: bool = True) -> int:
        """Launch the queued writes (unless not ``flush``), bring pinned chunks online and
        finish the transfers that landed (scheduler thread); under TP only those every rank
        has seen (``agreed``). Returns how many transfers are still in flight."""
        if flush:
            self.flush_writes()
        self.bring_chunks_online()
        if self.timing is not None:
            self.timing.poll()
        still, done = [], {}
        for t in self.in_flight:
            if self._landed(t, done):
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
        if self.agreed is not None:     # every rank waited here: every write has landed on each
            self.agreed[1] = self.launched[0]

    def drain(self) -> None:
        """Wait for every transfer, then finish them (shutdown, tests)."""
        self.flush_writes()
        for t in self.in_flight:
            if t.event is not None:
                t.event.synchronize()
        if self.agreed is not None:
            self.agreed[1:] = self.launched
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

