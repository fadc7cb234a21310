"""Host integers to the GPU without synchronizing the stream.

``torch.tensor(values, device="cuda")`` copies from pageable memory with ``non_blocking=False``,
which synchronizes the current stream. In SGLang's scheduler that stream waits for the forward
pass in flight after every launch (its write-after-read barrier), so such a copy stalls the
scheduler until the pass ends. A copy from pinned memory is queued instead; PyTorch's caching
host allocator keeps the pinned buffer until the copy has run.
"""
from __future__ import annotations

import numpy as np
import torch


def to_device(values, device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` (a sequence of ints or an array) as a ``dtype`` tensor on ``device``."""
    host = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
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
