"""What the index asks of the code that owns the bytes (ARCHITECTURE: the index decides, the
binding executes). The index hands out these frozen actions; the binding frees device pages and
slots, the host tier copies, and each copy reports back with ``PrefixIndex.landed(action)``.
Every id in them is opaque to the index: device page and slot ids belong to SGLang's allocators,
host slab ids to the pinned pool.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Optional

if TYPE_CHECKING:
    from .index import SequenceState
    from .snapshots import Snapshot
    from .tree import Node


class FreeDevice(NamedTuple):
    """Device pages and snapshot slots the index let go (evicted, deleted, or never
    committed): the binding returns them to SGLang's allocators. Every index call that lets
    any go returns them; between calls the index holds none."""
    pages: list[int]
    slots: list[int]

    @property
    def empty(self) -> bool:
        return not (self.pages or self.slots)


class SlotGrant(NamedTuple):
    """A device snapshot slot for a new snapshot (``PrefixIndex.acquire_slot``): ``slot`` is the
    id reclaimed from another snapshot, or None to take a fresh one from the pool; ``freed``
    is what reclaiming it let go (a device-only victim's tail page)."""
    slot: Optional[int]
    freed: FreeDevice


@dataclass(frozen=True)
class WriteBlocks:
    """Write-through (§7.6): copy each node's device page to its host slab. The nodes stay
    pinned as Filling until the copy has landed."""
    nodes: tuple[Node, ...]
    slabs: tuple[int, ...]            # one host slab per node, in order

    @property
    def pages(self) -> list[int]:
        return [n.device_page for n in self.nodes]


@dataclass(frozen=True)
class WriteImage:
    """Write-through of a snapshot (§7.6): its state image from its device slot into
    ``image_slabs``, its tail page (when it has a tail) into ``tail_slab``. The snapshot and
    its path stay pinned until the copy has landed."""
    snapshot: Snapshot
    image_slabs: tuple[int, ...]
    tail_slab: int = -1

    @property
    def slabs(self) -> tuple[int, ...]:
        return self.image_slabs + ((self.tail_slab,) if self.tail_slab >= 0 else ())


@dataclass(frozen=True)
class Restore:
    """A host hit's restore (§6.4, §6.5): each host-only block of the source's path into the
    device page it adopted (``node.device_page``), in path order. The snapshot's image and tail,
    when they are on host only, go where the binding keeps the request's working state. The
    blocks stay pinned until the copy has landed; admissions meanwhile may share them (the
    forward stream waits for the copy before any of their passes). A prefetch (§6.6) is a
    restore of blocks alone, for no sequence (``seq`` None); it pins the snapshot meanwhile."""
    seq: Optional[SequenceState]
    snapshot: Snapshot
    blocks: tuple[Node, ...]

    @property
    def pages(self) -> list[int]:
        return [n.device_page for n in self.blocks]

    @property
    def slabs(self) -> list[int]:
        return [n.host_slab for n in self.blocks]


Action = FreeDevice | WriteBlocks | WriteImage | Restore
