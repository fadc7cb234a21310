"""Model-agnostic prefix index: block tree, snapshots, eviction policies, tap planner, cost model.

Pure Python + numpy + xxhash: imports neither torch nor sglang.
"""
from .actions import Action, FreeDevice, Restore, SlotGrant, WriteBlocks, WriteImage
from .cost import CostModel
from .index import Candidate, CommitStatus, Match, PrefixIndex, Readiness, SequenceState
from .invariants import check_invariants, sanity_check
from .keys import BLOCK_BYTES, BLOCK_TOKENS, PromptKey
from .lru import DeviceLRU
from .roles import Role
from .slabs import SlabPool
from .snapshots import Snapshot, SnapshotKind
from .tree import BlockTree, Node

__all__ = [
    "Action", "BLOCK_BYTES", "BLOCK_TOKENS", "BlockTree", "Candidate", "CommitStatus",
    "CostModel", "DeviceLRU", "FreeDevice", "Match", "Node", "PrefixIndex", "PromptKey",
    "Readiness", "Restore", "Role", "SequenceState", "SlabPool", "SlotGrant", "Snapshot", "SnapshotKind",
    "WriteBlocks", "WriteImage", "check_invariants", "sanity_check",
]
