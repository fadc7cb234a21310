"""What the patches switch on at runtime, in one object rather than module globals: each hook
reads its switch and leaves SGLang's own path untouched while it is off."""
from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class PatchState:
    batch_syncs: bool = False       # extend batches built without waiting (batch_syncs.py)
    decode_pages: bool = False      # decode steps that start no page skip the allocation
    state_copy: bool = False        # snapshot images copied by the cache's kernel (state_copy.py)
    hooks_installed: bool = False   # scheduler_hooks registered with SGLang's HookRegistry
    # batch_syncs: the ping-pong positions noted during one prepare_for_extend (None: outside)
    track_positions: Optional[list] = None


STATE = PatchState()
