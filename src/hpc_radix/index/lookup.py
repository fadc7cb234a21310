"""What a prompt can resume from and what admitting it takes (design §6.1–§6.3, §6.6): the
matched path and the source the cost model chooses, what the prompt shows about the traffic
(ghosts, divergence), whether it fits the device now, and what a restore or a prefetch from a
source copies. Reads the other parts; changes none but the learners it feeds."""
from __future__ import annotations

from typing import Optional

from .device import DeviceResidency
from .host import HostResidency
from .keys import BLOCK_TOKENS, TOKEN_BYTES, PromptKey
from .lru import DeviceLRU
from .requests import Candidate, Match, Readiness
from .roles import DivergenceLearner, Ghosts, Role, RoleStats
from .snapshots import Snapshot
from .tree import BlockTree, Node
from .valuation import Valuation

PREFETCH_MAX_BLOCKS = 256             # one prefetch's copy (design §6.6)


class Lookup:
    DIVERGENCE_NODES = 64     # tree nodes one observation looks at, at most

    def __init__(self, tree: BlockTree, lru: DeviceLRU, device: DeviceResidency,
                 host: HostResidency, valuation: Valuation, roles: RoleStats, ghosts: Ghosts,
                 divergence: DivergenceLearner):
        self.tree = tree
        self.lru = lru
        self.device = device
        self.host = host
        self.valuation = valuation
        self.roles = roles
        self.ghosts = ghosts
        self.divergence = divergence

    def match(self, key: PromptKey, limit: Optional[int] = None) -> Match:
        """Side-effect free lookup: the matched path and the source chosen by the cost model.
        The frontier is at most n - 1, or at most ``limit`` when given: a caller that passes only
        the matchable tokens (SGLang's key limit, itself <= n - 1 of the request) sets it to
        len(key)."""
        n = len(key)
        limit = n - 1 if limit is None else min(limit, n)
        node = self.tree.match(key, max(0, limit) // BLOCK_TOKENS)
        root = Candidate(None, 0, self.valuation.cost.prefill_seconds(0, n), 0, 0)
        deepest = device = None
        walk_paths = self.host_blocks_possible()
        a = node
        while device is None:
            for s in self.valid_snapshots_at(a, key, limit):
                cand = self.valuation.candidate(s, n, walk_paths)
                if deepest is None or s.frontier > deepest.frontier:
                    deepest = cand
                if cand.host_bytes == 0 and (device is None or s.frontier > device.frontier):
                    device = cand
            if a.is_root:
                break
            a = a.parent
        options = [c for c in (root, deepest, device) if c is not None]
        chosen = min(options, key=lambda c: (c.seconds, c.host_bytes, -c.frontier))
        return Match(key, node, root, deepest, device, chosen)

    def host_blocks_possible(self) -> bool:
        """Whether some tree block is host-only (O(1), from the counters)."""
        return (self.host.slabs is not None
                and bool(self.tree.num_nodes - (self.device.owned_pages - self.device.tail_pages)))

    def valid_snapshots_at(self, a: Node, key: PromptKey, limit: int):
        """The snapshots anchored at ``a`` that ``key`` can resume from, within ``limit``."""
        start = a.end * TOKEN_BYTES
        media = key.media_key(a.depth + 1)
        for s in a.snapshots.values():
            if s.frontier <= limit and key.buf[start:start + len(s.tail)] == s.tail \
                    and (not s.tail or s.tail_media == media):
                yield s

    def observe(self, match: Match) -> Optional[int]:
        """Once per request, what its prompt shows. Whether it came for a snapshot lost before
        its first hit, deeper than what it resumes from (``Ghosts``: reported per role). And if
        it leaves the cached path shortly before where an earlier prompt ended (a prompt tail
        below the deepest matched block that this prompt does not go through) and goes on past
        that end, the distance between the two (``divergence``), which is returned (else
        None)."""
        m, key = match.matched_tokens, match.key
        if key.media is None:
            served = match.chosen.frontier if match.chosen.snapshot is not None else 0
            role = self.ghosts.take_deepest(key.hashes, key.buf, served, len(key))
            if role is not None:
                self.roles.missed(role)
        horizon = m + self.divergence.HORIZON_TOKENS
        through = set(self.valid_snapshots_at(match.node, key, len(key)))   # not left
        nearest, budget, stack = None, self.DIVERGENCE_NODES, [match.node]
        while stack and budget:
            a = stack.pop()
            budget -= 1
            for s in a.snapshots.values():
                if s.role is Role.TAIL and m < s.frontier < len(key) and s.frontier <= horizon \
                        and (nearest is None or s.frontier < nearest) and s not in through:
                    nearest = s.frontier
            stack.extend(c for c in a.children.values() if c.end < horizon)
        if nearest is None:
            return None
        self.divergence.observe(nearest - m)
        return nearest - m

    # ---- capacity (§6.3, §6.6) -----------------------------------------------------------
    def classify(self, match: Match, *, free_pages: int, total_pages: int, growth_pages: int) -> tuple[Readiness, Optional[Candidate]]:
        """Whether the request can be admitted now, and from which candidate (§6.3).

        ``growth_pages``: pages the whole request needs from position 0 (prompt plus its output
        window); a candidate saves its frontier's full blocks. Evictable pages on the
        candidate's own path do not count as available. When even the root does not fit, the
        request is blocked while active requests hold pages, infeasible if it exceeds the pool.
        """
        for cand in match.candidates():
            need = cand.host_blocks + (1 if cand.snapshot is not None and cand.snapshot.tail else 0)
            need += growth_pages - cand.frontier // BLOCK_TOKENS
            own = self.evictable_on_path(cand)
            if need <= free_pages + len(self.lru) - own:
                return Readiness.READY, cand
        if growth_pages > total_pages:
            return Readiness.PERMANENTLY_INFEASIBLE, None
        return Readiness.TEMPORARILY_BLOCKED, None

    def evictable_on_path(self, cand: Candidate) -> int:
        """Evictable device pages of the candidate's path and tail (pinning it takes them)."""
        if cand.snapshot is None:
            return 0
        count = sum(1 for p in cand.snapshot.anchor.path() if p in self.lru)
        return count + (cand.snapshot in self.lru)

    @staticmethod
    def host_only_blocks(s: Snapshot) -> list[Node]:
        """The blocks of ``s``'s path with no device copy, in path order (a restore's)."""
        return [n for n in s.anchor.path() if n.device_page < 0]

    def restore_pages(self, s: Snapshot) -> int:
        """Device pages a restore from ``s`` takes: its host-only blocks, and its tail when
        that is on host only (it comes back into the request's private copy)."""
        return len(self.host_only_blocks(s)) + int(bool(s.tail) and not s.tail_on_device)

    def prefetch_size(self, cand: Candidate, room_pages: int) -> int:
        """§6.6: how many host-only blocks of ``cand``'s path to copy to device while its
        request waits at the head of the queue, refused for want of pages, with ``room_pages``
        left in SGLang's budget after this round's admissions: at most PREFETCH_MAX_BLOCKS,
        within the room (what SGLang promised the admitted and running requests stays theirs),
        less the evictable pages of the path, which pinning the source takes. 0 for a source
        with its image on device (pinning it would take a mamba slot SGLang counted)."""
        s = cand.snapshot
        if s is None or s.image_on_device:
            return 0
        room = room_pages - self.evictable_on_path(cand)
        return max(0, min(len(self.host_only_blocks(s)), PREFETCH_MAX_BLOCKS, room))
