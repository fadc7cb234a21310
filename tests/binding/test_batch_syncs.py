"""patches/batch_syncs.py: SGLang's own extend-batch build (ScheduleBatch.init_new and
prepare_for_extend on the real pools, CPU tensors) gives the same batch with the hooks as
without them: the tracking slots gathered on the device equal what ``.item()`` read."""
from __future__ import annotations

import random

import pytest
from sglang_harness import PAGE, build_cache, make_server_args

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

from hpc_radix.sglang_version import mamba_cache_chunk_size, ported, prefix_len, req_slots
from hpc_radix.patches.state import STATE  # noqa: E402


pytestmark = pytest.mark.skipif(not ported("batch_syncs"),
                                reason="not ported to this SGLang: it builds extend batches itself")


@pytest.fixture(scope="module")
def extra_buffer_args(tmp_path_factory):
    return make_server_args(tmp_path_factory.mktemp("tiny-config-eb"),
                            "--mamba-radix-cache-strategy", "extra_buffer")


def _hooked(monkeypatch):
    """The three hooks wrapped around SGLang's methods, as HookRegistry applies them."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    from hpc_radix.patches import batch_syncs

    for cls, name, hook in ((HybridReqToTokenPool, "alloc", batch_syncs._around_alloc),
                            (ScheduleBatch, "_mamba_radix_cache_v2_req_prepare_for_extend",
                             batch_syncs._around_track),
                            (ScheduleBatch, "prepare_for_extend", batch_syncs._around_prepare)):
        orig = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *a, _o=orig, _h=hook, **k: _h(_o, self, *a, **k))
    monkeypatch.setattr(STATE, "batch_syncs", STATE.batch_syncs)    # restored after


def _build_batches(args, seed: int, active: bool):
    """Two rounds of extend batches over the same requests (the second continues the first
    chunk of each), returning what each batch's tracking fields and the pool's mappings hold.
    ``active``: the hooks' way (the cache activates them) or SGLang's own."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from hpc_radix.patches import batch_syncs

    h = build_cache(args)
    batch_syncs.activate(active)
    rng = random.Random(seed)
    reqs = []
    for n in (150, 64, 300, 20):
        r = h.new_req([rng.randrange(200) for _ in range(n)])
        r.init_next_round_input(h.cache)
        h.cache.inc_lock_ref(r.last_node)
        h.cache.on_admitted(r)
        reqs.append(r)
    seen = []
    config = ModelConfig.from_server_args(args)
    for chunk in (PAGE + 3, None):          # a first chunk, then the rest
        for r in reqs:
            start = prefix_len(r)
            end = len(r.origin_input_ids) if chunk is None else min(len(r.origin_input_ids), start + chunk)
            r.set_extend_range(start, end)
        batch = ScheduleBatch.init_new(reqs, h.req_pool, h.allocator, h.cache, config, False,
                                       SpeculativeAlgorithm.NONE)
        batch.prepare_for_extend()
        pool = h.req_pool
        for name in ("mamba_track_mask", "mamba_track_seqlens"):   # host values kept, the same
            host = getattr(getattr(batch, name), batch_syncs.HOST_ATTR, None)
            assert host is None if not active else host == getattr(batch, name).tolist()
        seen.append({
            "indices": batch.mamba_track_indices.tolist(), "mask": batch.mamba_track_mask.tolist(),
            "seqlens": batch.mamba_track_seqlens.tolist(),
            "mamba map": pool.req_index_to_mamba_index_mapping[batch.req_pool_indices].tolist(),
            "ping-pong map": pool.req_index_to_mamba_ping_pong_track_buffer_mapping[batch.req_pool_indices].tolist(),
            "next": [req_slots(r).mamba_next_track_idx for r in reqs],
            "tracked": [req_slots(r).mamba_last_track_seqlen for r in reqs],
        })
        for r in reqs:                      # the chunk ran: its KV is the request's prefix
            row = h.req_pool.req_to_token[req_slots(r).req_pool_idx]
            r.prefix_indices = row[:r.extend_range.end].clone()
    return seen


