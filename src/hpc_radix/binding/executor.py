"""The one place the index's actions are carried out (index/actions.py; ARCHITECTURE: the index
decides, the binding moves bytes). Every index call that changes what lives where returns its
actions; the caller hands them here, and they run in order: device pages and slots the index let
go are held for SGLang's allocators, a duplicate block's page is swapped for the tree's, writes
and restores go to the host tier, whose landing the index hears of, and the host memory is
pinned when the index wants it."""
from __future__ import annotations

import functools
import logging
from typing import Callable, Optional, Sequence

from hpc_radix.index import (
    Action, FreeDevice, PinHost, PrefixIndex, Restore, ShareBlocks, WriteBlocks, WriteImage,
)

from .device.pool import DevicePool

logger = logging.getLogger(__name__)


class Executor:
    def __init__(self, index: PrefixIndex, pool: DevicePool, host=None,
                 image_on_host: Optional[Callable] = None):
        """``host``: the host tier's transfers (host/transfers.py HostTier), None without one;
        ``image_on_host``: told of each snapshot whose image landed there (the shared tier)."""
        self.index = index
        self.pool = pool
        self.host = host
        self.image_on_host = image_on_host

    def __call__(self, actions: Sequence[Action], *, row=None, restore_after=None,
                 for_pass: bool = False):
        """Run ``actions`` in order. ``row``: the committing request's token row (for
        ShareBlocks); ``restore_after`` and ``for_pass``: when a Restore's copy starts and
        whether the pass built next waits for it (HostTier.restore). Returns the Restore's
        transfer, if one ran."""
        transfer = None
        for action in actions:
            match action:
                case FreeDevice():
                    self.pool.take(action)
                case ShareBlocks():
                    self.pool.share_blocks(row, action)
                case WriteBlocks() | WriteImage():
                    self.host.write(action, self._landed(action))
                case Restore():
                    transfer = self.host.restore(action, self._landed(action),
                                                 after_event=restore_after, for_pass=for_pass)
                case PinHost():
                    self._pin_host()
                case _:
                    raise TypeError(f"{action!r} is not an index action")
        return transfer

    def _landed(self, action: Action):
        if isinstance(action, WriteImage) and self.image_on_host is not None:
            return functools.partial(self._image_landed, action)
        return functools.partial(self.index.landed, action)

    def _image_landed(self, action: WriteImage) -> None:
        self.index.landed(action)
        self.image_on_host(action.snapshot)

    def _pin_host(self) -> None:
        memory = self.host.memory
        if not memory.started:            # --host-cache-pin on-demand
            memory.start()
            logger.info("hybrid radix cache: the device cache is half as full as "
                        "--host-write-threshold asks: pinning the host tier's %d MiB in the "
                        "background", memory.slabs.num_slabs * memory.slabs.slab_bytes >> 20)

