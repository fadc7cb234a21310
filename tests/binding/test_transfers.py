"""KV blocks and state images through the host tier and back, over SGLang's real pools, the
host tier's real memory and the run-copy kernel (interpreted on CPU)."""
from __future__ import annotations

import pytest

from sglang_harness import FULL_LAYERS, MAMBA_LAYERS, PAGE

torch = pytest.importorskip("torch")

from hpc_radix.binding.host.layout import in_layer_order  # noqa: E402
from hpc_radix.kernels.host_copy import copy_runs  # noqa: E402


@pytest.fixture
def tier(hosted):
    host = hosted.cache.host
    return hosted, host.layout, host.memory


def same(a, b):
    """Bitwise (random bytes make NaNs, which never compare equal as floats)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def fill_random(t, seed):
    g = torch.Generator().manual_seed(seed)
    t.view(torch.uint8).copy_(torch.randint(0, 255, t.view(torch.uint8).shape, generator=g,
                                            dtype=torch.uint8))


def test_layout_of_the_harness_pools(tier):
    h, layout, _ = tier
    # one full-attention layer: K and V pages of 64 tokens x 2 heads x 8 dims in bf16
    assert [layer for layer, _ in layout.kv_planes] == [FULL_LAYERS[0]] * 2
    assert layout.block_bytes == 2 * 64 * 2 * 8 * 2 and layout.slab_bytes == 4096
    assert layout.image_bytes == h.cache.image_bytes == 4224 and layout.image_slabs == 2
    assert sorted({layer for layer, _, _ in layout.image_parts}) == MAMBA_LAYERS


def test_a_draft_models_layers_follow_the_targets_and_are_copied_with_its_last(hosted):
    """A restore waited for layer by layer: the pass that waited for the target's last layer
    finds the draft's KV too (the draft pass runs after it)."""
    from hpc_radix.binding.host.layout import TierLayout, by_layer

    target = hosted.cache.host.layout
    draft = hosted.attach_draft()       # the tier is built already: tail copies only, here
    layout = TierLayout(hosted.kv, hosted.mamba, PAGE, [draft])
    assert layout.draft_planes == 2 and layout.kv_planes[-2][1] is draft.full_kv_pool.k_buffer[0]
    assert [layer for layer, _ in layout.kv_planes] == [FULL_LAYERS[-1]] * 4
    assert layout.block_bytes == 2 * target.block_bytes
    runs, ends = by_layer(layout.block_runs(hosted.cache.host.memory, [3], [5], to_host=False))
    assert ends[-1] == (FULL_LAYERS[-1], len(runs)) and len(runs) == 4


def test_a_block_goes_to_a_slab_and_comes_back_bit_exact(tier):
    h, layout, host = tier
    planes = [p for _, p in layout.kv_planes]
    for i, p in enumerate(planes):
        fill_random(p, i)
    page, slab = 7, host.slabs.alloc(1)[0]
    want = [p[page * PAGE:(page + 1) * PAGE].clone() for p in planes]
    places = layout.places(host)
    copy_runs(places, in_layer_order(layout.block_runs(host, [page], [slab], to_host=True)))
    assert torch.equal(host.view(slab)[:layout.block_bytes],
                       torch.cat([w.reshape(-1).view(torch.uint8) for w in want]))
    for p in planes:
        p[page * PAGE:(page + 1) * PAGE] = 0
    other = [p.clone() for p in planes]
    copy_runs(places, in_layer_order(layout.block_runs(host, [page], [slab], to_host=False)))
    for p, w, o in zip(planes, want, other):
        assert same(p[page * PAGE:(page + 1) * PAGE], w)
        o[page * PAGE:(page + 1) * PAGE] = w
        assert same(p, o)                          # nothing else written


def test_blocks_of_one_table_each_land_in_their_own_slab(tier):
    h, layout, host = tier
    planes = [p for _, p in layout.kv_planes]
    for i, p in enumerate(planes):
        fill_random(p, 20 + i)
    pages, slabs = [9, 2, 7], host.slabs.alloc(3)
    copy_runs(layout.places(host), in_layer_order(layout.block_runs(host, pages, slabs, to_host=True)))
    for page, slab in zip(pages, slabs):
        want = torch.cat([p[page * PAGE:(page + 1) * PAGE].reshape(-1).view(torch.uint8) for p in planes])
        assert torch.equal(host.view(slab)[:layout.block_bytes], want)
    assert layout.block_runs(host, [], [], to_host=True).shape == (0, 6)


