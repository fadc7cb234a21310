"""benchmarks/ab.py's command line: --host-mib for every regime or per regime."""
from __future__ import annotations

import os

import pytest

from benchmarks import ab


def test_host_mib_per_regime_or_for_all():
    a = ab.parse(["--host-mib", "host=3909,host-tight=1978", "--regimes", "host,host-tight,ample"])
    assert ab.host_mib_for(a, "host", {}, None) == (3909, "--host-mib")
    assert ab.host_mib_for(a, "host-tight", {}, None) == (1978, "--host-mib")
    assert ab.host_mib_for(a, "ample", {}, None)[1] == "computed from --hicache-size"
    assert ab.host_mib_for(ab.parse(["--host-mib", "512"]), "host", {}, None) == (512, "--host-mib")
    assert ab.host_mib_for(a, "device", {}, None) == (0, "regime table")


@pytest.mark.parametrize("bad", ["hots=12", "host=big", "host=", "-5"])
def test_a_bad_host_mib_names_the_problem(bad, capsys):
    with pytest.raises(SystemExit):
        ab.parse(["--host-mib", bad])
    assert "--host-mib" in capsys.readouterr().err


def test_the_deadline_check_learns_from_the_servers_started_so_far():
    assert ab._time_needed({"server": [], "replay": []}, 2) == 120.0
    # the latest start (the first one compiled), the slowest replay, one replay per regime
    assert ab._time_needed({"server": [131, 97, 70], "replay": [10.7, 8.2]}, 2) == 70 + 2 * 10.7 + 15
    # after the first start alone (cold JIT caches) a warm one is expected, at most 120 s
    assert ab._time_needed({"server": [210], "replay": [10.8]}, 2) == 120 + 2 * 10.8 + 15
    assert ab._time_needed({"server": [90], "replay": [10.8]}, 1) == 90 + 10.8 + 15


def test_queue_times_come_from_sglangs_time_stats_log_and_reach_the_report():
    log = ("[t] ReqTimeStats(rid=agent/s0#1@7.11, input_len=9, cached_input_len=0, output_len=2, "
           "attempts=0, type=unified): queue_duration=12.50ms, forward_duration=30.00ms, entry_time=1\n"
           "[t] ReqTimeStats(rid=agent/s0#2@7.12, input_len=9, cached_input_len=0, output_len=2, "
           "attempts=0, type=unified): queue_duration=7.50ms, forward_duration=3.00ms, entry_time=1\n")
    recs = [dict(id=f"agent/s0#{i}", session="agent/s0", round=i, kind="continue", tag="coder",
                 rid=f"agent/s0#{i}@7.1{i}", n_prompt=9, max_new=2, status="ok", error=None,
                 ttft=0.05, cached=4, cached_host=0, output=[1, 2], n_out=2, oracle=4)
            for i in (1, 2, 3)]
    assert ab.attach_time_stats(recs, log) == 2
    assert [r.get("queue_ms") for r in recs] == [12.5, 7.5, None]    # the third was not logged
    m = ab.metrics({"records": recs, "wall_s": 1.0})
    assert m["queue_ms_continuing"]["n"] == 2 and m["queue_ms_continuing"]["mean"] == 10.0
    assert m["admitted_ms_continuing"]["n"] == 2 and m["admitted_ms_continuing"]["mean"] == 40.0
    res = {"regime": "host", "arm": "hybrid", "records": recs, "wall_s": 1.0, "complete": True}
    report = ab.render(ab.summarize([res]), {}, None)
    assert "waiting queue" in report and "hybrid 10/" in report
    assert "to the first token: hybrid 40/" in report


def test_arms_run_in_the_order_given_with_hicache_before_the_hybrids_that_copy_its_bytes():
    assert ab.parse(["--arms", "hicache,hybrid,stock"]).arms == ["hicache", "hybrid", "stock"]
    assert ab.parse(["--arms", "hybrid,stock,hicache"]).arms == ["hicache", "hybrid", "stock"]
    assert ab.parse(["--arms", "hybrid,hicache", "--host-mib", "512"]).arms == ["hybrid", "hicache"]
    assert ab.parse(["--arms", "nocache,stock,stock"]).arms == ["nocache", "stock"]


