#!/usr/bin/env python3
"""What the tap policy costs in prefill passes, replayed on CPU through the real cache.

With ``--zero-split`` the taps are captured inside the passes (the harness plays the GDN
hook), so no pass is split; without it, the split fallback's passes are counted.

Replays a workload trace (benchmarks/workloads) one request at a time through
HybridRadixCache over SGLang 0.5.17's real pools on CPU tensors (the binding tests'
harness), with the trace's stand-in outputs, splitting each prefill where the cache's
``chunk_cap`` says (exact taps) as the scheduler hook does. Prints, per request kind:
requests, prompt and cached tokens, prefill passes and how many of them exact-tap splits
added. No model runs and nothing is concurrent: it shows what the policy plans, not
timings (benchmarks/ab.py measures those on a GPU).

    python benchmarks/micro/tap_split_sim.py --mix pressure --scale 0.1 \\
        --kv-tokens 11264 --mamba-slots 48 --chunk 8192
    python benchmarks/micro/tap_split_sim.py ... --ignore-echo   # what-if: no echo rule
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "binding")]

from benchmarks.workloads import MIXES, TINY  # noqa: E402
from benchmarks.workloads.trace import simulate as stand_in_outputs  # noqa: E402
from sglang_harness import PAGE, build_cache, make_server_args, zero_split  # noqa: E402


def replay(h, reqs, texts: dict, chunk: int) -> dict:
    stats: dict = collections.defaultdict(collections.Counter)
    for r in reqs:
        prompt, output = texts[r.id]
        req = h.new_req(prompt, max_new_tokens=max(1, len(output)))
        s = stats[r.kind]
        s["requests"] += 1
        s["prompt"] += len(prompt)
        s["cached"] += h.admit(req)
        n, pos = len(prompt), len(req.prefix_indices)
        while pos < n:
            end = min(n, pos + chunk)
            cap = h.cache.chunk_cap(req)
            if cap is not None and pos + cap < end:
                end = pos + cap
                s["splits"] += 1
                s["split at " + req.last_node.taps.planned[end].source.name.lower()] += 1
            h.prefill_chunk(req, end, final=end == n)
            s["passes"] += 1
            pos = end
        h.decode(req, output or [TINY.im_end])
        h.finish(req)
    h.check_idle()
    return stats


def simulate(args, *, mix: str, scale: float, seed: int = 0, kv_tokens: int = 11264,
             mamba_slots: int = 48, chunk: int = 8192, ignore_echo: bool = False,
             in_pass: bool = False) -> dict:
    """Per request kind (and "all"): requests, prompt, cached, passes, splits, split at SOURCE.
    ``args``: SGLang ServerArgs (the harness's ``make_server_args``)."""
    from hpc_radix.binding.hints import ChatMLMarkers
    from hpc_radix.index.index import Match

    reqs = MIXES[mix](seed, scale, TINY)
    texts = stand_in_outputs(reqs, TINY)
    longest = max(len(p) + len(o) for p, o in texts.values())
    h = build_cache(args, kv_pages=kv_tokens // PAGE, mamba_slots=mamba_slots, chunk=chunk,
                    reqs=args.max_running_requests or 8, max_context_len=longest + PAGE)
    h.cache.markers = ChatMLMarkers.build(TINY.im_start, TINY.im_end, TINY.encode)
    if in_pass:
        zero_split(h)
    echoes = Match.echoes_output
    if ignore_echo:
        Match.echoes_output = property(lambda self: False)
    try:
        stats = replay(h, reqs, texts, chunk)
    finally:
        Match.echoes_output = echoes
    stats["all"] = sum(stats.values(), collections.Counter())
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mix", default="pressure", choices=sorted(MIXES))
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-tokens", type=int, default=11264, help="device KV pool (tokens)")
    ap.add_argument("--mamba-slots", type=int, default=48)
    ap.add_argument("--max-running", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=8192, help="chunked prefill size")
    ap.add_argument("--ignore-echo", action="store_true",
                    help="what-if: plan as if no prompt echoed an earlier output")
    ap.add_argument("--zero-split", action="store_true",
                    help="taps captured inside the prefill passes (no splits)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tap-split-sim-") as model_dir:
        args = make_server_args(model_dir, "--max-running-requests", str(a.max_running))
        stats = simulate(args, mix=a.mix, scale=a.scale, seed=a.seed, kv_tokens=a.kv_tokens,
                         mamba_slots=a.mamba_slots, chunk=a.chunk, ignore_echo=a.ignore_echo,
                         in_pass=a.zero_split)
    print(f"mix {a.mix} x{a.scale}, {stats['all']['requests']} requests; KV {a.kv_tokens} tokens, "
          f"{a.mamba_slots} mamba slots, chunk {a.chunk}"
          f"{', echo rule ignored' if a.ignore_echo else ''}"
          f"{', taps in the pass (zero-split)' if a.zero_split else ', split fallback'}")
    header = f"{'kind':<10} {'requests':>8} {'prompt tok':>11} {'cached tok':>11} {'passes':>7} {'splits':>7}"
    print(header + "\n" + "-" * len(header))
    for kind in sorted(stats, key=lambda k: (k == "all", k)):
        s = stats[kind]
        print(f"{kind:<10} {s['requests']:>8} {s['prompt']:>11,} {s['cached']:>11,} "
              f"{s['passes']:>7} {s['splits']:>7}")
    print("splits by tap source: " + ", ".join(
        f"{k[len('split at '):]} {v}" for k, v in sorted(stats["all"].items())
        if k.startswith("split at ")))


if __name__ == "__main__":
    main()
