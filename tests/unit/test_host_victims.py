"""The host tier's eviction queue: the lowest current key goes first, whatever was queued."""
from hpc_radix.index.host_victims import HostVictims


class Snap:
    def __init__(self, sid, key):
        self.id, self.gen, self.key, self.restore_pins = sid, 0, key, 0


def queue(*snaps):
    by_id = {s.id: s for s in snaps}
    q = HostVictims(lambda s: s.key, by_id.get)
    for s in snaps:
        q.add(s)
    return q, by_id


def evict(q, bound=None):
    """The index's host eviction: the victim loses its host copy (leaves the held set)."""
    victim = q.pop(bound)
    if victim is not None:
        q.discard(victim)
    return victim


def test_victims_come_by_current_key_with_superseded_first_and_pinned_ones_skipped():
    a, b, c, d = Snap(1, (1, 5.0)), Snap(2, (1, 2.0)), Snap(3, (1, 9.0)), Snap(4, (1, 7.0))
    q, _ = queue(a, b, c, d)
    b.key = (1, 8.0)                   # rose since queued (a hit): found out at the top
    d.key = (0, 1.0)                   # superseded: its key fell, so it is queued again
    q.requeue(d)
    a.restore_pins = 1                 # a restore reads it: not now
    assert [evict(q).id for _ in range(3)] == [4, 2, 3]
    q.check()
    assert q.pop(None) is None         # only the pinned one is left
    a.restore_pins = 0
    assert q.pop(4.0) is None          # worth more than the bound
    assert q.pop(5.0) is a


def test_a_discarded_snapshot_is_never_a_victim_and_stale_entries_are_rebuilt():
    snaps = [Snap(i, (1, float(i))) for i in range(300)]
    q, _ = queue(*snaps)
    q.discard(snaps[0])
    for _ in range(5):                 # many requeues leave stale entries behind
        for s in snaps[1:]:
            q.requeue(s)
    assert len(q._heap) <= HostVictims.STALE_FACTOR * 300 + 1
    q.check()
    assert q.pop(None) is snaps[1] and len(q) == 299


class Node:
    def __init__(self, nid, depth):
        self.id, self.gen, self.depth = nid, 0, depth
        self.on_host, self.live_below, self.pinned = True, 0, False


def test_dead_kv_comes_deepest_first_skipping_revived_and_keeping_pinned_nodes():
    from hpc_radix.index.host_victims import DeadKV

    nodes = {i: Node(i, depth) for i, depth in enumerate([1, 5, 3, 4, 2])}
    dead = DeadKV(lambda i, g: nodes.get(i) if nodes.get(i) and nodes[i].gen == g else None)
    for n in nodes.values():
        dead.offer(n, tree_nodes=len(nodes))
    nodes[3].live_below = 1            # reached by a snapshot again: not dead
    nodes[2].pinned = True             # dead, but a restore reads it
    nodes[4].gen = 1                   # gone (its id reused)
    taken = []
    for n in dead.take(lambda: len(taken) < 2):
        taken.append(n.id)
    assert taken == [1, 0]             # depth 5, then depth 1: 3 revived, 2 pinned, 4 gone
    assert dead.queued() == {nodes[2]}
    nodes[2].pinned = False
    assert [n.id for n in dead.take(lambda: True)] == [2]
