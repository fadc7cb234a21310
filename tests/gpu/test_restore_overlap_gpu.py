"""The restore stream's wait (binding/host_tier.py) on a GPU: after a batch build's event, a
copy runs beside the pass in flight (--host-restore-overlap on); after the forward stream, it
waits for that pass to end (the default)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PASS_CYCLES = 200_000_000        # ~0.1 s of GPU time: the pass in flight


def restore_beside_a_pass(wait_for_build: bool) -> tuple[bool, bool]:
    """(whether the pass was still running when the copy had landed, whether the copy is exact)."""
    from hpc_radix.binding.host_tier import _on

    forward, restore = torch.cuda.Stream(), torch.cuda.Stream()
    src = torch.randint(0, 1 << 30, (1 << 20,), dtype=torch.int32).pin_memory()
    dst = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(forward):
        built = torch.cuda.Event()
        built.record()                            # the batch build: passes before it are done
        torch.cuda._sleep(PASS_CYCLES)            # the pass launched after it
        passed = torch.cuda.Event()
        passed.record()
    with _on(restore, forward, built if wait_for_build else None):
        dst.copy_(src, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record()
    landed.synchronize()
    running = not passed.query()
    torch.cuda.synchronize()
    return running, torch.equal(dst.cpu(), src)


def test_a_restore_after_the_build_event_lands_while_the_pass_in_flight_runs():
    running, exact = restore_beside_a_pass(wait_for_build=True)
    assert running and exact


def test_a_restore_after_the_forward_stream_waits_for_the_pass_in_flight():
    running, exact = restore_beside_a_pass(wait_for_build=False)
    assert not running and exact
