"""Where KV blocks and state images live on each tier, as byte runs (design §5.4, §11.2).

A host slab holds one KV block bundle laid out [full-attention layer][K | V (| scales)][64
tokens], so a block's layer is two contiguous runs and a restore can go layer by layer; a
speculative draft model's layers follow the target's (its KV sits at the same token slots). A state
image is packed in model layer order (each GDN layer's conv state, then its recurrent state) and
cut into slabs: its byte o lives in slab o // slab_bytes of the image's slab list, so runs are
split where a slab ends. Everything here is bookkeeping over SGLang's real pools and the host
tier's chunks; ``kernels/host_copy.copy_runs`` moves the bytes.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..device.pool import full_kv_pool
from .memory import HostMemory

SLAB_ALIGN = 4096


# A run table is an int64 array with a row per run: (model layer, source place, source byte
# offset, destination place, destination byte offset, length), places as in ``places``. Built
# with numpy: a write-through of a long conversation is thousands of runs, and building them one
# object at a time cost the scheduler thread more than the copies.

class TierLayout:
    """Byte runs between SGLang's pools and host slabs for blocks and images."""

    def __init__(self, kv_pool, mamba_pool, page_tokens: int, draft_kv_pools: Sequence = ()):
        # (model layer id, plane [tokens, ...]) in slab order
        self.kv_planes: list[tuple[int, torch.Tensor]] = []
        layer_ids = _full_attention_layer_ids(kv_pool, len(full_kv_pool(kv_pool).k_buffer))
        self._add_planes(kv_pool, layer_ids)
        target_planes = len(self.kv_planes)
        # A draft's layers are copied with the target's last: the draft pass runs after the
        # target's, so a pass that waited for that layer finds the draft's KV too.
        for pool in draft_kv_pools:
            self._add_planes(pool, [layer_ids[-1]] * len(full_kv_pool(pool).k_buffer))
        self.draft_planes = len(self.kv_planes) - target_planes
        self.page_tokens = page_tokens
        self.plane_page_bytes = [p.stride(0) * p.element_size() * page_tokens for _, p in self.kv_planes]
        self.block_bytes = sum(self.plane_page_bytes)
        self.slab_bytes = -(-self.block_bytes // SLAB_ALIGN) * SLAB_ALIGN
        cache = mamba_pool.mamba_cache
        state = [*cache.conv, cache.temporal]                    # each [layers, slots, ...]
        mamba_ids = list(getattr(mamba_pool, "mamba_layer_ids", None) or range(state[0].shape[0]))
        # (model layer id, tensor, index in it) in image order
        self.image_parts = [(mamba_ids[l], t, l) for l in range(state[0].shape[0]) for t in state]
        self.part_bytes = [t[l, 0].numel() * t.element_size() for _, t, l in self.image_parts]
        self.image_bytes = sum(self.part_bytes)
        self.image_slabs = -(-self.image_bytes // self.slab_bytes)
        self._device = [p for _, p in self.kv_planes] + list(dict.fromkeys(t for _, t, _ in self.image_parts))
        # a block's planes: model layer, byte size (= offset step per page), offset in the slab
        self._plane_layer = np.array([layer for layer, _ in self.kv_planes], dtype=np.int64)
        self._plane_size = np.array(self.plane_page_bytes, dtype=np.int64)
        self._plane_at = np.cumsum(self._plane_size) - self._plane_size
        self._image_template = self._image_pieces()

    def _add_planes(self, kv_pool, layer_ids: list[int]) -> None:
        full = full_kv_pool(kv_pool)
        for i, layer in enumerate(layer_ids):
            planes = [full.k_buffer[i], full.v_buffer[i]]
            if getattr(full, "k_scale_buffer", None) is not None:
                planes += [full.k_scale_buffer[i], full.v_scale_buffer[i]]
            self.kv_planes += [(layer, p) for p in planes]

    def _image_pieces(self) -> np.ndarray:
        """One row per piece of the image, split where a slab ends: (model layer, device
        place, byte offset in slot 0, slot stride in bytes, index in the image's slab list,
        offset in that slab, length)."""
        first_state = len(self.kv_planes)
        place_of = {id(t): first_state + i for i, t in enumerate(self._device[first_state:])}
        rows, packed = [], 0
        for (layer, t, l), size in zip(self.image_parts, self.part_bytes):
            at_slot0 = t[l, 0].data_ptr() - t.data_ptr()
            stride = t.stride(1) * t.element_size()
            done = 0
            while done < size:
                k, within = divmod(packed + done, self.slab_bytes)
                n = min(size - done, self.slab_bytes - within)
                rows.append((layer, place_of[id(t)], at_slot0 + done, stride, k, within, n))
                done += n
            packed += size
        return np.array(rows, dtype=np.int64).reshape(-1, 7)

    def places(self, host: HostMemory) -> list[torch.Tensor]:
        """Every device tensor a run may touch (the first is the copy's anchor), then the host
        chunks online so far."""
        return self._device + host.chunks

    def _host_place(self, host: HostMemory, slabs: np.ndarray, offset) -> tuple[np.ndarray, np.ndarray]:
        chunk, index = np.divmod(slabs, host.slabs.slabs_per_chunk)
        return len(self._device) + chunk, index * host.slabs.slab_bytes + offset

    def block_runs(self, host: HostMemory, pages: Sequence[int], slabs: Sequence[int],
                   to_host: bool) -> np.ndarray:
        """The run table of blocks: device page ``pages[i]`` and host slab ``slabs[i]``."""
        pages = np.asarray(pages, dtype=np.int64).reshape(-1, 1)
        slabs = np.asarray(slabs, dtype=np.int64).reshape(-1, 1)
        host_place, host_at = self._host_place(host, slabs, self._plane_at)
        device_place = np.arange(len(self.kv_planes))
        return _table(self._plane_layer, (device_place, pages * self._plane_size),
                      (host_place, host_at), self._plane_size, to_host)

    def image_runs(self, host: HostMemory, slot: int, slabs: Sequence[int],
                   to_host: bool) -> np.ndarray:
        """The run table of the image in mamba slot ``slot`` stored in ``slabs``."""
        if len(slabs) != self.image_slabs:
            raise ValueError(f"an image takes {self.image_slabs} slabs, got {len(slabs)}")
        layer, place, at_slot0, stride, k, within, n = self._image_template.T
        host_place, host_at = self._host_place(host, np.asarray(slabs, dtype=np.int64)[k], within)
        return _table(layer, (place, at_slot0 + slot * stride), (host_place, host_at), n, to_host)


def _table(layer, device, host, length, to_host: bool) -> np.ndarray:
    src, dst = (device, host) if to_host else (host, device)
    columns = (layer, *src, *dst, length)
    # broadcast by assignment: a third of broadcast_arrays + stack's time for a block table
    table = np.empty(np.broadcast_shapes(*(np.shape(c) for c in columns)) + (len(columns),), np.int64)
    for i, column in enumerate(columns):
        table[..., i] = column
    return table.reshape(-1, len(columns))


def _full_attention_layer_ids(kv_pool, count: int) -> list[int]:
    """Model layer id of each full-attention buffer (SGLang's id -> buffer index mapping)."""
    mapping = getattr(kv_pool, "full_attention_layer_id_mapping", None) or {}
    by_index = {i: layer for layer, i in mapping.items()}
    return [by_index.get(i, i) for i in range(count)]


def in_layer_order(*tables: np.ndarray) -> np.ndarray:
    """The runs of ``tables`` by model layer (stable), without the layer column: what
    ``copy_runs`` takes."""
    return _sorted_by_layer(tables)[:, 1:]


def layer_parts(runs: np.ndarray, layer_ends: list[tuple[int, int]], parts: int) -> list[tuple[list[int], int]]:
    """``by_layer``'s runs cut into at most ``parts`` parts of consecutive layers, about equal
    in bytes (a part ends once it holds its share of what the parts before left): (the layers
    of each part, the row where the next part starts)."""
    total = int(runs[:, 4].sum()) if len(runs) else 0
    through = np.cumsum(runs[:, 4])
    cut, layers, done = [], [], 0
    for layer, end in layer_ends:
        layers.append(layer)
        left = parts - len(cut)
        if end == len(runs) or (left > 1 and (through[end - 1] - done) * left >= total - done):
            cut.append((layers, end))
            layers, done = [], int(through[end - 1])
    return cut


def by_layer(*tables: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """``in_layer_order``'s runs, and (model layer, end row) for each layer they touch: row
    ``end`` is where the next layer's runs start."""
    table = _sorted_by_layer(tables)
    ends = [*np.flatnonzero(np.diff(table[:, 0])) + 1, len(table)] if len(table) else []
    return table[:, 1:], [(int(table[end - 1, 0]), int(end)) for end in ends]


def _sorted_by_layer(tables: tuple[np.ndarray, ...]) -> np.ndarray:
    table = np.concatenate(tables) if len(tables) > 1 else tables[0]
    return table[np.argsort(table[:, 0], kind="stable")]
