"""Cost model (design §6.2, §11.4): seconds to prefill vs seconds to restore from the host tier.

It only ranks choices and values snapshots; capacity and validity never depend on it. The
defaults are generic; a deployment replaces them with coefficients measured on its GPU and
model (``dataclasses.replace``). Every rank must use the same coefficients (no per-rank timing).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    prefill_pass_s: float = 2e-3        # fixed cost of one forward pass (a chunk)
    prefill_token_s: float = 1e-4       # linear cost per prefilled token
    attention_pair_s: float = 2e-10     # per (query, key) pair of the attention layers
    chunk_tokens: int = 8192            # prefill chunk size: passes = ceil(tokens / chunk)
    h2d_bytes_per_s: float = 2.0e10     # pinned host -> device bandwidth
    restore_batch_s: float = 1e-4       # fixed latency of one restore batch

    def prefill_seconds(self, base: int, tokens: int) -> float:
        """Prefill ``tokens`` new tokens after ``base`` cached ones: linear plus attention pairs
        (each new token at position p attends to p + 1 keys)."""
        if tokens <= 0:
            return 0.0
        passes = math.ceil(tokens / self.chunk_tokens)
        pairs = base * tokens + tokens * (tokens + 1) / 2
        return passes * self.prefill_pass_s + tokens * self.prefill_token_s + pairs * self.attention_pair_s

    def restore_seconds(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        return nbytes / self.h2d_bytes_per_s + self.restore_batch_s