def test_the_page_size_and_device_only_arms():
    a = ab.parse(["--arms", "stock64,devonly", "--model", "m"])
    stock64 = ab.server_cmd(a, "stock64", "device", "large", None, 11264)
    assert stock64[stock64.index("--page-size") + 1] == "64" and "--radix-cache" not in stock64
    devonly = ab.server_cmd(a, "devonly", "ample", "large", None, None)
    assert devonly[devonly.index("--host-cache-mib") + 1] == "0"
    assert devonly[devonly.index("--radix-cache") + 1] == "hybrid"


def test_a_device_pool_given_in_server_args_is_the_one_reported():
    a = ab.parse(["--arms", "stock", "--regimes", "device", "--model", "m",
                  "--server-args=--enable-metrics --max-total-tokens 73728"])
    traces = {"device": {"path": "pressure.jsonl",
                         "stats": {"working_set": 40000, "max_request": 3000}}}
    (_, _, cmd, extra), = ab.plan_runs(a, "large", traces, {})
    assert extra["device"]["device_tokens"] == 73728
    assert [cmd[i + 1] for i, x in enumerate(cmd) if x == "--max-total-tokens"] == ["10240", "73728"]
    a = ab.parse(["--arms", "stock", "--regimes", "device", "--model", "m"])
    assert ab.plan_runs(a, "large", traces, {})[0][3]["device"]["device_tokens"] == 10240


def _turn(i, cached=4, host=0, ttft=0.05, queue=None, kind="continue"):
    """A replayed request's record as ``ab.replay`` writes it."""
    return dict(id=f"s#{i}", session="s", round=i, kind=kind, tag="t", n_prompt=9, max_new=2,
                status="ok", error=None, ttft=ttft, cached=cached, cached_host=host, output=[1],
                n_out=1, oracle=4, queue_ms=queue)


def _run(regime, arm, records, **extra):
    return {"regime": regime, "arm": arm, "records": records, "wall_s": 1.0, "complete": True,
            **extra}


def test_the_hybrid_caches_counters_are_summed_over_the_replay_and_reach_the_report():
    log = ("[t] hybrid radix cache: in the last interval host_hits +3, host_hit_tokens +900, "
           "scheduler_ms +40; write_backlog 0, host_used_bytes 12\n"
           "[t] Prefill batch, #new-seq: 1\n"
           "[t] hybrid radix cache: in the last interval host_hits +2, restores_dropped +1, "
           "scheduler_ms +10\n")
    counters = ab.cache_counters(log)
    assert counters == {"host_hits": 5, "host_hit_tokens": 900, "scheduler_ms": 50,
                        "restores_dropped": 1}
    assert ab.cache_counters("[t] Prefill batch, #new-seq: 1\n") == {}
    report = ab.render(ab.summarize([_run("host", "hybrid", [_turn(1)], cache_counters=counters)]),
                       {}, None)
    assert ("hybrid: host_hits 5, host_hit_tokens 900, restores_dropped 1, restores_overlapped 0, "
            "passes_waiting_by_layer 0, prefetched_blocks 0, "
            "captures_without_slot 0") in report


def test_continuing_turns_are_joined_by_where_each_arm_served_them():
    hicache = _run("host", "hicache", [
        _turn(1, 400, 0, 0.010, 1.0), _turn(2, 400, 400, 0.020, 2.0), _turn(3, 400, 64, 0.030, 4.0),
        _turn(4, 0, 0, 0.5, 9.0, kind="new"), _turn(5, 400, 0, 0.010, 1.0)])
    hybrid = _run("host", "hybrid", [
        _turn(1, 400, 200, 0.040, 3.0), _turn(2, 400, 128, 0.020, None), _turn(3, 0, 0, 0.050, 5.0),
        _turn(4, 400, 0, 0.1, 1.0, kind="new"), _turn(5, 430, 63, 0.020, 2.0)])
    rows = ab.served_join(hicache, hybrid)
    assert [(r["served"], r["n"]) for r in rows] == [
        (["device", "host"], 1), (["device", "host tail"], 1), (["host", "host"], 1), (["host", "miss"], 1)]
    assert rows[0]["ttft_ms"] == [10.0, 40.0] and rows[2]["queue_ms"] == [2.0, None]
    report = ab.render(ab.summarize([hicache, hybrid]), {}, None)
    assert "| device | host | 1 | 10 / 40 | 1 / 3 |" in report
    assert "| device | host tail | 1 | 10 / 20 | 1 / 2 |" in report