def test_hooked_batch_build_equals_sglangs(extra_buffer_args, monkeypatch):
    _hooked(monkeypatch)
    plain = _build_batches(extra_buffer_args, seed=3, active=False)   # SGLang's .item() reads
    queued = _build_batches(extra_buffer_args, seed=3, active=True)
    assert plain == queued
    first = plain[0]
    assert first["mask"] == [True, True, True, False]           # extends of >= 64 tokens track
    assert all(i >= 0 for i in first["indices"])                # real slots, not NOT_READ
    assert first["indices"] != plain[1]["indices"]              # ping and pong alternate


def test_track_hook_notes_positions_without_reading_the_buffer(extra_buffer_args):
    """The entry's slot is NOT_READ (the buffer is never read); the position is noted."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    from hpc_radix.patches import batch_syncs

    h = build_cache(extra_buffer_args)
    r = h.new_req(list(range(130)))
    r.init_next_round_input(h.cache)
    r.set_extend_range(0, 130)
    h.req_pool.alloc([r])
    buffer = req_slots(r).mamba_ping_pong_track_buffer
    STATE.track_positions = []
    try:
        entry = batch_syncs._around_track(ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend,
                                          ScheduleBatch(reqs=[r], req_to_token_pool=h.req_pool), r)
        assert STATE.track_positions == [0]
    finally:
        STATE.track_positions = None
    assert entry.track_index == batch_syncs.NOT_READ and entry.track_mask
    assert req_slots(r).mamba_ping_pong_track_buffer is buffer and req_slots(r).mamba_next_track_idx == 1


def test_gather_refuses_a_batch_with_untracked_rows(extra_buffer_args):
    from types import SimpleNamespace

    from hpc_radix.patches import batch_syncs

    with pytest.raises(RuntimeError, match="2 tracking positions noted for 3 requests"):
        batch_syncs.gather_track_indices(SimpleNamespace(reqs=[1, 2, 3]), [0, 1])


def _sglang_track_metadata(mask, track_seqlens, extend_lens, prefix_lens, track_indices,
                           cache_indices, conv_len):
    """SGLang's own tracking tables (hybrid_linear_attn_backend and gdn_backend) on CPU tensors."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention.hybrid_linear_attn_backend import MambaAttnBackendBase

    bs = len(mask)
    fb = SimpleNamespace(mamba_track_mask=torch.tensor(mask, dtype=torch.bool),
                         mamba_track_seqlens=torch.tensor(track_seqlens, dtype=torch.int64),
                         extend_seq_lens=torch.tensor(extend_lens, dtype=torch.int32),
                         extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
                         mamba_track_indices=track_indices)
    starts = torch.zeros(bs, dtype=torch.int32)
    starts[1:] = torch.cumsum(fb.extend_seq_lens[:-1], 0)
    query_start_loc = torch.empty(bs + 1, dtype=torch.int32)
    query_start_loc[:bs] = starts
    query_start_loc[bs] = starts[-1] + fb.extend_seq_lens[-1]
    backend = SimpleNamespace(conv_states_shape=(1, 8, conv_len), device="cpu")
    rows = fb.mamba_track_mask.nonzero(as_tuple=True)[0]
    return {"track_conv_indices": MambaAttnBackendBase._init_track_conv_indices(backend, query_start_loc, fb),
            **dict(zip(("track_ssm_h_src", "track_ssm_h_dst", "track_ssm_final_src", "track_ssm_final_dst"),
                       MambaAttnBackendBase._init_track_ssm_indices(backend, cache_indices, fb))),
            "mamba_track_mask_indices": rows, "conv_states_mask_indices": track_indices[rows]}


