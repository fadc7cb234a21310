"""What the index asks of the code that owns the bytes (ARCHITECTURE: the index decides, the
binding executes): one closed set of frozen actions. Every index call that changes what lives
where returns them, in the order they are to run, alone or beside its value (``SlotGrant``,
``Begun``, ``Committed``, ``Published``); the binding's executor runs them in that order, and
each copy reports back with ``PrefixIndex.landed(action)``. Every id in them is opaque to the
index: device page and slot ids belong to SGLang's allocators, host slab ids to the pinned pool.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

from .requests import CommitStatus, SequenceState
from .snapshots import Snapshot
from .tree import Node


class FreeDevice(NamedTuple):
    """Device pages and snapshot slots the index let go (evicted, deleted, a duplicate never
    kept): the binding returns them to SGLang's allocators. Between calls the index holds
    none."""
    pages: list[int]
    slots: list[int]

    @property
    def empty(self) -> bool:
        return not (self.pages or self.slots)


@dataclass(frozen=True)
class ShareBlocks:
    """The committing request's own pages of ``blocks`` duplicate blocks the tree already has
    on device (identical blocks are one physical page): its token row maps the tree's
    ``tree_pages`` instead, and its ``own_pages`` go back to the allocator."""
    blocks: tuple[int, ...]
    tree_pages: tuple[int, ...]
    own_pages: tuple[int, ...]


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
    device page it adopted (``node.device_page``), in path order; the snapshot's image into
    mamba slot ``image_slot`` and its tail into page ``tail_page`` when those are on host only
    (None, -1: nothing to copy). The blocks stay pinned until the copy has landed; admissions
    meanwhile may share them (the forward stream waits for the copy before any of their
    passes). A prefetch (§6.6) is a restore of blocks alone, for no sequence (``seq`` None); it
    pins the snapshot meanwhile."""
    seq: Optional[SequenceState]
    snapshot: Snapshot
    blocks: tuple[Node, ...]
    image_slot: Optional[int] = None
    tail_page: int = -1

    @property
    def pages(self) -> list[int]:
        return [n.device_page for n in self.blocks]

    @property
    def slabs(self) -> list[int]:
        return [n.host_slab for n in self.blocks]


@dataclass(frozen=True)
class PinHost:
    """The device cache is filling up: the host tier's memory, pinned on demand, is wanted
    soon (a no-op where it was pinned at startup)."""


Action = Union[FreeDevice, ShareBlocks, WriteBlocks, WriteImage, Restore, PinHost]
Actions = list   # of Action, in the order they run


class SlotGrant(NamedTuple):
    """A device snapshot slot for a new snapshot (``acquire_slot``, ``reclaim_slot``):
    ``slot`` is the id reclaimed from another snapshot, or None to take a fresh one from the
    pool; ``actions`` what reclaiming it let go (a device-only victim's tail page)."""
    slot: Optional[int]
    actions: Actions


class Begun(NamedTuple):
    """A request admitted (``begin``), and the restore of what its source has on host only."""
    seq: SequenceState
    actions: Actions


class Committed(NamedTuple):
    """Blocks that joined the tree (``commit``): each node with what became of the sequence's
    page, and the sharing of the duplicates."""
    nodes: list[tuple[Node, CommitStatus]]
    actions: Actions


class Published(NamedTuple):
    """A snapshot published (None: the same one exists, refreshed; its slot and tail page go
    back in ``actions``), and its write-through to host when the index writes it."""
    snapshot: Optional[Snapshot]
    actions: Actions


def freed_by(actions: Sequence[Action]) -> FreeDevice:
    """Every device page and slot ``actions`` let go, as one FreeDevice."""
    pages, slots = [], []
    for a in actions:
        if isinstance(a, FreeDevice):
            pages += a.pages
            slots += a.slots
    return FreeDevice(pages, slots)
