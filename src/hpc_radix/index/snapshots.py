"""Snapshot records (design §5.3, §9.3): a recurrent-state image at an exact frontier.

A snapshot is anchored on the node of the last full block below its frontier (the namespace root
when F < 64) and may own a tail: the exact tokens of the partial last block plus one private page.
A tail's identity includes the media key of its block (a Vision item in the partial block changes
the state as much as in a full one). At most one snapshot exists per (anchor, tail tokens, tail
media). Each records its nearest snapshot above it
on its path (``ancestor``) and those that record it (``dependents``).
"""
from __future__ import annotations

import enum
from typing import Optional

from .keys import TOKEN_BYTES
from .roles import Role
from .tree import Node


class SnapshotKind(enum.Enum):
    TAP = "tap"              # flexible or semantic tap at a page boundary
    ENDPOINT = "endpoint"    # exact frontier at finish / cancel, may carry a tail
    BOUNDARY = "boundary"    # tap at a client breakpoint or structural boundary: may be shared


def default_role(kind: SnapshotKind, provisional: bool = False) -> Role:
    """The role of a snapshot whose publisher did not name one."""
    if kind is SnapshotKind.ENDPOINT:
        return Role.ENDPOINT
    if kind is SnapshotKind.BOUNDARY:
        return Role.STRUCTURAL
    return Role.CHUNK_END if provisional else Role.LADDER


class Snapshot:
    __slots__ = (
        "id", "gen", "anchor", "tail", "tail_media", "kind",
        "device_slot", "host_slabs", "host_ready",        # image copies
        "tail_page", "tail_slab", "tail_host_ready",      # tail copies (tail only)
        "restore_pins", "superseded", "superseded_tick",
        "hits", "L", "last_hit", "ancestor", "dependents", "role", "prior",
    )

    def __init__(self, anchor: Node, tail: bytes, kind: SnapshotKind, tail_media: int = 0,
                 role: Optional[Role] = None, prior: float = 1.0):
        self.id = self.gen = -1
        self.anchor = anchor
        self.tail = tail
        self.tail_media = tail_media if tail else 0
        self.kind = kind
        self.device_slot = -1
        self.host_slabs: list[int] = []
        self.host_ready = False
        self.tail_page = -1
        self.tail_slab = -1
        self.tail_host_ready = False
        self.restore_pins = 0
        self.superseded = False
        self.superseded_tick = 0
        self.hits = 0
        self.L = 0.0
        self.last_hit = 0
        self.ancestor: Optional[Snapshot] = None
        self.dependents: set = set()
        self.role = role if role is not None else default_role(kind)
        self.prior = prior            # GDSF's frequency before any hit (roles.RoleStats)

    @property
    def key(self) -> tuple[bytes, int]:
        """The snapshot's key in its anchor's table."""
        return self.tail, self.tail_media

    @property
    def tail_len(self) -> int:
        return len(self.tail) // TOKEN_BYTES

    @property
    def frontier(self) -> int:
        return self.anchor.end + self.tail_len

    # Residency of the parts; a part that does not exist counts as resident.
    @property
    def image_on_device(self) -> bool:
        return self.device_slot >= 0

    @property
    def image_on_host(self) -> bool:
        return bool(self.host_slabs) and self.host_ready

    @property
    def tail_on_device(self) -> bool:
        return not self.tail or self.tail_page >= 0

    @property
    def tail_on_host(self) -> bool:
        return not self.tail or (self.tail_slab >= 0 and self.tail_host_ready)

    @property
    def complete_on_device(self) -> bool:
        return self.image_on_device and self.tail_on_device

    @property
    def complete_on_host(self) -> bool:
        return self.image_on_host and self.tail_on_host

    @property
    def host_slab_ids(self) -> list[int]:
        """Every host slab the snapshot holds: its image's and its tail's."""
        return self.host_slabs + ([self.tail_slab] if self.tail_slab >= 0 else [])

    def is_above(self, other: "Snapshot") -> bool:
        """Whether this snapshot's frontier is a strict prefix position of ``other``'s path."""
        if self.frontier >= other.frontier or self.anchor.namespace != other.anchor.namespace:
            return False
        a = other.anchor
        if a.depth < self.anchor.depth or a.ancestor_at(self.anchor.depth) is not self.anchor:
            return False
        if not self.tail:
            return True
        # The tail must equal the tokens that follow self.anchor on other's path.
        start = self.anchor.end * TOKEN_BYTES
        if a.depth > self.anchor.depth:
            return (a.buf[start:start + len(self.tail)] == self.tail
                    and a.ancestor_at(self.anchor.depth + 1).media == self.tail_media)
        return other.tail.startswith(self.tail) and other.tail_media == self.tail_media

    def __repr__(self) -> str:
        return (f"Snapshot(id={self.id}, F={self.frontier}, kind={self.kind.value}, "
                f"role={self.role.value}, slot={self.device_slot}, host={self.image_on_host}, "
                f"superseded={self.superseded})")
