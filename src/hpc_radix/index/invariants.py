"""The index's invariants (design §10), checked from first principles: a function of their own,
for tests and the ``HPC_CACHE_FULL_CHECK`` switch, not the hot path. It reads the counts each
part of the index keeps to check them against what the tree and snapshots say."""
from __future__ import annotations

from .keys import TOKEN_BYTES
from .tree import Node


def check_invariants(index) -> None:
    """Full check of the §10 invariants from first principles; raises AssertionError.
    O(nodes + snapshots · depth): for tests and a debug switch, not the hot path."""
    nodes = list(index.tree.nodes())
    snaps = list(index.snapshots())
    device, host = index.device, index.host
    # 1. one owner per device page, per device slot and per host slab
    pages = [n.device_page for n in nodes if n.device_page >= 0] + \
            [s.tail_page for s in snaps if s.tail_page >= 0]
    assert len(pages) == len(set(pages)), "a device page has two owners"
    assert device.freed.empty, "a call kept what it let go"
    assert device.owned_pages == len(pages), "device page counter"
    assert device.tail_pages == sum(1 for s in snaps if s.tail_page >= 0), "tail page counter"
    for n in nodes:
        assert not n.restoring or (n.pinned and n.device_page >= 0), f"restoring {n!r} unpinned"
    slots = [s.device_slot for s in snaps if s.device_slot >= 0]
    assert device.images == {x for x in snaps if x.device_slot >= 0}, "device snapshot set"
    assert device.pinned_images == sum(1 for s in snaps if s.device_slot >= 0 and s.restore_pins)
    assert len(slots) == len(set(slots)), "a device slot has two owners"
    assert len(slots) + device.staged <= device.snapshot_slots, "more images than D"
    slabs = [n.host_slab for n in nodes if n.host_slab >= 0]
    for s in snaps:
        slabs += s.host_slab_ids
    assert len(slabs) == len(set(slabs)), "a host slab has two owners"
    if host.slabs is not None:
        used = {i for i in range(host.slabs.num_slabs) if host.slabs.is_used(i)}
        assert not host.reading & set(slabs), "a slab being read into has an owner"
        assert used == set(slabs) | host.reading, "host slab ownership differs from the pool's"
    # 2/5. structure and exact identity: every node's bytes extend its parent's path
    for n in nodes:
        assert index.tree.resolve(n.id, n.gen) is n
        assert n.parent.children.get(n.id) is n and n.depth == n.parent.depth + 1
        assert n.buf[:n.parent.end * TOKEN_BYTES] == n.parent.buf[:n.parent.end * TOKEN_BYTES] \
            or n.parent.is_root, "node bytes differ from its parent's path"
        assert n.namespace == n.parent.namespace
        # a node with neither copy does not exist (§5.2, §9.4)
        assert n.device_page >= 0 or n.host_slab >= 0, f"{n!r} has no copy"
    # host victims are found without a scan: every dead KV node is queued, and the host
    # snapshot set is exactly the snapshots holding host slabs
    queued = host.dead_kv.queued()
    for n in nodes:
        if host.dead_kv.holds(n):
            assert n in queued, f"dead KV {n!r} is not queued"
    assert host.victims.held == {s for s in snaps if s.host_slab_ids}, "host snapshot set"
    host.victims.check()
    # 3. active paths are pinned and device resident
    refs: dict = {}
    for seq in index.sequences:
        for d, n in enumerate(seq.path):
            assert n.depth == d and n.device_page >= 0, f"active {n!r} not on device"
            assert n.pinned, f"active {n!r} not pinned"
        if seq.path:                                  # only the deepest block holds a ref
            refs[seq.path[-1]] = refs.get(seq.path[-1], 0) + 1
    for n in nodes:
        assert n.active_refs == refs.get(n, 0), f"{n!r} active_refs {n.active_refs} != {refs.get(n, 0)}"
    # 4. snapshots are valid, unique per (anchor, tail), counted along their paths
    live: dict = {}
    retained: dict = {}
    for s in snaps:
        assert s.anchor.snapshots.get(s.key) is s
        assert s.anchor.is_root or index.tree.resolve(s.anchor.id, s.anchor.gen) is s.anchor
        assert s.image_on_device or s.image_on_host or (s.host_slabs and s.restore_pins), \
            f"{s!r} has no image"
        assert s.tail_on_device or s.tail_on_host, f"{s!r} has no tail copy"
        for n in s.anchor.path():
            live[n] = live.get(n, 0) + 1
            retained[n] = retained.get(n, 0) + (not s.superseded)
        # ancestor link: the nearest snapshot above
        above = [t for t in snaps if t.is_above(s)]
        want = max(above, key=lambda t: t.frontier) if above else None
        assert s.ancestor is want, f"{s!r} ancestor {s.ancestor!r} != {want!r}"
        assert all(d.ancestor is s for d in s.dependents)
    assert index.lineage.topmost == {s for s in snaps if s.ancestor is None}, "topmost snapshot set"
    # a node is pinned by its own pins or by any pinned descendant node or snapshot
    pinned_below: dict = {}
    for s in snaps:
        if s.restore_pins and not s.anchor.is_root:
            pinned_below[s.anchor] = pinned_below.get(s.anchor, 0) + 1
    for n in sorted(nodes, key=lambda n: -n.depth):
        own = n.active_refs > 0 or n.restore_pins > 0 or n.filling
        if (own or pinned_below.get(n, 0)) and not n.parent.is_root:
            pinned_below[n.parent] = pinned_below.get(n.parent, 0) + 1
    writing = sum(s.anchor.depth + 1 for s in snaps if s.host_slabs and not s.host_ready)
    assert host.write_pinned_pages == sum(n.filling for n in nodes) + writing, "write pins"
    for n in nodes:
        assert n.pinned_below == pinned_below.get(n, 0), f"{n!r} pinned_below {n.pinned_below}"
        assert n.live_below == live.get(n, 0), f"{n!r} live_below {n.live_below}"
        assert n.retained_below == retained.get(n, 0), f"{n!r} retained_below {n.retained_below}"
    # device LRU: exactly the unpinned device-resident entries, in the right queue
    want_lru = {n for n in nodes if n.device_page >= 0 and not n.pinned}
    want_lru |= {s for s in snaps if s.tail_page >= 0 and not s.restore_pins}
    order = index.lru.order()
    assert set(order) == want_lru and len(order) == len(want_lru), "LRU membership"
    for e in order[:index.lru.num_backed]:
        assert (e.on_host if isinstance(e, Node) else e.complete_on_host), f"{e!r} not backed"
    for e in order[index.lru.num_backed:]:
        assert not (e.on_host if isinstance(e, Node) else e.complete_on_host), f"{e!r} backed"
    # tail-first: an unbacked descendant is never evicted after its unbacked ancestor
    pos = {e: i for i, e in enumerate(order)}
    for e in order:
        if isinstance(e, Node) and not e.parent.is_root and e.parent in pos \
                and not e.on_host and not e.parent.on_host:
            assert pos[e] < pos[e.parent], f"{e!r} would outlive its parent in the LRU"

def sanity_check(index) -> None:
    """Cheap O(1) consistency check for SGLang's idle loop."""
    device = index.device
    assert device.staged >= 0
    assert len(device.images) + device.staged <= device.snapshot_slots
