"""What the cache reports beyond SGLang's own series: host hits, restores, bytes moved, host
evictions and the write-through backlog, as Prometheus series under
``--enable-metrics`` and as one log line, at most every ``log_interval_s``, while they change.

The counts live where they happen: the index's and the host tier's ``stats`` dicts (the index's
start again with each flush's new index), and the report's own ``counts``, which the binding's
parts count into (taps and coalescing, given it when built, so their totals run across
flushes); ``CacheReport.update`` reads the running totals, only when an update is due (it is
called on the scheduler's hot path), and publishes what changed.
"""
from __future__ import annotations

import contextlib
import cProfile
import functools
import logging
import pstats
import time
import traceback
import warnings
from typing import Callable, Mapping, Optional

from hpc_radix.index.roles import EVENTS as KIND_EVENTS

logger = logging.getLogger(__name__)

PREFIX = "sglang:hybrid_cache_"

COUNTERS = {
    "host_hits": "Requests admitted with a prefix restored from the host tier.",
    "host_hit_tokens": "Prompt tokens restored from the host tier instead of prefilled.",
    "restores_dropped": ("Host restores given up at admission (source evicted, no room): cold prefill, or a "
                         "round's wait where SGLang counted device blocks of it as cached."),
    "restores_overlapped": ("Host restores that ran beside the forward pass in flight (into spares taken "
                            "before the last batch build; --host-restore-overlap on)."),
    "passes_waiting_by_layer": ("Prefill passes that waited for host restores layer by layer, each layer for "
                                "its own bytes (--host-restore-wait layer)."),
    "restore_layer_waits": "Waits those passes made at a layer's KV or state read for its restored bytes.",
    "prefetches": "Copies of host-only blocks for a request refused for want of pages (--host-prefetch on).",
    "prefetched_blocks": "KV blocks those prefetches brought to the device while the request waited.",
    "blocks_written": "KV blocks written through to the host tier.",
    "images_written": "Recurrent-state images written through to the host tier.",
    "blocks_restored": "KV blocks restored from the host tier.",
    "images_restored": "Recurrent-state images restored from the host tier.",
    "bytes_to_host": "Bytes copied device to host.",
    "bytes_to_device": "Bytes copied host to device.",
    "host_evicted_snapshots": "Snapshots whose host copy was evicted (superseded, then lowest GDSF).",
    "host_swept_blocks": "Host KV blocks freed by the dead-KV sweep (no snapshot reaches them).",
    "host_writes_refused": "Write-throughs skipped: no host slab worth evicting for them.",
    "evicted_pages": "Device KV pages evicted.",
    "deleted_snapshots": "Snapshots deleted from the index (every tier).",
    "taps_skipped_no_slot": "Planned taps not taken for want of a device slot.",
    "captures": "Tap states captured inside prefill passes (zero-split).",
    "captures_published": "Captured tap states published as snapshots.",
    "captures_dropped": "Captured tap states given back (request ended, no tail page).",
    "captures_without_slot": "Taps a prefill pass could not capture: no slot reclaimed or spare.",
    "coalesce_waits": "Scheduler rounds a request waited for a sibling's prefill of a shared prefix.",
    "coalesce_timeouts": "Requests that stopped waiting for a sibling's prefill (time limit).",
    "restored_tails_dropped": ("Host tails restored for a request SGLang then did not admit that round (its "
                               "page goes back; the restored blocks stay cached)."),
    "pages_recovered": ("KV pages found owned by nothing when the scheduler went idle (a leak, warned "
                        "with where each was) and given back to the allocator."),
    "store_writes_queued": "Snapshots (with their paths) queued for the shared tier (--cache-store).",
    "store_writes_gone": "Snapshots not written: they left the host tier before their path landed there (or it did not within 10 s).",
    "store_writes_unvalued": ("Snapshots not written to the shared tier: requests here resumed from under "
                              "2 % of their role's snapshots (endpoints where clients do not echo outputs)."),
    "store_blocks_written": "KV blocks written to the shared tier (--cache-store).",
    "store_states_written": "Recurrent-state images written to the shared tier.",
    "store_put_bytes": "Bytes written to the shared tier.",
    "store_put_failures": "Writes the shared tier refused or failed (disk full, store unreachable, budget).",
    "store_writes_dropped": "Writes to the shared tier dropped: its queue was full.",
    "store_writes_overtaken": ("Writes to the shared tier dropped: the host slabs were reused before the "
                               "object was published."),
    "store_evicted": "Objects the file tier evicted to keep its byte budget.",
    "store_probes": "Requests that asked the shared tier for a deeper state than the cache held.",
    "store_probe_hits": "Of those, the ones it had one for (then read back and checked).",
    "store_probes_skipped": ("Requests that went on past the cache's deepest state but did not ask the "
                             "shared tier: it held no state beyond it (its listing and journals said so)."),
    "store_states_read": "States read back from the shared tier into the host tier.",
    "store_read_tokens": "Prompt tokens those states reach beyond what the cache held.",
    "store_get_bytes": "Bytes read from the shared tier.",
    "store_objects_refused": "Objects read from the shared tier and refused (torn, damaged, another model's).",
    "store_reads_dropped": "States read back for which the host tier had no room.",
    "store_reads_stale": "States read back that no longer fitted the cache when they arrived.",
    "store_waits": "Scheduler rounds a request waited in the queue for the shared tier.",
    "store_sync_ms": ("Milliseconds the scheduler thread waited in its rounds for read-backs, so "
                      "that their requests were admitted in the round they arrived "
                      "(--cache-store-sync-ms)."),
    "store_answered_ms": ("Milliseconds from each request's question to the shared tier until its answer "
                          "was complete (a miss, or the state read into host slabs), summed."),
    "store_hit_answered_ms": "Of those, the milliseconds of the questions it had a state for (read back whole).",
    "store_read_ms": "Milliseconds the shared tier's read thread spent answering questions and reading back.",
    "store_fill_ms": "Of those, milliseconds reading states and their blocks into the host slabs.",
    "store_fill_wait_ms": ("Milliseconds read-backs waited between the answer and their reading into host "
                           "slabs (the scheduler's poll and its slabs, where none came with the "
                           "question), summed."),
    "store_read_cpu_ms": "CPU milliseconds of the shared tier's read thread (its Python holds the GIL).",
    "store_write_cpu_ms": "CPU milliseconds of the shared tier's write thread (its Python holds the GIL).",
    "store_writer_process_cpu_ms": ("CPU milliseconds of the file tier's writer process on its objects "
                                    "(checksums and file calls outside the scheduler's process)."),
    "store_writer_unavailable": ("Shared tier writes done by the scheduler's process because its writer "
                                 "process was gone (started again at most every 10 s)."),
    "store_wait_timeouts": "Requests admitted without the shared tier's answer (--cache-store-wait-ms).",
    "scheduler_ms": "Milliseconds the scheduler thread spent inside the cache's entry points.",
    "device_read_ms": "Of those, milliseconds spent reading device ids back (GPU syncs).",
}
GAUGES = {
    "write_backlog": "Host-tier copies in flight (write-through and restore).",
    "host_used_bytes": "Host tier bytes holding cache data.",
    "host_online_bytes": "Host tier bytes pinned and usable so far.",
}
# per snapshot kind (index/roles.py Role) and event (kept, written to host, hit, evicted):
# sglang:hybrid_cache_snapshots_total{kind="prompt_tail", event="hit"}; the totals read for the
# report carry them under this key as {(kind, event): running count}
BY_KIND = "snapshots"
BY_KIND_DOC = ("Snapshots by kind (endpoint, prompt_tail, branch, learned, ...) and event: kept "
               "(published), written (to host), hit (served a request), evicted (left the cache), "
               "missed (a request came for one evicted before its first hit).")