def test_requests_the_hybrid_reuses_as_much_of_are_timed_against_the_base_per_request():
    """Issue 58's per-request ratio: only requests the hybrid cached at least as many tokens of
    as stock count, each by its own first-token time over stock's."""
    stock = _run("device", "stock", [_turn(1, 400, 0, 0.100), _turn(2, 400, 0, 0.100),
                                     _turn(3, 64, 0, 0.100), _turn(4, 400, 0, 0.100)])
    hybrid = _run("device", "hybrid", [_turn(1, 400, 0, 0.050), _turn(2, 400, 0, 0.200),
                                       _turn(3, 0, 0, 0.900), _turn(4, 500, 0, 0.100)])
    m = ab.reuse_matched_ttft(stock, hybrid)
    assert m["n"] == 3 and m["median"] == 1.0 and m["slower"] == 1      # request 3 cached less
    assert abs(m["geomean"] - 1.0) < 1e-9                                # 0.5 x 2.0 x 1.0
    report = ab.render(ab.summarize([stock, hybrid]), {}, None)
    assert ("Requests the hybrid reused at least as much of as stock (3): its first token at "
            "1.00× stock's per request (geometric mean; median 1.00×, p90 2.00×; 1 over 1.1×).") in report


def test_scheduler_phases_are_summed_over_the_replay_and_reach_the_report():
    line = ("[t] scheduler phases: 1.00 s, 163 iterations; recv 3 ms, schedule 121 ms, launch 495 "
            "ms, results 379 ms (GPU waits 318), sample 0 ms; outside them 24 ms; inside: forward "
            "429 ms, gdn_extend 240 ms; gc 1 ms (5)\n")
    phases = ab.scheduler_phases(line + "[t] Decode batch\n" + line)
    assert phases["seconds"] == 2.0 and phases["GPU waits"] == 0.636 and phases["schedule"] == 0.242
    assert phases["outside them"] == 0.048 and phases["gdn_extend"] == 0.48 and phases["gc"] == 0.002
    report = ab.render(ab.summarize([_run("device", "stock", [_turn(1)], scheduler_phases=phases)]),
                       {}, None)
    assert ("stock schedule 0.24, launch 0.99, results 0.76, GPU waits 0.64, outside them 0.05 of 2.0 "
            "(own work 1.35)") in report, report


def test_admission_census_lines_are_summed_and_reach_the_report():
    from hpc_radix.patches.scheduler_phases import AdmissionCensus

    census = AdmissionCensus()
    census.counts.update(admitted=30, refused=4, other=12, retracted=1)
    census.sums.update(short=1240, free=4096, evictable=8192)
    census.by_source.update({("device", "admitted"): 20, ("host", "admitted"): 5, ("host", "refused"): 3,
                             ("miss", "admitted"): 5, ("miss", "refused"): 1})
    census.blocked_s = 0.18
    log = (f"[t] {census.line()}\n[t] Decode batch\n"      # the second line as logged before the sources
           "[t] admission: admitted 5, refused for memory 0, other 1; blocked 20 ms; retracted 0\n")
    c = ab.admission_census(log)
    assert c.pop("blocked_s") == pytest.approx(0.2)
    assert c == {"admitted": 35, "refused": 4, "other": 13, "retracted": 1,
                 "short_tokens": 1240, "free_tokens": 4096, "evictable_tokens": 8192,
                 "admitted_device": 20, "refused_device": 0, "admitted_host": 5, "refused_host": 3,
                 "admitted_miss": 5, "refused_miss": 1}
    report = ab.render(ab.summarize([_run("device", "stock", [_turn(1)], admission=dict(c, blocked_s=0.2))]),
                       {}, None)
    assert ("stock admitted 35, refused for want of KV tokens 4 (missing 310 tokens mean, free 1,024, "
            "evictable 2,048), queue stopped 0.20 s after refusals, 1 retracted; device hits admitted 20, "
            "refused 0; host hits admitted 5, refused 3; misses admitted 5, refused 1") in report


