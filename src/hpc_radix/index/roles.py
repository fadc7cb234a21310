"""What each snapshot is for, and what the traffic shows each kind is worth.

A snapshot's role says why it was taken (a request's endpoint, its prompt tail, a ladder tap,
...). ``RoleStats`` counts per role what the cache kept, wrote to host, saw hit and evicted,
and the requests that came for one evicted before its first hit (``Ghosts``). It keeps a recent
hit rate per role: the share of snapshots of that role that served a request at least once,
counted over the last snapshots of the role (exponentially decayed). That rate
is the prior of a new snapshot's GDSF frequency (gdsf.py): on a chat service whose clients
echo their outputs, endpoints are what later turns resume from; on a service whose next turn
carries new text after the prompt, prompt tails are, and endpoints are never hit. A fixed
``1 + hits`` valued both alike and filled the host tier with images traffic never came back to.

``DivergenceLearner`` learns where later prompts leave earlier ones: how far before an earlier
prompt's end a new prompt diverged from it (a client that re-renders its last message, a
trace whose last block is re-hashed). Taps at that distance before a prompt's end serve the
next such prompt.

Pure Python: imports neither torch nor sglang.
"""
from __future__ import annotations

import collections
import enum
from typing import Optional

from .keys import BLOCK_TOKENS, TOKEN_BYTES


class Role(enum.Enum):
    ENDPOINT = "endpoint"            # state at finish: prompt + output
    TAIL = "prompt_tail"             # state after the whole prompt
    OPENER = "opener"                # before the generation opener
    STRUCTURAL = "structural"        # end of the system / tools block
    BRANCH = "branch"                # where a prompt left a cached conversation (2nd sighting)
    LEARNED = "learned"              # at a distance before the end where prompts diverge
    LADDER = "ladder"                # the geometric ladder
    EXPLICIT = "explicit"            # a client's breakpoint
    CHUNK_END = "chunk_end"          # a chunk's end state, kept provisionally
    SAVED = "saved"                  # loaded from the cache file


EVENTS = ("kept", "written", "hit", "evicted", "missed")   # missed: a hit its eviction denied


class RoleStats:
    """Per role: running counts of EVENTS, and the decayed hit rate that serves as prior."""

    DECAY = 0.99          # per snapshot of the role published: remembers about the last 100
    MIN_SEEN = 32         # (decayed) snapshots of a role before its own rate is used

    def __init__(self):
        self.counts: dict[tuple[Role, str], int] = collections.Counter()
        self._published: dict[Role, float] = collections.defaultdict(float)
        self._hit: dict[Role, float] = collections.defaultdict(float)

    def prior(self, role: Role) -> float:
        """The expected share of snapshots of ``role`` that serve a request: (hits + 1) /
        (published + 2) over the recent ones; 1 (a hit, as plain GDSF counts every snapshot)
        until MIN_SEEN of them were published."""
        if not self.known(role):
            return 1.0
        return min(1.0, (self._hit[role] + 1.0) / (self._published[role] + 2.0))

    def known(self, role: Role) -> bool:
        """Whether ``role``'s own rate is used (MIN_SEEN of it were published)."""
        return self._published[role] >= self.MIN_SEEN

    def kept(self, role: Role) -> float:
        """A snapshot of ``role`` was published; returns the prior it starts with."""
        prior = self.prior(role)
        self._published[role] = self._published[role] * self.DECAY + 1.0
        self._hit[role] *= self.DECAY
        self.counts[role, "kept"] += 1
        return prior

    def first_hit(self, role: Role) -> None:
        self._hit[role] += 1.0
        self.counts[role, "hit"] += 1

    def missed(self, role: Role) -> None:
        """A request came for a snapshot of ``role`` lost before its first hit (``Ghosts``).
        Reported only: counted in the rate, such hits valued prompt tails above the blocks and
        taps that served more, and the host tier kept less; in the shared tier's write filter
        they showed no gain on three windows (benchmarks/WHY.md)."""
        self.counts[role, "missed"] += 1

    def hit(self, role: Role) -> None:
        self.counts[role, "hit"] += 1

    def evicted(self, role: Role) -> None:
        self.counts[role, "evicted"] += 1

    def written(self, role: Role) -> None:
        self.counts[role, "written"] += 1

    def totals(self) -> dict[tuple[str, str], int]:
        """(role name, event) -> running count, for the report."""
        return {(r.value, e): n for (r, e), n in self.counts.items()}


