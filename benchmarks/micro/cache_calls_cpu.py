#!/usr/bin/env python3
"""CPU: the scheduler-thread cost of the hybrid cache's entry points, per call.

SGLang's scheduler thread runs the cache's calls (``match_prefix``, ``init_load_back``,
``cache_unfinished_req``, ``cache_finished_req``, ``evict``, ...) between its forward launches;
on the H200 A/B (benchmarks/results/HISTORY.md) they took 1.0-1.5 s of a 10 s replay. This replays
multi-turn sessions round-robin through the test harness (``tests/binding/sglang_harness.py``:
SGLang 0.5.17's real pools, allocators and ``Req``; no model) with a device pool smaller than
the working set, so requests evict, restore from the host tier and write through, and prints
the cache's own timing of each entry point (the ``scheduler time in cache calls`` log line)
per call and per turn. The host tier's and snapshot copies' kernel launches are skipped (under
the Triton interpreter a launch costs far more than on a GPU; the tables are still built).

Compare commits on one machine; a GPU host's CPU spends roughly 1.5-3x these times.

    python benchmarks/micro/cache_calls_cpu.py [--sessions 6] [--turns 120] [--tokens 2500]
        [--pages 200] [--host-mib 256] [--repeat 3] [--profile 25]

With ``--replicas 2`` two caches share a file tier (``--tierless``: none) and each session's
turns go to them in turn, through SGLang's scheduling rounds (a request may wait for the tier's
answer); ``--fresh P`` starts a new session in a share of the turns, which nothing anywhere
can serve deeper, and ``--no-directory`` makes every such request ask the tier anyway (as
before the tier's directory of states).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import os
import pstats
import random
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "binding")]
os.environ.setdefault("TRITON_INTERPRET", "1")      # kernels are defined at import

from benchmarks.micro.tap_split_sim import copies_skipped  # noqa: E402


# What each costs the scheduler thread on a GPU host beyond its Python, counted per turn (on the
# H200 these, not the Python, were most of the cache's time: benchmarks/results/HISTORY.md).
GPU_CALLS = {"uploads": 0, "copy launches": 0}


def _count_launch() -> None:
    GPU_CALLS["copy launches"] += 1


def _count_uploads() -> None:
    """Uploads (host ints to a device tensor) counted."""
    from hpc_radix.binding import cache
    from hpc_radix.kernels import snapshot_copy, upload

    for module in (cache, snapshot_copy, upload):
        def counted(*args, _to_device=module.to_device, **kwargs):
            GPU_CALLS["uploads"] += 1
            return _to_device(*args, **kwargs)
        module.to_device = counted


def run(a) -> tuple[str, list, "cProfile.Profile | None"]:
    """Fresh caches through warm-up and the measured turns: the caches' timing summary, the
    GC pauses in the turns and the profile (with ``--profile``)."""
    from sglang.srt.mem_cache.common import evict_from_tree_cache
    from sglang_harness import PAGE, build_cache, make_server_args, sglang_init_next_round_input

    from hpc_radix.patches.scheduler_hooks import _around_next_round
    from hpc_radix.sglang_version import prefix_len

    env = {"HPC_HOST_CACHE_MIB": str(a.host_mib), **dict(kv.split("=", 1) for kv in a.env)}
    if a.replicas > 1 and not a.tierless and "HPC_CACHE_STORE_DIR" not in env:
        env["HPC_CACHE_STORE_DIR"] = tempfile.mkdtemp()      # replicas share a file tier
    if a.no_directory:                                         # every request asks the tier
        from hpc_radix.binding.store.directory import StateDirectory
        StateDirectory.complete = property(lambda self: False)
    args = make_server_args(tempfile.mkdtemp())
    replicas = []
    for _ in range(a.replicas):
        # zero-split: taps captured in the pass, as on a GPU with the hooks live
        h = build_cache(args, kv_pages=a.pages, mamba_slots=a.slots, env=env, chunk=256,
                        zero_split=a.taps == "zero-split",
                        max_context_len=max(4096, a.max_tokens + a.new_tokens + 1024))
        if h.cache.host is not None:
            assert h.cache.host.memory.wait(120), "the host tier did not come online"
            h.cache._poll_host()
        if replicas:                 # one timer for the replicas' calls (they run one at a time)
            h.cache.call_timer = h.cache.ids._timer = replicas[0].cache.call_timer
        replicas.append(h)
    h = replicas[0]
    rng = random.Random(0)
    sessions = [[rng.randrange(1, 250) for _ in range(a.tokens)] for _ in range(a.sessions)]

    def settle(h) -> None:
        """The host copies landed and the tier's writes done, as between a session's turns."""
        if h.cache.host is not None:
            h.cache.host.drain()
        if h.cache.store_worker is not None:
            for _ in range(2):
                h.cache._poll_host()
                h.cache.store_worker.drain()

    def turn(t: int) -> None:
        i = t % a.sessions
        h = replicas[t // a.sessions % a.replicas]     # a session's turns go to each replica in turn
        if a.fresh and rng.random() < a.fresh:           # a new session in its place
            sessions[i] = [rng.randrange(1, 250) for _ in range(a.tokens)]
        tokens = sessions[i]
        req = h.new_req(list(tokens))
        # SGLang's rounds: the cache may hold a request back for the shared tier's answer
        while (_around_next_round(sglang_init_next_round_input, req, h.cache)
               or h.cache.coalesce_wait(req)):
            time.sleep(0.0005)
        h.admit_locked(req)
        # SGLang evicts an extend's shortfall in one call before allocating (the harness would
        # evict page by page); decode evicts a page at a time, as here
        evict_from_tree_cache(h.cache, len(tokens) - prefix_len(req) + PAGE)
        pos, n = prefix_len(req), len(tokens)
        while True:                    # SGLang's chunked prefill: a cache_unfinished_req per chunk
            end = n if not a.prefill_chunk or n - pos <= a.prefill_chunk else pos // PAGE * PAGE + a.prefill_chunk
            h.prefill_chunk(req, end, final=end == n)
            if end == n:
                break
            pos = end
        out = [rng.randrange(1, 250) for _ in range(8)]
        h.decode(req, out)
        h.finish(req)
        settle(h)
        sessions[i] = (tokens + out + [rng.randrange(1, 250) for _ in range(a.new_tokens)])[-a.max_tokens:]

    for t in range(3):
        turn(t)
    h.cache.call_timer.take_summary()
    GPU_CALLS.update(dict.fromkeys(GPU_CALLS, 0))
    # the imports' heap would make every collection slow (the server logged ~12 ms of GC per
    # A/B replay: HPC_SCHEDULER_PHASES); collections during the turns are counted
    gc.collect()
    gc.freeze()
    pauses = [0.0, 0, 0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            pauses[2] = time.perf_counter()
        else:
            pauses[0] += time.perf_counter() - pauses[2]
            pauses[1] += 1

    gc.callbacks.append(on_gc)
    profiler = cProfile.Profile() if a.profile else None
    h.cache.call_timer.profiler = profiler      # enabled inside the cache's calls only
    with OpCounter() if a.ops else contextlib.nullcontext() as ops:
        for t in range(a.turns):
            turn(t)
    h.cache.call_timer.profiler = None
    gc.callbacks.remove(on_gc)
    gc.unfreeze()
    summary = h.cache.call_timer.take_summary() + "".join(
        f", {name} 0 ms ({count})" for name, count in GPU_CALLS.items())
    for h in replicas:
        if h.cache.host is not None:
            h.cache.release_host_resources()
    return summary, pauses, (profiler, ops)


class OpCounter:
    """Torch operators dispatched inside each cache entry point (the innermost), by operator:
    on a GPU host each is a kernel launch, an allocation, a copy or a read back, the costs that
    make the cache's calls 2-3x slower there than here."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        from hpc_radix.binding.report import CallTimer

        self.counts: dict[str, dict[str, int]] = {}
        timed_code = CallTimer.wrap(lambda cache: None).__code__
        counts = self.counts

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                frame = sys._getframe(1)
                while frame is not None and frame.f_code is not timed_code:
                    frame = frame.f_back
                if frame is not None:
                    per = counts.setdefault(frame.f_locals["name"], {})
                    op = str(func.overloadpacket)
                    per[op] = per.get(op, 0) + 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)

    def report(self, turns: int) -> str:
        lines = [f"torch operators per turn inside the cache's calls: "
                 f"{sum(sum(c.values()) for c in self.counts.values()) / turns:.1f}"]
        for name, per in sorted(self.counts.items(), key=lambda kv: -sum(kv[1].values())):
            top = sorted(per.items(), key=lambda kv: -kv[1])[:6]
            lines.append(f"  {name:24s} {sum(per.values()) / turns:6.1f}  ("
                         + ", ".join(f"{op.replace('aten.', '')} {n / turns:.1f}" for op, n in top) + ")")
        return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=6, help="sessions served round-robin")
    ap.add_argument("--turns", type=int, default=120, help="measured turns (after 3 warm-up)")
    ap.add_argument("--tokens", type=int, default=2500, help="first prompt of each session")
    ap.add_argument("--max-tokens", type=int, default=3500, help="a session's history is cut to this")
    ap.add_argument("--new-tokens", type=int, default=60, help="new prompt tokens per turn")
    ap.add_argument("--prefill-chunk", type=int, default=0,
                    help="tokens per prefill pass (0: the whole extend in one)")
    ap.add_argument("--pages", type=int, default=200, help="device KV pages of 64 tokens")
    ap.add_argument("--slots", type=int, default=48, help="mamba slots")
    ap.add_argument("--host-mib", type=int, default=256, help="host tier (0: device only)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="caches sharing a file tier; a session's turns go to each in turn")
    ap.add_argument("--tierless", action="store_true", help="replicas without a shared tier")
    ap.add_argument("--fresh", type=float, default=0.0,
                    help="share of turns that start a new session (nothing to resume anywhere)")
    ap.add_argument("--no-directory", action="store_true",
                    help="every request that goes past the cache's deepest state asks the tier")
    ap.add_argument("--env", action="append", default=[], metavar="HPC_NAME=VALUE",
                    help="a hybrid option as its environment variable (repeatable)")
    ap.add_argument("--repeat", type=int, default=3, help="fresh runs; the median one is shown")
    ap.add_argument("--taps", choices=("zero-split", "split"), default="zero-split",
                    help="taps captured in the pass (the GPU default) or ending prefill chunks")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print the top N of a cProfile of the cache's calls")
    ap.add_argument("--sort", default="tottime", help="the profile's order (cumulative, ...)")
    ap.add_argument("--ops", action="store_true",
                    help="count the torch operators each entry point dispatches, per turn")
    ap.add_argument("--restrict", action="append", default=[], metavar="RE",
                    help="only functions whose file:line(name) matches (repeatable)")
    a = ap.parse_args()

    _count_uploads()
    runs = []
    with copies_skipped(launched=_count_launch):     # kernel launches: counted no-ops
        for _ in range(a.repeat):
            summary, pauses, profiler = run(a)
            total = re.match(r"(\d+) ms in all", summary)
            runs.append((int(total.group(1)) / a.turns if total else 0.0, summary, pauses, profiler))
    runs.sort(key=lambda r: r[0])
    per_turn, summary, pauses, (profiler, ops) = runs[len(runs) // 2]
    print(f"{a.turns} turns, {a.sessions} sessions of {a.tokens}-{a.max_tokens} tokens, "
          f"{a.pages} device pages, host tier {a.host_mib} MiB, {a.taps} taps"
          + (f", {a.replicas} replicas{'' if a.tierless else ' sharing a file tier'}" if a.replicas > 1 else "")
          + (f", {a.fresh:.0%} of turns new sessions" if a.fresh else ""))
    print(f"cache calls: {per_turn:.2f} ms per turn (median of "
          f"{', '.join(f'{r[0]:.2f}' for r in runs)})")
    found = re.findall(r"([a-z_ ]+) (\d+) ms \((\d+)\)", summary)
    for name, ms, calls in found:
        if name.strip() not in GPU_CALLS:
            print(f"  {name.strip():24s} {int(ms) / max(int(calls), 1):7.3f} ms/call  ({calls} calls)")
    per_turn_calls = {name.strip(): int(calls) / a.turns for name, _, calls in found}
    print("calls that wait for or launch on a GPU, per turn: " + ", ".join(
        f"{name} {per_turn_calls.get(name, 0):.1f}"
        for name in ("settled reads", "device reads", *GPU_CALLS)))
    print(f"garbage collector: {pauses[0] * 1e3:.0f} ms in {pauses[1]} collections (inside the figures)")
    if ops:
        print(ops.report(a.turns))
    if profiler:
        pstats.Stats(profiler).sort_stats(a.sort).print_stats(*a.restrict, a.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