def test_replays_repeat_each_regime_on_the_same_server_and_report_each_after_its_regime(capsys):
    a = ab.parse(["--regimes", "ample,host", "--replays", "2", "--arms", "hybrid"])
    assert a.regimes == ["ample", "ample#2", "host", "host#2"]
    assert ab.regime_conf("host#2") is ab.regime_conf("host")
    assert ab.host_mib_for(a, "host#2", {"host": 3909}, None) == (3909, "measured: HiCache's allocation in this regime")
    with pytest.raises(SystemExit):
        ab.parse(["--replays", "0"])
    assert "--replays=0: must be at least 1" in capsys.readouterr().err
    rec = dict(id="agent/s0#1", session="agent/s0", round=1, kind="continue", tag="coder", rid="r",
               n_prompt=9, max_new=2, status="ok", error=None, ttft=0.05, cached=4, cached_host=0,
               output=[1, 2], n_out=2, oracle=4)
    results = [{"regime": reg, "arm": "hybrid", "records": [rec], "wall_s": 1.0, "complete": True}
               for reg in ("host#2", "ample#2", "host", "ample")]
    assert list(ab.summarize(results)["regimes"]) == ["ample", "ample#2", "host", "host#2"]


def test_server_starts_are_labelled_alternate_their_order_and_share_replays_as_the_first():
    a = ab.parse(["--arms", "stock,hybrid", "--regimes", "device,host", "--starts", "3",
                  "--host-mib", "100", "--model", "m"])
    assert ab.start_rounds(a.arms, a.starts) == [(1, "stock"), (1, "hybrid"), (2, "hybrid"),
                                                 (2, "stock"), (3, "stock"), (3, "hybrid")]
    assert ab.started("host", 1) == "host" and ab.started("host#2", 3) == "host#2@3"
    assert ab.base_regime("host#2@3") == "host" and ab.regime_conf("host@2") is ab.REGIMES["host"]
    stats = {"working_set": 40000, "max_request": 3000}
    traces = {ab.started(r, k): {"path": "pressure.jsonl", "stats": stats}
              for k in (1, 2) for r in ("device", "host")}
    runs = ab.plan_runs(a, "large", traces, {}, start=2)
    assert [(arm, regs) for arm, regs, _, _ in runs] == [
        ("stock", ["device@2", "host@2"]),                 # one server, as on the first start
        ("hybrid", ["device@2"]), ("hybrid", ["host@2"])]
    assert runs[2][3]["host@2"]["host_mib"] == 100
    for bad in ("0", "-1"):
        with pytest.raises(SystemExit):
            ab.parse(["--starts", bad])
    # A series split over two runs: the second run's round is start 2, in the reversed order.
    b = ab.parse(["--arms", "stock,hybrid", "--regimes", "device", "--first-start", "2",
                  "--host-mib", "100", "--model", "m"])
    assert ab.start_rounds(b.arms, b.starts, b.first_start) == [(2, "hybrid"), (2, "stock")]
    assert ab.all_starts(b.regimes, b.starts, b.first_start) == ["device@2"]
    with pytest.raises(SystemExit):
        ab.parse(["--first-start", "0"])


