"""The scheduler-phase diagnostics (patches/scheduler_phases.py): off by default, and when on,
the time of each phase (GPU waits inside it apart) in one log line per interval."""
import logging
import time

from hpc_radix.patches import scheduler_phases
from hpc_radix.patches.scheduler_phases import PhaseClock


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv(scheduler_phases.ENV, raising=False)
    assert not scheduler_phases.install()


def test_phases_are_timed_once_with_their_gpu_waits_and_logged_per_interval(caplog):
    clock = PhaseClock(interval_s=0.05)
    wait = clock.waited(lambda: time.sleep(0.02))
    results, schedule, launch, recv = (clock.timed(p) for p in ("results", "schedule", "launch", "recv"))
    work = lambda: results(lambda: (time.sleep(0.01), wait()))                  # noqa: E731
    nested = lambda: schedule(lambda: launch(time.sleep, 0.01))                 # noqa: E731
    wait()                                 # outside every phase: not charged
    work()
    nested()
    assert clock.totals["results"] >= 0.03 and clock.waits["results"] >= 0.02
    assert clock.totals["schedule"] >= 0.01 and clock.totals["launch"] == 0
    time.sleep(0.05)
    with caplog.at_level(logging.INFO, logger=scheduler_phases.__name__):
        recv(lambda: None)
    line, = [r.getMessage() for r in caplog.records]
    assert "1 iterations" in line and "results 3" in line and "(GPU waits 2" in line, line
    assert clock.totals == dict.fromkeys(scheduler_phases.PHASES, 0.0)   # the next interval


def test_details_and_garbage_collections_are_timed_inclusively():
    clock = PhaseClock()
    forward = clock.detail("forward")
    clock.timed("launch")(lambda: forward(time.sleep, 0.01))
    assert clock.inside["forward"] >= 0.01 and clock.totals["launch"] >= clock.inside["forward"]
    clock.on_gc("start", {})
    time.sleep(0.005)
    clock.on_gc("stop", {})
    assert clock.gc_runs == 1 and clock.gc_s >= 0.005


def test_sync_census_counts_sync_warnings_by_phase_and_site_and_shows_the_others(caplog):
    shown = []
    clock = PhaseClock(interval_s=0.0)
    hook = clock.census_hook(lambda *args: shown.append(args[0]))

    def forward_like():                    # where a '.item()' would be
        hook(UserWarning(f"x {scheduler_phases.SYNC_MESSAGE} y"), UserWarning, "f.py", 1)

    clock.timed("launch")(forward_like)
    forward_like()
    hook(UserWarning("something else"), UserWarning, "f.py", 1)
    assert [str(m) for m in shown] == ["something else"]
    sites = {(phase, site.split(" ")[1]) for phase, site in clock.syncs}
    assert sites == {("launch", "forward_like"), ("outside", "forward_like")}, clock.syncs
    assert all(site.startswith("test_scheduler_phases.py:") for _, site in clock.syncs)
    with caplog.at_level(logging.INFO, logger=scheduler_phases.__name__):
        clock.timed("recv")(lambda: None)
    line, = [r.getMessage() for r in caplog.records]
    assert "; syncs: 2; " in line and "launch test_scheduler_phases.py:" in line, line
    assert not clock.syncs                                      # the next interval


def test_admission_census_counts_what_the_real_adder_took_and_refused(harness):
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    from sglang_harness import PAGE

    h = harness
    census = PhaseClock().admission
    adder = PrefillAdder(PAGE, h.cache, h.allocator, ScheduleBatch(reqs=[]), 0.5, 1 << 20, None,
                         max_running_requests=16)
    small = h.new_req(list(range(1, 200)), max_new_tokens=8)
    huge = h.new_req(list(range(1, 200)) * 40, max_new_tokens=8)     # more than the KV pool
    results = []
    for req in (small, huge):
        req.init_next_round_input(h.cache)
        results.append(census.add_one(PrefillAdder.add_one_req, adder, req, False, None))
    assert results[1] == AddReqResult.NO_TOKEN and small in adder.can_run_list
    assert census.counts == {"admitted": 1, "refused": 1}
    assert census.by_source == {("miss", "admitted"): 1, ("miss", "refused"): 1}
    assert census.sums["short"] > len(huge.origin_input_ids) - h.allocator.size
    assert census.sums["free"] == h.allocator.available_size()
    time.sleep(0.01)
    census.add_one(lambda *a, **k: AddReqResult.OTHER, adder, huge, False, None)
    assert census.blocked_s >= 0.01 and census.counts["other"] == 1
    line = census.line()
    assert line.startswith("admission: admitted 1, refused for memory 1 (short ") and "other 1" in line, line
    assert line.endswith("admitted/refused by source: device 0/0, host 0/0, miss 1/1"), line
    census.reset()
    assert census.line() == ""