_SERIES: dict = {}          # one registration per process (prometheus_client refuses a second)


def _prometheus(labels: Mapping[str, str]) -> dict:
    if not _SERIES:
        from prometheus_client import Counter, Gauge

        names = list(labels)
        _SERIES.update({k: Counter(PREFIX + k, doc, labelnames=names) for k, doc in COUNTERS.items()})
        _SERIES.update({k: Gauge(PREFIX + k, doc, labelnames=names, multiprocess_mode="mostrecent")
                        for k, doc in GAUGES.items()})
        _SERIES[BY_KIND] = Counter(PREFIX + BY_KIND, BY_KIND_DOC, labelnames=names + ["kind", "event"])
    out = {k: series.labels(**labels) for k, series in _SERIES.items() if k != BY_KIND}
    out[BY_KIND] = lambda kind, event: _SERIES[BY_KIND].labels(**labels, kind=kind, event=event)
    return out


class CallTimer:
    """Wall time of the cache's entry points on the scheduler thread: per entry point
    (inclusive) and in all (outermost calls only, so nested entry points count once); and the
    thread's CPU time in them, which leaves out time the thread did not run (the GIL held
    elsewhere, the OS) but counts a GPU sync's spin."""

    def __init__(self, profile: bool = False):
        """``profile`` (diagnostics, slow): a cProfile of the calls and every synchronizing
        CUDA operation in them with its stack, both logged with each summary."""
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.total = 0.0
        self.waited = 0.0        # of which reading device tensors back (see add)
        self.outer_wall = self.outer_cpu = 0.0       # outermost calls, since the last summary
        self._depth = 0
        self.profiler = cProfile.Profile() if profile else None
        self.syncs: dict[str, int] = {}       # stack -> count, with profile

    def add(self, name: str, seconds: float, waited: bool = False) -> None:
        """Count ``seconds`` under ``name``; a wait (``waited``) outside every entry point also
        counts in the total, so that the waits stay a part of it."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1
        if waited:
            self.waited += seconds
            if not self._depth:
                self.total += seconds

    @property
    def inside_call(self) -> bool:
        """Whether a timed call is running (a nested call returns into it)."""
        return self._depth > 0

    @staticmethod
    def wrap(method):
        """Decorator for the cache's methods; the cache holds its timer as ``call_timer``."""
        name = method.__name__

        @functools.wraps(method)
        def timed(cache, *args, **kwargs):
            return cache.call_timer.run(name, method, cache, *args, **kwargs)
        return timed

    def run(self, name: str, method, *args, **kwargs):
        """``method(*args, **kwargs)``, timed under ``name``."""
        outermost_profiled = self.profiler is not None and not self._depth
        with self._profiling() if outermost_profiled else contextlib.nullcontext():
            self._depth += 1
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self._depth -= 1
                self.add(name, dt)
                if not self._depth:
                    self.total += dt
                    self.outer_wall += dt
                    self.outer_cpu += time.thread_time() - c0

    @contextlib.contextmanager
    def _profiling(self):
        import torch

        def record(message, *rest, **kw):
            if "synchroniz" in str(message):
                frames = [f for f in traceback.extract_stack()[:-1]
                          if not f.filename.endswith("warnings.py")][-6:]
                key = " < ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
                                 for f in reversed(frames))
                self.syncs[key] = self.syncs.get(key, 0) + 1

        cuda = torch.cuda.is_available()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            self.profiler.enable()
            try:
                yield
            finally:
                self.profiler.disable()
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")

    def take_summary(self) -> str:
        """'name ms (calls), ...' by time since the last summary; resets the per-call figures."""
        parts = [f"{n} {1e3 * s:.0f} ms ({self.calls[n]})"
                 for n, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])]
        summary = (f"{1e3 * self.outer_wall:.0f} ms in all, thread CPU time {1e3 * self.outer_cpu:.0f} "
                   f"ms; " + ", ".join(parts)) if parts else ""
        self.seconds, self.calls = {}, {}
        self.outer_wall = self.outer_cpu = 0.0
        if self.profiler is not None and parts:
            summary += self._take_profile()
        return summary

    def _take_profile(self, lines: int = 40) -> str:
        import io

        out = io.StringIO()
        stats = pstats.Stats(self.profiler, stream=out)
        stats.sort_stats("tottime").print_stats(lines)
        stats.sort_stats("cumulative").print_stats("hpc_radix", lines)
        syncs = sorted(self.syncs.items(), key=lambda kv: -kv[1])
        self.profiler, self.syncs = cProfile.Profile(), {}
        return ("\nsynchronizing CUDA operations (count, stack):\n"
                + "".join(f"  {n} {stack}\n" for stack, n in syncs) + out.getvalue())


