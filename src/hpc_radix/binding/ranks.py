"""Tensor parallelism (design §12.3): every rank decides alike.

Under ``--tp N`` each rank runs its own scheduler and cache over its shard of the KV and GDN
heads, and SGLang needs every rank to admit, evict and schedule alike: a rank that matched one
block more than the others runs a pass of another shape, and the ranks' collectives hang. The
cache's decisions are functions of the requests, which every rank sees in the same order, and
of facts that arrive on each rank at its own moment:

- host tier chunks pinned by a background thread (slabs a host write may take);
- host copies landing (a landed write unpins its pages and makes its blocks restorable; a
  landed restore makes its pages evictable).

``RankAgreement.agree`` takes, once per batch build, the smallest count of each that every rank
has reached (an all-reduce over SGLang's TP CPU group, as SGLang's HiCache agrees on its host
hits), and the host tier acts on those counts only, so every rank brings the same chunks online
and lands the same copies before the same step. Nothing else a decision reads differs between
ranks: settled reads only choose how page ids are read (the epoch counts batch builds), the
coalescer's wait is counted in batch builds, the cost model has no per-rank timing, and the
ranks' layouts are checked equal at startup.

With ``HPC_TP_CHECK=1`` each batch build also compares a digest of the decisions made since the
last one (matches, evictions, and the index's counters) across the ranks, and stops the server
at the first divergence with both ranks' decisions in the error.
"""
from __future__ import annotations

import logging
from typing import Sequence

import xxhash

from hpc_radix.errors import HybridConfigError

logger = logging.getLogger(__name__)


class RankDivergence(RuntimeError):
    """The ranks' caches decided differently (``HPC_TP_CHECK``)."""


class RankAgreement:
    """What the TP ranks' caches agree on; one rank (``size == 1``) agrees with itself at no
    cost. ``check``: keep a decision log and compare it across ranks at each batch build."""

    def __init__(self, group=None, rank: int = 0, size: int = 1, check: bool = False):
        if size > 1 and group is None:
            raise HybridConfigError(f"tp_size={size} but SGLang gave the cache no TP CPU group")
        self.group, self.rank, self.size = group, rank, size
        self.checking = check
        self.step = 0                          # batch builds compared so far
        self.digests: list[int] = []           # check: one per step (tests compare them)
        self._decisions: list[tuple] = []      # check: since the last step

    @classmethod
    def of_group(cls, group, check: bool = False) -> "RankAgreement":
        """Over SGLang's TP CPU group for the cache (the attention TP group under DP attention,
        where it may be one rank); None: one rank."""
        if group is None:
            return cls(check=check)
        import torch

        return cls(group, torch.distributed.get_rank(group), torch.distributed.get_world_size(group),
                   check=check)

    @property
    def solo(self) -> bool:
        return self.size == 1

    def agree(self, counts: Sequence[int]) -> list[int]:
        """Each count's smallest value over the ranks."""
        if self.solo:
            return list(counts)
        import torch

        values = torch.tensor(list(counts), dtype=torch.int64)
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return values.tolist()

    def spread(self, values: Sequence[int]) -> tuple[list[int], list[int]]:
        """Each value's smallest and largest over the ranks, in one all-reduce."""
        both = self.agree([*values, *(-v for v in values)])
        return both[:len(values)], [-v for v in both[len(values):]]

    def same_everywhere(self, value: int) -> bool:
        """Whether every rank holds ``value`` (an int64 digest)."""
        (low,), (high,) = self.spread([value])
        return low == high == value

    def check_layout(self, **sizes: int) -> None:
        """Refuse to start when the ranks' pools or host tiers differ in size: their indexes
        would run out of room at different moments."""
        if self.solo:
            return
        names = sorted(sizes)
        low, high = self.spread([sizes[n] for n in names])
        differ = [f"{n} {lo}..{hi}" for n, lo, hi in zip(names, low, high) if lo != hi]
        if differ:
            raise HybridConfigError(f"the {self.size} TP ranks' caches differ in size ("
                                    f"{', '.join(differ)}): they could not decide alike")

    # ---- the divergence check (HPC_TP_CHECK) ---------------------------------------------------
    def note(self, *decision) -> None:
        """A decision of this step (call only when ``checking``)."""
        self._decisions.append(decision)

    def end_step(self, state: tuple) -> None:
        """A batch was built: digest this step's decisions and ``state`` (the index's
        counters), compare it across the ranks, and raise at the first difference."""
        if not self.checking:
            return
        decisions, self._decisions = self._decisions, []
        self.step += 1
        digest = xxhash.xxh64_intdigest(repr((decisions, state)).encode()) & (2**63 - 1)
        self.digests.append(digest)
        if self.same_everywhere(digest):
            return
        import torch

        logs = [None] * self.size
        torch.distributed.all_gather_object(logs, (decisions, state), group=self.group)
        mine = "; ".join(f"rank {r}: decisions {d}, index {s}" for r, (d, s) in enumerate(logs))
        raise RankDivergence(f"hybrid radix cache: the TP ranks' caches diverged at batch build "
                             f"{self.step} (HPC_TP_CHECK): {mine}")


def index_state(index, pool) -> tuple:
    """What the index holds and the allocators have free, in counts (``end_step`` compares
    it across the ranks); ``pool``: the cache's DevicePool."""
    sizes = index.sizes
    return (sizes.snapshots, sizes.device_pages, sizes.evictable_pages, sizes.device_images,
            pool.num_freed_pages, sizes.write_pinned_pages, sorted(index.stats.items()),
            pool.free, pool.mamba_allocator.available_size())