class _Event:
    """A recorded CUDA event's stand-in on CPU: a time stamp (ms) and whether it has run."""
    def __init__(self, clock):
        self.t, self.ran = clock["now"], clock["ran"]
        clock["made"].append(self)

    def query(self):
        return self.ran

    def elapsed_time(self, end):
        return end.t - self.t


def test_gpu_clock_counts_passes_once_they_have_run_with_their_attention_layers_apart(caplog, monkeypatch):
    from types import SimpleNamespace

    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from hpc_radix.patches.scheduler_phases import GpuClock

    now = {"now": 0.0, "ran": True, "made": []}
    gpu = GpuClock(event_factory=lambda: _Event(now))
    monkeypatch.setattr(GpuClock, "_capturing", staticmethod(lambda: False))
    backend = object.__new__(HybridLinearAttnBackend)          # only its layer dispatch is used
    backend.full_attn_layers = {3}

    def layer(layer_id, ms):
        def run(backend, layer, forward_batch):
            now["now"] += ms
        gpu.layer(run, backend, SimpleNamespace(layer_id=layer_id), None)

    def model(runner, batch):                                   # two GDN layers, one full attention
        now["now"] += 1
        if batch.forward_mode.is_extend():
            layer(0, 4), layer(1, 4), layer(3, 2)
        return "out"

    extend = SimpleNamespace(forward_mode=ForwardMode.EXTEND, extend_num_tokens=300, batch_size=2)
    decode = SimpleNamespace(forward_mode=ForwardMode.DECODE, extend_num_tokens=None, batch_size=5)
    assert gpu.forward(model, None, extend) == "out"
    assert gpu.ms == {"extend": 11, "gdn": 8, "attention": 2} and gpu.counts["extend_tokens"] == 300
    assert sorted(map(id, gpu._spare)) == sorted(map(id, now["made"]))   # read: to record again
    now["ran"] = False                                          # launched, not run yet
    gpu.forward(model, None, decode)
    assert gpu.counts["decode"] == 0 and len(gpu.pending) == 1
    layer(0, 4)                                                 # outside a pass: not counted
    assert gpu.ms["gdn"] == 8
    for event in now["made"]:
        event.ran = True
    with caplog.at_level(logging.INFO, logger=scheduler_phases.__name__):
        line = gpu.line()
    assert line == ("gpu: extend 11 ms in 1 passes (300 tokens; gdn 8, attention 2), "
                    "decode 1 ms in 1 steps"), line
    monkeypatch.setattr(GpuClock, "_capturing", staticmethod(lambda: True))
    gpu.reset()
    gpu.forward(model, None, extend)                            # a CUDA graph capture: untouched
    assert not gpu.pending and gpu.line() == ""


def test_every_hook_target_resolves_in_sglang(monkeypatch):
    import gc
    import pkgutil

    import torch
    from sglang.srt.plugins.hook_registry import HookRegistry

    targets = []
    monkeypatch.setattr(HookRegistry, "register", classmethod(lambda cls, target, *a, **k: targets.append(target)))
    for owner, name in ((torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda, "synchronize")):
        monkeypatch.setattr(owner, name, getattr(owner, name))          # restored after the test
    monkeypatch.setenv(scheduler_phases.ENV, "1")
    callbacks = list(gc.callbacks)
    try:
        assert scheduler_phases.install()
    finally:
        gc.callbacks[:] = callbacks
    assert len(targets) == len(set(targets)) == len(scheduler_phases.PHASES) + len(scheduler_phases.DETAILS) + 3
    for target in targets:
        assert callable(pkgutil.resolve_name(target)), target
