"""Deterministic token-level workloads for the hpc_radix A/B benchmark (see trace.py)."""
from .chatml import TINY, Vocab
from .generate import MIXES, agentic, chat, fanout, long_agentic, merge
from .oracle import (
    PrefixIndex, clairvoyant_retention_bounds, clairvoyant_tap_bounds, describe, distinct_tokens, oracle_bounds,
)
from .trace import Request, dump, load, resolve, simulate

__all__ = ["TINY", "Vocab", "MIXES", "agentic", "chat", "fanout", "long_agentic", "merge",
           "PrefixIndex", "clairvoyant_retention_bounds", "clairvoyant_tap_bounds", "describe",
           "distinct_tokens", "oracle_bounds", "Request", "dump", "load", "resolve", "simulate"]
