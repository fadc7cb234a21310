"""The host tier's memory over real anonymous mappings (pinned where CUDA is present)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

from hpc_radix.binding.host.memory import HOST_MEMORY_RESERVE_BYTES, HostMemory, check_host_budget  # noqa: E402
from hpc_radix.index import SlabPool  # noqa: E402
from hpc_radix.options import OptionError  # noqa: E402

SLAB = 64 << 10


def test_chunks_come_online_in_order_as_the_scheduler_polls():
    slabs = SlabPool(10 * SLAB, SLAB, max_chunk_bytes=4 * SLAB, online=False)
    assert slabs.num_chunks == 3 and slabs.num_free == 0 and slabs.alloc(1) == []
    host = HostMemory(slabs)
    host.start()
    assert host.wait(60)
    assert slabs.online_chunks == 0               # the fill thread never touches the index
    assert host.poll() == 3 and host.complete and slabs.num_free == 10
    taken = slabs.alloc(10)
    views = [host.view(s) for s in taken]
    assert all(v.numel() == SLAB and v.dtype == torch.uint8 for v in views)
    for s, v in zip(taken, views):
        v.fill_(s + 1)
    for s, v in zip(taken, views):                # no two slabs share a byte
        assert int(v.min()) == int(v.max()) == s + 1
    assert sorted(v.data_ptr() for v in views) == sorted(set(v.data_ptr() for v in views))
    host.close()
    host.close()


def test_a_slab_not_yet_online_has_no_view():
    slabs = SlabPool(8 * SLAB, SLAB, max_chunk_bytes=4 * SLAB, online=False)
    host = HostMemory(slabs)
    with pytest.raises(IndexError, match="not online"):
        host.view(0)
    with pytest.raises(ValueError, match="out of order"):
        slabs.bring_online(1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works here")
def test_a_failed_pin_leaves_the_chunks_pinned_so_far_and_says_why(caplog):
    slabs = SlabPool(8 * SLAB, SLAB, max_chunk_bytes=4 * SLAB, online=False)
    host = HostMemory(slabs, pin=True)             # no CUDA on this machine: pinning fails
    host.start()
    assert host.wait(60)
    with caplog.at_level("ERROR"):
        assert host.poll() == 0
    assert "host tier stopped at 0 of 2 chunks" in caplog.text
    assert slabs.num_free == 0 and not host.complete
    host.close()


def test_budget_below_one_snapshot_and_one_block_is_refused():
    with pytest.raises(OptionError) as err:
        check_host_budget(1, image_bytes=3 << 20, slab_bytes=SLAB, available_bytes=64 << 30)
    assert str(err.value) == ("--host-cache-mib=1: the host tier must hold at least one snapshot "
                              "and one block (4 MiB: a 3.0 MiB state image and a 64 KiB block)")
    check_host_budget(4, image_bytes=3 << 20, slab_bytes=SLAB, available_bytes=64 << 30)
    check_host_budget(0, image_bytes=3 << 20, slab_bytes=SLAB)        # device only


def test_budget_above_what_can_be_pinned_is_refused():
    available = HOST_MEMORY_RESERVE_BYTES + (2 << 30)
    check_host_budget(2048, image_bytes=3 << 20, slab_bytes=SLAB, available_bytes=available)
    with pytest.raises(OptionError) as err:
        check_host_budget(2049, image_bytes=3 << 20, slab_bytes=SLAB, available_bytes=available)
    assert str(err.value) == ("--host-cache-mib=2049: 12288 MiB of host memory are available and "
                              "10240 MiB stay free for the rest of the machine, so at most 2048 MiB "
                              "can be pinned")
    # two TP ranks on the machine pin one tier each
    check_host_budget(1024, image_bytes=3 << 20, slab_bytes=SLAB, available_bytes=available,
                      ranks_on_host=2)
    with pytest.raises(OptionError) as err:
        check_host_budget(1025, image_bytes=3 << 20, slab_bytes=SLAB, available_bytes=available,
                          ranks_on_host=2)
    assert str(err.value).endswith("at most 1024 MiB can be pinned by each of the 2 TP ranks on "
                                   "this machine")