def test_an_image_is_split_over_its_slabs_and_restored_layer_by_layer(tier):
    h, layout, host = tier
    cache = h.mamba.mamba_cache
    state = [*cache.conv, cache.temporal]
    for i, t in enumerate(state):
        fill_random(t, 10 + i)
    slot, slabs = 5, host.slabs.alloc(layout.image_slabs)
    want = [t[:, slot].clone() for t in state]
    places = layout.places(host)
    copy_runs(places, in_layer_order(layout.image_runs(host, slot, slabs, to_host=True)))
    for t in state:
        t[:, slot] = 0
    back = layout.image_runs(host, slot, slabs, to_host=False)
    assert sorted(set(back[:, 0].tolist())) == MAMBA_LAYERS
    for layer in MAMBA_LAYERS:                     # one layer's runs at a time, in image order
        copy_runs(places, back[back[:, 0] == layer][:, 1:])
        l = MAMBA_LAYERS.index(layer)
        assert all(same(t[l, slot], w[l]) for t, w in zip(state, want))
        assert all(not t[l + 1:, slot].view(torch.uint8).any() for t in state)   # not yet
    with pytest.raises(ValueError, match="takes 2 slabs"):
        layout.image_runs(host, slot, slabs[:1], to_host=True)


def test_runs_by_layer_end_where_the_next_layer_starts():
    """A restore copies a layer at a time: the runs of several tables in model layer order
    (stable), each layer's last row marked, and nothing for an empty table."""
    import numpy as np

    from hpc_radix.binding.host.layout import by_layer, in_layer_order

    blocks = np.array([[3, 0, 0, 1, 0, 8], [7, 0, 8, 1, 8, 8], [3, 0, 16, 1, 16, 8]])
    image = np.array([[0, 2, 0, 1, 24, 4], [7, 2, 4, 1, 28, 4], [1, 2, 8, 1, 32, 4]])
    ordered, ends = by_layer(blocks, image)
    assert ends == [(0, 1), (1, 2), (3, 4), (7, 6)]
    assert ordered[:, 1].tolist() == [0, 8, 0, 16, 8, 4]         # layer 3's two runs kept in order
    assert np.array_equal(in_layer_order(blocks, image), ordered)
    empty, none = by_layer(np.empty((0, 6), dtype=np.int64))
    assert none == [] and empty.shape == (0, 5)


def test_a_restore_waited_for_by_layer_is_cut_into_a_few_parts_of_about_equal_bytes():
    """At most the parts asked for, consecutive layers each, cut where the bytes pass an equal
    share of what is left; every layer in exactly one part, the last ending at the last run."""
    import numpy as np

    from hpc_radix.binding.host.layout import by_layer, layer_parts

    # 16 layers: 12 with 10 bytes (state), 4 with 100 (KV: layers 3, 7, 11, 15)
    table = np.array([[layer, 0, 0, 1, 0, 100 if layer % 4 == 3 else 10] for layer in range(16)])
    runs, ends = by_layer(table)
    parts = layer_parts(runs, ends, 4)
    assert [layers for layers, _ in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert [end for _, end in parts] == [4, 8, 12, 16]
    heavy_first = table.copy()
    heavy_first[0, 5] = 1000                                        # one layer past two shares
    assert [layers for layers, _ in layer_parts(*by_layer(heavy_first), 4)] == [
        [0], [1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]     # the rest shared anew
    assert layer_parts(runs, ends, 1) == [(list(range(16)), 16)]
    assert len(layer_parts(runs, ends, 64)) == 16                  # never more than the layers
    empty = np.array([[layer, 0, 0, 1, 0, 0] for layer in range(8)])
    assert len(layer_parts(*by_layer(empty), 4)) == 4              # nothing to weigh: still capped
