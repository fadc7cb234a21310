"""The restore stream's wait (binding/host_tier.py) on a GPU: after a batch build's event, a
copy runs beside the pass in flight (--host-restore-overlap on); after the forward stream, it
waits for that pass to end (the default). Both for the host tier's two copy paths: the copy
engines' batched copy (ordered in its stream: a wrong source access order would show here as
a copy landing before the pass ends) and the Triton kernel."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PASS_CYCLES = 200_000_000        # ~0.1 s of GPU time: the pass in flight


COPIES = ["copy engines", "kernel"]


def restore_beside_a_pass(wait_for_build: bool, copy: str) -> tuple[bool, bool]:
    """(whether the pass was still running when the copy had landed, whether the copy is exact)."""
    from hpc_radix.binding.host_tier import _on
    from hpc_radix.kernels.host_copy import Run, copy_runs, copy_runs_dma

    forward, restore = torch.cuda.Stream(), torch.cuda.Stream()
    src = torch.randint(0, 1 << 30, (1 << 20,), dtype=torch.int32).pin_memory()
    dst = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    copier = copy_runs_dma if copy == "copy engines" else copy_runs
    runs = [Run(1, 0, 0, 0, src.numel() * src.element_size())]
    with torch.cuda.stream(restore):              # compiled (the kernel) before the timing
        copier([dst, src], runs)
    torch.cuda.synchronize()
    dst.zero_()
    torch.cuda.synchronize()
    with torch.cuda.stream(forward):
        built = torch.cuda.Event()
        built.record()                            # the batch build: passes before it are done
        torch.cuda._sleep(PASS_CYCLES)            # the pass launched after it
        passed = torch.cuda.Event()
        passed.record()
    with _on(restore, forward, built if wait_for_build else None):
        copier([dst, src], runs)
        landed = torch.cuda.Event()
        landed.record()
    landed.synchronize()
    running = not passed.query()
    torch.cuda.synchronize()
    return running, torch.equal(dst.cpu(), src)


@pytest.mark.parametrize("copy", COPIES)
def test_a_restore_after_the_build_event_lands_while_the_pass_in_flight_runs(copy):
    running, exact = restore_beside_a_pass(wait_for_build=True, copy=copy)
    assert running and exact


@pytest.mark.parametrize("copy", COPIES)
def test_a_restore_after_the_forward_stream_waits_for_the_pass_in_flight(copy):
    running, exact = restore_beside_a_pass(wait_for_build=False, copy=copy)
    assert not running and exact