def test_the_report_gives_each_ratio_per_server_start_and_their_geometric_mean():
    def run(regime, arm, ttft, valid=True):
        recs = [_turn(i, ttft=ttft) for i in (1, 2)]
        if not valid:
            recs[0].update(status="failed", error="boom")
        return _run(regime, arm, recs)
    results = [run("host", "hicache", 0.100), run("host", "hybrid", 0.090),
               run("host@2", "hicache", 0.080), run("host@2", "hybrid", 0.100),
               run("host@3", "hicache", 0.100), run("host@3", "hybrid", 0.050, valid=False)]
    summary = ab.summarize(results)
    spread = summary["across_starts"]["host"]
    assert spread["starts"] == [1, 2, 3]
    assert spread["arms"]["hybrid"]["ttft_cont_mean"][:2] == [90.0, 100.0]
    assert spread["arms"]["hybrid"]["ttft_cont_mean"][2] is None        # invalid on start 3
    means = spread["ratios"]["hybrid/hicache"]["ttft_cont_mean"]
    assert means[:2] == pytest.approx([0.9, 1.25]) and means[2] is None
    assert means[3] is None                                    # no mean over a missing start
    two = ab.summarize(results[:4])["across_starts"]["host"]["ratios"]["hybrid/hicache"]
    assert two["ttft_cont_mean"][2] == pytest.approx((0.9 * 1.25) ** 0.5)
    report = ab.render(ab.summarize(results[:4]), {}, None)
    assert "## host: across server starts" in report and "| hybrid/hicache | 0.90 / " in report
    assert "across_starts" not in ab.summarize(results[:2])     # one start: no such section


def test_outputs_are_compared_with_nocache_on_the_same_trace_from_another_regime_or_start():
    def run(regime, arm, out):
        recs = [dict(_turn(i), output=[out]) for i in (1, 2)]
        return _run(regime, arm, recs, trace=("ample" if regime == "ample" else "pressure") + ".jsonl")
    results = [run("device", "stock", 1), run("device", "hybrid", 1),
               run("device@2", "stock", 1), run("device@2", "hybrid", 2),
               run("device@2", "nocache", 1), run("ample", "hybrid", 1)]
    regimes = ab.summarize(results)["regimes"]
    assert regimes["device"]["agreement_with_nocache"]["hybrid"] == (2, 2)
    assert regimes["device"]["nocache_from"] == "device@2"
    assert regimes["device@2"]["agreement_with_nocache"]["hybrid"] == (0, 2)
    assert "nocache_from" not in regimes["device@2"]
    assert regimes["ample"]["agreement_with_nocache"] == {}      # another trace: not compared
    assert "nocache's replay of the same trace in device@2" in ab.render(ab.summarize(results), {}, None)


def test_gpu_time_lines_are_summed_and_reach_the_report():
    from hpc_radix.patches.scheduler_phases import GpuClock

    gpu = GpuClock()
    gpu.ms.update(extend=412.4, gdn=150.2, attention=60.0, decode=300.0)
    gpu.counts.update(extend=30, extend_tokens=12000, decode=900)
    log = f"[t] {gpu.line()}\n[t] Decode batch\n[t] {gpu.line()}\n"
    g = ab.gpu_time(log)
    assert g == {"extend_ms": 824, "extend_passes": 60, "extend_tokens": 24000, "gdn_ms": 300,
                 "attention_ms": 120, "decode_ms": 600, "decode_steps": 1800}
    report = ab.render(ab.summarize([_run("device", "stock", [_turn(1)], gpu_time=g)]), {}, None)
    assert ("stock extend 0.82 s in 60 passes (24,000 tokens, 34.3 µs each; GDN layers 0.30 s, "
            "full attention 0.12 s), decode 0.60 s in 1,800 steps.") in report, report
    # with the phase lines of the same window: the time no forward pass ran
    phased = _run("device", "stock", [_turn(1)], gpu_time=g, scheduler_phases={"seconds": 2.0})
    report = ab.render(ab.summarize([phased]), {}, None)
    assert "decode 0.60 s in 1,800 steps, no pass running 0.58 s of 2.0." in report, report


def test_mooncake_regimes_need_their_trace_and_are_not_default(tmp_path, capsys):
    assert not any(r.startswith("mooncake") for r in ab.DEFAULT_REGIMES)
    with pytest.raises(SystemExit):
        ab.parse(["--regimes", "mooncake-exact"])
    assert "regime mooncake-exact needs --mooncake FILE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.parse(["--regimes", "mooncake-exact", "--mooncake", str(tmp_path / "none.jsonl")])
    assert "no such file" in capsys.readouterr().err
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 8, "hash_ids": [1, 2]}\n')
    a = ab.parse(["--regimes", "mooncake-blocks", "--mooncake", str(trace), "--mooncake-window",
                  "0,1", "--out", str(tmp_path / "out")])
    info = ab.build_traces(a, a.regimes)["mooncake-blocks"]
    assert info["stats"]["requests"] == 1 and info["stats"]["prompt_tokens"] == 150
    with pytest.raises(SystemExit):
        ab.parse(["--mooncake-window", "3,0"])
    assert "COUNT >= 1" in capsys.readouterr().err


