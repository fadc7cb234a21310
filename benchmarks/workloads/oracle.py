"""The reuse an infinite exact prefix cache could deliver (the oracle bound).

For request i sent at s_i with prompt P_i (n_i tokens):
    oracle_i = min(n_i - 1, max over requests j that finished before s_i
                            of LCP(P_i, P_j + O_j))
where O_j is the output j returned (for an aborted request, what the client
received). P_j + O_j covers "P_j alone" since P_j is its prefix. Requests still
running at s_i do not count, even if a real cache may already share their prefix
(so a server can report more than the oracle under concurrency).

PrefixIndex is a trie over 64-token blocks (exact tuples as keys) plus, per node,
the partial tails of inserted sequences; a query walks whole blocks and then
compares the next <= 64 tokens with the node's children and tails.
"""
from __future__ import annotations

import bisect
import heapq
from typing import Iterable, Sequence

from .trace import Request, simulate

BLOCK = 64


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _BlockTrie:
    """Exact 64-token blocks as trie nodes, each with a set of sub-block tails."""

    def __init__(self, block: int = BLOCK):
        self.block = block
        self.children: list[dict[tuple, int]] = [{}]
        self.tails: list[set[tuple]] = [set()]

    def _insert_blocks(self, seq: Sequence[int]) -> tuple[int, int]:
        """Add seq's whole blocks; returns (the node of the last one, how many tokens were new)."""
        B, node, new = self.block, 0, 0
        for b in range(len(seq) // B):
            key = tuple(seq[b * B:(b + 1) * B])
            nxt = self.children[node].get(key)
            if nxt is None:
                nxt = len(self.children)
                self.children[node][key] = nxt
                self.children.append({})
                self.tails.append(set())
                new += B
            node = nxt
        return node, new


class PrefixIndex(_BlockTrie):
    def insert(self, seq: Sequence[int]) -> int:
        """Add seq; returns how many of its tokens were new to the index (whole blocks + tail)."""
        node, new = self._insert_blocks(seq)
        tail = tuple(seq[len(seq) // self.block * self.block:])
        if tail and tail not in self.tails[node] and not any(
                k[:len(tail)] == tail for k in self.children[node]):
            new += len(tail) - max((_lcp(tail, t) for t in self.tails[node]), default=0)
            self.tails[node].add(tail)
        return new

    def longest(self, seq: Sequence[int]) -> int:
        """Longest prefix of seq that some inserted sequence shares (uncapped)."""
        B, node, d = self.block, 0, 0
        while (d + 1) * B <= len(seq):
            nxt = self.children[node].get(tuple(seq[d * B:(d + 1) * B]))
            if nxt is None:
                break
            node, d = nxt, d + 1
        rest = seq[d * B:(d + 1) * B]
        best = 0
        if rest:
            for k in self.children[node]:
                best = max(best, _lcp(rest, k))
            for t in self.tails[node]:
                best = max(best, _lcp(rest, t))
        return d * B + best


class EndIndex(_BlockTrie):
    """Whole sequences by where they end: a node's tails are those that end a sequence there."""

    def insert(self, seq: Sequence[int]) -> None:
        node, _ = self._insert_blocks(seq)
        self.tails[node].add(tuple(seq[len(seq) // self.block * self.block:]))

    def deepest(self, seq: Sequence[int], limit: int) -> int:
        """The longest inserted sequence that is a prefix of ``seq``, at most ``limit`` long."""
        B, node, d, best = self.block, 0, 0, 0
        while True:
            for t in self.tails[node]:
                end = d * B + len(t)
                if best < end <= limit and tuple(seq[d * B:end]) == t:
                    best = end
            if (d + 1) * B > len(seq):
                return best
            nxt = self.children[node].get(tuple(seq[d * B:(d + 1) * B]))
            if nxt is None:
                return best
            node, d = nxt, d + 1


def _in_send_order(events: Iterable[tuple]):
    """(id, prompt, the (prompt, output) of the requests that finished since the previous one
    was sent) for each request, in send order. events: (id, sent, finished_or_None, prompt,
    output); finished=None: never finished (failed), so it never counts for later requests."""
    events = list(events)
    fins = sorted((e for e in events if e[2] is not None), key=lambda e: e[2])
    k = 0
    for rid, sent, _, prompt, _ in sorted(events, key=lambda e: e[1]):
        done = []
        while k < len(fins) and fins[k][2] < sent:
            done.append(fins[k][3:])
            k += 1
        yield rid, prompt, done


def oracle_bounds(events: Iterable[tuple]) -> dict[str, int]:
    """events: (id, sent, finished_or_None, prompt, output). Returns id -> oracle bound."""
    idx, out = PrefixIndex(), {}
    for rid, prompt, done in _in_send_order(events):
        for p, o in done:
            idx.insert(list(p) + list(o))
        out[rid] = max(0, min(len(prompt) - 1, idx.longest(prompt)))
    return out


def clairvoyant_tap_bounds(events: Iterable[tuple]) -> dict[str, int]:
    """Bound (a) of the hybrid cache: infinite memory and a state taken wherever some later
    request will resume. A recurrent state exists only where a pass stopped: anywhere in an
    earlier prompt (a tap in its prefill) or at the end of an earlier request's prompt and
    output (its endpoint, after all but the last output token), never inside an output. So
    request i gets min(n_i - 1, the longest prefix it shares with an earlier finished prompt),
    or the deepest earlier endpoint its prompt continues, whichever is deeper. ``events`` as
    for ``oracle_bounds``; never above it."""
    prompts, endpoints, out = PrefixIndex(), EndIndex(), {}
    for rid, prompt, done in _in_send_order(events):
        for p, o in done:
            prompts.insert(list(p))
            endpoints.insert(list(p) + list(o)[:-1])
        limit = len(prompt) - 1
        out[rid] = max(0, min(limit, prompts.longest(prompt)), endpoints.deepest(prompt, limit))
    return out


def distinct_tokens(seqs: Iterable[Sequence[int]]) -> int:
    """Size of the union of the sequences' prefix trees, in tokens (the working set)."""
    idx = PrefixIndex()
    return sum(idx.insert(s) for s in seqs)


def describe(reqs: list[Request]) -> dict:
    """Token counts with stand-in outputs, assuming rounds finish in order."""
    done = simulate(reqs)
    depth: dict[str, int] = {}
    rounds = {r.id: r.round for r in reqs}
    events = []
    for r in reqs:
        d = 1 + max((depth[x] for x in r.deps() if rounds[x] == r.round), default=-1)
        depth[r.id] = d
        events.append((r.id, r.round * 1000 + d, r.round * 1000 + d + 0.5, *done[r.id]))
    orc = oracle_bounds(events)
    plen = [len(done[r.id][0]) for r in reqs]
    return {
        "requests": len(reqs), "sessions": len({r.session for r in reqs}),
        "rounds": 1 + max((r.round for r in reqs), default=-1),
        "kinds": {k: sum(r.kind == k for r in reqs) for k in sorted({r.kind for r in reqs})},
        "prompt_tokens": sum(plen), "max_prompt": max(plen, default=0),
        "max_request": max((p + r.max_new_tokens for p, r in zip(plen, reqs)), default=0),
        "output_tokens": sum(len(o) for _, o in done.values()),
        "oracle_tokens": sum(orc.values()),
        "working_set": distinct_tokens(p + o for p, o in done.values()),
        "max_round_requests": max((sum(r.round == k for r in reqs) for k in set(rounds.values())),
                                  default=0),
    }


def clairvoyant_retention_bounds(events: Iterable[tuple], memory: Sequence[int], block_bytes: int,
                                 state_bytes: int) -> dict[str, int]:
    """Bound (b) of the hybrid cache: bound (a)'s clairvoyant taps (``clairvoyant_tap_bounds``)
    in ``memory``: (device KV bytes, device state bytes, host bytes), kept by clairvoyant
    retention. The device pools hold only their own kind (KV blocks, states: a mamba slot is
    no room for KV), the host either, so what is kept fits when the KV beyond the device's KV
    pool and the states beyond its slots fit in host together; over that, the item needed
    farthest in the future of a kind that overflows goes first (Belady; the sizes are not
    weighed). The items: 64-token KV blocks (``block_bytes`` each) and the states later
    requests resume at (``state_bytes``, plus a block of KV for a partial page's tail). A finished
    request leaves its blocks and the states on its path that a later request will resume at
    (a tap in its prompt, or its endpoint); a request gets the deepest retained state on its
    path, up to its bound (a), with every block below it retained. ``events`` as for
    ``oracle_bounds``; never above bound (a)."""
    events = list(events)
    targets = clairvoyant_tap_bounds(events)
    order = [rid for rid, _, _ in _in_send_order(events)]
    prompts = {e[0]: list(e[3]) for e in events}
    uses: dict = {}                     # item -> the send indices of the requests that use it
    used_at: list = []                  # send index -> the items its resume uses
    anchored: dict = {}                 # chain key -> {tail tokens: state item}
    for t, rid in enumerate(order):
        r, chain = targets[rid], _chain(prompts[rid])
        used_at.append([])
        if not r:
            continue
        state = ("s", chain[r // BLOCK], tuple(prompts[rid][r // BLOCK * BLOCK:r]))
        anchored.setdefault(state[1], {})[state[2]] = state
        for item in [("b", c) for c in chain[1:r // BLOCK + 1]] + [state]:
            uses.setdefault(item, []).append(t)
            used_at[t].append(item)
    *device, host = memory
    pools = dict(zip("bs", device))    # KV bytes, state bytes the device holds
    kv_of = {item: block_bytes if item[0] == "b" or item[2] else 0 for item in uses}
    used = {"b": 0, "s": 0}             # KV bytes, state bytes kept
    kept, heaps, out = {}, {"b": [], "s": []}, {}

    def over(kind: str) -> int:
        return max(0, used[kind] - pools[kind])

    def fits() -> bool:
        return over("b") + over("s") <= host

    def account(item, sign: int) -> None:
        used["b"] += sign * kv_of[item]
        used["s"] += sign * (state_bytes if item[0] == "s" else 0)

    def next_use(item, now: int) -> int:
        times = uses.get(item, ())
        k = bisect.bisect_right(times, now)
        return times[k] if k < len(times) else len(order)

    def keep(item, now: int) -> None:
        when = next_use(item, now)
        if when == len(order):              # no later request resumes through it
            return
        if item not in kept:
            account(item, 1)
        kept[item] = when
        heapq.heappush(heaps[item[0]], (-when, item))

    def evict() -> bool:
        """Let go of the kept item needed farthest of a kind beyond its device pool."""
        for heap in heaps.values():     # entries superseded by a later keep or a use
            while heap and kept.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)
        kinds = ["b" if heaps["b"] else "s"] if over("b") else []   # (a tail's KV)
        kinds = [k for k in kinds + (["s"] if over("s") else []) if heaps[k]]
        if not kinds:
            return False
        _, item = heapq.heappop(min((heaps[k] for k in kinds), key=lambda h: h[0]))
        del kept[item]
        account(item, -1)
        return True

    for t, (rid, prompt, done) in enumerate(_in_send_order(events)):
        for p, o in done:
            seq, chain = list(p) + list(o), _chain(list(p) + list(o))
            for c in chain[1:]:
                keep(("b", c), t - 1)
            for _, end, state in _states_on(seq, chain, anchored):
                if end <= len(p) or end == len(seq) - 1:      # a tap in the prompt, or the endpoint
                    keep(state, t - 1)
        while not fits() and evict():
            pass
        out[rid] = _deepest_kept(list(prompt), targets[rid], kept, anchored)
        for item in used_at[t]:
            if kept.get(item) == t:         # used now: kept for its next use, if any
                del kept[item]
                account(item, -1)
                keep(item, t)
    return out


def _chain(seq: Sequence[int]) -> list:
    """Keys of the path after 0, 1, ... whole blocks of ``seq`` (entry b: the path of b blocks)."""
    out = [()]
    for b in range(len(seq) // BLOCK):
        out.append(hash((out[-1], tuple(seq[b * BLOCK:(b + 1) * BLOCK]))))
    return out


def _states_on(seq: Sequence[int], chain: list, anchored: dict):
    """(blocks below it, depth, item) of each state in ``anchored`` on ``seq``'s path
    (``chain``: its block keys)."""
    for b, c in enumerate(chain):
        for tail, state in anchored.get(c, {}).items():
            end = b * BLOCK + len(tail)
            if tuple(seq[b * BLOCK:end]) == tail:
                yield b, end, state


def _deepest_kept(prompt: list, limit: int, kept: dict, anchored: dict) -> int:
    """The deepest kept state on ``prompt``'s path at most ``limit`` deep, all blocks below it
    kept."""
    chain = _chain(prompt[:limit])
    held = next((b for b in range(1, len(chain)) if ("b", chain[b]) not in kept), len(chain))
    return max((end for b, end, state in _states_on(prompt, chain, anchored)
                if b < held and end <= limit and state in kept), default=0)
