"""Diagnostics for any radix cache (``HPC_SCHEDULER_PHASES=1``): where SGLang's scheduler thread
spends its time, so cache backends can be compared on one host.

AROUND hooks time the event loop's phases (requests in, batch choice, launch, result
processing, sampling launch); ``torch.cuda`` event and stream synchronizations inside them are
counted as GPU waits. Inside the phases, the model forward and the GDN backend's steps are timed
too (``DETAILS``, inclusive), and the garbage collector's pauses. Every ``INTERVAL_S`` a log line
gives the totals since the previous line: ``scheduler phases: 1.00 s, 412 iterations; recv
12 ms, schedule 180 ms (...); inside: forward 300 ms, ...; gc 3 ms (2)``. The cost is a few
microseconds per call; off by default.

With ``HPC_SYNC_CENSUS=1`` as well, torch's sync debug mode reports every implicit GPU
synchronization (``.item()``, ``.cpu()``, ``bool(tensor)``, ``nonzero``...) and each log line
adds the busiest sites: ``syncs: 240; launch hybrid_linear_attn_backend.py:106 _forward_metadata
x120, ...`` (the first frame outside torch, by phase). Costs a Python warning per sync.

An admission census goes with the phases (``AdmissionCensus``): how often SGLang's PrefillAdder
took the request at the head of the queue or refused it for want of KV tokens, how many tokens
it found missing then (free and evictable ones beside), how long the queue then stood still
(until the next request was considered), decode retractions, and admissions and refusals by
where the request's prefix was matched: ``admission: admitted 30, refused for memory 4 (short
310 tokens mean; free 1,024, evictable 2,048), other 12; blocked 180 ms; retracted 0;
admitted/refused by source: device 20/1, host 5/2, miss 5/1``.

The GPU's own time in the model's forward passes goes with them too (``GpuClock``): CUDA events
recorded on the forward stream around each pass, and around each attention layer of an extend
pass, read back once they have run (never waited for): ``gpu: extend 412 ms in 30 passes
(12,000 tokens; gdn 150, attention 60), decode 300 ms in 900 steps``. Two arms that prefill as
many tokens but differ here differ in what the GPU does, not in what the scheduler waits for.
"""
from __future__ import annotations

import gc
import logging
import os
import time
import traceback
import warnings
from collections import Counter, deque

from hpc_radix.options import DIAGNOSTICS, diagnostic
from hpc_radix.sglang_version import prefix_len

logger = logging.getLogger(__name__)

ENV = DIAGNOSTICS["scheduler_phases"][0]
SYNC_MESSAGE = "called a synchronizing CUDA operation"     # torch's sync debug mode warning
TOP_SITES = 8
INTERVAL_S = 1.0
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
PHASES = {    # log name -> Scheduler method
    "recv": "process_input_requests",
    "schedule": "get_next_batch_to_run",
    "launch": "run_batch",
    "results": "process_batch_result",
    "sample": "launch_batch_sample_if_needed",
}
_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
_GDN = "sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend"
_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
_HYBRID_ATTN = "sglang.srt.layers.attention.hybrid_linear_attn_backend.HybridLinearAttnBackend"
DETAILS = {   # log name -> method, timed inclusively wherever it runs
    "forward": _FORWARD,
    "init_new": "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
    "gdn_metadata": f"{_GDN}.init_forward_metadata",
    "gdn_extend": f"{_GDN}.forward_extend",
    "gdn_kernel": "sglang.srt.layers.attention.linear.kernels.gdn_triton.TritonGDNKernel.extend",
}


SOURCES = ("device", "host", "miss")


def _source(req) -> str:
    """Where the request's matched prefix is: on device, partly on host (a load-back), none."""
    if req.needs_host_load_back():
        return "host"
    return "device" if prefix_len(req) else "miss"


