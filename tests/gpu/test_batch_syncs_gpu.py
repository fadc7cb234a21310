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