def test_without_a_no_cache_replay_outputs_are_compared_with_stocks_then_hicaches():
    def run(arm, outputs, regime="mooncake-exact"):
        recs = [dict(id=f"mc{i}", session=f"mc{i}", round=0, kind="new", tag="", rid=f"mc{i}@1",
                     n_prompt=9, max_new=2, prompt_digest=f"d{i}", status="ok", error=None, ttft=0.05,
                     cached=0, cached_host=0, output=out, n_out=2, oracle=0)
                for i, out in enumerate(outputs)]
        return {"regime": regime, "arm": arm, "records": recs, "wall_s": 1.0, "complete": True}

    same, differs = [[1, 2], [3, 4]], [[1, 2], [3, 5]]
    s = ab.summarize([run("stock", same), run("hicache", differs), run("hybrid", same)])
    e = s["regimes"]["mooncake-exact"]
    assert e["output_reference"] == "stock"
    assert e["agreement_with_nocache"] == {"hicache": (1, 2), "hybrid": (2, 2)}
    assert "same output as stock" in ab.render(s, {}, None)
    s = ab.summarize([run("hicache", same, "mooncake-exact-24"), run("hybrid", differs, "mooncake-exact-24")])
    e = s["regimes"]["mooncake-exact-24"]
    assert e["output_reference"] == "hicache" and e["agreement_with_nocache"] == {"hybrid": (1, 2)}
    assert "Same output as hicache (requests): hybrid 1/2" in ab.render(s, {}, None)
    s = ab.summarize([run("nocache", same), run("stock", differs)])
    assert s["regimes"]["mooncake-exact"]["output_reference"] == "nocache"


def test_speculative_accept_length_is_output_tokens_per_verify_step_and_reaches_the_report():
    recs = [dict(id=f"agent/s0#{i}", session="agent/s0", round=i, kind="continue", tag="coder",
                 n_prompt=9, max_new=6, status="ok", error=None, ttft=0.05, cached=4, cached_host=0,
                 output=[1] * 6, n_out=6, oracle=4, verify_steps=steps)
            for i, steps in ((1, 4), (2, 2), (3, None))]     # the third ran without speculation
    assert ab.metrics({"records": recs, "wall_s": 1.0})["accept_length"] == 2.0
    assert ab.metrics({"records": recs[2:], "wall_s": 1.0})["accept_length"] is None
    res = {"regime": "host", "arm": "hybrid", "records": recs, "wall_s": 1.0, "complete": True}
    assert "verify step (1 + accepted drafts; random weights accept few): hybrid 2.00." in \
        ab.render(ab.summarize([res]), {}, None)


def test_arm_args_reach_only_their_arms_server_and_a_bad_one_is_named(capsys):
    a = ab.parse(["--arms", "stock,hybrid", "--regimes", "device", "--model", "m",
                  "--server-args=--speculative-algorithm NEXTN",
                  "--arm-args", "hybrid=--disable-overlap-schedule"])
    traces = {"device": {"path": "pressure.jsonl", "stats": {"working_set": 40000, "max_request": 3000}}}
    cmds = {arm: cmd for arm, _, cmd, _ in ab.plan_runs(a, "large", traces, {})}
    assert all("NEXTN" in cmd for cmd in cmds.values())
    assert "--disable-overlap-schedule" in cmds["hybrid"] and "--disable-overlap-schedule" not in cmds["stock"]
    with pytest.raises(SystemExit):
        ab.parse(["--arms", "stock", "--regimes", "device", "--model", "m", "--arm-args", "hicache=--x"])
    assert "--arm-args 'hicache=--x'" in capsys.readouterr().err