@pytest.mark.parametrize("seed", range(12))
def test_host_tracking_tables_equal_sglangs(extra_buffer_args, seed):
    """``set_track_metadata`` (host values, one upload) builds the tables SGLang's GDN metadata
    builds from the device mask: row for row, dtype for dtype."""
    from types import SimpleNamespace

    from hpc_radix.patches.batch_syncs import set_track_metadata

    chunk = mamba_cache_chunk_size()          # of the published extra_buffer_args
    rng = random.Random(seed)
    bs = rng.randrange(1, 9)
    extend_lens = [rng.choice((1, 2, 63, 64, 65, 130, 256, 300)) for _ in range(bs)]
    prefix_lens = [rng.choice((0, 64, 128, 500)) for _ in range(bs)]
    mask = [rng.random() < 0.7 for _ in range(bs)]
    if seed == 0:
        mask = [False] * bs
    if seed == 1:       # an aligned extend before a row tracked from h: the h offsets count it
        extend_lens, prefix_lens, mask = [64, 130], [0, 64], [True, True]
        bs = 2
    # a tracked row's state sits at a chunk boundary or at its extend's end
    track_seqlens = [p + rng.choice((n // chunk * chunk, n, 0)) for p, n in zip(prefix_lens, extend_lens)]
    if seed == 1:
        track_seqlens = [64, 194]
    track_indices = torch.tensor(rng.sample(range(100), bs), dtype=torch.int64)
    cache_indices = torch.tensor(rng.sample(range(100, 200), bs), dtype=torch.int32)
    metadata = SimpleNamespace(mamba_cache_indices=cache_indices)
    set_track_metadata(metadata, mask, track_seqlens, extend_lens, prefix_lens, track_indices,
                       chunk=chunk, conv_len=4)
    assert metadata.has_mamba_track_mask == any(mask)
    if not any(mask):
        return
    want = _sglang_track_metadata(mask, track_seqlens, extend_lens, prefix_lens, track_indices,
                                  cache_indices, conv_len=4)
    for name, tensor in want.items():
        got = getattr(metadata, name)
        assert got.dtype == tensor.dtype and got.tolist() == tensor.tolist(), name


def test_queued_torch_keeps_host_tensors_as_torch_builds_them():
    from hpc_radix.patches import batch_syncs
    from hpc_radix.patches.batch_syncs import _QueuedTorch

    qt = _QueuedTorch()
    t = qt.tensor([1, 2, 3], dtype=torch.int64, device="cpu")
    assert t.dtype == torch.int64 and t.tolist() == [1, 2, 3]
    assert getattr(t, batch_syncs.HOST_ATTR) == [1, 2, 3]
    assert qt.int64 is torch.int64 and qt.Tensor is torch.Tensor


def test_metadata_hook_uses_host_values_or_leaves_the_batch_to_sglang(extra_buffer_args, monkeypatch):
    """The hook runs SGLang's metadata without the mask (so without its device reads), then sets
    the tracking tables; a batch whose tracking tensors carry no host values goes SGLang's way."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from hpc_radix.patches import batch_syncs

    monkeypatch.setattr(STATE, "batch_syncs", True)
    qt = batch_syncs._QueuedTorch()
    mask = qt.tensor([True, False], dtype=torch.bool, device="cpu")
    fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND, mamba_track_mask=mask,
                         mamba_track_seqlens=qt.tensor([100, 0], dtype=torch.int64, device="cpu"),
                         extend_seq_lens_cpu=[100, 5], extend_prefix_lens_cpu=[0, 0], batch_size=2,
                         mamba_track_indices=torch.tensor([7, 8]))
    backend = SimpleNamespace(conv_states_shape=(1, 8, 4),
                              kernel_dispatcher=SimpleNamespace(extend_uses_state_checkpoints=False))
    seen = []

    def sglangs(b, f):
        seen.append(f.mamba_track_mask)
        b.forward_metadata = SimpleNamespace(mamba_cache_indices=torch.tensor([3, 4], dtype=torch.int32),
                                             has_mamba_track_mask=f.mamba_track_mask is not None)

    batch_syncs._around_metadata(sglangs, backend, fb)
    md = backend.forward_metadata
    assert seen == [None] and fb.mamba_track_mask is mask
    assert md.has_mamba_track_mask and md.mamba_track_mask_indices.tolist() == [0]
    assert md.track_ssm_h_dst.tolist() == [7] and md.track_ssm_h_src.tolist() == [1]   # h at 64
    assert md.track_ssm_final_dst.tolist() == []
    fb.mamba_track_mask = torch.tensor([True, False])               # no host values
    batch_syncs._around_metadata(sglangs, backend, fb)
    assert seen[-1] is fb.mamba_track_mask and not hasattr(backend.forward_metadata, "track_ssm_h_dst")
    fb.mamba_track_mask, fb.batch_size = mask, 3                    # a mixed batch's extra rows
    batch_syncs._around_metadata(sglangs, backend, fb)
    assert seen[-1] is mask