class CacheReport:
    def __init__(self, labels: Optional[Mapping[str, str]] = None, *, min_interval_s: float = 1.0,
                 log_interval_s: float = 60.0):
        """``labels``: Prometheus labels, or None for the log line only."""
        self.counts = dict.fromkeys(("host_hits", "host_hit_tokens", "restores_dropped", "restores_overlapped",
                                     "prefetches", "prefetched_blocks", "pages_recovered",
                                     "restored_tails_dropped"), 0)
        self.series = _prometheus(labels) if labels is not None else None
        self.published = dict.fromkeys(COUNTERS, 0)
        self.min_interval_s, self.log_interval_s = min_interval_s, log_interval_s
        self._next_update = 0.0
        self._next_log = time.monotonic() + log_interval_s
        self._logged = dict(self.published)
        self.by_kind: dict = {}            # (kind, event) -> published running count
        self._by_kind_logged: dict = {}

    def update(self, read: Callable[[], tuple[Mapping[str, int], Mapping[str, int]]], *,
               force: bool = False) -> None:
        """Publish the running totals (keys of COUNTERS; others are ignored) and gauges that
        ``read()`` returns; at most every ``min_interval_s`` unless ``force``, which also logs
        what changed since the last line (a flush: what the cache did before it)."""
        now = time.monotonic()
        if not force and now < self._next_update:
            return
        self._next_update = now + self.min_interval_s
        totals, gauges = read()
        current = {k: int(totals.get(k, self.published[k])) for k in COUNTERS}
        if self.series is not None:
            for k, v in current.items():
                if v > self.published[k]:
                    self.series[k].inc(v - self.published[k])
            for k, v in gauges.items():
                self.series[k].set(v)
        self.published = current
        by_kind = dict(totals.get(BY_KIND, {}))
        if self.series is not None:
            for key, v in by_kind.items():
                if v > self.by_kind.get(key, 0):
                    self.series[BY_KIND](*key).inc(v - self.by_kind.get(key, 0))
        self.by_kind = by_kind
        if (force or now >= self._next_log) and (current != self._logged
                                                 or by_kind != self._by_kind_logged):
            self._next_log = now + self.log_interval_s
            changed = {k: v - self._logged[k] for k, v in current.items() if v != self._logged[k]}
            self._logged = current
            logger.info("hybrid radix cache: in the last interval %s; %s%s",
                        ", ".join(f"{k} {v:+d}" for k, v in changed.items()),
                        ", ".join(f"{k} {v}" for k, v in gauges.items()) or "no host tier",
                        self._kinds_line(by_kind))
            self._by_kind_logged = by_kind

    def _kinds_line(self, by_kind: Mapping) -> str:
        """'; snapshots by kind, kept/written/hit/evicted/missed since the last line: endpoint
        +3/+2/+0/+1/+0, ...' for the kinds that changed (totals restart at a flush)."""
        old = self._by_kind_logged
        if any(v < old.get(k, 0) for k, v in by_kind.items()):
            old = {}                       # the index was rebuilt: counts start again
        parts = []
        for kind in sorted({k for k, _ in by_kind}):
            d = [by_kind.get((kind, e), 0) - old.get((kind, e), 0) for e in KIND_EVENTS]
            if any(d):
                parts.append(f"{kind} " + "/".join(f"{x:+d}" for x in d))
        return ("; snapshots by kind, kept/written/hit/evicted/missed: " + ", ".join(parts)) if parts else ""
