"""Where each missed token went, in a CPU replay (tap_split_sim.py --census).

A request's missed tokens are those between what the cache served it and its oracle bound
(the longest prefix it shares with a request finished before it was sent). For each such
request the census finds the deepest snapshot the index ever published on the shared part of
its path and what became of it:

- ``no snapshot``: none was ever taken between what was served and the oracle (where to tap);
- ``evicted before arrival: WHY`` / ``evicted while queued: WHY``: one was, and an eviction
  took it (WHY: host tier full, device slot given to a new snapshot, mamba slots taken back by
  SGLang, device pages evicted with no host copy, ...);
- ``held, not used``: it was there, and the request resumed from less (cost model, a refused
  restore, a concurrent request still writing it);
and, past the deepest snapshot, ``beyond the deepest snapshot``: oracle tokens no snapshot
reached. Each missed token is counted once, in one of these.
"""
from __future__ import annotations

import collections
import contextlib
import traceback
from typing import Callable
from unittest import mock

import numpy as np

# the index method on the deletion's stack that says why (first found, innermost first)
WHY = (("host_alloc", "host tier full"),
       ("reclaim_slot", "device slot taken for a new snapshot"),
       ("acquire_slot", "device slot taken for a new snapshot"),
       ("evict_slots", "mamba slots taken back by SGLang"),
       ("evict_pages", "device pages evicted, no host copy"),
       ("delete_subtree", "its blocks evicted"))


def _why() -> str:
    names = [f.name for f in traceback.extract_stack()]
    for name, why in WHY:
        if name in names:
            return why
    return "other"


class SnapshotLog:
    """Every snapshot published and deleted during a replay, by identity (anchor block hash,
    tail tokens), with the step (``now()``) of each and the reason of a deletion."""

    def __init__(self, now: Callable[[], int]):
        self.now = now
        self.by_anchor: dict = collections.defaultdict(list)   # anchor hash -> [record]
        self._live: dict = {}                                    # id(snapshot) -> record

    @contextlib.contextmanager
    def recording(self, lifecycle_cls):
        """Record every snapshot ``lifecycle_cls`` (index/lifecycle.py's Lifecycle) adds and
        deletes."""
        add, delete = lifecycle_cls.add_snapshot, lifecycle_cls.delete_snapshot
        log = self

        def added(lifecycle, s):
            add(lifecycle, s)
            rec = {"frontier": s.frontier, "role": s.role.value, "tail": s.tail,
                   "published": log.now(), "deleted": None, "why": None}
            log.by_anchor[0 if s.anchor.is_root else s.anchor.hash].append(rec)
            log._live[id(s)] = rec

        def deleted(lifecycle, s):
            rec = log._live.pop(id(s), None)
            if rec is not None:
                rec["deleted"], rec["why"] = log.now(), _why()
            delete(lifecycle, s)

        with mock.patch.object(lifecycle_cls, "add_snapshot", added), \
                mock.patch.object(lifecycle_cls, "delete_snapshot", deleted):
            yield self

    def deepest(self, key, lo: int, hi: int, before: int):
        """The deepest snapshot published before step ``before`` (not by the request itself) on ``key``'s path with a
        frontier in (lo, hi], or None."""
        best = None
        for b in range(hi // 64, -1, -1):
            if b * 64 + 63 <= lo:
                break
            anchor = key.hashes[b - 1] if b else 0
            start = b * 64
            for rec in self.by_anchor.get(anchor, ()):
                f = rec["frontier"]
                if lo < f <= hi and rec["published"] < before \
                        and key.tokens(start, f) == rec["tail"] \
                        and (best is None or f > best["frontier"]):
                    best = rec
            if best is not None:
                return best
        return None


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if len(diff) else n


def census(reqs, texts: dict, sent: dict, admitted: dict, finished: dict, served: dict,
           log: SnapshotLog) -> tuple[collections.Counter, collections.Counter, list[str]]:
    """(missed tokens by fate, missed requests by fate, one line per missed request)."""
    from hpc_radix.index.keys import PromptKey

    arrays = {r.id: np.asarray(texts[r.id][0] + texts[r.id][1], dtype=np.int64) for r in reqs}
    tokens, requests, lines = collections.Counter(), collections.Counter(), []
    for r in reqs:
        prompt = np.asarray(texts[r.id][0], dtype=np.int64)
        earlier = [j for j in reqs if finished.get(j.id) is not None and finished[j.id] < sent[r.id]]
        best, source = 0, None
        for j in earlier:
            n = _lcp(prompt, arrays[j.id])
            if n > best:
                best, source = n, j
        oracle, cached = min(best, len(prompt) - 1), served[r.id]
        if oracle <= cached:
            continue
        key = PromptKey(texts[r.id][0])
        rec = log.deepest(key, cached, oracle, sent[r.id])
        if rec is None:
            fate, reached = "no snapshot", cached
        else:
            reached = rec["frontier"]
            gone = rec["deleted"]
            if gone is not None and gone <= sent[r.id]:
                fate = f"evicted before arrival: {rec['why']}"
            elif gone is not None and gone <= admitted[r.id]:
                fate = f"evicted while queued: {rec['why']}"
            else:
                fate = "held, not used"
            fate += f" ({rec['role']})"
        tokens[fate] += reached - cached
        requests[fate] += 1
        if oracle > reached:
            tokens["beyond the deepest snapshot"] += oracle - reached
        lines.append(f"{r.id} ({r.kind}): served {cached} of {oracle} shared with {source.id}; "
                     f"{fate}, snapshot at {reached}")
    return tokens, requests, lines
