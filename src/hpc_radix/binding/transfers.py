"""Where KV blocks and state images live on each tier, as byte runs (spec §5.4, §11.2).

A host slab holds one KV block bundle laid out [full-attention layer][K | V (| scales)][64
tokens], so a block's layer is two contiguous runs and a restore can go layer by layer. A state
image is packed in model layer order (each GDN layer's conv state, then its recurrent state) and
cut into slabs: its byte o lives in slab o // slab_bytes of the image's slab list, so runs are
split where a slab ends. Everything here is bookkeeping over SGLang's real pools and the host
tier's chunks; ``kernels/host_copy.copy_runs`` moves the bytes.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch

from hpc_radix.kernels.host_copy import Run

from .host import HostMemory

SLAB_ALIGN = 4096


class TierLayout:
    """Byte runs between SGLang's pools and host slabs for blocks and images."""

    def __init__(self, kv_pool, mamba_pool, page_tokens: int):
        full = getattr(kv_pool, "full_kv_pool", kv_pool)
        layer_ids = _full_attention_layer_ids(kv_pool, len(full.k_buffer))
        # (model layer id, plane [tokens, ...]) in slab order
        self.kv_planes: list[tuple[int, torch.Tensor]] = []
        for i, layer in enumerate(layer_ids):
            planes = [full.k_buffer[i], full.v_buffer[i]]
            if getattr(full, "k_scale_buffer", None) is not None:
                planes += [full.k_scale_buffer[i], full.v_scale_buffer[i]]
            self.kv_planes += [(layer, p) for p in planes]
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

    def places(self, host: HostMemory) -> list[torch.Tensor]:
        """Every device tensor a run may touch (the first is the copy's anchor), then the host
        chunks online so far."""
        return self._device + host.chunks

    def _host_place(self, host: HostMemory, slab: int, offset: int) -> tuple[int, int]:
        chunk, base = host.slabs.locate(slab)
        return len(self._device) + chunk, base + offset

    def block_runs(self, host: HostMemory, page: int, slab: int, to_host: bool) -> dict[int, list[Run]]:
        """The runs of one block (device page ``page``, host slab ``slab``) by model layer."""
        out: dict[int, list[Run]] = defaultdict(list)
        offset = 0
        for i, ((layer, _), size) in enumerate(zip(self.kv_planes, self.plane_page_bytes)):
            place, at = self._host_place(host, slab, offset)
            out[layer].append(_run((i, page * size), (place, at), size, to_host))
            offset += size
        return out

    def image_runs(self, host: HostMemory, slot: int, slabs: Sequence[int],
                   to_host: bool) -> dict[int, list[Run]]:
        """The runs of the image in mamba slot ``slot`` stored in ``slabs``, by model layer."""
        if len(slabs) != self.image_slabs:
            raise ValueError(f"an image takes {self.image_slabs} slabs, got {len(slabs)}")
        out: dict[int, list[Run]] = defaultdict(list)
        first_state = len(self.kv_planes)
        place_of = {id(t): first_state + i for i, t in enumerate(self._device[first_state:])}
        packed = 0
        for (layer, t, l), size in zip(self.image_parts, self.part_bytes):
            device_at = (t[l, slot].data_ptr() - t.data_ptr())
            done = 0
            while done < size:                           # split where a slab ends
                k, within = divmod(packed + done, self.slab_bytes)
                n = min(size - done, self.slab_bytes - within)
                place, at = self._host_place(host, slabs[k], within)
                out[layer].append(_run((place_of[id(t)], device_at + done), (place, at), n, to_host))
                done += n
            packed += size
        return out


def _run(device: tuple[int, int], host: tuple[int, int], length: int, to_host: bool) -> Run:
    src, dst = (device, host) if to_host else (host, device)
    return Run(src[0], src[1], dst[0], dst[1], length)


def _full_attention_layer_ids(kv_pool, count: int) -> list[int]:
    """Model layer id of each full-attention buffer (SGLang's id -> buffer index mapping)."""
    mapping = getattr(kv_pool, "full_attention_layer_id_mapping", None) or {}
    by_index = {i: layer for layer, i in mapping.items()}
    return [by_index.get(i, i) for i in range(count)]


def in_layer_order(runs: dict[int, list[Run]]) -> list[Run]:
    return [r for layer in sorted(runs) for r in runs[layer]]