class Ghosts:
    """Where snapshots were lost before their first hit (as ARC's ghost lists): the chained
    hash of the block each was anchored at, its tail's token bytes and its role, the last
    CAPACITY of them. A later prompt that goes through one, deeper than what the cache could
    serve it from, is a hit the eviction cost: the report counts it per role ("missed"), so
    an operator sees when the host tier is too small for the traffic's gaps between turns."""

    CAPACITY = 4096

    def __init__(self):
        self._order: collections.OrderedDict = collections.OrderedDict()   # (hash, tail) -> role
        self._at: dict[int, dict[bytes, Role]] = {}                          # hash -> tail -> role

    def __len__(self) -> int:
        return len(self._order)

    def lost(self, anchor_hash: int, tail: bytes, role: Role) -> None:
        self._order[anchor_hash, tail] = role
        self._order.move_to_end((anchor_hash, tail))
        self._at.setdefault(anchor_hash, {})[tail] = role
        if len(self._order) > self.CAPACITY:
            (h, t), _ = self._order.popitem(last=False)
            self._drop(h, t)

    def take_deepest(self, hashes: list, buf: bytes, after: int, before: int) -> Optional[Role]:
        """The role of the deepest ghost a prompt goes through (``hashes``: its chained block
        hashes, ``buf``: its token bytes) whose frontier lies in (after, before), forgotten once
        taken; None if there is none."""
        for b in range(min(len(hashes), before // BLOCK_TOKENS) - 1, after // BLOCK_TOKENS - 2, -1):
            tails = self._at.get(hashes[b]) if b >= 0 else None
            if not tails:
                continue
            start = (b + 1) * BLOCK_TOKENS
            best = None
            for tail, role in tails.items():
                frontier = start + len(tail) // TOKEN_BYTES
                if after < frontier < before and buf[start * TOKEN_BYTES:frontier * TOKEN_BYTES] == tail \
                        and (best is None or len(tail) > len(best[0])):
                    best = tail, role
            if best is not None:
                del self._order[hashes[b], best[0]]
                self._drop(hashes[b], best[0])
                return best[1]
        return None

    def _drop(self, anchor_hash: int, tail: bytes) -> None:
        tails = self._at[anchor_hash]
        del tails[tail]
        if not tails:
            del self._at[anchor_hash]


class DivergenceLearner:
    """Distances before an earlier prompt's end at which later prompts left it, over the
    last WINDOW such prompts. ``distance()`` is the QUANTILE of them once MIN_SEEN were seen
    (None before): a tap that far before a prompt's end, snapped down to its page, serves the
    prompts that diverge within it."""

    WINDOW = 128
    MIN_SEEN = 8
    QUANTILE = 0.9
    HORIZON_TOKENS = 1024   # farther back the tap ladder serves

    def __init__(self):
        self.seen: collections.deque = collections.deque(maxlen=self.WINDOW)
        self._distance: Optional[int] = None

    def observe(self, distance: int) -> None:
        """Once per request; the quantile is kept here, not at every plan (every match)."""
        if 0 < distance <= self.HORIZON_TOKENS:
            self.seen.append(distance)
            if len(self.seen) >= self.MIN_SEEN:
                ordered = sorted(self.seen)
                self._distance = ordered[min(len(ordered) - 1, int(self.QUANTILE * len(ordered)))]

    def distance(self) -> Optional[int]:
        return self._distance