class AdmissionCensus:
    """Counts PrefillAdder.add_one_req outcomes (an AROUND hook, outermost) and retractions."""

    def __init__(self):
        self._refused_at = None                # when the last refusal stopped the queue
        self.reset()

    def reset(self) -> None:
        """A new interval (a stop that began in the last one is charged to this one)."""
        self.counts: Counter = Counter()       # admitted, refused, other, retracted
        self.by_source: Counter = Counter()    # (device / host / miss, admitted / refused)
        self.sums: Counter = Counter()         # short, free, evictable (tokens, at refusals)
        self.blocked_s = 0.0

    def add_one(self, orig, adder, req, *args, **kwargs):
        from sglang.srt.managers.schedule_policy import AddReqResult

        from hpc_radix.patches.scheduler_hooks import needed_tokens

        now = time.perf_counter()
        if self._refused_at is not None:
            self.blocked_s += now - self._refused_at
            self._refused_at = None
        source = _source(req)                  # before the call: a load-back clears it
        res = orig(adder, req, *args, **kwargs)
        if any(r is req for r in adder.can_run_list):
            self.counts["admitted"] += 1
            self.by_source[source, "admitted"] += 1
        elif res == AddReqResult.NO_TOKEN:
            self.counts["refused"] += 1
            self.by_source[source, "refused"] += 1
            self.sums["short"] += max(0, needed_tokens(adder, req) - int(adder.rem_total_tokens))
            self.sums["free"] += adder.token_to_kv_pool_allocator.available_size()
            cache = adder.tree_cache
            self.sums["evictable"] += (cache.full_evictable_size() if cache.supports_mamba()
                                       else cache.evictable_size())
            self._refused_at = time.perf_counter()
        else:
            self.counts["other"] += 1
        return res

    def retract(self, orig, *args, **kwargs):
        res = orig(*args, **kwargs)
        self.counts["retracted"] += len(res[0])
        return res

    def line(self) -> str:
        """The interval's log line, "" when nothing was considered."""
        if not self.counts:
            return ""
        c, refused = self.counts, self.counts["refused"]
        mean = lambda k: f"{self.sums[k] / refused:,.0f}"      # noqa: E731
        detail = (f" (short {mean('short')} tokens mean; free {mean('free')}, evictable "
                  f"{mean('evictable')})" if refused else "")
        sources = ", ".join(f"{src} {self.by_source[src, 'admitted']}/{self.by_source[src, 'refused']}"
                            for src in SOURCES)
        return (f"admission: admitted {c['admitted']}, refused for memory {refused}{detail}, "
                f"other {c['other']}; blocked {self.blocked_s * 1e3:.0f} ms; retracted {c['retracted']}; "
                f"admitted/refused by source: {sources}")


class GpuClock:
    """GPU time of the model's forward passes, by CUDA events on the stream each runs on: extend
    passes (tokens, and their layers' time in the GDN and full-attention backends apart) and
    decode steps. Events are polled, never synchronized, so a pass is counted once it has run;
    read events are recorded again (creating one costs the scheduler thread microseconds, and an
    extend pass takes two per layer)."""

    def __init__(self, event_factory=None):
        self._event_factory = event_factory    # () -> a recorded event; torch's by default
        self.pending: deque = deque()          # (kind, tokens, start, end, [(part, start, end)])
        self._layers = None                    # the extend pass being launched: its layers' events
        self._spare: list = []                 # events already read, to record again
        self.reset()

    def reset(self) -> None:
        self.ms: Counter = Counter()           # extend, decode, gdn, attention
        self.counts: Counter = Counter()       # extend, decode (passes), extend_tokens

    def _event(self):
        if self._event_factory is not None:
            return self._event_factory()
        import torch

        event = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def _capturing() -> bool:
        import torch

        return torch.cuda.is_current_stream_capturing()

    def forward(self, orig, runner, forward_batch, *args, **kwargs):
        mode = forward_batch.forward_mode
        kind = "extend" if mode.is_extend() else "decode" if mode.is_decode() else None
        if kind is None or self._layers is not None or self._capturing():
            return orig(runner, forward_batch, *args, **kwargs)
        self._layers = []
        start = self._event()
        try:
            return orig(runner, forward_batch, *args, **kwargs)
        finally:
            layers, self._layers = self._layers, None
            tokens = (forward_batch.extend_num_tokens or 0) if kind == "extend" else forward_batch.batch_size
            self.pending.append((kind, tokens, start, self._event(), layers if kind == "extend" else ()))
            self.poll()

    def layer(self, orig, backend, *args, **kwargs):
        """HybridLinearAttnBackend.forward_extend: one layer's attention, GDN or full."""
        if self._layers is None:
            return orig(backend, *args, **kwargs)
        layer = kwargs.get("layer", args[0] if args else None)
        part = "attention" if backend._is_full_attn(layer, kwargs.get("layer_id")) else "gdn"
        start = self._event()
        try:
            return orig(backend, *args, **kwargs)
        finally:
            self._layers.append((part, start, self._event()))

    def poll(self) -> None:
        """Count the passes that have run, oldest first."""
        while self.pending and self.pending[0][3].query():
            kind, tokens, start, end, layers = self.pending.popleft()
            self.ms[kind] += start.elapsed_time(end)
            self.counts[kind] += 1
            self.counts[f"{kind}_tokens"] += tokens
            for part, first, last in layers:
                self.ms[part] += first.elapsed_time(last)
                self._spare += (first, last)
            self._spare += (start, end)

    def line(self) -> str:
        """The interval's log line, "" when no pass ran."""
        self.poll()
        if not (self.counts["extend"] or self.counts["decode"]):
            return ""
        ms, n = self.ms, self.counts
        return (f"gpu: extend {ms['extend']:.0f} ms in {n['extend']} passes ({n['extend_tokens']:,} "
                f"tokens; gdn {ms['gdn']:.0f}, attention {ms['attention']:.0f}), decode "
                f"{ms['decode']:.0f} ms in {n['decode']} steps")


