"""CUDA-event timing shared by the GPU micro-benchmarks (run them as scripts: this folder is
then on sys.path)."""
from __future__ import annotations

import statistics

import torch


def median_ms(fn, iters: int = 10, warmup: int = 2, *, sleep_cycles: int = 0, stream=None) -> float:
    """Median milliseconds between CUDA events recorded on ``stream`` (the current one by
    default) around ``fn``, the GPU idle before each run. ``sleep_cycles``: a sleep kernel first
    keeps the GPU busy while the host enqueues ``fn``, so host launch cost stays out (device
    time); without it, a launch-bound ``fn`` is timed as the host enqueues it (wall time)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
