"""The cache's own Prometheus series and log line, and SGLang's eviction series, with
--enable-metrics over SGLang's real pools."""
from __future__ import annotations

import logging

import pytest

from sglang_harness import PAGE, build_cache

prometheus_client = pytest.importorskip("prometheus_client")

from hpc_radix.binding.report import PREFIX, CacheReport  # noqa: E402
from hpc_radix.sglang_version import checkpoints  # noqa: E402

# SGLang's labels for a cache's series (one set per process): from 0.5.23 with the ranks
LABELS = ({"cache_type": "CheckpointCache", "tp_rank": "0", "pp_rank": "0", "dp_rank": "0"}
          if checkpoints() else {"cache_type": "HybridRadixCache"})


def sample(name, **labels):
    return prometheus_client.REGISTRY.get_sample_value(name, {**LABELS, **labels})


def test_running_totals_become_counters_that_never_go_back(caplog):
    report = CacheReport(LABELS, min_interval_s=0, log_interval_s=0)
    base = sample(PREFIX + "host_hits_total") or 0.0
    with caplog.at_level(logging.INFO, logger="hpc_radix.binding.report"):
        report.update(lambda: ({"host_hits": 2, "unknown": 5}, {"write_backlog": 3}))
    assert sample(PREFIX + "host_hits_total") == base + 2
    assert sample(PREFIX + "write_backlog") == 3
    assert "host_hits +2" in caplog.text and "write_backlog 3" in caplog.text
    report.update(lambda: ({"host_hits": 0}, {}))              # the index was rebuilt (a flush)
    report.update(lambda: ({"host_hits": 1}, {}))
    assert sample(PREFIX + "host_hits_total") == base + 3
    report.min_interval_s = 60
    report.update(lambda: ({"host_hits": 9}, {}), force=True)
    report.update(lambda: ({"host_hits": 20}, {}))             # within the interval: not yet
    assert sample(PREFIX + "host_hits_total") == base + 11


@pytest.fixture(scope="module")
def metered(server_args):
    """One cache with --enable-metrics and a host tier: SGLang registers its cache series once
    per process. Plain reads: no spare pages, which an eviction would give back before cached
    ones."""
    h = build_cache(server_args, enable_metrics=True,
                    env={"HPC_CACHE_SETTLED_READS": "off", "HPC_HOST_CACHE_MIB": "1",
                         "HPC_HOST_WRITE_THRESHOLD": "0"})
    assert h.cache.host.memory.wait(60)
    yield h
    h.cache.release_host_resources()


def test_evictions_reach_sglang_series(metered):
    h = metered
    assert h.cache.metrics_collector is not None and h.cache.report.series is not None
    before = sample("sglang:evicted_tokens_total") or 0.0
    pages_before = sample(PREFIX + "evicted_pages_total") or 0.0
    req = h.new_req([(i * 31) % 250 + 1 for i in range(300)])
    h.serve(req, [7] * 4)
    freed = h.evict(num_tokens=2 * PAGE).num_tokens_evicted
    assert freed >= 2 * PAGE
    assert sample("sglang:evicted_tokens_total") == before + freed
    h.cache._update_report(force=True)
    assert sample(PREFIX + "evicted_pages_total") == pages_before + freed // PAGE
    h.check_idle()


def test_host_hits_reach_sglangs_load_back_series(metered):
    """The tokens a host hit brings back count in SGLang's load-back series (from 0.5.23 under
    the KV pool's label, which that release requires)."""
    h = metered
    pool = {"pool": "kv"} if checkpoints() else {}
    before = sample("sglang:load_back_tokens_total", **pool) or 0.0
    first = [(i * 31) % 250 + 1 for i in range(200)]
    h.serve(h.new_req(first), [7] * 10)
    h.cache.host.drain()
    h.evict(num_tokens=h.cache.full_evictable_size(), mamba_num=h.cache.mamba_evictable_size())
    nxt = h.new_req(first + [7] * 10 + [5] * 40)
    nxt.init_next_round_input(h.cache)
    assert h.admit(nxt) == 210                       # from host
    h.complete(nxt, [4] * 3)
    h.cache.host.drain()
    assert sample("sglang:load_back_tokens_total", **pool) == before + 210
    h.check_idle()


def test_a_flush_logs_what_the_cache_did_before_it(hosted, caplog):
    """A benchmark that flushes between runs finds each run's counts in the log."""
    hosted.serve(hosted.new_req([(i * 31) % 250 + 1 for i in range(3 * PAGE + 5)]), [1, 2])
    hosted.cache.host.drain()
    with caplog.at_level(logging.INFO, logger="hpc_radix.binding"):
        hosted.cache.reset()                                # /flush_cache
    assert "in the last interval" in caplog.text and "blocks_written +3" in caplog.text
    assert "host_used_bytes" in caplog.text           # the host tier's gauges, without a shared tier
    # and how long the scheduler spent in the cache's entry points, each called once here
    calls = caplog.text.split("scheduler time in cache calls since the last flush: ")[1]
    assert "match_prefix" in calls and "cache_finished_req" in calls and "(1)" in calls
    assert "device reads" in calls          # the page ids of the committed blocks, at least


