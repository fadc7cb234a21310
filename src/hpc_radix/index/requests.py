"""What the index knows of a request (design §6.1–§6.4): the sources a lookup found
(``Candidate``, ``Match``), whether it can be admitted (``Readiness``), and its hold on the cache
while it runs (``SequenceState``)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from .keys import TOKEN_BYTES, PromptKey
from .snapshots import Snapshot
from .tree import Node


class Readiness(enum.Enum):
    READY = "ready"
    TEMPORARILY_BLOCKED = "temporarily_blocked"
    PERMANENTLY_INFEASIBLE = "permanently_infeasible"


class CommitStatus(enum.Enum):
    INSERTED = "inserted"      # a new node owns the sequence's page
    ADOPTED = "adopted"        # a host-only node adopted the sequence's page as its device copy
    DUPLICATE = "duplicate"    # the node already has a device page; the sequence's stays private


@dataclass
class Candidate:
    snapshot: Optional[Snapshot]   # None: the root (cold prefill)
    frontier: int
    seconds: float
    host_blocks: int               # path blocks that need a host -> device restore
    host_bytes: int


@dataclass
class Match:
    key: PromptKey
    node: Node                     # deepest node matched within the limit
    root: Candidate
    deepest: Optional[Candidate]   # deepest valid snapshot s*
    device: Optional[Candidate]    # deepest valid snapshot fully device resident
    chosen: Candidate

    @property
    def matched_tokens(self) -> int:
        return self.node.end

    @property
    def branches(self) -> bool:
        """The cached path goes on past the deepest match: the prompt leaves a cached
        conversation there (an edit, a re-render, another branch) instead of extending it."""
        return bool(self.node.children)

    @property
    def echoes_output(self) -> bool:
        """The prompt goes on with the tail of an endpoint (prompt + output) published at the
        deepest matched block, even one since evicted: the client sent that output back token
        for token (an agent loop, preserved reasoning)."""
        start = self.matched_tokens
        return any(self.key.tokens(start, start + len(t) // TOKEN_BYTES) == t
                   for t in self.node.endpoint_tails)

    def candidates(self) -> list[Candidate]:
        """Fallback order for capacity: the chosen one, then s_dev, then the root."""
        out = [self.chosen]
        for c in (self.device, self.root):
            if c is not None and all(c is not o for o in out):
                out.append(c)
        return out


@dataclass
class SequenceState:
    """A request's hold on the cache: the committed path it maps and its snapshot lineage."""
    key: PromptKey
    path: list = field(default_factory=list)          # nodes of blocks 0..len-1, each pinned
    source: Optional[Snapshot] = None                  # snapshot resumed from, pinned until used
    resumed_from: Optional[Snapshot] = None            # lineage: superseded by a deeper snapshot
    last_tap: Optional[Snapshot] = None
    provisional: Optional[Snapshot] = None             # unplanned chunk-end tap: the next
                                                       # snapshot of the lineage supersedes it
    enabled: bool = True                               # disabled requests never insert
    hit_counted: bool = False
    released: bool = False
