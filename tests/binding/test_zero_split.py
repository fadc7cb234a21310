"""Zero-split taps in the binding: slots reserved before a pass, published after it, no split.

SGLang's real pools on CPU; the harness plays the scheduler, and its ``forward_taps`` plays the
ForwardBatch hook and the GDN pass (each reserved slot gets the state value of its frontier).
"""
from __future__ import annotations

import pytest

from sglang_harness import PAGE, build_cache

torch = pytest.importorskip("torch")

from benchmarks.workloads.chatml import TINY  # noqa: E402
from hpc_radix.sglang_version import req_slots, prefix_len
from hpc_radix.binding.hints import ChatMLMarkers  # noqa: E402


def prompt(n, seed=0):
    return [(seed * 7919 + i * 31) % 250 + 1 for i in range(n)]


def snaps(cache):
    return sorted((s.frontier, s.kind.value, s.superseded) for s in cache.index.snapshots())


@pytest.fixture
def h(server_args):
    return build_cache(server_args, chunk=256, env={
        "HPC_CACHE_FULL_CHECK": "1", "HPC_CACHE_TAPS_PER_REQUEST": "4"}, zero_split=True)


def chat(h):
    h.cache.taps.markers = ChatMLMarkers.build(TINY.im_start, TINY.im_end, TINY.encode)
    system = TINY.message("system", prompt(150, seed=1))
    return system + TINY.message("user", prompt(100, seed=2)) + TINY.opener()


def test_taps_are_captured_where_planned_without_splitting_the_prefill(h):
    tokens = chat(h)                                  # system block ends mid-page, opener at the end
    req = h.new_req(tokens)
    h.admit(req)
    planned = sorted(req.last_node.taps.planned)
    assert h.cache.chunk_cap(req) is None             # no chunk is ever cut at a tap
    h.prefill_chunk(req, len(tokens), final=True)     # one pass captures every tap
    published = {s.frontier: s for s in h.cache.index.snapshots()}
    assert sorted(published) == planned
    for frontier, s in published.items():
        assert h.state_of(s.device_slot) == float(frontier)   # the state the pass wrote there
    h.decode(req, [7] * 4)
    h.finish(req)
    h.check_idle()


def test_prompt_tail_without_special_tokens_resumes_at_the_end_of_the_prompt(h):
    first = h.new_req(prompt(300))                    # no chat markers at all
    h.admit(first)
    assert sorted(first.last_node.taps.planned) == [300]
    h.prefill_chunk(first, 256, final=False)          # the chunk end at 256 is kept too
    h.prefill_chunk(first, 300, final=True)
    assert snaps(h.cache) == [(256, "tap", True), (300, "tap", False)]
    h.decode(first, [9] * 5)
    h.finish(first)
    # the client re-renders its history (other output tokens) and goes on: resume at 300
    nxt = h.new_req(prompt(300) + prompt(40, seed=5) + prompt(30, seed=6))
    assert h.admit(nxt) == 300
    assert h.state_of(int(req_slots(nxt).mamba_pool_idx)) == 300.0
    tail = next(s for s in h.cache.index.snapshots() if s.frontier == 300)
    row = h.req_pool.req_to_token[req_slots(nxt).req_pool_idx]
    k = h.kv.full_kv_pool.k_buffer[0]
    # the private tail page holds the KV of [256, 300), now copied for the new request
    assert torch.equal(k[row[256:300]], k[tail.tail_page * PAGE:tail.tail_page * PAGE + 44])
    assert torch.equal(k[row[256:300], 0, 0], torch.tensor([t % 251 for t in prompt(300)[256:]],
                                                           dtype=k.dtype))
    h.complete(nxt, [3])
    h.check_idle()


