"""Diagnostics for any radix cache (``HPC_SCHEDULER_PHASES=1``): where SGLang's scheduler thread
spends its time, so cache backends can be compared on one host.

AROUND hooks time the event loop's phases (requests in, batch choice, launch, result
processing, sampling launch); ``torch.cuda`` event and stream synchronizations inside them are
counted as GPU waits. Every ``INTERVAL_S`` a log line gives the phase totals since the previous
line: ``scheduler phases: 1.00 s, 412 iterations; recv 12 ms, schedule 180 ms (...)``. The
cost is a few microseconds per call; off by default.
"""
from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

ENV = "HPC_SCHEDULER_PHASES"
INTERVAL_S = 1.0
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
PHASES = {    # log name -> Scheduler method
    "recv": "process_input_requests",
    "schedule": "get_next_batch_to_run",
    "launch": "run_batch",
    "results": "process_batch_result",
    "sample": "launch_batch_sample_if_needed",
}


class PhaseClock:
    def __init__(self, interval_s: float = INTERVAL_S):
        self.interval_s = interval_s
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.waits = dict.fromkeys(PHASES, 0.0)
        self.iterations = 0
        self.current = None               # the phase being timed (GPU waits are charged to it)
        self.since = time.perf_counter()

    def timed(self, phase: str):
        def around(orig, *args, **kwargs):
            if self.current is not None:          # nested: the outer phase owns the time
                return orig(*args, **kwargs)
            self.current = phase
            start = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - start
                self.current = None
                if phase == "recv":
                    self.iterations += 1
                    self.maybe_log()
        return around

    def waited(self, orig):
        def sync(*args, **kwargs):
            start = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                if self.current is not None:
                    self.waits[self.current] += time.perf_counter() - start
        return sync

    def maybe_log(self) -> None:
        now = time.perf_counter()
        span = now - self.since
        if span < self.interval_s:
            return
        busy = sum(self.totals.values())
        if self.iterations and busy > 0.01 * span:     # an idle server logs nothing
            parts = ", ".join(f"{p} {self.totals[p] * 1e3:.0f} ms"
                              + (f" (GPU waits {self.waits[p] * 1e3:.0f})" if self.waits[p] >= 5e-4 else "")
                              for p in PHASES)
            logger.info("scheduler phases: %.2f s, %d iterations; %s; outside them %.0f ms",
                        span, self.iterations, parts, (span - busy) * 1e3)
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.waits = dict.fromkeys(PHASES, 0.0)
        self.iterations = 0
        self.since = now


def install() -> bool:
    """Register the hooks when ``HPC_SCHEDULER_PHASES`` is set; returns whether it did."""
    if os.environ.get(ENV, "") in ("", "0"):
        return False
    import torch
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    clock = PhaseClock()
    for phase, method in PHASES.items():
        HookRegistry.register(f"{_SCHEDULER}.{method}", clock.timed(phase), HookType.AROUND)
    torch.cuda.Event.synchronize = clock.waited(torch.cuda.Event.synchronize)
    torch.cuda.Stream.synchronize = clock.waited(torch.cuda.Stream.synchronize)
    torch.cuda.synchronize = clock.waited(torch.cuda.synchronize)
    return True
