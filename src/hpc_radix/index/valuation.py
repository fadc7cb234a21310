"""What the index values (design §6.2, §9.3): a candidate source's cost (restore and prefill
seconds, host bytes), a snapshot's GDSF priority over its size (image, tail and exclusive
blocks), a new snapshot's estimated priority from its role's prior, and the inflation clock
``L`` that eviction raises."""
from __future__ import annotations

from typing import Optional

from . import gdsf
from .cost import CostModel
from .keys import BLOCK_TOKENS
from .requests import Candidate, SequenceState
from .roles import Role, RoleStats
from .snapshots import Snapshot


class Valuation:
    def __init__(self, cost: CostModel, image_bytes: int, block_bytes: int, roles: RoleStats):
        """``image_bytes``: one state image; ``block_bytes``: one KV block bundle."""
        self.cost = cost
        self.image_bytes = image_bytes
        self.block_bytes = block_bytes
        self.roles = roles
        self.L = 0.0                  # GDSF's inflation: the priority of the last retained
                                      # snapshot eviction took (§9.3)

    def size(self, has_tail: bool, blocks: int) -> int:
        """Z: an image, its tail and ``blocks`` KV blocks, in bytes."""
        return self.image_bytes + (has_tail + blocks) * self.block_bytes

    def priority(self, s: Snapshot) -> float:
        size = self.size(bool(s.tail), gdsf.exclusive_path_blocks(s))
        value = gdsf.recompute_value(self.cost, s, self.image_bytes)
        return gdsf.priority(s.L, s.prior + s.hits, value, size)

    def evicted(self, s: Snapshot) -> None:
        """Eviction took ``s``: L rises to its priority unless it was superseded."""
        if not s.superseded:
            self.L = max(self.L, self.priority(s))

    def new_priority(self, seq: SequenceState, frontier: int, role: Optional[Role] = None) -> float:
        """A new snapshot's estimated priority: no hits (its role's prior), the blocks since the
        sequence's previous snapshot its own."""
        prev = max((s.frontier for s in (seq.last_tap, seq.source, seq.resumed_from)
                    if s is not None and s.frontier < frontier), default=0)
        value = gdsf.value(self.cost, prev, frontier, self.image_bytes)
        own_blocks = frontier // BLOCK_TOKENS - prev // BLOCK_TOKENS
        prior = self.roles.prior(role) if role is not None else 1.0
        return gdsf.priority(self.L, prior, value, self.size(frontier % BLOCK_TOKENS != 0, own_blocks))

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
        host_bytes = host_blocks * self.block_bytes
        if not s.image_on_device:
            host_bytes += self.image_bytes
        if not s.tail_on_device:
            host_bytes += self.block_bytes
        seconds = self.cost.restore_seconds(host_bytes) + self.cost.prefill_seconds(s.frontier, n - s.frontier)
        return Candidate(s, s.frontier, seconds, host_blocks, host_bytes)
