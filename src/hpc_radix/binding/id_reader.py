"""Device ids (KV pages, mamba slots) read back to the host for the index, waiting as little as
the data allows.

A plain read synchronizes the current stream, and in SGLang's overlap scheduler that stream
waits for the forward pass in flight after every launch (``Scheduler._apply_war_barrier``): a
read can hold the scheduler until the pass ends. Ids that were written before the last batch
was built are final once an event recorded when it was built has completed (in
``ForwardBatch.init_new`` the forward stream has already waited for everything the scheduler
queued), and that happens long before the pass in flight ends. ``read_settled`` reads such ids
on a side stream that waits for that event only. It is opt-in (``HPC_SETTLED_READS=1``) until
measured on a GPU; with ``HPC_CACHE_FULL_CHECK`` every settled read is compared with a plain one.
"""
from __future__ import annotations

import time

import torch

SETTLED_READS_ENV = "HPC_SETTLED_READS"


class IdReader:
    def __init__(self, device, timer, settled: bool, check: bool):
        self.settled = settled            # the epoch rules apply on any device (tests: CPU)
        self.check = check
        self.epoch = 0                    # batches built so far
        self._timer = timer
        self._event = None
        cuda = torch.device(device).type == "cuda"
        self._stream = torch.cuda.Stream(device) if settled and cuda else None

    def batch_built(self) -> None:
        """A forward batch was built and is about to launch (the ForwardBatch hook)."""
        self.epoch += 1
        if self._stream is not None and not torch.cuda.is_current_stream_capturing():
            event = torch.cuda.Event()
            event.record()
            self._event = event

    def read(self, ids: torch.Tensor) -> list[int]:
        """A plain read: waits for everything queued on the current stream."""
        return self._plain(ids)

    def read_settled(self, ids: torch.Tensor) -> list[int]:
        """``ids`` that were written before the last batch build (the caller knows)."""
        if not self.settled or self._event is None:
            return self._plain(ids)
        t0 = time.perf_counter()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._event)
            out = ids.reshape(-1).tolist()
        self._timer.add("settled reads", time.perf_counter() - t0, waited=True)
        if self.check:
            plain = ids.reshape(-1).tolist()
            if out != plain:
                raise RuntimeError(f"hybrid radix cache: settled read {out} but the ids are "
                                   f"{plain}: they were written after the last batch build")
        return out

    def _plain(self, ids: torch.Tensor) -> list[int]:
        t0 = time.perf_counter()
        try:
            return ids.reshape(-1).tolist()
        finally:
            self._timer.add("device reads", time.perf_counter() - t0, waited=True)
