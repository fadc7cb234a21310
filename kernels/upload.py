"""Host integers to the GPU without synchronizing the stream.

``torch.tensor(values, device="cuda")`` copies from pageable memory with ``non_blocking=False``,
which synchronizes the current stream. In SGLang's scheduler that stream waits for the forward
pass in flight after every launch (its write-after-read barrier), so such a copy stalls the
scheduler until the pass ends. A copy from pinned memory is queued instead. Small uploads are
staged in one pinned ring (``PinnedRing``): ``pin_memory()`` per upload costs the scheduler
thread tens of microseconds, thousands of times per replay (benchmarks/WHY.md).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch


class PinnedRing:
    """Pinned staging memory handed out in order and reused a lap later. A copy's region may
    be overwritten only after the copy ran: the last copy on each stream records an event, and
    going round the ring again waits for those (a lap ago: long done)."""

    ALIGN = 64

    def __init__(self, nbytes: int):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.pos = 0
        self.last_copy: dict[torch.cuda.Stream, torch.cuda.Event] = {}
        self.laps = 0

    def upload(self, host: torch.Tensor, device) -> Optional[torch.Tensor]:
        """``host`` (contiguous, CPU) copied to ``device`` through the ring; None when it is
        too large for it (the caller pins it on its own)."""
        nbytes = host.numel() * host.element_size()
        size = -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        if size > len(self.buffer) // 4:
            return None
        if self.pos + size > len(self.buffer):
            for event in self.last_copy.values():
                event.synchronize()
            self.last_copy.clear()
            self.pos, self.laps = 0, self.laps + 1
        staged = self.buffer[self.pos:self.pos + nbytes].view(host.dtype).view(host.shape)
        self.pos += size
        staged.copy_(host)
        out = staged.to(device, non_blocking=True)
        stream = torch.cuda.current_stream(out.device)
        event = torch.cuda.Event()
        event.record(stream)
        self.last_copy[stream] = event
        return out


_ring: Optional[PinnedRing] = None
RING_BYTES = 8 << 20


def upload(host: torch.Tensor, device) -> torch.Tensor:
    """A CPU tensor on the GPU ``device``, queued on the current stream (never waited for)."""
    global _ring
    if _ring is None:
        _ring = PinnedRing(RING_BYTES)
    out = None if torch.cuda.is_current_stream_capturing() else _ring.upload(host.contiguous(), device)
    return out if out is not None else host.pin_memory().to(device, non_blocking=True)


def to_device(values, device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` (a sequence of ints or an array) as a ``dtype`` tensor on ``device``."""
    host = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return upload(host, device)
    return host.to(device)


def page_slots(pages, page_size: int, device) -> torch.Tensor:
    """The token slots of whole ``pages`` (host ints), in order, on ``device`` (int64).
    Computed on the host and uploaded once: each torch op on the scheduler thread costs tens of
    microseconds on a GPU host, the upload of 64x more ints almost nothing."""
    if len(pages) == 0:
        return torch.empty((0,), dtype=torch.int64, device=device)
    slots = np.asarray(pages, dtype=np.int64)
    if page_size > 1:
        slots = (slots[:, None] * page_size + np.arange(page_size, dtype=np.int64)).reshape(-1)
    return to_device(slots, device)