class PhaseClock:
    def __init__(self, interval_s: float = INTERVAL_S):
        self.interval_s = interval_s
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.waits = dict.fromkeys(PHASES, 0.0)
        self.inside = dict.fromkeys(DETAILS, 0.0)
        self.gc_s, self.gc_runs, self._gc_start = 0.0, 0, 0.0
        self.iterations = 0
        self.current = None               # the phase being timed (GPU waits are charged to it)
        self.since = time.perf_counter()
        self.syncs: Counter = Counter()   # (phase, site) -> implicit syncs (HPC_SYNC_CENSUS)
        self.census_wanted = False        # armed in the scheduler process, at its first phase
        self.admission = AdmissionCensus()
        self.gpu = GpuClock()

    def count_sync(self) -> None:
        """An implicit sync just happened: charge it to the phase and to the first frame of
        the stack outside torch, warnings and this module."""
        site = "?"
        for frame in reversed(traceback.extract_stack()[:-1]):
            path = frame.filename.replace(os.sep, "/")
            if frame.filename != __file__ and not any(p in path for p in ("/torch/", "/warnings.py")):
                site = f"{os.path.basename(path)}:{frame.lineno} {frame.name}"
                break
        self.syncs[(self.current or "outside", site)] += 1

    def _sync_summary(self) -> str:
        if not self.syncs:
            return ""
        top = ", ".join(f"{phase} {site} x{n}" for (phase, site), n in self.syncs.most_common(TOP_SITES))
        return f"; syncs: {sum(self.syncs.values())}; {top}"

    def detail(self, name: str, inner=None):
        """An AROUND hook timing ``name``; ``inner``, an AROUND hook too, runs inside it (one
        hook per target: SGLang warns about several)."""
        def around(orig, *args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(orig, *args, **kwargs) if inner else orig(*args, **kwargs)
            finally:
                self.inside[name] += time.perf_counter() - start
        return around

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_start
            self.gc_runs += 1

    def timed(self, phase: str):
        def around(orig, *args, **kwargs):
            if self.current is not None:          # nested: the outer phase owns the time
                return orig(*args, **kwargs)
            if self.census_wanted:
                self.arm_census()
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
            inside = ", ".join(f"{d} {t * 1e3:.0f} ms" for d, t in self.inside.items() if t >= 5e-4)
            logger.info("scheduler phases: %.2f s, %d iterations; %s; outside them %.0f ms; "
                        "inside: %s; gc %.0f ms (%d)%s", span, self.iterations, parts,
                        (span - busy) * 1e3, inside or "-", self.gc_s * 1e3, self.gc_runs,
                        self._sync_summary())
            for line in (self.gpu.line(), self.admission.line()):
                if line:
                    logger.info(line)
        self.admission.reset()
        self.gpu.reset()
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.waits = dict.fromkeys(PHASES, 0.0)
        self.inside = dict.fromkeys(DETAILS, 0.0)
        self.gc_s, self.gc_runs = 0.0, 0
        self.iterations = 0
        self.syncs.clear()
        self.since = now

    def arm_census(self) -> None:
        """Count implicit syncs from now on (the scheduler process: it initializes CUDA)."""
        import torch

        self.census_wanted = False
        warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}")
        warnings.showwarning = self.census_hook(warnings.showwarning)
        torch.cuda.set_sync_debug_mode("warn")

    def census_hook(self, show):
        """A ``warnings.showwarning`` that counts the sync warnings and shows the others."""
        def showwarning(message, category, filename, lineno, file=None, line=None):
            if SYNC_MESSAGE in str(message):
                self.count_sync()
            else:
                show(message, category, filename, lineno, file, line)
        return showwarning


def install() -> bool:
    """Register the hooks when ``HPC_SCHEDULER_PHASES`` is set; returns whether it did."""
    if not diagnostic("scheduler_phases"):
        return False
    import torch
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    clock = PhaseClock()
    for phase, method in PHASES.items():
        HookRegistry.register(f"{_SCHEDULER}.{method}", clock.timed(phase), HookType.AROUND)
    for name, target in DETAILS.items():
        inner = clock.gpu.forward if target == _FORWARD else None
        HookRegistry.register(target, clock.detail(name, inner), HookType.AROUND)
    HookRegistry.register(f"{_ADDER}.add_one_req", clock.admission.add_one, HookType.AROUND)
    HookRegistry.register(f"{_BATCH}.retract_decode", clock.admission.retract, HookType.AROUND)
    HookRegistry.register(f"{_HYBRID_ATTN}.forward_extend", clock.gpu.layer, HookType.AROUND)
    gc.callbacks.append(clock.on_gc)
    torch.cuda.Event.synchronize = clock.waited(torch.cuda.Event.synchronize)
    torch.cuda.Stream.synchronize = clock.waited(torch.cuda.Stream.synchronize)
    torch.cuda.synchronize = clock.waited(torch.cuda.synchronize)
    clock.census_wanted = diagnostic("sync_census")
    return True
