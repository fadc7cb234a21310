"""kernels/upload.to_device: host ints reach the device without waiting for the stream."""
import pytest
import torch

from hpc_radix.kernels.upload import page_slots, to_device


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
