"""PrefixIndex unit tests: design §13.1 list (TapPlanner is in test_taps.py).

Every expected value below is derived by hand in the comments: tokens, pages and slabs are
chosen so that each assertion pins one exact outcome. Unless a test says otherwise the cost model
is linear and free of fixed costs (1 ms per prefilled token, 1 GB/s host -> device), one slab is
4096 bytes, a KV block bundle is one slab and a state image is two slabs:

    prefill_seconds(base, t) = t * 1e-3
    restore_seconds(image)   = 8192 / 1e9 = 8.192e-6 s
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import hpc_radix.index.keys as keys_mod
from hpc_radix.index import (
    CommitStatus, CostModel, PrefixIndex, PromptKey, Readiness, SlabPool, SnapshotKind,
    check_invariants,
)
from hpc_radix.index.actions import FreeDevice, WriteBlocks, WriteImage, freed_by
from hpc_radix.index.slabs import MAX_CHUNK_BYTES

TAP, ENDPOINT, BOUNDARY = SnapshotKind.TAP, SnapshotKind.ENDPOINT, SnapshotKind.BOUNDARY
SLAB = 4096
IMAGE = 2 * SLAB
R_IMG = IMAGE / 1e9          # restore seconds of one image
CM = CostModel(prefill_pass_s=0.0, prefill_token_s=1e-3, attention_pair_s=0.0,
               h2d_bytes_per_s=1e9, restore_batch_s=0.0)


def blk(i: int) -> list[int]:
    """64 tokens that belong to block ``i`` alone."""
    return list(range(64 * i + 1, 64 * i + 65))


def tail(i: int, n: int) -> list[int]:
    """``n`` tokens of a partial block ``i`` (a prefix of blk(i))."""
    return blk(i)[:n]


def cat(*parts) -> list[int]:
    out: list[int] = []
    for p in parts:
        out += p
    return out


class Cache:
    """A PrefixIndex driven the way the binding drives it, with fake page and slot ids."""

    def __init__(self, slots: int = 8, host_slabs: int = 0, cost: CostModel = CM):
        host = SlabPool(host_slabs * SLAB, SLAB) if host_slabs else None
        self.idx = PrefixIndex(image_bytes=IMAGE, device_snapshot_slots=slots, host=host,
                               cost=cost, block_bytes=SLAB)
        self._pages = itertools.count(1000)
        self._slots = itertools.count(0)

    def page(self) -> int:
        return next(self._pages)

    def key(self, tokens, namespace=None, media=None) -> PromptKey:
        return PromptKey(np.asarray(tokens, dtype=np.int32), namespace, media)

    def start(self, tokens, source="auto", namespace=None, media=None):
        """begin(): from the match's chosen source ("auto"), cold (None) or a given candidate."""
        key = self.key(tokens, namespace, media)
        if source == "auto":
            source = self.idx.match(key).chosen
        if source is not None and source.snapshot is None:
            source = None
        restore = [self.page() for _ in range(source.host_blocks)] if source else []
        seq, actions = self.idx.begin(key, source, restore_pages=restore)
        for restore in actions:
            self.idx.landed(restore)
        return seq

    def commit(self, seq, upto=None):
        upto = len(seq.key) if upto is None else upto
        pages = [n.device_page for n in seq.path]
        pages += [self.page() for _ in range(len(pages), upto // 64)]
        return self.idx.commit(seq, upto, pages).nodes

    def snap(self, seq, frontier, kind=TAP):
        got = self.idx.acquire_slot(seq, frontier, kind)
        if got is None:
            return None
        slot = got.slot if got.slot is not None else next(self._slots)
        return self.idx.publish(seq, frontier, kind, slot, self.page() if frontier % 64 else -1).snapshot

    def write(self, nodes):
        """The nodes written through, their copy landed."""
        write = copy_of(self.idx.writes.write_through(nodes))
        if write is None:
            return []
        self.idx.landed(write)
        return list(write.nodes)

    def write_image(self, s):
        """The host slabs of s's image and tail, its copy landed ([] when refused)."""
        write = copy_of(self.idx.writes.write_image(s))
        if write is None:
            return []
        self.idx.landed(write)
        return list(write.slabs)

    def turn(self, tokens, snaps=(), source="auto", write=False, namespace=None, media=None):
        """One request: begin, commit every full block, publish ``snaps`` ((F, kind) or F),
        release, and with ``write`` write its path and its snapshots through to the host."""
        seq = self.start(tokens, source, namespace, media)
        self.commit(seq)
        out = []
        for sp in snaps:
            f, kind = sp if isinstance(sp, tuple) else (sp, TAP)
            out.append(self.snap(seq, f, kind))
        path = list(seq.path)
        self.idx.release(seq)
        if write:
            self.write(path)
            for s in out:
                if s is not None:
                    self.write_image(s)
        check_invariants(self.idx)
        return out if len(out) != 1 else out[0]

    def nodes_by_block(self):
        """{first token of the block: node} for every node (blocks are unique in these tests)."""
        return {int(np.frombuffer(n.block_bytes, "<i4")[0]) // 64: n for n in self.idx.tree.nodes()}


def copy_of(actions):
    """The write among a write-through plan's actions (None when it was refused)."""
    return next((a for a in actions if not isinstance(a, FreeDevice)), None)


def node_of(c: Cache, *blocks):
    """The node of the path made of ``blocks`` (block ids)."""
    key = c.key(cat(*(blk(b) for b in blocks)))
    n = c.idx.tree.walk(key, len(blocks))
    assert n.depth == len(blocks) - 1
    return n


# =========================================================================== BlockTree


def test_insert_and_match_exact_tokens():
    c = Cache()
    seq = c.start(cat(blk(0), blk(1), blk(2), tail(3, 10)))
    res = c.commit(seq)
    assert [st for _, st in res] == [CommitStatus.INSERTED] * 3
    assert [n.device_page for n, _ in res] == [1000, 1001, 1002]
    c.idx.release(seq)
    tree = c.idx.tree
    # same first two blocks, third differs in its last token
    other = cat(blk(0), blk(1), blk(2)[:-1], [999_999], [5])
    assert tree.match(c.key(other), 10).depth == 1
    # a prompt whose first block differs in its first token shares nothing
    assert tree.match(c.key(cat([999_999], blk(0)[1:], blk(1), [5])), 10).is_root
    # a second request sharing two blocks: those are duplicates, its own page stays private
    seq2 = c.start(cat(blk(0), blk(1), blk(7), [1]), source=None)
    res = c.commit(seq2)
    assert [st for _, st in res] == [CommitStatus.DUPLICATE, CommitStatus.DUPLICATE,
                                     CommitStatus.INSERTED]
    assert [n.device_page for n, _ in res] == [1000, 1001, 1005]
    c.idx.release(seq2)
    assert tree.num_nodes == 4
    check_invariants(c.idx)


def test_a_prompt_going_on_with_an_evicted_endpoint_echoes_its_output():
    c = Cache()
    history = cat(blk(0), blk(1), tail(2, 40))           # prompt + output, endpoint at 168
    c.turn(history, snaps=[(168, ENDPOINT)])
    assert freed_by(c.idx.evict_slots(1)).slots == [0] and not c.idx.sizes.snapshots      # the endpoint is gone
    echo = c.key(cat(blk(0), blk(1), tail(2, 40), [7] * 30))       # history + a new message
    assert c.idx.match(echo).echoes_output
    rerendered = c.key(cat(blk(0), blk(1), tail(2, 20), [5] * 50))  # output changed at 148
    assert not c.idx.match(rerendered).echoes_output
    assert not c.idx.match(c.key(cat(blk(0), [9] * 100))).echoes_output  # no endpoint at block 0
    check_invariants(c.idx)


def test_namespace_extra_key_isolates_identical_tokens():
    c = Cache()
    toks = cat(blk(0), blk(1), [1])
    c.turn(toks, snaps=[128])
    assert c.idx.match(c.key(cat(toks, [2]))).chosen.frontier == 128
    for ns in ("lora-1", "salt:abc"):
        m = c.idx.match(c.key(cat(toks, [2]), namespace=ns))
        assert m.node.is_root and m.deepest is None and m.chosen.snapshot is None
    # inserting under a namespace builds a separate path; both keep their own snapshot
    c.turn(toks, snaps=[64], namespace="lora-1")
    assert c.idx.tree.num_nodes == 4
    assert c.idx.match(c.key(cat(toks, [2]), namespace="lora-1")).chosen.frontier == 64
    assert c.idx.match(c.key(cat(toks, [2]))).chosen.frontier == 128


def test_different_media_digest_with_same_tokens_misses():
    c = Cache()
    toks = cat(blk(0), blk(1), blk(2), [1])
    # an image over block 1: its key and every later block's key depend on its digest
    c.turn(toks, snaps=[64, 192], media=[0, 0xA1, 0xA1, 0xA1])
    assert c.idx.lineage.by_id[0].superseded     # the tap at 64 yields to the tap at 192 (§9.3)
    m = c.idx.match(c.key(toks, media=[0, 0xA1, 0xA1, 0xA1]))
    assert m.node.depth == 2 and m.chosen.frontier == 192
    for media in ([0, 0xB2, 0xB2, 0xB2], None):
        m = c.idx.match(c.key(toks, media=media))
        assert m.node.depth == 0                       # block 0 is text: shared
        assert m.deepest.frontier == 64                # only the snapshot before the image


def test_tail_media_key_is_part_of_the_tail_identity():
    # An image inside the partial last block: same tail tokens, other digest must miss.
    c = Cache()
    toks = cat(blk(0), blk(1), tail(2, 22))             # endpoint at 150, tail in block 2
    c.turn(toks, snaps=[(150, ENDPOINT)], media=[0, 0, 0xA1])
    q = cat(toks, [7, 7])
    assert c.idx.match(c.key(q, media=[0, 0, 0xA1])).chosen.frontier == 150
    assert c.idx.match(c.key(q, media=[0, 0, 0xB2])).deepest is None
    assert c.idx.match(c.key(q)).deepest is None
    # the other digest publishes its own snapshot at the same (anchor, tail tokens)
    s2 = c.turn(toks, snaps=[(150, ENDPOINT)], media=[0, 0, 0xB2])
    assert s2 is not None and c.idx.sizes.snapshots == 2
    assert c.idx.match(c.key(q, media=[0, 0, 0xB2])).chosen.snapshot is s2


class _Spy:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *a, **k):
        self.calls += 1
        return self.fn(*a, **k)


def test_forced_constant_lookup_hash_never_gives_a_false_hit(monkeypatch):
    monkeypatch.setattr(keys_mod, "_xxh3", lambda data, seed=0: 0x42)
    c = Cache()
    tree = c.idx.tree
    # P = A B C D, Q = A B X (sibling of C), R = Y B C D (same later bytes, other root block)
    c.turn(cat(blk(0), blk(1), blk(2), blk(3), [1]), snaps=[256])
    c.turn(cat(blk(0), blk(1), blk(9), [1]), snaps=[192], source=None)
    s_r = c.turn(cat(blk(8), blk(1), blk(2), blk(3), [1]), snaps=[256], source=None)
    assert tree.num_nodes == 4 + 1 + 4
    assert len({n.hash for n in tree.nodes()}) == 1          # every node in one bucket
    spy = _Spy(tree.walk)
    monkeypatch.setattr(tree, "walk", spy)

    def deepest_blocks(q, limit=100):
        n = tree.match(c.key(q), limit)
        assert n is tree.walk.fn(c.key(q), limit)             # same as the reference walk
        return [int(np.frombuffer(p.block_bytes, "<i4")[0]) // 64 for p in n.path()]

    # full paths present: the binary search answers without the block-by-block walk
    assert deepest_blocks(cat(blk(0), blk(1), blk(2), blk(3), [5])) == [0, 1, 2, 3]
    assert deepest_blocks(cat(blk(8), blk(1), blk(2), blk(3), [5])) == [8, 1, 2, 3]
    assert deepest_blocks(cat(blk(0), blk(1), blk(2), blk(3), [5]), limit=2) == [0, 1]
    assert spy.calls == 0
    # partial or absent paths: every depth "hits" the hash, verification fails, walk decides
    assert deepest_blocks(cat(blk(0), blk(1), blk(9), blk(3), [5])) == [0, 1, 9]
    assert deepest_blocks(cat(blk(0), blk(1), blk(4), [5])) == [0, 1]
    assert deepest_blocks(cat(blk(7), blk(1), blk(2), blk(3), [5])) == []
    assert deepest_blocks(cat(blk(0), blk(8), blk(2), blk(3), [5])) == [0]
    assert spy.calls == 4
    # snapshots: R's snapshot (same last three blocks, same hash) never serves P's prompt
    m = c.idx.match(c.key(cat(blk(5), blk(1), blk(2), blk(3), [5])))
    assert m.node.is_root and m.deepest is None
    assert c.idx.match(c.key(cat(blk(8), blk(1), blk(2), blk(3), [5]))).chosen.snapshot is s_r
    # a new sibling in the shared bucket is inserted, not confused with C or X
    seq = c.start(cat(blk(0), blk(1), blk(6), [1]), source=None)
    assert [st for _, st in c.commit(seq)] == [CommitStatus.DUPLICATE, CommitStatus.DUPLICATE,
                                             CommitStatus.INSERTED]
    assert seq.path[2].block_bytes == np.asarray(blk(6), "<i4").tobytes()
    c.idx.release(seq)
    # namespaces share the (constant) seed too and still never meet
    assert tree.match(c.key(cat(blk(0), blk(1), [5]), namespace="ns"), 10).is_root
    check_invariants(c.idx)


def test_tail_snapshot_matches_exact_tail_tokens_only():
    c = Cache()
    base = cat(blk(0), blk(1))
    c.turn(cat(base, tail(2, 10)), snaps=[128, (138, ENDPOINT)])   # tap 128, endpoint 138
    m = c.idx.match

    def best(q):
        return m(c.key(q)).deepest.frontier

    assert best(cat(base, tail(2, 10), [1])) == 138                 # tail then more: hit
    assert best(cat(base, tail(2, 40))) == 138                      # longer tail: hit at 138
    assert best(cat(base, tail(2, 9), [999_999], [1])) == 128       # last tail token differs
    assert best(cat(base, [999_999], tail(2, 10)[1:], [1])) == 128  # first tail token differs
    assert best(cat(base, tail(2, 7), [999_999])) == 128            # prompt ends inside the tail
    assert best(cat(base, tail(2, 10))) == 128                      # n = 138: F <= 137


def test_frontier_never_reaches_the_whole_prompt():
    c = Cache()
    seq_toks = cat(blk(0), blk(1), tail(2, 22))                     # 150 tokens
    c.turn(seq_toks, snaps=[64, (150, ENDPOINT)])
    m = c.idx.match
    # the same prompt as the cached sequence: at most n - 1 = 149, so the tap at 64 (not 150)
    assert m(c.key(seq_toks)).deepest.frontier == 64
    assert m(c.key(cat(seq_toks, [3]))).deepest.frontier == 150
    # n = 128 (two full blocks): only one block may be matched
    mm = m(c.key(cat(blk(0), blk(1))))
    assert mm.node.depth == 0 and mm.deepest.frontier == 64
    # a 64-token prompt: the tap at 64 would be a full hit
    mm = m(c.key(blk(0)))
    assert mm.node.is_root and mm.deepest is None
    # limit lowers it
    long = cat(seq_toks, [3] * 100)
    assert m(c.key(long), limit=150).deepest.frontier == 150
    assert m(c.key(long), limit=149).deepest.frontier == 64
    assert m(c.key(long), limit=63).deepest is None
    assert m(c.key(long), limit=127).node.depth == 0


def test_duplicate_publication_is_a_noop_that_refreshes_recency():
    c = Cache()
    idx = c.idx
    toks = cat(blk(0), tail(1, 10))
    first = c.turn(toks, snaps=[(74, ENDPOINT)])                  # A 1000, tail 1001, slot 0
    other = c.turn(cat(blk(5), tail(6, 3)), snaps=[(67, ENDPOINT)], source=None)
    assert idx.lru.order() == [first, node_of(c, 0), other, node_of(c, 5)]
    tick, slot, tail_page = first.last_hit, first.device_slot, first.tail_page
    seq = c.start(toks, source=None)
    c.commit(seq)
    assert idx.find_snapshot(seq, 74) is first
    assert idx.acquire_slot(seq, 74, ENDPOINT) == (None, [])
    assert idx.sizes.staged_slots == 1
    # the duplicate's slot and tail page go back
    assert idx.publish(seq, 74, ENDPOINT, device_slot=99, tail_page=5555) == (None, [FreeDevice([5555], [99])])
    assert idx.sizes.staged_slots == 0
    assert list(idx.snapshots()) == [first, other]
    assert (first.device_slot, first.tail_page, first.hits) == (slot, tail_page, 0)
    assert first.last_hit > tick
    assert idx.lru.order()[-1] is first               # its tail moved to the MRU end
    idx.release(seq)
    assert idx.sizes.device_images == 2                     # slot 99 and page 5555 stay the caller's
    assert 5555 not in [n.device_page for n in idx.tree.nodes()] + [s.tail_page for s in idx.snapshots()]
    check_invariants(idx)


# =========================================================================== Liveness


def live(c: Cache, *blocks) -> int:
    return node_of(c, *blocks).live_below


def test_live_snapshots_below_under_publish_evict_and_subtree_deletion():
    c = Cache(slots=3)
    idx = c.idx
    # tree: A B C, A B X, A Y; no host tier, so every eviction loses the last copy.
    # pages: turn 1 A B C = 1000 1001 1002; turn 2 (cold) A B dup 1003 1004, X 1005, tail 1006;
    # turn 3 A dup 1007, Y 1008.
    c.turn(cat(blk(0), blk(1), blk(2), [1]), snaps=[64, 192])       # s64 (superseded), s192
    sx = c.turn(cat(blk(0), blk(1), blk(3), tail(4, 5)), snaps=[(197, ENDPOINT)], source=None)
    assert [live(c, 0), live(c, 0, 1), live(c, 0, 1, 2), live(c, 0, 1, 3)] == [3, 2, 1, 1]
    # all three slots in use; a new tap on A Y takes the superseded s64's slot and deletes it
    sy = c.turn(cat(blk(0), blk(5), [1]), snaps=[128], source=None)
    assert sy.device_slot == 0 and idx.sizes.snapshots == 3
    assert [live(c, 0), live(c, 0, 1), live(c, 0, 1, 2), live(c, 0, 5)] == [3, 2, 1, 1]
    # LRU, oldest first: C (turn 1; B and A were re-pinned later), sx's tail (enters the LRU
    # when published, before its lane releases), X, B (turn 2), Y, A (turn 3)
    order = idx.lru.order()
    assert order == [node_of(c, 0, 1, 2), sx, node_of(c, 0, 1, 3), node_of(c, 0, 1),
                     node_of(c, 0, 5), node_of(c, 0)]
    assert freed_by(idx.evict_pages(1)) == ([1002], [1])                       # C, with s192 (slot 1)
    assert [live(c, 0), live(c, 0, 1), live(c, 0, 1, 3), live(c, 0, 5)] == [2, 1, 1, 1]
    assert freed_by(idx.evict_pages(1)) == ([1006], [2])                       # sx's tail: sx goes (slot 2)
    assert not idx.is_live(sx)
    assert [live(c, 0), live(c, 0, 1), live(c, 0, 1, 3), live(c, 0, 5)] == [1, 0, 0, 1]
    assert freed_by(idx.evict_pages(2)) == ([1005, 1001], [])                       # X, then B: no snapshot left there
    check_invariants(idx)
    # a new branch A Z (A dup 1009, Z 1010, a fresh slot 3), then evict everything
    c.turn(cat(blk(0), blk(6), [1]), snaps=[128], source=None)
    assert [live(c, 0), live(c, 0, 5), live(c, 0, 6)] == [2, 1, 1]
    assert idx.lru.order() == [node_of(c, 0, 5), node_of(c, 0, 6), node_of(c, 0)]
    assert idx.sizes.evictable_pages == 3 and freed_by(idx.evict_pages(100)) == ([1008, 1010, 1000], [0, 3])
    assert idx.tree.num_nodes == 0 and not idx.sizes.snapshots
    check_invariants(idx)


def test_losing_the_last_copy_deletes_exactly_the_subtree_snapshots():
    c = Cache(slots=8, host_slabs=64)
    idx = c.idx
    # A B C D with taps at 64 (A), 128 (B), 192 (C), each from a cold turn (all retained);
    # a branch A B X with an endpoint at 195; A Y with a tap; a root-anchored endpoint at 10.
    s_a = c.turn(cat(blk(0), [1]), snaps=[64])
    s_root = c.turn(tail(0, 10) + [77], snaps=[(10, ENDPOINT)], source=None)
    s_b = c.turn(cat(blk(0), blk(1), [1]), snaps=[128], source=None)
    s_c = c.turn(cat(blk(0), blk(1), blk(2), blk(3), [1]), snaps=[192], source=None)
    s_x = c.turn(cat(blk(0), blk(1), blk(4), tail(5, 3)), snaps=[(195, ENDPOINT)], source=None)
    s_y = c.turn(cat(blk(0), blk(6), [1]), snaps=[128], source=None)
    a, b, y = node_of(c, 0), node_of(c, 0, 1), node_of(c, 0, 6)
    cn, d, x = node_of(c, 0, 1, 2), node_of(c, 0, 1, 2, 3), node_of(c, 0, 1, 4)
    assert [a.live_below, b.live_below, cn.live_below, d.live_below] == [5, 3, 1, 0]
    # every block but B and every image go to the host: only B is unbacked
    assert c.write([a, y, cn, d, x]) == [a, y, cn, d, x]
    for s in idx.snapshots():
        assert c.write_image(s)
    check_invariants(idx)
    backed = idx.lru.num_backed
    assert backed == 7 and len(idx.lru) == 8           # 5 blocks and 2 tails; B unbacked
    assert len(freed_by(idx.evict_pages(7)).pages) == 7           # device copies of backed entries only
    assert idx.tree.num_nodes == 6 and idx.sizes.snapshots == 6
    slots = sorted(s.device_slot for s in (s_b, s_c, s_x))
    handles = {s: (s.id, s.gen) for s in (s_b, s_c, s_x)}
    node_handles = [(n.id, n.gen) for n in (b, cn, d, x)]
    free0 = idx.host.slabs.num_free
    # B loses its last copy: B C D X and exactly s_b s_c s_x go
    assert idx.lru.order() == [b]
    pages, freed_slots = freed_by(idx.evict_pages(1))
    # pages: A 1000, s_root's tail 1001, then turn 3: A dup 1002, B 1003
    assert pages == [1003] and sorted(freed_slots) == slots
    assert idx.host.slabs.num_free - free0 == 3 + 3 * 2 + 1   # C D X, three images, s_x's tail
    assert all(idx.lineage.resolve(*h) is None for h in handles.values())
    assert all(idx.tree.resolve(*h) is None for h in node_handles)
    assert set(idx.snapshots()) == {s_a, s_root, s_y}
    assert [a.live_below, y.live_below] == [2, 1]
    assert idx.tree.num_nodes == 2
    check_invariants(idx)


# =========================================================================== Device LRU


def test_lru_is_tail_first_after_release():
    c = Cache()
    seq = c.start(cat(blk(0), blk(1), blk(2), blk(3), [1]), source=None)
    c.commit(seq)
    path = list(seq.path)
    assert c.idx.sizes.evictable_pages == 0              # active: nothing evictable
    c.idx.release(seq)
    assert c.idx.lru.order() == path[::-1]
    assert freed_by(c.idx.evict_pages(2)) == ([1003, 1002], [])
    assert c.idx.lru.order() == path[:2][::-1]


def test_a_hit_moves_the_whole_path_to_the_mru_end():
    c = Cache()
    p = cat(blk(0), blk(1), blk(2), [1])
    q = cat(blk(5), blk(6), [1])
    c.turn(p, snaps=[64, 192])                        # pages 1000 1001 1002
    c.turn(q, snaps=[128], source=None)               # pages 1003 1004
    a0, a1, a2 = node_of(c, 0), node_of(c, 0, 1), node_of(c, 0, 1, 2)
    b0, b1 = node_of(c, 5), node_of(c, 5, 6)
    assert c.idx.lru.order() == [a2, a1, a0, b1, b0]
    # a request resuming from the tap at 192 touches a0 a1 a2; it ends without committing
    seq = c.start(cat(p, [2]))
    assert seq.source.frontier == 192 and seq.path == [a0, a1, a2]
    c.idx.release(seq)
    assert c.idx.lru.order() == [b1, b0, a2, a1, a0]
    # a hit on the tap at 64 (superseded, still valid) touches a0 only
    seq = c.start(cat(blk(0), [5]))
    assert seq.source.frontier == 64 and seq.path == [a0]
    c.idx.release(seq)
    assert c.idx.lru.order() == [b1, b0, a2, a1, a0]  # a0 was already the MRU end
    seq = c.start(cat(q, [2]))
    c.idx.release(seq)
    assert c.idx.lru.order() == [a2, a1, a0, b1, b0]
    assert freed_by(c.idx.evict_pages(2)) == ([1002, 1001], [1]) # a2 with the tap at 192 (slot 1), a1


def test_backed_entries_are_consumed_before_unbacked():
    c = Cache(host_slabs=32)
    old = cat(blk(0), blk(1), [1])
    new = cat(blk(5), blk(6), [1])
    c.turn(old, snaps=[128])                         # released first, never written: unbacked
    c.turn(new, snaps=[128], source=None, write=True)   # released later but host-backed
    idx = c.idx
    n_new = [node_of(c, 5), node_of(c, 5, 6)]
    assert idx.lru.order() == [n_new[1], n_new[0], node_of(c, 0, 1), node_of(c, 0)]
    assert freed_by(idx.evict_pages(2)).pages == [1003, 1002]      # the backed ones, deepest first
    assert all(n.device_page == -1 and n.on_host for n in n_new)   # only the copy dropped
    assert idx.tree.num_nodes == 4
    # only unbacked entries remain: the next eviction loses data (B of `old`, then A)
    assert freed_by(idx.evict_pages(1)) == ([1001], [0]) # B's page, and the snapshot at 128 with it
    assert idx.tree.num_nodes == 3
    check_invariants(idx)


def test_an_eviction_for_backed_entries_only_stops_before_a_last_copy():
    c = Cache(host_slabs=32)
    c.turn(cat(blk(0), blk(1), [1]), snaps=[128])                 # unbacked
    c.turn(cat(blk(5), blk(6), [1]), snaps=[128], source=None, write=True)
    idx = c.idx
    assert freed_by(idx.evict_pages(5, backed_only=True)) == ([1003, 1002], [])             # the two backed blocks only
    assert freed_by(idx.evict_pages(1, backed_only=True)) == ([], []) and len(idx.lru) == 2
    check_invariants(idx)


def test_a_prefetch_gives_leading_host_only_blocks_device_pages_pinned_until_landed():
    """§6.6: the blocks adopt the pages in path order, pinned (with the snapshot, whose host
    copies are the source) until the copy lands; then they are cached device blocks at the
    MRU end of the LRU, and the match finds them on device."""
    c = Cache(host_slabs=64)
    p = cat(blk(0), blk(1), blk(2), [1])
    s = c.turn(p, snaps=[192], write=True)
    c.turn(cat(blk(7), [1]), snaps=[64], source=None)            # other device content
    idx = c.idx
    assert len(freed_by(idx.evict_pages(3, backed_only=True)).pages) == 3   # p's blocks: host only
    other = node_of(c, 7)
    assert idx.match(c.key(cat(p, [2]))).chosen.host_blocks == 3
    [restore] = idx.prefetch(s, [2000, 2001])
    a, b, d = node_of(c, 0), node_of(c, 0, 1), node_of(c, 0, 1, 2)
    assert restore.seq is None and restore.blocks == (a, b) and restore.pages == [2000, 2001]
    assert a.restoring and b.restoring and a.pinned and b.pinned and s.restore_pins == 1
    assert idx.lru.order() == [other] and d.device_page < 0
    assert idx.match(c.key(cat(p, [2]))).chosen.host_blocks == 1  # restoring counts as device
    check_invariants(idx)
    idx.landed(restore)
    assert not (a.restoring or b.restoring or a.pinned) and s.restore_pins == 0
    assert idx.lru.order() == [b, a, other] and idx.lru.num_backed == 2   # backed queue
    with pytest.raises(ValueError):
        idx.prefetch(s, [2002, 2003])                             # one host-only block left
    check_invariants(idx)


def test_pinned_entries_are_never_returned():
    c = Cache(host_slabs=64)
    idx = c.idx
    # 1. an active sequence's path (pages 1000 1001)
    active = c.start(cat(blk(0), blk(1), [1]), source=None)
    c.commit(active)
    # 2. a snapshot whose image write is in flight, over an unbacked path (1002 1003, tail 1004)
    seq = c.start(cat(blk(5), blk(6), tail(7, 4)), source=None)
    c.commit(seq)
    s_w = c.snap(seq, 132, ENDPOINT)
    n5, n6 = seq.path
    idx.release(seq)
    [w_image] = idx.writes.write_image(s_w)            # pinned until it has landed
    assert w_image.slabs == (0, 1, 2) and w_image.image_slabs == (0, 1) and w_image.tail_slab == 2
    # 3. a node being written through (filling) below a host-backed one (1005 1006)
    seq = c.start(cat(blk(10), blk(11), [1]), source=None)
    c.commit(seq)
    n10, n11 = seq.path
    idx.release(seq)
    [w_blocks] = idx.writes.write_through([n10, n11])
    assert w_blocks.nodes == (n10, n11) and w_blocks.slabs == (3, 4) and w_blocks.pages == [1005, 1006]
    idx.landed(WriteBlocks((n10,), (3,)))            # n10 backed, n11 still filling
    # 4. a request resuming from a snapshot: path and source pinned (1007 1008, slot 1)
    s_r = c.turn(cat(blk(20), blk(21), [1]), snaps=[128], source=None)
    reader = c.start(cat(blk(20), blk(21), [2]))
    assert reader.source is s_r
    # nothing is evictable: every device entry is pinned or holds a pinned entry below it
    assert idx.sizes.evictable_pages == 0 and len(idx.lru) == 0
    assert freed_by(idx.evict_pages(1000)) == ([], [])
    check_invariants(idx)
    # unpin one at a time: exactly the entries that became free are returned
    idx.release(reader)                              # unbacked: evicting loses s_r
    assert freed_by(idx.evict_pages(1000)) == ([1008, 1007], [1])
    idx.landed(WriteBlocks((n11,), (4,)))
    assert idx.lru.order() == [n11, n10]
    idx.landed(w_image)
    # backed: n11 n10, then s_w's tail (backed last); unbacked: n6 n5 (rejoined when s_w's
    # pin went)
    assert idx.lru.order() == [n11, n10, s_w, n6, n5] and idx.lru.num_backed == 3
    assert idx.sizes.evictable_pages == 5
    check_invariants(idx)
    n0, n1 = active.path
    idx.release(active)                              # no snapshot below: dead KV goes first
    assert idx.lru.order() == [n11, n10, s_w, n1, n0, n6, n5]
    assert sorted(freed_by(idx.evict_pages(1000)).pages) == [1000, 1001, 1002, 1003, 1004, 1005, 1006]
    check_invariants(idx)


def test_device_kv_no_snapshot_needs_goes_first_and_back_once_a_snapshot_needs_it():
    """Device KV no snapshot resumes through can give no hit: it is evicted before any live
    path, however recent; a snapshot published below it puts it back at the MRU end."""
    c = Cache(slots=2)
    idx = c.idx
    c.turn(cat(blk(0), blk(1), [1]), snaps=[128], source=None)      # live, oldest
    a0, a1 = node_of(c, 0), node_of(c, 0, 1)
    c.turn(cat(blk(5), blk(6), [1]), source=None)                   # dead from the start
    b0, b1 = node_of(c, 5), node_of(c, 5, 6)
    assert idx.lru.order() == [b1, b0, a1, a0]
    assert freed_by(idx.evict_slots(1)).slots == [0] and not a0.live_below            # a's snapshot goes: a dies
    assert idx.lru.order() == [a1, a0, b1, b0]
    c.turn(cat(blk(9), blk(10), [1]), snaps=[128], source=None)     # live, newest
    d0, d1 = node_of(c, 9), node_of(c, 9, 10)
    assert idx.lru.order() == [a1, a0, b1, b0, d1, d0]
    assert len(freed_by(idx.evict_pages(2)).pages) == 2 and idx.lru.order() == [b1, b0, d1, d0]
    c.turn(cat(blk(5), blk(6), [1]), snaps=[128], source=None)      # b again, with a snapshot
    assert b0.live_below and idx.lru.order() == [d1, d0, b1, b0]
    check_invariants(idx)


def test_filling_descendant_keeps_its_unbacked_ancestor_from_eviction_and_sweep():
    # A written to host earlier; X below it still filling when A is swept and evicted.
    c = Cache(host_slabs=16)
    idx = c.idx
    seq = c.start(cat(blk(0), [1]), source=None)
    c.commit(seq)
    a = seq.path[0]
    idx.release(seq)
    c.write([a])                                     # A: device + host, no snapshot: dead KV
    seq = c.start(cat(blk(0), blk(1), [1]), source=None)
    c.commit(seq)
    x = seq.path[1]
    idx.release(seq)
    [w_x] = idx.writes.write_through([a, x])
    assert w_x.nodes == (x,)
    # the dead-KV sweep may not free A's host copy nor delete it while X is filling below
    assert idx.lifecycle.host_alloc(idx.host.slabs.num_free + 1) == []
    assert a.host_slab >= 0 and idx.tree.resolve(a.id, a.gen) is a
    assert freed_by(idx.evict_pages(10)) == ([], [])
    idx.landed(w_x)
    check_invariants(idx)
    assert idx.lru.order() == [x, a]


def test_dead_kv_losing_its_host_copy_goes_first_and_tail_first():
    # A B C (cold, no snapshot) and A D with a tap at 128: A is live, B and C are dead.
    # Pages: A 1000, B 1001, C 1002; then A dup 1003, D 1004.
    c = Cache(host_slabs=3)
    idx = c.idx
    c.turn(cat(blk(0), blk(1), blk(2), [1]))
    c.turn(cat(blk(0), blk(3), [1]), snaps=[128], source=None)
    a, b, cn, d = node_of(c, 0), node_of(c, 0, 1), node_of(c, 0, 1, 2), node_of(c, 0, 3)
    assert idx.lru.order() == [cn, b, d, a]
    c.write([b])                                     # only B gets a host copy (slab 0)
    assert idx.lru.order() == [b, cn, d, a] and idx.lru.num_backed == 1
    # the sweep takes B's host copy: B and its device-only subtree (C) are dead KV and now
    # unbacked: they go to the front, deepest first, never behind their parent A
    got = idx.lifecycle.host_alloc(3)
    assert got == [0, 1, 2] and b.host_slab == -1
    idx.host.slabs.free(got)
    assert idx.lru.order() == [cn, b, d, a] and idx.lru.num_backed == 0
    check_invariants(idx)
    assert freed_by(idx.evict_pages(2)) == ([1002, 1001], [])
    assert idx.tree.num_nodes == 2 and idx.sizes.snapshots == 1


def test_image_write_in_flight_protects_its_unbacked_path():
    c = Cache(host_slabs=16)
    idx = c.idx
    seq = c.start(cat(blk(0), blk(1), blk(2), tail(3, 3)), source=None)
    c.commit(seq)
    s = c.snap(seq, 195, ENDPOINT)
    idx.release(seq)
    [write] = idx.writes.write_image(s)
    assert (write.image_slabs, write.tail_slab) == ((0, 1), 2)
    check_invariants(idx)
    assert idx.sizes.evictable_pages == 0 and freed_by(idx.evict_pages(100)) == ([], [])
    idx.landed(write)
    assert freed_by(idx.evict_pages(100)) == ([1003, 1002, 1001, 1000], [0])                 # tail (backed) first, then C B A
    assert idx.tree.num_nodes == 0 and not idx.sizes.snapshots


# =========================================================================== Host GDSF


def host_only(c: Cache) -> None:
    """Drop every device copy that has a host copy (images then pages)."""
    freed_by(c.idx.evict_slots(c.idx.sizes.device_images))
    freed_by(c.idx.evict_pages(c.idx.sizes.evictable_pages))
    check_invariants(c.idx)


def take(c: Cache, k: int) -> list[int]:
    """Allocate k host slabs the way a write would, and hand them straight back to the pool
    bookkeeping of a fake owner (so check_invariants sees every used slab owned)."""
    got = c.idx.lifecycle.host_alloc(k)
    assert len(got) == k
    c.idx.host.slabs.free(got)
    return got


def test_gdsf_two_siblings_hand_computed():
    c = Cache(host_slabs=8)
    idx = c.idx
    # s1: A B1, tap at 128; s2: A B2 C2, tap at 192. Both written through: 4 blocks + 2 images
    s1 = c.turn(cat(blk(0), blk(1), [1]), snaps=[128], write=True)
    s2 = c.turn(cat(blk(0), blk(2), blk(3), [1]), snaps=[192], source=None, write=True)
    host_only(c)
    assert idx.host.slabs.num_free == 0
    # H(s1) = 0 + (0.128 - R_IMG) / (8192 + 4096 [B1: s1 alone below it; A is shared])
    # H(s2) = 0 + (0.192 - R_IMG) / (8192 + 2 * 4096 [B2, C2])
    h1 = (0.128 - R_IMG) / 12288
    h2 = (0.192 - R_IMG) / 16384
    assert idx.valuation.priority(s1) == pytest.approx(h1, rel=1e-12)
    assert idx.valuation.priority(s2) == pytest.approx(h2, rel=1e-12)
    assert h1 < h2
    # 3 slabs: victim s1 (2 image slabs, L := H(s1)), then its exclusive path B1 is dead KV
    take(c, 3)
    assert not idx.is_live(s1) and idx.is_live(s2)
    assert idx.valuation.L == pytest.approx(h1, rel=1e-12)
    assert set(c.nodes_by_block()) == {0, 2, 3}      # A, B2, C2 remain; B1 went
    # now s2 alone holds A: H(s2) = (0.192 - R_IMG) / (8192 + 3 * 4096), below L
    h2b = (0.192 - R_IMG) / 20480
    assert idx.valuation.priority(s2) == pytest.approx(h2b, rel=1e-12) and h2b < h1
    assert idx.host.slabs.num_free == 3                    # take() handed its 3 slabs back
    take(c, 3 + 5)                                   # s2's image, then A B2 C2 (dead KV)
    assert not idx.sizes.snapshots and idx.tree.num_nodes == 0
    assert idx.valuation.L == pytest.approx(h1, rel=1e-12)      # monotonic: H(s2) < L leaves L
    check_invariants(idx)


def test_gdsf_nested_ancestor_and_descendant_hand_computed():
    c = Cache(host_slabs=7)
    idx = c.idx
    # s_a: tap at 64 on A; s_c: tap at 192 on A B C (a cold request: no supersession)
    s_a = c.turn(cat(blk(0), [1]), snaps=[64], write=True)
    s_c = c.turn(cat(blk(0), blk(1), blk(2), [1]), snaps=[192], source=None, write=True)
    host_only(c)
    assert s_c.ancestor is s_a and s_a.dependents == {s_c}
    assert idx.host.slabs.num_free == 0                    # A B C + two images = 7 slabs
    # H(s_a) = (0.064 - R) / 8192             (A is shared with s_c: not exclusive)
    # H(s_c) = (0.128 - R) / (8192 + 2 * 4096) (prefill above s_a only; B and C exclusive)
    ha = (0.064 - R_IMG) / 8192
    hc = (0.128 - R_IMG) / 16384
    assert idx.valuation.priority(s_a) == pytest.approx(ha, rel=1e-12)
    assert idx.valuation.priority(s_c) == pytest.approx(hc, rel=1e-12)
    assert ha < hc
    take(c, 2)                                       # s_a's image only; A is still needed
    assert not idx.is_live(s_a) and idx.tree.num_nodes == 3
    assert idx.valuation.L == pytest.approx(ha, rel=1e-12)
    # s_c now carries the whole prefix and A: (0.192 - R) / (8192 + 3 * 4096)
    hc2 = (0.192 - R_IMG) / 20480
    assert s_c.ancestor is None
    assert idx.valuation.priority(s_c) == pytest.approx(hc2, rel=1e-12)
    take(c, 2 + 5)                                   # s_c's image, then C B A
    assert idx.valuation.L == pytest.approx(hc2, rel=1e-12)     # hc2 > ha: L rises to it
    assert idx.tree.num_nodes == 0


def test_gdsf_frequency_and_inflation_hand_computed():
    c = Cache(host_slabs=12)
    idx = c.idx
    # two symmetric siblings: same value and size, s1 gets one hit
    s1 = c.turn(cat(blk(0), blk(1), [1]), snaps=[128], write=True)
    s2 = c.turn(cat(blk(0), blk(2), [1]), snaps=[128], source=None, write=True)
    seq = c.start(cat(blk(0), blk(1), [2]))          # the hit
    assert seq.source is s1 and s1.hits == 1
    idx.release(seq)
    host_only(c)
    v = (0.128 - R_IMG) / 12288
    assert idx.valuation.priority(s1) == pytest.approx(2 * v, rel=1e-12)
    assert idx.valuation.priority(s2) == pytest.approx(v, rel=1e-12)
    assert idx.host.slabs.num_free == 12 - 7
    take(c, 5 + 3)                                   # s2 (image) and B2: L := v
    assert idx.is_live(s1) and not idx.is_live(s2)
    assert idx.valuation.L == pytest.approx(v, rel=1e-12)
    # a snapshot published now starts from L: H = L + (0.128 - R) / (8192 + 2 * 4096)
    s3 = c.turn(cat(blk(5), blk(6), [1]), snaps=[128], source=None, write=True)
    assert s3.L == pytest.approx(v, rel=1e-12)
    assert idx.valuation.priority(s3) == pytest.approx(v + (0.128 - R_IMG) / 16384, rel=1e-12)
    # s1 (no longer sharing A with s2): 2 * (0.128 - R) / (8192 + 2 * 4096)
    assert idx.valuation.priority(s1) == pytest.approx(2 * (0.128 - R_IMG) / 16384, rel=1e-12)


def test_dead_kv_is_reclaimed_before_any_snapshot():
    c = Cache(host_slabs=7)
    idx = c.idx
    s = c.turn(cat(blk(0), blk(1), [1]), snaps=[128], write=True)     # slabs: A 0, B 1, image 2 3
    # a path no snapshot reaches (slabs 4 5 6): dead the moment it is written
    c.turn(cat(blk(5), blk(6), blk(7), [1]), source=None, write=True)
    host_only(c)
    assert idx.host.slabs.num_free == 0
    d5, d6, d7 = node_of(c, 5), node_of(c, 5, 6), node_of(c, 5, 6, 7)
    assert [d5.host_slab, d6.host_slab, d7.host_slab] == [4, 5, 6]
    # leaves first: the deepest dead block goes, and nothing else
    assert idx.lifecycle.host_alloc(1) == [6]
    idx.host.slabs.free([6])
    assert idx.tree.num_nodes == 4 and idx.is_live(s) and idx.valuation.L == 0.0
    # 3 slabs: 6 is free; then 5 and 4 (dead, leaves first) before any snapshot
    assert idx.lifecycle.host_alloc(3) == [4, 5, 6]
    idx.host.slabs.free([4, 5, 6])
    assert idx.tree.num_nodes == 2 and idx.is_live(s) and idx.valuation.L == 0.0
    # 4 slabs: only now the snapshot goes (its path becomes dead KV in the same allocation)
    assert len(idx.lifecycle.host_alloc(4 + 3)) == 7
    assert not idx.is_live(s) and idx.tree.num_nodes == 0
    assert idx.valuation.L == pytest.approx((0.128 - R_IMG) / (8192 + 2 * 4096), rel=1e-12)


def test_superseded_snapshots_go_before_gdsf_and_leave_l_unchanged():
    c = Cache(host_slabs=9)
    idx = c.idx
    # one lineage: taps at 64 and 128 (64 superseded by 128), written through
    s64, s128 = c.turn(cat(blk(0), blk(1), [1]), snaps=[64, 128], write=True)
    assert s64.superseded and not s128.superseded
    # a cheap retained snapshot elsewhere: (0.064 - R) / (8192 + 4096) is the lowest H
    cheap = c.turn(cat(blk(5), [1]), snaps=[64], source=None, write=True)
    host_only(c)
    assert idx.valuation.priority(cheap) < idx.valuation.priority(s128)
    assert idx.host.slabs.num_free == 0                    # 3 blocks + 3 images = 9
    take(c, 2)
    assert not idx.is_live(s64) and idx.is_live(cheap) and idx.valuation.L == 0.0


def test_victim_exclusive_path_is_freed_and_shared_path_kept():
    c = Cache(host_slabs=10)
    idx = c.idx
    # shared A B; s_long: A B C D tap at 256; s_short: A B E endpoint at 202 (tail 10)
    s_long = c.turn(cat(blk(0), blk(1), blk(2), blk(3), [1]), snaps=[256], write=True)
    s_short = c.turn(cat(blk(0), blk(1), blk(4), tail(5, 10)), snaps=[(202, ENDPOINT)],
                     source=None, write=True)
    host_only(c)
    assert idx.host.slabs.num_free == 0                    # 5 blocks + 2 images + 1 tail
    # H(s_long)  = (0.256 - R) / (8192 + 2 * 4096 [C D])
    # H(s_short) = (0.202 - R) / (8192 + 4096 [tail] + 4096 [E])
    h_long, h_short = (0.256 - R_IMG) / 16384, (0.202 - R_IMG) / 16384
    assert idx.valuation.priority(s_long) == pytest.approx(h_long, rel=1e-12)
    assert idx.valuation.priority(s_short) == pytest.approx(h_short, rel=1e-12)
    e = node_of(c, 0, 1, 4)
    e_handle = (e.id, e.gen)
    take(c, 4)                                       # image 2 + tail 1, then E (dead)
    assert not idx.is_live(s_short) and idx.is_live(s_long)
    assert idx.tree.resolve(*e_handle) is None
    assert sorted(n.depth for n in idx.tree.nodes()) == [0, 1, 2, 3]   # A B C D kept
    assert all(n.on_host for n in idx.tree.nodes())
    assert idx.valuation.L == pytest.approx(h_short, rel=1e-12)
    # s_long alone now: A B count as its own
    assert idx.valuation.priority(s_long) == pytest.approx((0.256 - R_IMG) / (8192 + 4 * 4096), rel=1e-12)
    check_invariants(idx)


def test_l_is_monotonic_over_a_sequence_of_evictions():
    c = Cache(host_slabs=40)
    idx = c.idx
    rng = np.random.default_rng(0)
    for i in range(8):
        nblk = int(rng.integers(1, 4))
        # all share block A: the last survivors take A over, so their H falls below L
        toks = cat(blk(0), *(blk(10 * i + j + 1) for j in range(nblk)),
                   tail(10 * i + nblk + 1, int(rng.integers(0, 9))), [1])
        f = len(toks) - 1
        c.turn(toks, snaps=[(f, ENDPOINT)], source=None, write=True)
    host_only(c)
    ls = [idx.valuation.L]
    decreasing_seen = False
    while idx.sizes.snapshots:
        victim = min(idx.snapshots(), key=lambda s: (idx.valuation.priority(s), s.id))
        h = idx.valuation.priority(victim)
        decreasing_seen |= h < idx.valuation.L
        dead = sum(1 for n in idx.tree.nodes() if n.host_slab >= 0 and n.live_below == 0)
        take(c, idx.host.slabs.num_free + dead + 1)        # all dead KV, then exactly one victim
        assert not idx.is_live(victim)
        assert idx.valuation.L == max(ls[-1], h)
        ls.append(idx.valuation.L)
    assert ls == sorted(ls) and ls[-1] > 0
    assert decreasing_seen                           # a victim below L did not lower it


# ====================================================== Supersession and admission (§9.2, §9.3)


def test_lineage_previous_snapshot_is_superseded_and_a_hit_retains_it():
    c = Cache()
    idx = c.idx
    turn1 = cat(blk(0), blk(1), tail(2, 10))
    e1 = c.turn(turn1, snaps=[(138, ENDPOINT)])
    a, b = node_of(c, 0), node_of(c, 0, 1)
    assert (a.retained_below, b.retained_below) == (1, 1)
    # turn 2 resumes from e1 and taps deeper: e1 is superseded before the tap takes a slot
    turn2 = cat(turn1, tail(2, 64)[10:], blk(3), [1])
    seq = c.start(turn2)
    assert seq.source is e1
    c.commit(seq)
    t2 = c.snap(seq, 256, TAP)
    assert e1.superseded and not t2.superseded
    assert (a.retained_below, b.retained_below, a.live_below) == (1, 1, 2)
    # the endpoint leaves the prompt's last tap retained
    e2 = c.snap(seq, 257, ENDPOINT)
    assert not t2.superseded and not e2.superseded
    idx.release(seq)
    # a retry of turn 2 (an edit after e1) resumes from e1: the hit retains it again
    retry = cat(turn1, [999_999], [1])
    seq = c.start(retry)
    assert seq.source is e1 and not e1.superseded and e1.hits == 2   # turn 2 was hit 1
    idx.release(seq)
    check_invariants(idx)


def test_second_tap_in_one_prompt_supersedes_the_first():
    c = Cache()
    s64, s128, s192 = c.turn(cat(blk(0), blk(1), blk(2), [1]), snaps=[64, 128, 192])
    assert [s64.superseded, s128.superseded, s192.superseded] == [True, True, False]
    # superseded snapshots stay valid (a retry diverging before 192 may still use them)
    m = c.idx.match(c.key(cat(blk(0), blk(1), [9])))             # n = 129: F <= 128
    assert m.deepest.snapshot is s128 and m.chosen is m.deepest
    assert c.idx.match(c.key(cat(blk(0), [9]))).chosen.snapshot is s64
    # a cold request publishing a duplicate tap, then an endpoint, supersedes nothing
    seq = c.start(cat(blk(0), blk(1), blk(2), tail(3, 7)), source=None)
    c.commit(seq)
    t = c.snap(seq, 192, TAP)
    assert t is None and not s192.superseded       # a duplicate of s192: nothing new
    e = c.snap(seq, 199, ENDPOINT)
    assert e is not None and not s192.superseded
    c.idx.release(seq)


def test_a_boundary_is_never_superseded_and_a_tap_in_its_place_is():
    # one conversation only: its lineage moves past the boundary, which stays retained (the
    # spec supersedes it while the tree below is a single chain; see supersede_lineage)
    c = Cache()
    bnd = c.turn(cat(blk(0), blk(1), [1]), snaps=[(128, BOUNDARY)])
    seq = c.start(cat(blk(0), blk(1), blk(2), [1]))
    assert seq.source is bnd
    c.commit(seq)
    c.snap(seq, 192, TAP)
    e = c.snap(seq, 193, ENDPOINT)
    assert e is not None and not bnd.superseded
    c.idx.supersede(bnd)                             # the binding's call (an echoing client's prompt tail)
    assert not bnd.superseded
    c.idx.release(seq)
    # a plain tap in the same position is superseded
    c = Cache()
    tap = c.turn(cat(blk(0), blk(1), [1]), snaps=[(128, TAP)])
    seq = c.start(cat(blk(0), blk(1), blk(2), [1]))
    assert seq.source is tap
    c.commit(seq)
    c.snap(seq, 192, TAP)
    assert tap.superseded


def _fill_slots_three_kinds(c: Cache):
    """Three device slots: a superseded owner (device-only, slot 0), a retained device-only
    owner whose path is on the host (slot 1), and a host-backed retained owner (slot 2)."""
    sup, keep = c.turn(cat(blk(0), blk(1), [1]), snaps=[64, 128])         # 64 superseded
    c.write([node_of(c, 0), node_of(c, 0, 1)])                             # path only
    backed = c.turn(cat(blk(5), blk(6), blk(7), [1]), snaps=[192], source=None, write=True)
    assert sup.superseded and not keep.superseded
    assert backed.complete_on_host and not keep.image_on_host and not sup.image_on_host
    assert [sup.device_slot, keep.device_slot, backed.device_slot] == [0, 1, 2]
    return sup, keep, backed


def test_device_slot_goes_to_superseded_then_least_valuable_device_only_then_lru_backed():
    c = Cache(slots=3, host_slabs=64)
    idx = c.idx
    sup, keep, backed = _fill_slots_three_kinds(c)
    # 1. the superseded owner first; without a host copy it is deleted, L unchanged
    new1 = c.turn(cat(blk(20), blk(21), blk(22), [1]), snaps=[192], source=None)
    assert new1.device_slot == 0 and not idx.is_live(sup) and idx.valuation.L == 0.0
    # 2. device-only owners: keep, H = (0.128 - R) / (8192 + 2 * 4096 [A B on host, its own])
    #    and new1, H = (0.192 - R) / 8192 (its blocks are not on the host). A cold tap at 256 is
    #    estimated at (0.256 - R) / (8192 + 4 * 4096) >= H(keep): keep is lost, L := H(keep)
    h_keep = (0.128 - R_IMG) / 16384
    assert idx.valuation.priority(keep) == pytest.approx(h_keep, rel=1e-12)
    assert idx.valuation.priority(new1) == pytest.approx((0.192 - R_IMG) / 8192, rel=1e-12)
    assert (0.256 - R_IMG) / 24576 >= h_keep
    new2 = c.turn(cat(blk(30), blk(31), blk(32), blk(33), [1]), snaps=[256], source=None)
    assert new2.device_slot == 1 and not idx.is_live(keep)
    assert idx.valuation.L == pytest.approx(h_keep, rel=1e-12)
    assert new2.L == pytest.approx(h_keep, rel=1e-12)
    # 3. a cold tap at 64: L + (0.064 - R) / (8192 + 4096) < H(new1), the cheapest device-only
    #    owner: the least recently hit host-backed owner gives its slot and keeps its host copy
    assert h_keep + (0.064 - R_IMG) / 12288 < idx.valuation.priority(new1)
    new3 = c.turn(cat(blk(40), [1]), snaps=[64], source=None)
    assert new3.device_slot == 2
    assert idx.is_live(backed) and backed.device_slot == -1 and backed.complete_on_host
    # 4. nothing left to take: device-only owners worth more than the new tap, no backed owner
    assert c.turn(cat(blk(50), [1]), snaps=[64], source=None) is None
    assert idx.stats["taps_skipped_no_slot"] == 1
    check_invariants(idx)


def test_device_only_owner_keeps_its_slot_against_a_less_valuable_snapshot():
    c = Cache(slots=1, host_slabs=64)
    idx = c.idx
    big = c.turn(cat(blk(0), blk(1), blk(2), blk(3), [1]), snaps=[256])
    c.write(node_of(c, 0, 1, 2, 3).path())           # its path on the host, image device-only
    h_big = (0.256 - R_IMG) / (8192 + 4 * 4096)
    assert idx.valuation.priority(big) == pytest.approx(h_big, rel=1e-12)
    # a cold tap at 64, estimated (0.064 - R) / (8192 + 4096) < H(big): skipped
    assert c.turn(cat(blk(9), [1]), snaps=[64], source=None) is None
    assert idx.is_live(big) and big.device_slot == 0
    assert idx.stats["taps_skipped_no_slot"] == 1
    # a cold tap at 320, estimated (0.320 - R) / (8192 + 5 * 4096) >= H(big): big is lost
    assert (0.320 - R_IMG) / 28672 >= h_big
    bigger = c.turn(cat(*(blk(20 + i) for i in range(5)), [1]), snaps=[320], source=None)
    assert bigger.device_slot == 0 and not idx.is_live(big)
    assert idx.valuation.L == pytest.approx(h_big, rel=1e-12)
    # its path is dead KV now, the first thing a host allocation takes, leaves first; the
    # blocks are still on the device, so they lose only their host copy
    assert idx.host.slabs.num_free == 60
    got = idx.lifecycle.host_alloc(61)
    assert len(got) == 61 and got[0] == 3            # slabs A 0, B 1, C 2, D 3: D freed, on top
    assert [n.host_slab for n in node_of(c, 0, 1, 2, 3).path()] == [0, 1, 2, -1]
    assert idx.tree.num_nodes == 4 + 1 + 5           # big's path, the skipped tap's block, bigger
    idx.host.slabs.free(got)
    check_invariants(idx)


def test_host_backed_slots_go_least_recently_hit_first():
    c = Cache(slots=2, host_slabs=64)
    idx = c.idx
    s1 = c.turn(cat(blk(0), [1]), snaps=[64], write=True)                 # slot 0
    s2 = c.turn(cat(blk(5), [1]), snaps=[64], source=None, write=True)    # slot 1
    seq = c.start(cat(blk(0), [2]))                  # hit s1: s2 is now least recently hit
    assert seq.source is s1
    idx.release(seq)
    new = c.turn(cat(blk(9), [1]), snaps=[64], source=None)
    assert new.device_slot == 1 and s2.device_slot == -1 and s1.device_slot == 0
    assert idx.is_live(s2) and s2.complete_on_host


def test_evict_slots_frees_without_loss_first():
    c = Cache(slots=3, host_slabs=64)
    idx = c.idx
    sup, keep, backed = _fill_slots_three_kinds(c)
    assert freed_by(idx.evict_slots(1)).slots == [0] and not idx.is_live(sup)  # superseded first
    assert freed_by(idx.evict_slots(1)).slots == [2]
    assert idx.is_live(keep) and idx.is_live(backed) and backed.device_slot == -1
    assert freed_by(idx.evict_slots(1)).slots == [1] and not idx.is_live(keep)  # the lossy one last


def test_host_image_write_displaces_only_snapshots_worth_no_more():
    c = Cache(slots=8, host_slabs=6)
    idx = c.idx
    # the host holds s_mid: A B (slabs 0 1) + image (2 3); slabs 4 5 are free
    s_mid = c.turn(cat(blk(0), blk(1), [1]), snaps=[128], write=True)
    freed_by(idx.evict_slots(1))                               # host-only now
    h_mid = (0.128 - R_IMG) / (8192 + 2 * 4096)
    assert idx.valuation.priority(s_mid) == pytest.approx(h_mid, rel=1e-12)
    # s_low: H = (0.064 - R) / 8192 (its block is not on the host: not part of Z), just below
    # H(s_mid); its image takes the 2 free slabs, nothing is evicted
    s_low = c.turn(cat(blk(5), [1]), snaps=[64], source=None)
    h_low = (0.064 - R_IMG) / 8192
    assert idx.valuation.priority(s_low) == pytest.approx(h_low, rel=1e-12) and h_low < h_mid
    assert c.write_image(s_low) == [4, 5]
    # a third snapshot now finds the host full; worth less than both: refused, nothing evicted
    s_lower = c.turn(cat(blk(6), tail(7, 1)), snaps=[(65, ENDPOINT)], source=None)
    # H(s_lower) = (0.065 - R) / (8192 + 4096 [tail]) < H(s_low) = (0.064 - R) / 8192
    assert idx.valuation.priority(s_lower) < idx.valuation.priority(s_low) < idx.valuation.priority(s_mid)
    assert idx.writes.write_image(s_lower) == []
    assert idx.stats["host_writes_refused"] == 1
    assert s_low.complete_on_host and s_mid.image_on_host and idx.valuation.L == 0.0
    # s_high, worth more than both, needs 2 slabs: the cheapest victim, s_low, is enough
    s_high = c.turn(cat(blk(8), blk(9), blk(10), [1]), snaps=[192], source=None)
    h_high = (0.192 - R_IMG) / 8192
    assert idx.valuation.priority(s_high) == pytest.approx(h_high, rel=1e-12)
    assert idx.valuation.priority(s_low) < h_high
    assert c.write_image(s_high) == [5, 4]
    # s_low was complete on the device: it keeps its slot, only its host copy went
    assert idx.is_live(s_low) and not s_low.image_on_host and s_low.device_slot >= 0
    assert s_mid.image_on_host and idx.valuation.L == pytest.approx(h_low, rel=1e-12)
    check_invariants(idx)


def test_host_image_write_may_displace_an_equal_value():
    c = Cache(slots=8, host_slabs=3)
    idx = c.idx
    s1 = c.turn(cat(blk(0), [1]), snaps=[64])
    s2 = c.turn(cat(blk(5), [1]), snaps=[64], source=None)
    h = (0.064 - R_IMG) / 8192
    assert idx.valuation.priority(s1) == pytest.approx(h, rel=1e-12) and idx.valuation.priority(s1) == idx.valuation.priority(s2)
    assert c.write_image(s1) == [0, 1]
    # one slab free; H(s1) == H(s2) is not worth more: s1 gives its host copy, keeps its slot
    assert c.write_image(s2) == [1, 0]
    assert not s1.image_on_host and s1.device_slot >= 0 and s2.image_on_host
    assert idx.valuation.L == pytest.approx(h, rel=1e-12)


# =========================================================================== HostSlabPool


def test_slab_pool_exhaustion_and_reuse():
    pool = SlabPool(5 * SLAB + 100, SLAB)
    assert pool.num_slabs == 5 and pool.num_free == 5
    a = pool.alloc(3)
    assert a == [0, 1, 2]
    assert pool.alloc(3) == [] and pool.num_free == 2    # all or nothing
    b = pool.alloc(2)
    assert b == [3, 4] and pool.num_free == 0
    assert pool.alloc(1) == []
    pool.free([1, 3])
    assert pool.num_free == 2 and not pool.is_used(1) and pool.is_used(0)
    assert pool.alloc(2) == [3, 1]                       # index stack: last freed first
    with pytest.raises(ValueError):
        pool.free([0, 0])
    with pytest.raises(ValueError):
        SlabPool(10 * SLAB, 1000)


def test_slab_pool_chunks_and_slabs_never_cross_a_chunk():
    # 10 slabs, chunks of at most 3 slabs + 100 bytes -> 3 slabs each, last chunk 1 slab
    pool = SlabPool(10 * SLAB, SLAB, max_chunk_bytes=3 * SLAB + 100)
    assert pool.slabs_per_chunk == 3
    assert pool.chunk_sizes == [3 * SLAB, 3 * SLAB, 3 * SLAB, SLAB]
    sizes = pool.chunk_sizes
    for s in range(10):
        chunk, off = pool.locate(s)
        assert (chunk, off) == (s // 3, (s % 3) * SLAB)
        assert off + SLAB <= sizes[chunk]
    # the real default: 4 GiB chunks of whole slabs, slab not a divisor of 4 GiB
    slab = 3 * SLAB * 7                                  # 86016 bytes
    pool = SlabPool(10 * (4 << 30) // 3, slab)
    per = MAX_CHUNK_BYTES // slab
    assert pool.slabs_per_chunk == per and all(c <= MAX_CHUNK_BYTES for c in pool.chunk_sizes)
    assert sum(pool.chunk_sizes) == pool.num_slabs * slab
    for s in (per - 1, per, per + 1, pool.num_slabs - 1):
        chunk, off = pool.locate(s)
        assert off + slab <= pool.chunk_sizes[chunk]
    with pytest.raises(ValueError):
        SlabPool(10 * SLAB, SLAB, max_chunk_bytes=SLAB - 1)


def test_claimed_slabs_are_never_allocated_until_freed_and_then_once():
    pool = SlabPool(8 * SLAB, SLAB, max_chunk_bytes=4 * SLAB, online=False)
    pool.bring_online(0)                              # slabs 0..3 online
    with pytest.raises(ValueError):
        pool.claim([5])                               # not online
    with pytest.raises(ValueError):
        pool.claim([1, 1])
    pool.claim([0, 2])
    assert pool.num_free == 2 and pool.is_used(0) and pool.is_used(2)
    with pytest.raises(ValueError):
        pool.claim([2])                               # used
    pool.bring_online(1)
    assert sorted(pool.alloc(6)) == [1, 3, 4, 5, 6, 7] and pool.num_free == 0
    assert pool.alloc(1) == []
    pool.free([2])
    assert pool.num_free == 1 and pool.alloc(1) == [2] and pool.num_free == 0
    pool.free([0, 2])
    assert sorted(pool.alloc(2)) == [0, 2] and pool.alloc(1) == []
    # claimed and freed again before any allocation: still one slab, handed out once
    pool = SlabPool(4 * SLAB, SLAB)
    pool.claim([1])
    pool.free([1])
    assert pool.num_free == 4 and sorted(pool.alloc(4)) == [0, 1, 2, 3] and pool.num_free == 0


def test_host_tier_smaller_than_one_snapshot_and_block_is_rejected():
    with pytest.raises(ValueError):
        PrefixIndex(image_bytes=IMAGE, device_snapshot_slots=2, host=SlabPool(2 * SLAB, SLAB))
    PrefixIndex(image_bytes=IMAGE, device_snapshot_slots=2, host=SlabPool(3 * SLAB, SLAB))


# =========================================================================== Admission (§6)


def test_candidate_fallback_chosen_then_device():
    c = Cache(host_slabs=64)
    idx = c.idx
    # d: tap at 128 on A B (pages 1000 1001). h: endpoint at 197 on A B C + 5 tokens (cold:
    # pages A 1002 B 1003 private, C 1004, tail 1005); C written through, then its device copy
    # dropped: h needs C from the host, its image and tail are on the device (unbacked).
    d = c.turn(cat(blk(0), blk(1), [1]), snaps=[128])
    h = c.turn(cat(blk(0), blk(1), blk(2), tail(3, 5)), snaps=[(197, ENDPOINT)], source=None)
    cn = node_of(c, 0, 1, 2)
    c.write([cn])
    assert freed_by(idx.evict_pages(1)) == ([1004], [])
    a, b = node_of(c, 0), node_of(c, 0, 1)
    assert idx.lru.order() == [h, b, a]              # E = 3 evictable pages
    m = idx.match(c.key(cat(blk(0), blk(1), blk(2), tail(3, 5), [9])))    # n = 198
    # costs: h 4096 / 1e9 + 1 token; d 70 tokens; root 198 tokens
    assert m.deepest.snapshot is h and m.device.snapshot is d and m.chosen is m.deepest
    assert (m.deepest.host_blocks, m.deepest.host_bytes) == (1, SLAB)
    assert m.chosen.seconds == pytest.approx(SLAB / 1e9 + 1e-3, rel=1e-12)
    assert m.candidates() == [m.deepest, m.device, m.root]
    # growth G = 10 pages from position 0:
    #   h:    1 (C) + 1 (tail copy) + 10 - 3 = 9 <= free + 3 - 3 (A, B, its tail)
    #   d:    10 - 2 = 8                       <= free + 3 - 2 (A, B)
    #   root: 10                               <= free + 3
    def cls(free, total=100):
        return idx.classify(m, free_pages=free, total_pages=total, growth_pages=10)
    assert cls(9) == (Readiness.READY, m.deepest)
    assert cls(8) == (Readiness.READY, m.device)
    assert cls(7) == (Readiness.READY, m.device)
    assert cls(6) == (Readiness.TEMPORARILY_BLOCKED, None)
    assert cls(6, total=9) == (Readiness.PERMANENTLY_INFEASIBLE, None)
    assert cls(6, total=10) == (Readiness.TEMPORARILY_BLOCKED, None)
    # the binding admits from d: begin pins A B, which leave the LRU
    seq, _ = idx.begin(m.key, cls(8)[1])
    assert seq.source is d and idx.lru.order() == [h]
    idx.release(seq)


def test_candidate_fallback_device_then_root():
    c = Cache()
    idx = c.idx
    # d: endpoint at 150 on A B; its tail page is in the LRU with A and B (E = 3)
    d = c.turn(cat(blk(0), blk(1), tail(2, 22)), snaps=[(150, ENDPOINT)])
    assert idx.sizes.evictable_pages == 3
    m = idx.match(c.key(cat(blk(0), blk(1), tail(2, 22), [4, 5])))
    assert m.chosen.snapshot is d and m.chosen is m.device is m.deepest
    assert m.candidates() == [m.device, m.root]
    #   d:    1 + 10 - 2 = 9 <= free + 3 - 3;   root: 10 <= free + 3
    def cls(free, total=100):
        return idx.classify(m, free_pages=free, total_pages=total, growth_pages=10)
    assert cls(9) == (Readiness.READY, m.device)
    assert cls(8) == (Readiness.READY, m.root)
    assert cls(7) == (Readiness.READY, m.root)
    assert cls(6) == (Readiness.TEMPORARILY_BLOCKED, None)


def test_blocked_vs_infeasible():
    c = Cache()
    idx = c.idx
    c.turn(cat(blk(0), [1]))                     # one evictable page, no snapshot
    m = idx.match(c.key(cat(blk(9), [1])))
    assert m.candidates() == [m.root]
    # root needs its growth: 20 pages; free 15 + evictable 1 = 16
    r = idx.classify(m, free_pages=15, total_pages=20, growth_pages=20)
    assert r == (Readiness.TEMPORARILY_BLOCKED, None)
    assert idx.classify(m, free_pages=19, total_pages=20, growth_pages=20) == \
        (Readiness.READY, m.root)
    # 21 pages on a pool of 20: never, even with every cached page evicted
    assert idx.classify(m, free_pages=19, total_pages=20, growth_pages=21) == \
        (Readiness.PERMANENTLY_INFEASIBLE, None)
    assert idx.classify(m, free_pages=19, total_pages=20, growth_pages=20) == \
        (Readiness.READY, m.root)


def test_quote_staleness():
    c = Cache(host_slabs=64)
    idx = c.idx
    s = c.turn(cat(blk(0), blk(1), [1]), snaps=[128])
    q = c.key(cat(blk(0), blk(1), [2]))
    m = idx.match(q)
    assert m.chosen.snapshot is s
    h_s = (s.id, s.gen)
    h_nodes = [(n.id, n.gen) for n in s.anchor.path()]
    assert h_nodes == [(0, 0), (1, 0)]
    freed_by(idx.evict_pages(idx.sizes.evictable_pages))       # unbacked: B (id 1), then A (id 0), and s
    with pytest.raises(ValueError):
        idx.begin(q, m.chosen)
    assert idx.lineage.resolve(*h_s) is None
    assert all(idx.tree.resolve(*h) is None for h in h_nodes)
    # a new node may reuse a freed id: the old handle still resolves to nothing
    c.turn(cat(blk(5), [1]))
    new = node_of(c, 5)
    assert (new.id, new.gen) == (0, 1)         # A's id, last freed, next generation
    assert idx.tree.resolve(0, 1) is new and idx.tree.resolve(0, 0) is None
    # residency changed under a quote: the path moved to the host -> the quote is stale too
    s2 = c.turn(cat(blk(7), blk(8), [1]), snaps=[128], source=None, write=True)
    q2 = c.key(cat(blk(7), blk(8), [2]))
    m2 = idx.match(q2)
    assert m2.chosen.snapshot is s2 and m2.chosen.host_blocks == 0
    freed_by(idx.evict_pages(idx.sizes.evictable_pages))
    with pytest.raises(ValueError):
        idx.begin(q2, m2.chosen)
    check_invariants(idx)
    assert not idx.sequences


def test_host_restore_pins_the_path_until_it_lands_and_is_shared_meanwhile():
    c = Cache(host_slabs=64)
    idx = c.idx
    s = c.turn(cat(blk(0), blk(1), [1]), snaps=[128], write=True)
    host_only(c)
    q = c.key(cat(blk(0), blk(1), [2]))
    m = idx.match(q)
    assert m.chosen.snapshot is s and m.chosen.host_blocks == 2
    assert m.chosen.host_bytes == 2 * SLAB + IMAGE
    seq, [restore] = idx.begin(q, m.chosen, restore_pages=[500, 501], image_slot=7)
    a, b = seq.path
    assert (a.device_page, b.device_page) == (500, 501)
    assert restore.blocks == (a, b) and restore.snapshot is s and restore.pages == [500, 501]
    assert (restore.image_slot, restore.tail_page) == (7, -1)       # the image comes too
    check_invariants(idx)
    # another admission shares the blocks in flight as device blocks (its pass runs behind the
    # restore's wait on the forward stream) and restores only the image, into its own slot
    q2 = c.key(cat(blk(0), blk(1), [3]))
    m2 = idx.match(q2)
    assert m2.chosen.snapshot is s and m2.chosen.host_blocks == 0 and m2.chosen.host_bytes == IMAGE
    seq2, [restore2] = idx.begin(q2, m2.chosen, image_slot=8)
    assert seq2.path == [a, b] and restore2.blocks == () and restore2.snapshot is s
    check_invariants(idx)
    idx.release(seq)                            # released before the batch landed
    idx.release(seq2)
    assert idx.sizes.evictable_pages == 0 and a.restoring and b.restore_pins == 1   # the deepest pins a
    idx.landed(restore2)                        # the image copy pinned no block
    assert idx.sizes.evictable_pages == 0 and b.restoring
    idx.landed(restore)
    assert not a.restoring
    assert idx.lru.order() == [b, a]
    assert idx.match(q).chosen.host_blocks == 0     # device resident now (image still host)
    check_invariants(idx)


def test_disabled_requests_leave_nothing_behind():
    c = Cache()
    seq, _ = c.idx.begin(c.key(cat(blk(0), blk(1), [1])), enabled=False)
    assert c.idx.commit(seq, 129, [1, 2]) == ([], [])
    c.idx.release(seq)
    assert c.idx.tree.num_nodes == 0 and not c.idx.sizes.snapshots


def test_index_imports_neither_torch_nor_sglang():
    import subprocess
    import sys

    code = ("import sys, hpc_radix.index, hpc_radix.index.taps, hpc_radix.binding.hints; "
            "print(sorted({'torch', 'sglang'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_options_block_size_is_the_index_block_size():
    # options.py (imported by the plugin at registration) must not import numpy, so it keeps
    # its own copy of the block size
    from hpc_radix import options
    from hpc_radix.index import BLOCK_TOKENS

    assert options.BLOCK_TOKENS == BLOCK_TOKENS


def test_slab_pool_grows_a_chunk_at_a_time():
    pool = SlabPool(10 * 4096, 4096, max_chunk_bytes=4 * 4096, online=False)
    assert (pool.num_slabs, pool.num_chunks, pool.num_free) == (10, 3, 0)
    pool.bring_online(0)
    assert pool.alloc(5) == [] and pool.alloc(4) == [0, 1, 2, 3]
    pool.bring_online(1)
    assert (pool.num_online, pool.num_used) == (8, 4)   # offline slabs are neither used nor free
    pool.free([2])
    assert pool.alloc(2) == [2, 4]                # freed slabs first, then the new chunk
    with pytest.raises(ValueError, match="out of order"):
        pool.bring_online(1)
    pool.bring_online(2)
    assert pool.num_free == 10 - 5 and pool.online_chunks == 3
    assert (pool.num_online, pool.num_used) == (10, 5)  # the last chunk holds 2 slabs


# =========================================================================== persistence (§5.5)


def saved_records(idx):
    """saved_snapshots() as the binding turns them into file records (kind, slabs, tokens)."""
    from hpc_radix.persistence import SavedSnapshot

    out = []
    for s, path in idx.saved_snapshots():
        tokens = np.frombuffer(s.anchor.buf[:s.anchor.end * 4] + s.tail, dtype="<i4")
        out.append(SavedSnapshot(s.anchor.namespace, tokens, None, s.kind.value, s.hits,
                                 np.array([n.host_slab for n in path]), np.array(s.host_slabs),
                                 s.tail_slab))
    return out


def test_saved_snapshots_come_back_host_only_with_their_paths(tmp_path):
    from hpc_radix.persistence import read_cache_file, write_cache_file

    c = Cache(host_slabs=64)
    a = c.turn(cat(blk(0), blk(1), tail(2, 10)), snaps=[128, (138, ENDPOINT)], write=True)
    b = c.turn(cat(blk(0), blk(3), blk(4), [7]), snaps=[(192, BOUNDARY)], write=True)
    c.turn(cat(blk(5), blk(6), [1]), snaps=[128])             # device only: not saved
    kept = {(s.frontier, s.kind) for s, _ in c.idx.saved_snapshots()}
    assert kept == {(s.frontier, s.kind) for s in a + [b]}
    path = str(tmp_path / "cache.bin")
    write_cache_file(path, {"f": 1}, saved_records(c.idx), {})
    _, records, _ = read_cache_file(path)

    d = Cache(host_slabs=64)
    for r in records:
        d.idx.adopt_saved(d.key(r.tokens, r.namespace), r.frontier, SnapshotKind(r.kind), r.hits,
                          [int(x) for x in r.node_slabs], [int(x) for x in r.image_slabs], r.tail_slab)
    check_invariants(d.idx)
    got = {(s.frontier, s.kind, tuple(s.host_slabs), s.tail_slab) for s in d.idx.snapshots()}
    want = {(s.frontier, s.kind, tuple(s.host_slabs), s.tail_slab) for s, _ in c.idx.saved_snapshots()}
    assert got == want
    assert d.idx.tree.num_nodes == 4                           # blocks 0, 1, 3, 4: shared 0 once
    assert all(n.device_page < 0 and n.on_host for n in d.idx.tree.nodes())
    m = d.idx.match(d.key(cat(blk(0), blk(1), tail(2, 10), [9])))
    assert m.deepest.frontier == 138 and m.deepest.host_blocks == 2
    # a record that contradicts what is rebuilt is refused and changes nothing
    r = records[0]
    bad = [int(x) + 1 for x in r.node_slabs]
    with pytest.raises(ValueError):
        d.idx.adopt_saved(d.key(r.tokens), r.frontier, SnapshotKind(r.kind), 0, bad,
                          [int(x) for x in r.image_slabs], r.tail_slab)
    check_invariants(d.idx)


def test_shared_blocks_counts_the_leading_blocks_two_keys_share():
    from hpc_radix.index.keys import shared_blocks

    base = list(range(1, 64 * 5 + 1))
    a = PromptKey(base + [7] * 30)
    assert shared_blocks(a, PromptKey(base[:64 * 3 + 10] + [9] * 200)) == 3
    assert shared_blocks(a, PromptKey(base)) == 5 == shared_blocks(PromptKey(base), a)
    assert shared_blocks(a, PromptKey([0] + base[1:])) == 0
    assert shared_blocks(a, PromptKey(base, namespace="lora-x")) == 0
    assert shared_blocks(a, PromptKey(base, media=[0, 0, 5, 5, 5])) == 0   # media: none


def test_device_lru_evicts_backed_entries_then_unbacked_ones_each_in_recency_order():
    from hpc_radix.index.lru import DeviceLRU

    lru = DeviceLRU()
    lru.push("old block", backed=True)
    lru.push("unbacked tail", backed=False)
    lru.push("unbacked block", backed=False)
    lru.push("backed tail", backed=True)             # a snapshot tail queues with the blocks
    assert lru.order() == ["old block", "backed tail", "unbacked tail", "unbacked block"]
    assert lru.peek() == "old block" and lru.num_backed == 2
    lru.set_backed("backed tail", False)             # its host copy went: it joins the unbacked
    assert lru.order() == ["old block", "unbacked tail", "unbacked block", "backed tail"]
    lru.set_backed("unbacked tail", True)            # backed again: the MRU end of the backed
    assert lru.order() == ["old block", "unbacked tail", "unbacked block", "backed tail"]
    lru.touch("old block")
    lru.to_front("backed tail")
    assert lru.order() == ["unbacked tail", "old block", "backed tail", "unbacked block"]
    lru.discard("unbacked tail")
    lru.set_backed("gone", True)                     # not queued: stays out
    assert lru.peek() == "old block" and len(lru) == 3 and "unbacked tail" not in lru
    assert "gone" not in lru


def test_only_copies_land_and_the_freed_ids_come_out_named():
    c = Cache(host_slabs=8)
    idx = c.idx
    c.turn(cat(blk(0), blk(1), [1]), snaps=[128], source=None)
    freed = freed_by(idx.evict_pages(10))
    assert isinstance(freed, FreeDevice) and freed.pages == [1001, 1000] and freed.slots == [0]
    with pytest.raises(TypeError, match="not a copy"):
        idx.landed(freed)
    assert freed_by(idx.evict_pages(10)) == FreeDevice([], [])


def test_every_call_that_frees_returns_what_it_let_go():
    """A page or slot leaves the index only in what the call that let it go returns: the tail
    page of a device-only snapshot whose slot is reclaimed for a new one comes with the slot;
    a host write that evicts a host-only image whose tail is still on device returns that
    page before the write. Between calls the index keeps none (check_invariants)."""
    c = Cache(slots=1, host_slabs=5)
    idx = c.idx
    end = c.turn(cat(blk(0), tail(1, 5)), snaps=[(69, ENDPOINT)], source=None)
    slot, page = end.device_slot, end.tail_page
    seq = c.start(cat(blk(0), blk(2), blk(3), [1]), source=None)
    c.commit(seq)
    grant = idx.acquire_slot(seq, 192, TAP)          # at the cap of one: the endpoint's slot
    assert grant == (slot, [FreeDevice([page], [])]) and not idx.is_live(end)
    check_invariants(idx)
    idx.publish(seq, 192, TAP, grant.slot)
    idx.release(seq)
    assert freed_by(idx.evict_slots(1)).slots == [slot]  # the tap (device-only, no tail) is lost
    # an endpoint written to host, then its image leaves the device; its tail page stays
    end = c.turn(cat(blk(5), tail(6, 5)), snaps=[(69, ENDPOINT)], source=None, write=True)
    slot = end.device_slot
    assert end.complete_on_host and freed_by(idx.evict_slots(1)).slots == [slot]
    assert end.tail_page >= 0 and not end.image_on_device
    page = end.tail_page
    tap = c.turn(cat(blk(0), blk(2), blk(3), blk(4), [1]), snaps=[256])  # worth more
    actions = idx.writes.write_image(tap)
    assert not idx.is_live(end) and actions[0] == ([page], [])
    assert isinstance(actions[-1], WriteImage)
    check_invariants(idx)