def test_speculative_flags_reach_every_arm_but_nospec_and_the_report_compares_the_two():
    a = ab.parse(["--arms", "stock,hybrid,nocache,nospec", "--regimes", "device", "--model", "m",
                  "--speculative", "--speculative-algorithm NEXTN --speculative-eagle-topk 1"])
    traces = {"device": {"path": "pressure.jsonl", "stats": {"working_set": 40000, "max_request": 3000}}}
    cmds = {arm: cmd for arm, _, cmd, _ in ab.plan_runs(a, "large", traces, {})}
    assert [arm for arm, cmd in cmds.items() if "NEXTN" in cmd] == ["stock", "hybrid", "nocache"]
    assert cmds["nospec"][cmds["nospec"].index("--radix-cache") + 1] == "hybrid"

    def run(arm, cached, steps):
        recs = [dict(id="agent/s0#1", session="agent/s0", round=1, kind="continue", tag="coder",
                     n_prompt=900, max_new=6, status="ok", error=None, ttft=0.05, cached=cached,
                     cached_host=0, output=[1] * 6, n_out=6, oracle=800, verify_steps=steps)]
        return {"regime": "device", "arm": arm, "records": recs, "wall_s": 1.0, "complete": True}
    text = ab.render(ab.summarize([run("hybrid", 792, 6), run("nospec", 800, None)]), {}, None)
    assert "The hybrid cached 792 tokens with speculative decoding and 800 without (nospec): -1.00 %." in text


def test_replicas_share_the_device_pools_and_the_host_bytes():
    cmd = ["python", "-m", "sglang.launch_server", "--port", "30000", "--mem-fraction-static", "0.6",
           "--max-total-tokens", "262144", "--max-mamba-cache-size", "64",
           "--host-cache-mib", "49152", "--hicache-size", "48"]
    second = ab.replica_cmd(cmd, 2, 1, 30001)
    assert second[4:] == ["30001", "--mem-fraction-static", "0.6", "--max-total-tokens", "131072",
                          "--max-mamba-cache-size", "32", "--host-cache-mib", "24576",
                          "--hicache-size", "24"]
    assert ab.replica_cmd(cmd, 1, 0, 30000) == cmd


def test_replicas_refuse_a_regime_without_a_capped_pool(capsys):
    with pytest.raises(SystemExit):
        ab.parse(["--replicas", "2", "--regimes", "host,ample"])
    assert "ample is not" in capsys.readouterr().err
    assert ab.parse(["--replicas", "2", "--regimes", "host"]).replicas == 2


class Req:
    def __init__(self, session):
        self.session = session


def test_round_robin_alternates_a_sessions_turns_and_skips_a_server_that_is_down():
    r = ab.Router(2, "rr", 8)
    assert [r.pick(Req("s")) for _ in range(4)] == [0, 1, 0, 1]
    r.down.add(0)
    assert [r.pick(Req("s")) for _ in range(2)] == [1, 1]


def test_sticky_keeps_a_session_on_its_server_until_that_one_is_busy():
    r = ab.Router(2, "sticky", 4)                # busy at 2 in flight each
    home = r.pick(Req("s1"))
    assert r.pick(Req("s1")) == home             # 2 in flight there now
    assert r.pick(Req("s1")) == 1 - home         # spills to the other
    r.done(home)
    assert r.pick(Req("s1")) == home


def test_least_loaded_picks_the_server_with_fewest_in_flight():
    r = ab.Router(3, "least-loaded", 9)
    assert [r.pick(Req(i)) for i in range(3)] == [0, 1, 2]
    r.done(1)
    assert r.pick(Req("x")) == 1


def test_store_arms_get_a_fresh_directory_each(tmp_path):
    a = ab.parse(["--out", str(tmp_path), "--arms", "hybridtier,hicachel3", "--replicas", "2", "--regimes", "host",
                  "--store-mib", "40960"])
    env = ab.store_env(a, "hicachel3", "host")
    path = env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"]
    assert os.path.isdir(path) and not os.listdir(path)
    assert env["SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"] == str(20480 * 2**20)  # its evictor counts its own server's
    cmd = ab.server_cmd(a, "hybridtier", "host", "tiny", 512, 1000)
    assert cmd[cmd.index("--cache-store-dir") + 1] == ab.store_dir(a, "hybridtier", "host")
    assert cmd[cmd.index("--cache-store-mib") + 1] == "40960"        # the shared directory's budget
    assert "--cache-store-mib" not in ab.server_cmd(ab.parse([]), "hybridtier", "host", "tiny", 512, 1000)
    proc = ab.server_cmd(a, "tierthreads", "host", "tiny", 512, 1000)      # no writer process
    assert proc[proc.index("--cache-store-writer") + 1] == "threads"
    assert proc[proc.index("--cache-store-dir") + 1] == ab.store_dir(a, "tierthreads", "host")
    assert proc[proc.index("--cache-store-mib") + 1] == "40960"
    with pytest.raises(SystemExit):
        ab.parse(["--replicas", "0"])


