"""Model-agnostic prefix index: block tree, snapshots, eviction policies, tap planner, cost model.

Pure Python + numpy + xxhash: imports neither torch nor sglang. ``PrefixIndex`` is the one door.
"""
from .actions import (
    Action, Actions, Begun, Committed, FreeDevice, PinHost, Published, Restore, ShareBlocks,
    SlotGrant, WriteBlocks, WriteImage, freed_by,
)
from .cost import CostModel
from .index import PrefixIndex
from .invariants import check_invariants, sanity_check
from .keys import BLOCK_BYTES, BLOCK_TOKENS, PromptKey
from .lru import DeviceLRU
from .requests import Candidate, CommitStatus, Match, Readiness, SequenceState
from .roles import Role
from .slabs import SlabPool
from .snapshots import Snapshot, SnapshotKind
from .taps import TapPlan, TapSettings
from .tree import BlockTree, Node

__all__ = [
    "Action", "Actions", "BLOCK_BYTES", "BLOCK_TOKENS", "Begun", "BlockTree", "Candidate",
    "CommitStatus", "Committed", "CostModel", "DeviceLRU", "FreeDevice", "Match", "Node",
    "PinHost", "PrefixIndex", "PromptKey", "Published", "Readiness", "Restore", "Role",
    "SequenceState", "ShareBlocks", "SlabPool", "SlotGrant", "Snapshot", "SnapshotKind",
    "TapPlan", "TapSettings", "WriteBlocks", "WriteImage", "check_invariants", "freed_by",
    "sanity_check",
]