def test_the_call_timer_counts_nested_calls_once_and_waits_as_part_of_the_total():
    from hpc_radix.binding.report import CallTimer

    class Cache:
        call_timer = CallTimer()

        @CallTimer.wrap
        def outer(self):
            self.inner()
            self.call_timer.add("device reads", 0.5, waited=True)

        @CallTimer.wrap
        def inner(self):
            pass

    cache = Cache()
    cache.outer()
    timer = cache.call_timer
    assert timer.calls == {"inner": 1, "device reads": 1, "outer": 1}
    # inside an entry point a wait is part of its wall time: not added again, nor is inner
    assert timer.total == timer.seconds["outer"]
    timer.add("device reads", 0.25, waited=True)           # a read outside any entry point
    assert timer.waited == 0.75 and timer.total == timer.seconds["outer"] + 0.25
    summary = timer.take_summary()
    assert summary.split("; ")[1].startswith("device reads 750 ms (2), outer") and timer.calls == {}
    assert timer.take_summary() == ""                       # nothing since


def test_the_call_timer_tells_the_threads_cpu_time_from_its_wall_time():
    import time

    from hpc_radix.binding.report import CallTimer

    class Cache:
        call_timer = CallTimer()

        @CallTimer.wrap
        def sleeps(self):
            time.sleep(0.2)                    # off the CPU, as behind the GIL or a blocking wait

        @CallTimer.wrap
        def computes(self):
            end = time.thread_time() + 0.2
            while time.thread_time() < end:
                pass

    cache = Cache()
    cache.sleeps()
    cache.computes()
    in_all, cpu = cache.call_timer.take_summary().split("; ")[0].split(", thread CPU time ")
    assert 400 <= int(in_all.split()[0]) < 1000 and 190 <= int(cpu.split()[0]) < 350


def test_the_profiled_call_timer_logs_where_the_calls_spend_time_and_synchronize():
    import warnings

    from hpc_radix.binding.report import CallTimer

    class Cache:
        call_timer = CallTimer(profile=True)

        @CallTimer.wrap
        def outer(self):
            self.read_back()

        def read_back(self):
            # the text torch's sync debug mode warns with
            warnings.warn("called a synchronizing CUDA operation")

    cache = Cache()
    filters = list(warnings.filters)
    for _ in range(3):
        cache.outer()
    assert warnings.filters == filters                 # the caller's warning filters are back
    summary = cache.call_timer.take_summary()
    assert summary.split("; ")[1].startswith("outer ")
    syncs = summary.split("synchronizing CUDA operations (count, stack):\n")[1]
    assert syncs.startswith("  3 test_report.py:") and "read_back < " in syncs
    assert " function calls " in summary              # the profile
    assert "  3 " not in cache.call_timer.take_summary()   # counted since the last summary


def test_snapshots_by_kind_become_labelled_counters_and_a_log_line(caplog):
    report = CacheReport(LABELS, min_interval_s=0, log_interval_s=0)
    name = PREFIX + "snapshots_total"
    base = sample(name, kind="prompt_tail", event="hit") or 0.0
    with caplog.at_level(logging.INFO, logger="hpc_radix.binding.report"):
        report.update(lambda: ({"snapshots": {("prompt_tail", "kept"): 3, ("prompt_tail", "hit"): 2,
                                              ("endpoint", "kept"): 3}}, {}))
    assert sample(name, kind="prompt_tail", event="hit") == base + 2
    assert "snapshots by kind, kept/written/hit/evicted/missed: endpoint +3/+0/+0/+0/+0, " \
           "prompt_tail +3/+0/+2/+0/+0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hpc_radix.binding.report"):
        report.update(lambda: ({"snapshots": {("prompt_tail", "kept"): 3, ("prompt_tail", "hit"): 5,
                                              ("endpoint", "kept"): 3}}, {}))
    assert sample(name, kind="prompt_tail", event="hit") == base + 5
    assert "kept/written/hit/evicted/missed: prompt_tail +0/+0/+3/+0/+0" in caplog.text
    assert "endpoint" not in caplog.text.split("snapshots by kind")[1]    # unchanged


def test_the_cache_reports_its_snapshots_by_kind(hosted):
    req = hosted.new_req([(i * 31) % 250 + 1 for i in range(3 * PAGE + 5)])
    hosted.serve(req, [1, 2])
    hosted.cache.host.drain()
    hosted.cache._update_report(force=True)
    by_kind = hosted.cache.report.by_kind
    assert by_kind[("endpoint", "kept")] == 1 and by_kind[("endpoint", "written")] == 1
