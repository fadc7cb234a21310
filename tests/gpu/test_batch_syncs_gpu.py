"""patches/batch_syncs.py on a GPU: what replaces SGLang's blocking copies queues them (torch's
sync debug mode raises on any synchronization) and gives the values the blocking copies do."""
from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_queued_torch_tensor_uploads_without_a_sync():
    from hpc_radix.patches.batch_syncs import _QueuedTorch

    qt = _QueuedTorch()
    qt.tensor([0], device="cuda")                 # the pinned ring is allocated once, first
    with no_sync():
        ids = qt.tensor([3, 1, 4, 1, 5], dtype=torch.int64, device="cuda")
        mask = qt.tensor([True, False, True], dtype=torch.bool, device=torch.device("cuda"))
    assert ids.is_cuda and ids.tolist() == [3, 1, 4, 1, 5]
    assert mask.dtype == torch.bool and mask.tolist() == [True, False, True]
    with pytest.raises(RuntimeError):            # the blocking copy it replaces does sync
        with no_sync():
            torch.tensor([3, 1, 4], dtype=torch.int64, device="cuda")


def test_rows_written_at_a_list_without_a_sync():
    from hpc_radix.patches.batch_syncs import _RowsUploaded

    mapping = torch.zeros(9, 2, dtype=torch.int32, device="cuda")
    want = mapping.clone()
    values = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32, device="cuda")
    want[[2, 7, 4]] = values
    with no_sync():
        _RowsUploaded(mapping)[[2, 7, 4]] = values
    assert torch.equal(mapping, want)


def test_gathered_track_indices_equal_the_slots_item_reads():
    from types import SimpleNamespace

    from hpc_radix.patches.batch_syncs import gather_track_indices

    buffers = torch.tensor([[10, 11], [20, 21], [30, 31], [40, 41]], device="cuda")
    pool = SimpleNamespace(req_index_to_mamba_ping_pong_track_buffer_mapping=buffers)
    rows, positions = [3, 0, 2], [1, 0, 1]
    batch = SimpleNamespace(reqs=[object()] * 3, req_to_token_pool=pool,
                            req_pool_indices=torch.tensor(rows, device="cuda"))
    with no_sync():
        gather_track_indices(batch, positions)
    assert batch.mamba_track_indices.tolist() == [buffers[r, p].item() for r, p in zip(rows, positions)]
    assert batch.mamba_track_indices.dtype == torch.int64


def test_tracking_tables_from_host_values_without_a_sync():
    """What the GDN metadata hook builds on the GPU, without a sync, equals SGLang's tables
    (its own functions, which read the device mask back)."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention.hybrid_linear_attn_backend import MambaAttnBackendBase

    from hpc_radix.patches.batch_syncs import set_track_metadata

    chunk, conv_len = 64, 4
    mask, extend_lens, prefix_lens = [True, False, True, True], [64, 300, 130, 65], [0, 64, 64, 128]
    track_seqlens = [64, 64, 192, 193]
    track_indices = torch.tensor([7, 3, 9, 1], dtype=torch.int64, device="cuda")
    cache_indices = torch.tensor([20, 21, 22, 23], dtype=torch.int32, device="cuda")
    fb = SimpleNamespace(mamba_track_mask=torch.tensor(mask, device="cuda"),
                         mamba_track_seqlens=torch.tensor(track_seqlens, device="cuda"),
                         extend_seq_lens=torch.tensor(extend_lens, dtype=torch.int32, device="cuda"),
                         extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device="cuda"),
                         mamba_track_indices=track_indices)
    starts = [0, 64, 364, 494]
    query_start_loc = torch.tensor(starts + [559], dtype=torch.int32, device="cuda")
    backend = SimpleNamespace(conv_states_shape=(1, 8, conv_len), device=torch.device("cuda"))
    import sglang.srt.layers.attention.hybrid_linear_attn_backend as m

    args = SimpleNamespace(mamba_cache_chunk_size=chunk)
    real = m.get_server_args
    m.get_server_args = lambda: args
    try:
        want = {"track_conv_indices": MambaAttnBackendBase._init_track_conv_indices(backend, query_start_loc, fb)}
        want.update(zip(("track_ssm_h_src", "track_ssm_h_dst", "track_ssm_final_src", "track_ssm_final_dst"),
                        MambaAttnBackendBase._init_track_ssm_indices(backend, cache_indices, fb)))
    finally:
        m.get_server_args = real
    metadata = SimpleNamespace(mamba_cache_indices=cache_indices)
    set_track_metadata(metadata, [True], [64], [64], [0], track_indices[:1], chunk=chunk,
                       conv_len=conv_len)             # the pinned ring is allocated once, first
    with no_sync():
        set_track_metadata(metadata, mask, track_seqlens, extend_lens, prefix_lens, track_indices,
                           chunk=chunk, conv_len=conv_len)
    for name, tensor in want.items():
        got = getattr(metadata, name)
        assert got.is_cuda and got.dtype == tensor.dtype and got.tolist() == tensor.tolist(), name
    assert metadata.mamba_track_mask_indices.tolist() == [0, 2, 3]
    assert metadata.conv_states_mask_indices.tolist() == [7, 9, 1]
