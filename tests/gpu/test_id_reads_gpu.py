"""Device-id reads by DMA (binding/id_reader.HostStage) on a GPU: the values a read returns on a
side stream, while the default stream is busy, equal what a plain ``tolist`` returns."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_a_dma_read_on_a_side_stream_returns_the_ids_a_plain_read_does():
    from hpc_radix.binding.device.ids import HostStage, _flat

    row = torch.arange(200_000, dtype=torch.int32, device="cuda") * 3
    slots = torch.arange(7, dtype=torch.int64, device="cuda") + 5
    parts = [row[128:65_536:64], slots, row[9:10], row[5:5], row[3:150_000:7]]
    want = _flat(parts).tolist()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())       # the ids are written
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):                                  # the default stream stays busy
        a = a @ a / 64
    stage = HostStage(pinned=True, nbytes=64)           # grows, pinned
    with torch.cuda.stream(side):
        got = stage.read(parts, side)
    assert got == want
    assert stage.buffer.is_pinned()
    with torch.cuda.stream(side):
        assert stage.read([row[64:640:64]], side) == row[64:640:64].tolist()   # reused
    torch.cuda.synchronize()
