"""GreedyDual-Size-Frequency valuation of snapshots for the host tier (design §9.3).

    H(s) = L_s + F(s) · C(s) / Z(s)
    C(s) = prefill_seconds(base=F_a, tokens=F_s − F_a) − restore_seconds(image), clamped at 0,
           a = the nearest retained snapshot above s on its path (the root: F_a = 0)
    Z(s) = image_bytes + tail_bytes + exclusive_path_bytes(s)
    F(s) = prior(s) + hits(s)

prior(s) is the recent share of snapshots of s's role that served a request (roles.py; 1 where
no role statistics are kept), fixed when s is published (those published before their kind's
rate was known take it once it is: ``Valuation.settle_priors``): a kind of snapshot the traffic
never resumes from is worth little before its first hit, one it always resumes from nearly a
hit.
L_s is the global inflation L when s was published or last hit, so snapshots that stop being
hit fall behind new ones without timers (L at full weight: benchmarks/WHY.md says why).
Valuing against the nearest *retained* ancestor makes a conversation's newest snapshot carry its
whole conversation-specific prefill.
"""
from __future__ import annotations

from typing import Optional

from .cost import CostModel
from .snapshots import Snapshot


def nearest_retained_ancestor(s: Snapshot) -> Optional[Snapshot]:
    a = s.ancestor
    while a is not None and a.superseded:
        a = a.ancestor
    return a


def value(cost: CostModel, base: int, frontier: int, image_bytes: int) -> float:
    """The prefill seconds a snapshot at ``frontier`` saves over one at ``base``, net of its
    restore."""
    return max(0.0, cost.prefill_seconds(base, frontier - base) - cost.restore_seconds(image_bytes))


def recompute_value(cost: CostModel, s: Snapshot, image_bytes: int) -> float:
    """C(s): the value of s over its nearest retained ancestor."""
    a = nearest_retained_ancestor(s)
    return value(cost, a.frontier if a is not None else 0, s.frontier, image_bytes)


def exclusive_path_blocks(s: Snapshot) -> int:
    """Host-resident nodes on s's path below which s is the only retained snapshot."""
    count = 0
    n = s.anchor
    while not n.is_root and n.retained_below == 1:
        count += n.on_host
        n = n.parent
    return count


def priority(L_s: float, frequency: float, value: float, size: int) -> float:
    """H(s), with ``frequency`` = F(s)."""
    return L_s + frequency * value / size
