"""kernels/upload.to_device: host ints reach the device without waiting for the stream."""
import pytest
import torch

from hpc_radix.kernels.upload import PinnedRing, page_slots, to_device


def test_values_and_dtype_arrive():
    assert to_device([3, 1, 2], "cpu").tolist() == [3, 1, 2]
    assert to_device([[1, 2], [3, 4]], "cpu", torch.int32).dtype == torch.int32


def test_page_slots_are_every_token_slot_of_each_page_in_order():
    assert page_slots([2, 0], 4, "cpu").tolist() == [8, 9, 10, 11, 0, 1, 2, 3]
    assert page_slots([5, 7], 1, "cpu").tolist() == [5, 7]
    assert page_slots([], 64, "cpu").shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_copy_is_queued_behind_busy_work_not_waited_for():
    busy = torch.cuda.Event()
    torch.cuda._sleep(2_000_000_000)               # about a second of GPU time on the stream
    busy.record()
    t = to_device(list(range(1000)), "cuda")
    assert not busy.query()                         # the host did not wait for the stream
    torch.cuda.synchronize()
    assert t.tolist() == list(range(1000))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_staging_ring_reuses_memory_only_after_the_copies_that_read_it_ran():
    ring = PinnedRing(4096)
    torch.cuda._sleep(500_000_000)                  # the first copy waits behind this
    first = ring.upload(torch.arange(64, dtype=torch.int64), "cuda")
    later = [ring.upload(torch.full((64,), i, dtype=torch.int64), "cuda") for i in range(20)]
    assert ring.laps >= 2                           # went round: staged bytes were rewritten
    torch.cuda.synchronize()
    assert first.tolist() == list(range(64))        # ... only after the first copy had run
    assert [t[0].item() for t in later] == list(range(20))
    assert ring.upload(torch.zeros(2048, dtype=torch.int64), "cuda") is None   # too large