def test_a_pass_with_several_requests_captures_each_rows_taps(h):
    a, b = h.new_req(prompt(200, seed=1)), h.new_req(prompt(130, seed=2))
    for r in (a, b):
        h.admit(r)
        h._alloc(r, len(r.origin_input_ids))
        h.set_extend(r, 0, len(r.origin_input_ids))
        req_slots(r).kv_committed_len = len(r.origin_input_ids)
    plan = h.forward_taps([(a, 0, 200), (b, 0, 130)])
    assert [(row, rel) for row, rel, _ in plan.taps] == [(0, 200), (1, 130)]
    assert plan.extend_starts == [0, 200] and plan.extend_lens == [200, 130]
    for r in (a, b):
        h.cache.cache_unfinished_req(r)
    assert [f for f, _, _ in snaps(h.cache)] == [130, 200]
    for r in (a, b):
        h.decode(r, [1])
        h.finish(r)
    h.check_idle()


def test_abort_before_publication_leaves_no_slot_behind(h):
    req = h.new_req(prompt(300))
    h.admit(req)
    start = prefix_len(req)
    h.set_extend(req, start, 300)
    h._alloc(req, 300)
    req_slots(req).kv_committed_len = 300
    plan = h.forward_taps([(req, start, 300)])
    assert plan is not None and h.cache.index.sizes.staged_slots == 1
    h.finish(req, is_insert=False)                    # aborted: nothing is inserted
    assert h.cache.index.sizes.staged_slots == 0 and not h.cache.index.sizes.snapshots
    h.check_idle()


def test_an_echoing_client_has_its_prompt_tail_superseded_by_its_endpoint(h):
    first = h.new_req(prompt(200))
    h.serve(first, [9] * 10)
    history = list(first.origin_input_ids) + list(first.output_ids)
    nxt = h.new_req(history + prompt(100, seed=3))    # echoes: resumes from the endpoint
    assert h.admit(nxt) == 210
    assert nxt.last_node.taps.echoes
    h.complete(nxt, [4] * 3)
    by_frontier = {f: sup for f, kind, sup in snaps(h.cache)}
    assert by_frontier[310] is True                   # its prompt tail: first to go
    assert by_frontier[313] is False                  # its endpoint serves the next turn
    h.check_idle()


def test_taps_beyond_the_slot_budget_are_skipped_without_leaking(server_args):
    h = build_cache(server_args, chunk=256, env={
        "HPC_CACHE_FULL_CHECK": "1", "HPC_DEVICE_SNAPSHOT_SLOTS": "1",
        "HPC_CACHE_TAPS_PER_REQUEST": "4", "HPC_CACHE_TAP_LADDER": "128",
        "HPC_CACHE_TAP_MIN_GAP": "64"}, zero_split=True)
    req = h.new_req(prompt(300))
    h.admit(req)
    assert len(req.last_node.taps.planned) > 1
    h.prefill_chunk(req, 300, final=True)
    assert h.cache.index.sizes.snapshots == 1 and h.cache.taps.stats["captures_without_slot"] >= 1
    h.decode(req, [2])
    h.finish(req)
    h.check_idle()


def test_taps_after_an_unaligned_resume_go_down_to_the_extends_grid(server_args):
    """Resumed from an endpoint at 210, a planned tap at a page boundary lies off the chunk
    kernel's grid of that extend (210 + 64k): it is captured at the grid point below, with a
    private tail page, instead of costing a partial-chunk call."""
    h = build_cache(server_args, chunk=512, env={
        "HPC_CACHE_FULL_CHECK": "1", "HPC_CACHE_TAPS_PER_REQUEST": "4",
        "HPC_CACHE_TAP_LADDER": "128", "HPC_CACHE_TAP_MIN_GAP": "64"}, zero_split=True)
    first = h.new_req(prompt(200))
    h.serve(first, [9] * 10, chunk=512)
    history = list(first.origin_input_ids) + list(first.output_ids)
    nxt = h.new_req(history + prompt(300, seed=3))
    assert h.admit(nxt) == 210
    planned = sorted(nxt.last_node.taps.planned)
    assert any(p % PAGE == 0 and p < 510 for p in planned), planned
    h.set_extend(nxt, 210, 510)
    h._alloc(nxt, 510)
    req_slots(nxt).kv_committed_len = 510
    plan = h.forward_taps([(nxt, 210, 510)])
    rels = [rel for _, rel, _ in plan.taps]
    assert all(rel % 64 == 0 or rel == 300 for rel in rels) and 300 in rels, rels
    h.cache.cache_unfinished_req(nxt)
    frontiers = {s.frontier for s in h.cache.index.snapshots()}
    assert {210 + rel for rel in rels} <= frontiers
    h.decode(nxt, [1])
    h.finish(nxt)
    h.check_idle()