def test_the_report_gives_each_arm_as_a_share_of_bound_a_per_request_kind():
    def rec(i, kind, cached, oracle, bound):
        return dict(id=f"s{i}#1", session=f"s{i}", round=1, kind=kind, tag="", n_prompt=900,
                    max_new=6, status="ok", error=None, ttft=0.05, cached=cached, cached_host=0,
                    output=[1] * 6, n_out=6, oracle=oracle, bound_a=bound, verify_steps=None)

    def run(arm, recs):
        return {"regime": "device", "arm": arm, "records": recs, "wall_s": 1.0, "complete": True}
    recs = [rec(0, "continue", 600, 800, 800), rec(1, "new", 100, 400, 200)]
    recs[0]["bound_b"], recs[1]["bound_b"] = 700, 100
    text = ab.render(ab.summarize([run("hybrid", recs)]), {}, None)
    assert "(never above the oracle), and each arm's cached tokens as a share of it: hybrid 70.0% " \
           "of 1,000 (continuing turns 75.0%, new prompts 50.0%)" in text
    assert "clairvoyant retention, and each arm's cached tokens as a share of it: hybrid 87.5% " \
           "of 800 (continuing turns 85.7%, new prompts 100.0%)" in text
    for r in recs:
        del r["bound_a"], r["bound_b"]       # results recorded before the bounds were
    assert "Bound (" not in ab.render(ab.summarize([run("hybrid", recs)]), {}, None)


def test_bound_b_takes_the_regimes_device_and_host_bytes_whatever_the_arm(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps({
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_key_value_heads": 2,
        "head_dim": 256, "linear_key_head_dim": 128, "linear_num_key_heads": 2,
        "linear_value_head_dim": 128, "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4}))
    a = ab.parse(["--model", str(tmp_path), "--host-mib", "100"])
    kv, state = ab.state_bytes(str(tmp_path))
    for arm in ("hybrid", "stock"):
        cmd = ab.server_cmd(a, arm, "host", "large", None, 11264)
        slots = int(ab._flag(cmd, "--max-mamba-cache-size"))
        assert ab.bound_b_memory(a, "host", cmd, {}, 11264) == [
            [11264 * kv, slots * state, 100 << 20], 64 * kv, state]
    assert ab.bound_b_memory(ab.parse([]), "host", cmd, {}, 11264) is None      # no config.json


def test_bound_a_never_exceeds_the_oracle_on_a_replayed_trace():
    events = [("a", 0.0, 1.0, [1, 2, 3, 4, 5], [6, 7]), ("b", 2.0, 3.0, [1, 2, 3, 4, 5, 6, 7, 8], [9]),
              ("c", 2.5, 4.0, [1, 2, 9], [5])]
    oracle, bound = ab.oracle_bounds(events), ab.clairvoyant_tap_bounds(events)
    assert bound == {"a": 0, "b": 6, "c": 2} and all(bound[k] <= oracle[k] for k in oracle)


def test_a_model_directory_given_relative_reaches_the_servers_absolute(tmp_path, monkeypatch):
    """The servers start in their log directory: a relative model directory is made absolute
    (a report cuts it to its last part); a hub id stays as given."""
    (tmp_path / "large16").mkdir()
    monkeypatch.chdir(tmp_path)
    assert ab.parse(["--model", "large16"]).model == str(tmp_path / "large16")
    assert ab.parse(["--model", "Qwen/Qwen3.5-27B"]).model == "Qwen/Qwen3.5-27B"
    assert ab._portable([str(tmp_path / "large16")]) == ["large16"]
