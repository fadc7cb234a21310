"""Block tree (design §5.2, §6.1, §9.4): one node per committed 64-token block, exact identity.

Nodes live in a global multimap keyed by their chained lookup hash. A node keeps a reference to
the token bytes of the sequence that inserted it, whose first ``depth + 1`` blocks are exactly its
path, so a whole path is verified with one memcmp. Matching therefore binary-searches the deepest
hash present and verifies once (O(log k) probes); a failed verification (a hash collision) or
media keys fall back to the block-by-block walk. Hashes never decide equality.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional

from .keys import BLOCK_BYTES, BLOCK_TOKENS, PromptKey


class Node:
    __slots__ = (
        "id", "gen", "parent", "depth", "hash", "media", "path_media", "buf", "namespace",
        "children",
        # residency: device page id or -1; host slab id or -1 (host_ready: its write landed)
        "device_page", "host_slab", "host_ready", "filling", "restoring",
        # liveness
        "active_refs", "restore_pins", "pinned_below", "live_below", "retained_below",
        "snapshots",  # (tail bytes, tail media key) -> Snapshot anchored here
        "endpoint_tails",  # tails (bytes) of the last endpoints anchored here, kept after
                           # their eviction: a prompt going on with one echoes that output
    )

    def __init__(self, parent: Optional["Node"], depth: int, h: int, media: int, buf: bytes,
                 namespace: Optional[str]):
        self.id = self.gen = -1
        self.parent = parent
        self.depth = depth
        self.hash = h
        self.media = media
        self.path_media = bool(media) or (parent is not None and parent.path_media)
        self.buf = buf
        self.namespace = namespace
        self.children: dict[int, Node] = {}
        self.device_page = -1
        self.host_slab = -1
        self.host_ready = False
        self.filling = False
        self.restoring = False  # its device page is being copied from host
        self.active_refs = 0
        self.restore_pins = 0
        self.pinned_below = 0   # pinned children and pinned snapshots anchored here
        self.live_below = 0
        self.retained_below = 0
        self.snapshots: dict = {}
        self.endpoint_tails: tuple = ()

    @property
    def is_root(self) -> bool:
        return self.depth < 0

    @property
    def end(self) -> int:
        """Token position after this block."""
        return BLOCK_TOKENS * (self.depth + 1)

    @property
    def block_bytes(self) -> bytes:
        return self.buf[self.depth * BLOCK_BYTES:(self.depth + 1) * BLOCK_BYTES]

    @property
    def on_host(self) -> bool:
        return self.host_slab >= 0 and self.host_ready

    @property
    def pinned(self) -> bool:
        """Pinned by a lane, a transfer, or anything pinned below it: deleting this node would
        delete its subtree (§9.4), so a pinned descendant pins the whole path above it."""
        return self.active_refs > 0 or self.restore_pins > 0 or self.filling or self.pinned_below > 0

    def path(self) -> list["Node"]:
        """Nodes from depth 0 to this one (the root excluded)."""
        out = []
        n = self
        while not n.is_root:
            out.append(n)
            n = n.parent
        out.reverse()
        return out

    def ancestor_at(self, depth: int) -> "Node":
        n = self
        while n.depth > depth:
            n = n.parent
        return n

    def __repr__(self) -> str:
        return f"Node(id={self.id}, depth={self.depth}, dev={self.device_page}, host={self.host_slab})"


class BlockTree:
    def __init__(self):
        self._roots: dict[Optional[str], Node] = {}
        self._by_hash: dict[int, list[Node]] = {}
        self._arena: list[Optional[Node]] = []
        self._gens: list[int] = []
        self._free_ids: list[int] = []
        self.num_nodes = 0

    # ---- handles -------------------------------------------------------------------------
    def root(self, namespace: Optional[str]) -> Node:
        r = self._roots.get(namespace)
        if r is None:
            r = self._roots[namespace] = Node(None, -1, 0, 0, b"", namespace)
        return r

    def resolve(self, node_id: int, gen: int) -> Optional[Node]:
        """The node of a (id, generation) handle, or None if it was deleted since."""
        if 0 <= node_id < len(self._arena) and self._gens[node_id] == gen:
            return self._arena[node_id]
        return None

    def _register(self, node: Node) -> None:
        if self._free_ids:
            node.id = self._free_ids.pop()
            self._arena[node.id] = node
        else:
            node.id = len(self._arena)
            self._arena.append(node)
            self._gens.append(0)
        node.gen = self._gens[node.id]
        self._by_hash.setdefault(node.hash, []).append(node)
        self.num_nodes += 1

    def _unregister(self, node: Node) -> None:
        bucket = self._by_hash[node.hash]
        bucket.remove(node)
        if not bucket:
            del self._by_hash[node.hash]
        self._arena[node.id] = None
        self._gens[node.id] += 1
        self._free_ids.append(node.id)
        self.num_nodes -= 1

    def nodes(self) -> Iterator[Node]:
        return (n for n in self._arena if n is not None)

    # ---- exact lookup ----------------------------------------------------------------------
    def child(self, parent: Node, key: PromptKey, b: int) -> Optional[Node]:
        """The exact child of ``parent`` for block ``b`` of ``key``."""
        blk = key.block(b)
        media = key.media_key(b)
        for n in self._by_hash.get(key.hashes[b], ()):
            if n.parent is parent and n.media == media and n.block_bytes == blk:
                return n
        return None

    def _path_equals(self, node: Node, key: PromptKey) -> bool:
        """Whether node's whole path equals key's first depth+1 blocks (media-free paths)."""
        n_bytes = (node.depth + 1) * BLOCK_BYTES
        return (node.namespace == key.namespace and not node.path_media
                and len(key.buf) >= n_bytes and key.buf.startswith(memoryview(node.buf)[:n_bytes]))

    def _exact_at(self, key: PromptKey, b: int) -> Optional[Node]:
        for n in self._by_hash.get(key.hashes[b], ()):
            if n.depth == b and self._path_equals(n, key):
                return n
        return None

    def match(self, key: PromptKey, max_blocks: int) -> Node:
        """The deepest node whose path equals key's leading blocks (at most max_blocks); the
        namespace root when none does."""
        max_blocks = min(max_blocks, key.num_blocks)
        if key.media is None:
            # Binary search the deepest depth whose hash is present: exact ancestors exist at
            # every shallower depth, so the answer is >= the true match; verify it once.
            lo, hi = 0, max_blocks           # depths [0, lo) present; answer in [lo, hi]
            hashes, by_hash = key.hashes, self._by_hash
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if hashes[mid - 1] in by_hash:
                    lo = mid
                else:
                    hi = mid - 1
            if lo == 0:
                return self.root(key.namespace)
            node = self._exact_at(key, lo - 1)
            if node is not None:
                return node
        return self.walk(key, max_blocks)

    def walk(self, key: PromptKey, max_blocks: int) -> Node:
        """Reference matcher: block-by-block exact walk from the root."""
        node = self.root(key.namespace)
        for b in range(min(max_blocks, key.num_blocks)):
            nxt = self.child(node, key, b)
            if nxt is None:
                break
            node = nxt
        return node

    # ---- structure ---------------------------------------------------------------------------
    def insert(self, parent: Node, key: PromptKey, b: int) -> Node:
        assert parent.depth == b - 1 and self.child(parent, key, b) is None
        node = Node(parent, b, key.hashes[b], key.media_key(b), key.buf, key.namespace)
        self._register(node)
        parent.children[node.id] = node
        return node

    def detach_subtree(self, node: Node, on_remove: Callable[[Node], None]) -> None:
        """Remove ``node`` and its descendants, deepest first, calling ``on_remove`` on each
        before it is unlinked."""
        order = []
        stack = [node]
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        order.sort(key=lambda n: -n.depth)
        for n in order:
            on_remove(n)
            del n.parent.children[n.id]
            self._unregister(n)