def test_spare_slots_let_a_pass_reserve_without_waiting_and_go_first_on_eviction(h):
    first = h.new_req(prompt(300))
    h.serve(first, [1] * 3, chunk=512)
    spares = h.cache.pool.spare_slots.held
    assert 2 * spares > h.cache.pages.slot_floor         # taken after the first results
    nxt = h.new_req(prompt(300, seed=4))
    h.admit(nxt)
    h.prefill_chunk(nxt, 300, final=True)
    assert h.cache.pool.spare_slots.held == spares - 1         # one taken by its capture (above
                                                         # half of the target: no top-up yet)
    assert h.cache.taps.stats["captures"] == 2
    h.decode(nxt, [1] * 3)
    h.finish(nxt)
    h.check_idle()                                       # spares count as evictable
    images, held = h.cache.index.sizes.device_images, h.cache.pool.spare_slots.held
    freed = h.evict(mamba_num=held + 1).mamba_num_evicted
    assert freed == held + 1 and not h.cache.pool.spare_slots.held
    assert h.cache.index.sizes.device_images == images - 1     # one image after all spares
    h.check_idle()


def test_spare_slots_follow_what_passes_captured_lately(server_args):
    """A pass whose captures took more spare slots than the floor raises the target: the next
    passes find their slots known, not read behind the pass in flight."""
    h = build_cache(server_args, chunk=256, mamba_slots=120, env={
        "HPC_CACHE_TAPS_PER_REQUEST": "4", "HPC_CACHE_TAP_LADDER": "256",
        "HPC_CACHE_TAP_MIN_GAP": "256"}, zero_split=True)
    pages, taps = h.cache.pages, h.cache.taps
    assert pages.spare_slot_target() == pages.slot_floor == 16
    reqs = [h.new_req(prompt(1000, seed=seed)) for seed in range(8)]
    for req in reqs:
        h.admit(req)
    plan = h.forward_taps([(req, 0, 1000) for req in reqs])   # one pass, every request's taps
    wanted = len(plan.taps) + taps.stats["captures_without_slot"]
    assert len(plan.taps) == pages.slot_floor < wanted       # the floor's spares ran out
    assert pages.spare_slot_target() == min(2 * wanted, 120 // 4) > pages.slot_floor
    pages.refill_spares()
    assert h.cache.pool.spare_slots.held >= pages.spare_slot_target() // 2


def test_flush_drops_spares_with_the_pools_it_clears(h):
    """SGLang's flush_cache resets the tree cache, then clears the pools the spares came from."""
    req = h.new_req(prompt(300))
    h.serve(req, [1])
    assert h.cache.pool.spare_slots.known
    h.cache.reset()
    h.req_pool.clear()
    h.allocator.clear()
    assert not h.cache.pool.spare_slots.known
    h.check_idle()


def test_the_first_pass_warms_the_tap_kernels_up_in_a_spare_slot(server_args):
    """SGLang's warm-up request carries a throwaway tap one token in (off the 64-token grid:
    every tap kernel variant runs), into a spare slot that stays spare; later passes don't."""
    h = build_cache(server_args, chunk=256, env={"HPC_CACHE_FULL_CHECK": "1"}, zero_split=True, warmed_up=False)
    spares = list(h.cache.pool.spare_slots.known)
    warm = h.new_req(prompt(5, seed=4))
    h.admit(warm)
    h._alloc(warm, 5)
    h.set_extend(warm, 0, 5)
    req_slots(warm).kv_committed_len = 5
    plan = h.forward_taps([(warm, 0, 5)])
    assert plan is not None and [(row, rel) for row, rel, _ in plan.taps] == [(0, 1)] + \
        [(row, rel) for row, rel, _ in plan.taps if rel != 1]
    assert plan.taps[0][2] == spares[0] and h.cache.pool.spare_slots.known[0] == spares[0]
    assert h.forward_taps([(warm, 0, 5)]).taps == []        # once only
    h.finish(warm, is_insert=False)
    h.serve(h.new_req(prompt(300)), [1, 2])
    h.check_idle()


def test_end_taps_take_every_layers_state_once_the_passs_last_gdn_layer_ran(server_args):
    """The GDN extend hook over SGLang's real mamba pool, each layer played by a stand-in that
    writes its working state: a tap at the end of the extend gets every layer's state in one
    copy after the last GDN layer, none before (a layer's state is final only after it ran)."""
    from types import SimpleNamespace

    from hpc_radix.kernels.gdn_taps import build_tap_tables
    from hpc_radix.patches.gdn_taps import _around_forward_extend

    pool = build_cache(server_args).req_pool
    cache = pool.mamba_pool.mamba_cache
    work, tap = 3, 9
    tables = build_tap_tables([0], [70], [(0, 70, tap)], torch.tensor([work], dtype=torch.int32),
                              conv_width=cache.conv[0].shape[-1], device="cpu")
    backend = SimpleNamespace(req_to_token_pool=pool,
                              forward_metadata=SimpleNamespace(hpc_taps=tables))

    def layer_forward(backend, layer, forward_batch, mixed_qkv, a, b):
        state = pool.mamba2_layer_cache(layer.layer_id)
        state.conv[0][work] = layer.layer_id + 1
        state.temporal[work] = layer.layer_id + 1

    mixed = torch.zeros(70, cache.conv[0].shape[2])
    layers = sorted(pool.mamba_map)
    for n, layer_id in enumerate(layers):
        _around_forward_extend(layer_forward, backend, SimpleNamespace(layer_id=layer_id), None,
                               mixed, None, None)
        copied = [bool((cache.temporal[i, tap] != 0).any()) for i in range(len(layers))]
        assert copied == [n == len(layers) - 1] * len(layers)
    for i, layer_id in enumerate(layers):
        assert (cache.temporal[i, tap] == layer_id + 1).all()
        assert all((conv[i, tap] == layer_id + 1).all() for conv in cache.conv[:1])


def test_a_tap_inside_the_extend_takes_its_conv_window_before_the_layer_runs(server_args):
    """The GDN extend hook over SGLang's real mamba pool: a tap 10 tokens into the extend gets
    the layer's W pre-conv inputs before it, written before the layer (whose conv kernel
    overwrites the working slot) runs."""
    from types import SimpleNamespace

    from hpc_radix.kernels.gdn_taps import build_tap_tables
    from hpc_radix.patches.gdn_taps import _around_forward_extend

    pool = build_cache(server_args).req_pool
    layer_id = sorted(pool.mamba_map)[0]
    conv = pool.mamba2_layer_cache(layer_id).conv[0]            # [slots, conv_dim, W]
    work, tap, rel, width = 3, 9, 10, conv.shape[-1]
    tables = build_tap_tables([0], [70], [(0, rel, tap)], torch.tensor([work], dtype=torch.int32),
                              conv_width=width, device="cpu")
    backend = SimpleNamespace(req_to_token_pool=pool,
                              forward_metadata=SimpleNamespace(hpc_taps=tables))
    # row + channel % 7: small integers, exact in the pool's dtype
    mixed = (torch.arange(70)[:, None] + torch.arange(conv.shape[1]) % 7).float()

    def layer_forward(backend, layer, forward_batch, mixed_qkv, a, b):
        conv[work] = -1                                          # as the conv kernel would

    _around_forward_extend(layer_forward, backend, SimpleNamespace(layer_id=layer_id), None,
                           mixed, None, None)
    assert torch.equal(conv[tap], mixed[rel - width:rel].T.to(conv.dtype))
    assert (conv[work] == -1).all()
