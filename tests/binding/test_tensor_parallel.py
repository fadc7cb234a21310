"""Tensor parallelism on CPU ranks: two processes, each a HybridRadixCache with a host tier over
SGLang's real pools, joined by a real gloo group as SGLang's TP CPU group, fed one request
stream. One rank sees its host memory pinned later and its copies land later; with the
agreement every rank still decides alike at every batch build (HPC_TP_CHECK compares them), and
without it the same timings make the two caches decide differently."""
from __future__ import annotations

import json
import multiprocessing
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

SESSIONS, TURNS = 5, 3
PINNED_LATE_UNTIL = 4        # the late rank's host memory is pinned once this request starts
LANDS_AFTER_BUILDS = 3       # the late rank's copies land this many batch builds after launch


def prompt(n, seed):
    return [(seed * 7919 + i * 31) % 250 + 1 for i in range(n)]


def stream():
    """Multi-turn sessions interleaved: each turn continues its session's prompt and output.
    Every fourth request the device loses what it can, so turns come back from host."""
    history = {s: prompt(180 + 40 * s, seed=s) for s in range(SESSIONS)}
    for turn in range(TURNS):
        for s in range(SESSIONS):
            yield history[s], [s + 1] * 6
            history[s] = history[s] + [s + 1] * 6 + prompt(70, seed=100 + 10 * s + turn)


class _LateEvent:
    """A copy's completion as a CUDA event reports it, landing ``builds`` batch builds after
    its launch (the CPU copies run inline; only when the cache hears of them moves)."""

    def __init__(self, ids, builds):
        self.ids, self.due = ids, ids.epoch + builds

    def query(self):
        return self.ids.epoch >= self.due

    def synchronize(self):
        self.due = 0


def _rank(rank, size, init_file, out, late, env, serve_extra=False, phases=("serve",)):
    """One rank: serve the stream (``late``: this rank's host memory and copies arrive late),
    then write its decision digests and counters to ``out``."""
    import threading

    os.environ.update(env)
    group = None
    if size > 1:
        import datetime

        torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                             world_size=size, timeout=datetime.timedelta(seconds=60))
        group = torch.distributed.new_group(backend="gloo")
    from sglang_harness import build_cache, make_server_args

    from hpc_radix.binding.host import transfers as host_tier
    from hpc_radix.binding.host.memory import HostMemory

    model_dir = out + ".model"
    os.makedirs(model_dir, exist_ok=True)
    args = make_server_args(model_dir)
    result = {"digests": [], "error": None}
    gate = threading.Event()
    if late:
        fill = HostMemory._fill
        HostMemory._fill = lambda self: (gate.wait(60), fill(self))
        submit = host_tier.HostTier._submit
        host_tier.HostTier._submit = lambda self, *a, **k: (
            submit(self, *a, **k), _LateEvent(h.cache.ids, LANDS_AFTER_BUILDS))[1]
    else:
        gate.set()
    h = None
    try:
        for phase in phases:
            h = build_cache(args, env={"HPC_HOST_CACHE_MIB": "1", "HPC_HOST_WRITE_THRESHOLD": "0",
                                       "HPC_TP_CHECK": "1", **env}, tp=(rank, size, group))
            result[f"{phase}_loaded"] = h.cache.index.sizes.snapshots
            result["shared_tier"] = h.cache.store_worker is not None
            if phase == "serve":
                for i, (tokens, output) in enumerate(stream()):
                    if i == PINNED_LATE_UNTIL:
                        gate.set()
                    if i % 4 == 3:
                        h.evict_all()
                    h.serve(h.new_req(tokens), output)
                if serve_extra and rank == 1:
                    h.serve(h.new_req(prompt(300, seed=99)), [1])
                h.cache.batch_built()
            h.cache._update_report(force=True)
            result["digests"] += h.cache.ranks.digests
            result["report"] = {k: h.cache.report.published.get(k, 0) for k in
                                ("host_hits", "blocks_restored", "images_written", "blocks_written")}
            h.cache.release_host_resources()
            h = None
    except Exception as err:   # reported to the test
        result["error"] = f"{type(err).__name__}: {err}"
    finally:
        with open(out, "w") as f:
            json.dump(result, f)
        if size > 1:
            torch.distributed.destroy_process_group()


def _run(tmp_path, size, *, late=(False, True), env=None, **kw):
    """Both ranks (``size`` 2: one TP group; 1: each rank alone), their results."""
    ctx = multiprocessing.get_context("spawn")
    outs = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    init = str(tmp_path / f"init{len(list(tmp_path.glob('init*')))}")   # one per group
    procs = []
    for r in range(2):
        procs.append(ctx.Process(target=_rank, args=(r if size > 1 else 0, size, init, outs[r], late[r],
                                                     env or {}), kwargs=kw))
        procs[-1].start()
    for p in procs:
        p.join(240)
        if p.is_alive():
            p.kill()
    return [json.load(open(o)) for o in outs]


def test_ranks_whose_memory_and_copies_arrive_at_different_steps_decide_alike(tmp_path):
    ranks = _run(tmp_path, 2)
    assert [r["error"] for r in ranks] == [None, None]
    first, late = ranks
    assert first["digests"] and first["digests"] == late["digests"]
    assert first["report"] == late["report"]
    assert first["report"]["host_hits"] > 0 and first["report"]["blocks_restored"] > 0


def test_without_the_agreement_the_same_timings_make_the_caches_decide_differently(tmp_path):
    """The control: each rank alone, the same stream and timings."""
    alone = _run(tmp_path, 1)
    assert [r["error"] for r in alone] == [None, None]
    assert alone[0]["digests"] != alone[1]["digests"]


def test_the_divergence_check_stops_both_ranks_at_the_first_difference(tmp_path):
    ranks = _run(tmp_path, 2, late=(False, False), serve_extra=True)
    for r in ranks:
        assert r["error"] and r["error"].startswith("RankDivergence") and "batch build" in r["error"]


def test_a_restart_loads_what_every_rank_saved_and_a_damaged_file_sends_every_rank_cold(tmp_path):
    path = str(tmp_path / "cache")
    env = {"HPC_PREFIX_CACHE_FILE": path}
    ranks = _run(tmp_path, 2, late=(False, False), env=env, phases=("serve", "restart"))
    assert [r["error"] for r in ranks] == [None, None]
    assert os.path.exists(path + ".tp0") and os.path.exists(path + ".tp1")
    assert ranks[0]["restart_loaded"] == ranks[1]["restart_loaded"] > 0
    with open(path + ".tp1", "r+b") as f:             # one rank's index damaged
        f.seek(40)
        f.write(b"\xff" * 64)
    ranks = _run(tmp_path, 2, late=(False, False), env=env, phases=("restart",))
    assert [r["error"] for r in ranks] == [None, None]
    assert ranks[0]["restart_loaded"] == ranks[1]["restart_loaded"] == 0


def test_the_shared_tier_is_off_under_tensor_parallelism_and_serving_goes_on(tmp_path):
    """Each rank would read the tier back on its own clock; until the ranks agree on those
    reads the tier is off under TP (with a warning), and the ranks still decide alike."""
    ranks = _run(tmp_path, 2, late=(False, False), env={"HPC_CACHE_STORE_DIR": str(tmp_path / "tier")})
    assert [r["error"] for r in ranks] == [None, None]
    assert [r["shared_tier"] for r in ranks] == [False, False]
    assert ranks[0]["digests"] == ranks[1]["digests"]
