"""What the index values (design §6.2, §9.3): a candidate source's cost (restore and prefill
seconds, host bytes), a snapshot's GDSF priority over its size (image, tail and exclusive
blocks), and a new snapshot's estimated priority from its role's prior. Part of the index: it
reads the index's cost model, sizes, role statistics and clock ``L`` (``index``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from . import gdsf
from .keys import BLOCK_TOKENS
from .roles import Role
from .snapshots import Snapshot

if TYPE_CHECKING:
    from .index import PrefixIndex, SequenceState


@dataclass
class Candidate:
    snapshot: Optional[Snapshot]   # None: the root (cold prefill)
    frontier: int
    seconds: float
    host_blocks: int               # path blocks that need a host -> device restore
    host_bytes: int


class Valuation:
    def __init__(self, index: "PrefixIndex"):
        self.index = index

    def size(self, has_tail: bool, blocks: int) -> int:
        """Z: an image, its tail and ``blocks`` KV blocks, in bytes."""
        return self.index.image_bytes + (has_tail + blocks) * self.index.block_bytes

    def priority(self, s: Snapshot) -> float:
        size = self.size(bool(s.tail), gdsf.exclusive_path_blocks(s))
        value = gdsf.recompute_value(self.index.cost, s, self.index.image_bytes)
        return gdsf.priority(s.L, s.prior + s.hits, value, size)

    def settle_priors(self, role: Role) -> float:
        """``role``'s rate is known now: the snapshots of it published before, at the default
        prior of a hit each, take it (else they would outrank every later one for good).
        Returns that rate."""
        prior = self.index.roles.prior(role)
        for s in self.index.snapshots.values():
            if s.role is role:
                s.prior = prior
        self.index.host_victims.rekey()
        return prior

    def new_priority(self, seq: SequenceState, frontier: int, role: Optional[Role] = None) -> float:
        """A new snapshot's estimated priority: no hits (its role's prior), the blocks since the
        sequence's previous snapshot its own."""
        prev = max((s.frontier for s in (seq.last_tap, seq.source, seq.resumed_from)
                    if s is not None and s.frontier < frontier), default=0)
        value = gdsf.value(self.index.cost, prev, frontier, self.index.image_bytes)
        own_blocks = frontier // BLOCK_TOKENS - prev // BLOCK_TOKENS
        prior = self.index.roles.prior(role) if role is not None else 1.0
        return gdsf.priority(self.index.L, prior, value, self.size(frontier % BLOCK_TOKENS != 0, own_blocks))

    def host_blocks_possible(self) -> bool:
        """Whether some tree block is host-only (O(1), from the counters)."""
        return self.index.host is not None and bool(self.index.tree.num_nodes - (self.index._device_pages - self.index._tail_pages))

    def candidate(self, s: Snapshot, n: int, walk_path: bool) -> Candidate:
        """``walk_path``: whether s's path may hold host-only blocks.

        A block still being restored for another admission counts as on device, unlike §6.5
        (which skips such candidates "for that short window"): here the window lasts at least
        the forward pass the copy queues behind, and the requests that arrive in it share the
        path being restored (agent turns over one system prompt) and fell back to a cold
        prefill. Sharing is safe: the restore's admission made the forward stream wait for the
        copy, and every later admission's pass runs behind that wait on the same stream."""
        host_blocks = 0
        if walk_path:
            p = s.anchor
            while not p.is_root:
                host_blocks += p.device_page < 0
                p = p.parent
        host_bytes = host_blocks * self.index.block_bytes
        if not s.image_on_device:
            host_bytes += self.index.image_bytes
        if not s.tail_on_device:
            host_bytes += self.index.block_bytes
        seconds = self.index.cost.restore_seconds(host_bytes) + self.index.cost.prefill_seconds(s.frontier, n - s.frontier)
        return Candidate(s, s.frontier, seconds, host_blocks, host_bytes)
