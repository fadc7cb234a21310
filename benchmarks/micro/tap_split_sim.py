#!/usr/bin/env python3
"""What the tap policy costs in prefill passes, replayed on CPU through the real cache.

With ``--zero-split`` the taps are captured inside the passes (the harness plays the GDN
hook), so no pass is split; without it, the split fallback's passes are counted.

Replays a workload trace (benchmarks/workloads) one request at a time through
HybridRadixCache over SGLang 0.5.17's real pools on CPU tensors (the binding tests'
harness), with the trace's stand-in outputs, splitting each prefill where the cache's
``chunk_cap`` says (exact taps) as the scheduler hook does. Prints, per request kind:
requests, prompt and cached tokens, prefill passes and how many of them exact-tap splits
added. No model runs: it shows what the policy plans, not timings (benchmarks/ab.py
measures those on a GPU).

With ``--inflight N`` (N > 1) the trace is sent as ``ab.py`` sends it (round by round, at most N
requests in flight) and scheduled as SGLang does, in steps (SGLang's real PrefillAdder, first
come first served, no admission after a refusal for want of KV tokens until a running request
finishes; every running request decodes a token per step), so requests hold their pages while
others are admitted. It then also reports the continuing turns by where their prefix came from
(device, a snapshot tail alone from host, more from host, none) and the steps they queued, and
where the device's pages are at the end of a step on average (free, spare, held by running
requests, evictable cached entries, snapshot tails); with ``--misses``, each continuing turn
served from nothing, with the KV and the device snapshot the cache held for it when it arrived
(a turn that arrived with both lost them while it queued). On
the pressure trace at 07227c8 it came close to the H200's replay: host regime 245,126 tokens
cached (H200 245,710), 92,575 from host (92,912), continuing turns served from device / tail
from host / more from host 8 / 20 / 109 (H200 9 / 23 / 103); device regime 140,263 (134,529).

    python benchmarks/micro/tap_split_sim.py --mix pressure --scale 0.1 \\
        --kv-tokens 11264 --mamba-slots 48 --chunk 8192
    python benchmarks/micro/tap_split_sim.py ... --ignore-echo   # what-if: no echo rule

With ``--host-mib N`` the cache has a host tier (its copies are skipped: hits are counted, not
checked) and the replay also reports what came from host. Every replay reports what the
device's pages held after each request: cached blocks, snapshot tails (private pages with the
partial last block of an unaligned snapshot), of those the superseded ones, and the blocks no
snapshot resumes through (dead KV: the device LRU gives them up first). ``--env HPC_NAME=VALUE``
sets any hybrid option (``HPC_CACHE_SPARE_PAGES=4``, ...).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import tempfile
import time
from typing import Callable
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "binding")]

from benchmarks.ab import CONT_KINDS, served_from  # noqa: E402
from benchmarks.workloads import (  # noqa: E402
    MIXES, TINY, clairvoyant_retention_bounds, clairvoyant_tap_bounds, mooncake, oracle_bounds,
)
from benchmarks.workloads.trace import simulate as stand_in_outputs  # noqa: E402
from sglang_harness import (  # noqa: E402
    PAGE, build_cache, make_server_args, sglang_init_next_round_input,
)

from hpc_radix.sglang_version import prefix_len, req_slots  # noqa: E402

from benchmarks.micro.census import SnapshotLog, census as missed_census  # noqa: E402


def _count_request(s: collections.Counter, prompt, req, cached: int) -> None:
    """A request admitted with ``cached`` tokens of its prompt (host hits loaded back)."""
    s["requests"] += 1
    s["prompt"] += len(prompt)
    s["cached"] += cached
    s["from host"] += req.host_hit_length or 0
    s["host hits"] += bool(req.host_hit_length)


def replay(hs, reqs, texts: dict, chunk: int) -> dict:
    """One request at a time; with several caches (``hs``: replicas), each request goes to the
    next (round robin: a session's turns alternate)."""
    from hpc_radix.index.tree import Node

    stats: dict = collections.defaultdict(collections.Counter)
    for i, r in enumerate(reqs):
        h = hs[i % len(hs)]
        prompt, output = texts[r.id]
        req = h.new_req(prompt, max_new_tokens=max(1, len(output)))
        s = stats[r.kind]
        read_back_first(h, req)
        _count_request(s, prompt, req, h.admit(req))
        n, pos = len(prompt), prefix_len(req)
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
        if h.cache.host is not None:
            h.cache.host.drain()
        settle_tier(h)
        pages = stats["device pages"]
        idx = h.cache.index
        pages["samples"] += 1
        pages["held"] += idx.sizes.device_pages
        pages["tails"] += idx.device.tail_pages
        pages["superseded tails"] += sum(1 for x in idx.snapshots()
                                         if x.superseded and x.tail_page >= 0)
        pages["dead"] += sum(1 for x in idx.lru.order() if isinstance(x, Node) and not x.live_below)
    for h in hs:
        h.check_idle()
    return stats


def settle_tier(h) -> None:
    """What reached host goes to the shared tier (--store) before the next request."""
    worker = h.cache.store_worker
    if worker is not None:
        for _ in range(2):
            h.cache._poll_host()
            worker.drain()


def read_back_first(h, req) -> None:
    """With a shared tier (--store): the request's match asks it, and it waits in the queue
    until the read-back is in, as a server lets it (the wait limit is not played)."""
    if h.cache.store_worker is None:
        return
    while True:                   # a scheduler round: SGLang matches it, the adder asks
        req.init_next_round_input(h.cache)
        if not h.cache.coalesce_wait(req):
            return
        settle_tier(h)


@contextlib.contextmanager
def copies_landing_late(tier, restore_steps: int, write_steps: int, now: Callable[[], int]):
    """Host restores land ``restore_steps`` steps after the one that launched them
    (``now()``), writes to host ``write_steps`` after the step that first looks at them (on
    the GPU a copy runs behind the pass in flight, and a write pins its pages until it has);
    all of them on exit."""
    from hpc_radix.binding.host import transfers as host_tier

    restore = tier.restore

    def delayed(*args, **kwargs):
        t = restore(*args, **kwargs)
        t.due = now() + restore_steps
        return t

    def done(t) -> bool:
        if not hasattr(t, "due"):
            t.due = now() + (write_steps if t.to_host else 0)
        return t.due <= now()
    with mock.patch.object(tier, "restore", delayed), mock.patch.object(host_tier.Transfer, "done", done):
        yield
    tier.drain()


def device_resume(index, prompt) -> tuple[int, int]:
    """(tokens of ``prompt`` whose KV blocks the index holds, frontier of the deepest snapshot
    it could resume from on device; 0 without one): a side-effect free lookup."""
    from hpc_radix.index.keys import PromptKey

    m = index.match(PromptKey(prompt))
    return m.matched_tokens, m.device.frontier if m.device is not None else 0


def replay_concurrent(h, reqs, texts: dict, inflight: int, max_running: int, chunk: int,
                      restore_steps: int = 0, with_census: bool = False,
                      step_ms: float = 0.0, write_steps: int = 0) -> dict:
    """The trace replayed as ``ab.py`` sends it (round by round, a request once those it
    depends on finished, at most ``inflight`` at once), scheduled as SGLang's scheduler does
    (the real PrefillAdder through the cache's adder hook, first come first served; a refusal
    for want of KV tokens stops admission until a running request finishes), one step at a
    time: a step admits and prefills a batch (a prompt longer than ``chunk`` in chunks, as
    SGLang's chunked prefill cuts it, within the step), and every request running before it
    decodes a token. Besides ``replay``'s counts: continuing turns by where their prefix came from, and
    the steps they waited in the queue. A host restore lands at the end of its step, or with
    ``restore_steps`` that many steps later (on the GPU a restore queues behind the pass in
    flight, and requests arrive meanwhile). With ``with_census``, where each missed token went
    (census.py), under "census". ``step_ms``: each step lasts at least this long, as a pass on
    the GPU does, so the shared tier's threads answer within as many steps as on a server."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    from hpc_radix.patches.scheduler_hooks import _around_add_one, _around_next_round

    stats: dict = collections.defaultdict(collections.Counter)
    arrived_with: dict = {}                 # continuing turn -> device_resume on arrival
    done: set = set()
    sent: dict = {}                         # request id -> step it arrived, and finished
    finished: dict = {}
    admitted: dict = {}                     # request id -> step admitted, and tokens served
    served: dict = {}
    step = 0
    log = SnapshotLog(lambda: step)
    tier = h.cache.host
    late = contextlib.ExitStack()
    if with_census:
        late.enter_context(log.recording(type(h.cache.index.lifecycle)))
    if tier is not None and (restore_steps or write_steps):
        late.enter_context(copies_landing_late(tier, restore_steps, write_steps, lambda: step))
    for rnd in sorted({r.round for r in reqs}):
        pending = [r for r in reqs if r.round == rnd]
        waiting: list = []                  # (trace request, Req, step it arrived)
        running: list = []                  # (trace request, Req, output tokens still to come)
        batch_full = False
        stalled = 0
        while pending or waiting or running:
            step_began = time.monotonic()
            for r in list(pending):
                if len(waiting) + len(running) >= inflight:
                    break
                if all(d in done for d in r.deps()):
                    prompt, output = texts[r.id]
                    waiting.append((r, h.new_req(prompt, max_new_tokens=max(1, len(output))), step))
                    sent[r.id] = step
                    if r.kind in CONT_KINDS:
                        arrived_with[r.id] = device_resume(h.cache.index, prompt)
                    pending.remove(r)
            batch = []
            if waiting and not batch_full:
                adder = PrefillAdder(PAGE, h.cache, h.allocator,
                                     ScheduleBatch(reqs=[req for _, req, _ in running]), 1.0,
                                     1 << 20, None, max_running_requests=max_running)
                for r, req, arrived in waiting:
                    if len(running) + len(adder.can_run_list) >= max_running:
                        break
                    _around_next_round(sglang_init_next_round_input, req, h.cache)   # as a server
                    res = _around_add_one(PrefillAdder.add_one_req, adder, req, False, None)
                    if any(x is req for x in adder.can_run_list):
                        batch.append((r, req, arrived))
                    elif (kv := req_slots(req)).mamba_pool_idx is not None:   # as SGLang reverts
                        h.req_pool.mamba_allocator.free(kv.mamba_pool_idx.unsqueeze(-1))   # one not taken
                        kv.mamba_pool_idx = None
                    if res != AddReqResult.CONTINUE:
                        batch_full = res == AddReqResult.NO_TOKEN
                        break
            stalled = (_admission_stall(h, waiting, batch_full, stalled)
                       if waiting and not batch and not running else 0)
            decoding = list(running)
            for r, req, arrived in batch:
                waiting.remove((r, req, arrived))
                if r.kind in CONT_KINDS:      # the adder loaded host hits back: the whole prefix
                    where = served_from({"cached": prefix_len(req),
                                         "cached_host": req.host_hit_length})
                    stats["served"][where] += 1
                    stats["queue steps"][where] += step - arrived
                    if where == "miss":
                        kv, frontier = arrived_with[r.id]
                        stats["misses"][f"{r.id}: {len(texts[r.id][0])} tokens, on arrival KV "
                                        f"{kv} and a snapshot at {frontier}, queued "
                                        f"{step - arrived} steps"] += 1
                served[r.id] = h.place(req)
                admitted[r.id] = step
                _count_request(stats[r.kind], texts[r.id][0], req, served[r.id])
            for r, req, _ in batch:                 # prepare_for_extend: every extend at once
                h._alloc(req, len(req.origin_input_ids))
            for r, req, _ in batch:       # a prompt longer than a chunk: chunked prefill
                h.prefill_rest(req, chunk)
                stats[r.kind]["passes"] += 1
                running.append((r, req, list(texts[r.id][1] or [TINY.im_end])))
            for entry in decoding:
                r, req, rest = entry
                h.decode(req, [rest.pop(0)])
                if not rest:
                    h.finish(req)
                    running.remove(entry)
                    done.add(r.id)
                    finished[r.id] = step + 0.5
                    batch_full = False
            if tier is not None:
                tier.poll()         # lands every copy done (restores due, unless late)
            census = stats["step pages"]       # where the device's pages are at the step's end
            census["steps"] += 1
            census["free"] += h.allocator.available_size() // PAGE
            census["spare"] += h.cache.pool.spares.held
            census["running requests"] += len(running)
            census["running requests' pages"] += sum(
                -(-(len(req.origin_input_ids) + len(req.output_ids)) // PAGE) for _, req, _ in running)
            census["evictable"] += len(h.cache.index.lru)
            census["snapshot tails"] += h.cache.index.device.tail_pages
            time.sleep(max(0.0, step_began + step_ms / 1e3 - time.monotonic()))
            step += 1
    late.close()
    h.check_idle()
    stats["device pages"]["samples"] = 0
    events = [(r.id, sent[r.id], finished.get(r.id), *texts[r.id]) for r in reqs]
    bounds, taps = oracle_bounds(events), clairvoyant_tap_bounds(events)
    retained = clairvoyant_retention_bounds(events, *memory_geometry(h))
    for r in reqs:
        stats[r.kind]["oracle"] += bounds[r.id]
        stats[r.kind]["bound a"] += taps[r.id]
        stats[r.kind]["bound b"] += retained[r.id]
    if with_census:
        stats["census"] = missed_census(reqs, texts, sent, admitted, finished, served, log)
    return stats


def _admission_stall(h, waiting, batch_full: bool, stalled: int) -> int:
    """Nothing runs and the queue's head was not admitted: SGLang (without HiCache) marks the
    batch full on a refusal for want of tokens and only a running request's end clears it,
    so the server would wait forever; a refusal of another kind that lasts as long is the
    same. Raises with the cache's accounting then; returns the steps stalled so far."""
    stalled += 1
    if batch_full or stalled > 100:
        r, req, _ = waiting[0]
        raise RuntimeError(
            f"admission stall: nothing runs and {r.id} ({len(req.origin_input_ids)} tokens, "
            f"prefix {prefix_len(req)}, host hit {req.host_hit_length}) is refused "
            f"({'for want of tokens' if batch_full else f'{stalled} steps'}); free "
            f"{h.allocator.available_size()} tokens, evictable {h.cache.evictable_size()}; "
            f"{h.cache.available_and_evictable_str()}")
    return stalled


def memory_geometry(h) -> tuple[tuple, int, int]:
    """((device KV bytes, device state bytes, host tier bytes), a 64-token block's KV bytes,
    a state's bytes) of the cache ``h`` replays through: bound (b)'s memory."""
    from hpc_radix.binding.host.layout import TierLayout

    layout = TierLayout(h.kv, h.req_pool.mamba_pool, PAGE)
    slots = h.req_pool.mamba_pool.size
    host = h.cache.host.memory.slabs.num_slabs * layout.slab_bytes if h.cache.host is not None else 0
    kv = h.allocator.size // PAGE * layout.block_bytes
    return (kv, slots * layout.image_bytes, host), layout.block_bytes, layout.image_bytes


@contextlib.contextmanager
def copies_skipped(launched: Callable[[], None] = lambda: None):
    """The host tier's and snapshots' copy kernels as no-ops (under the Triton interpreter a
    copy costs seconds): the index's decisions are counted, the bytes not moved; ``launched``
    is called for each launch skipped."""
    from hpc_radix.kernels import host_copy, snapshot_copy

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched()

    with mock.patch.object(host_copy, "_copy_items_kernel", NoLaunch()), \
            mock.patch.object(snapshot_copy, "_copy_state_slots_kernel", NoLaunch()):
        yield


def simulate(args, *, mix: str, scale: float, seed: int = 0, kv_tokens: int = 11264,
             mamba_slots: int = 48, chunk: int = 8192, ignore_echo: bool = False,
             in_pass: bool = False, host_mib: int = 0, env: dict | None = None,
             inflight: int = 1, restore_steps: int = 0, reqs: list | None = None,
             mamba_heads: int = 4, census: bool = False, replicas: int = 1,
             store_dir: str | None = None, step_ms: float = 0.0, write_steps: int = 0) -> dict:
    """Per request kind (and "all"): requests, prompt, cached, from host, passes, splits,
    split at SOURCE; and "device pages": sums over the requests of the pages held, tails and
    superseded tails after each (and "samples", their count). ``args``: SGLang ServerArgs (the
    harness's ``make_server_args``); ``env``: hybrid options as HPC_* variables; ``inflight``
    above 1: ``replay_concurrent`` with that many requests in flight; ``reqs``: a trace to
    replay instead of the mix; ``mamba_heads``: the state image's size (harness.make_pools);
    ``replicas``: caches the requests go to in turn (one at a time), each with ``host_mib``;
    ``store_dir``: a shared file tier for all of them."""
    from hpc_radix.binding.hints import ChatMLMarkers
    from hpc_radix.index import Match

    reqs = reqs if reqs is not None else MIXES[mix](seed, scale, TINY)
    texts = stand_in_outputs(reqs, TINY)
    longest = max(len(p) + len(o) for p, o in texts.values())
    os.environ.setdefault("TRITON_INTERPRET", "1")     # a host tier's kernels, on CPU
    if replicas > 1 and inflight > 1:
        raise ValueError("--replicas replays one request at a time (--inflight 1)")
    tier = {"HPC_CACHE_STORE_DIR": store_dir} if store_dir else {}
    hs = [build_cache(args, kv_pages=kv_tokens // PAGE, mamba_slots=mamba_slots, chunk=chunk,
                      reqs=args.max_running_requests or 8, max_context_len=longest + PAGE,
                      mamba_heads=mamba_heads, zero_split=in_pass,
                      markers=ChatMLMarkers.build(TINY.im_start, TINY.im_end, TINY.encode),
                      env={"HPC_HOST_CACHE_MIB": str(host_mib), **tier, **(env or {})})
          for _ in range(replicas)]
    h = hs[0]
    echoes = Match.echoes_output
    if ignore_echo:
        Match.echoes_output = property(lambda self: False)
    try:
        with copies_skipped():
            for x in hs:
                if x.cache.host is not None:
                    assert x.cache.host.memory.wait(120), "the host tier did not come online"
                    x.cache._poll_host()
            stats = (replay(hs, reqs, texts, chunk) if inflight <= 1 else
                     replay_concurrent(h, reqs, texts, inflight, args.max_running_requests or 8,
                                       chunk, restore_steps, census, step_ms, write_steps))
        counts = sum((collections.Counter(x.cache.report.counts) for x in hs), collections.Counter())
        for x in hs:
            if x.cache.store_worker is not None:
                counts.update({k: v for k, v in x.cache.store_worker.counters().items()
                               if k in ("store_states_read", "store_read_tokens", "store_probe_hits",
                                        "store_states_written", "store_blocks_written",
                                        "store_put_bytes", "store_evicted", "store_probes",
                                        "store_answered_ms", "store_read_ms", "store_get_bytes",
                                        "store_hit_answered_ms", "store_fill_ms")})
        call_times = "; ".join(x.cache.call_timer.take_summary() for x in hs)
    finally:
        Match.echoes_output = echoes
        for x in hs:
            if x.cache.host is not None:
                x.cache.release_host_resources()
    pages = stats.pop("device pages")
    extra = {k: stats.pop(k) for k in ("served", "queue steps", "step pages", "misses", "census")
             if k in stats}
    stats["all"] = sum(stats.values(), collections.Counter())
    stats["device pages"] = pages
    stats["cache counts"] = counts
    stats["cache call times"] = call_times
    stats.update(extra)
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
    ap.add_argument("--host-mib", type=int, default=0, help="host tier (copies skipped)")
    ap.add_argument("--inflight", type=int, default=1,
                    help="requests in flight: above 1, scheduled concurrently as SGLang does")
    ap.add_argument("--restore-steps", type=int, default=0,
                    help="with --inflight: a host restore lands this many steps after its own")
    ap.add_argument("--write-steps", type=int, default=0,
                    help="with --inflight: a write to host lands this many steps after the "
                         "step that first polls it (its pages stay pinned until then)")
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="with --inflight: each step lasts at least this long (a pass on the "
                         "GPU), so the shared tier answers within as many steps as on a server")
    ap.add_argument("--misses", action="store_true",
                    help="with --inflight: list the continuing turns served from nothing, with "
                    "what the device held for them when they arrived")
    ap.add_argument("--census", action="store_true",
                    help="with --inflight: where each missed token went (census.py), per request "
                         "with --misses")
    ap.add_argument("--env", action="append", default=[], metavar="HPC_NAME=VALUE",
                    help="a hybrid option as its environment variable (repeatable)")
    ap.add_argument("--mooncake", metavar="FILE",
                    help="replay this Mooncake trace file (workloads/mooncake.py) instead of --mix")
    ap.add_argument("--mode", default="exact", choices=mooncake.MODES, help="with --mooncake")
    ap.add_argument("--window", default="0,800", type=mooncake.Window.parse,
                    help="with --mooncake: START,COUNT lines of the file")
    ap.add_argument("--replicas", type=int, default=1,
                    help="caches the requests go to in turn (round robin), each with --host-mib")
    ap.add_argument("--store", action="store_true",
                    help="a shared file tier (in a temporary directory) under every cache")
    ap.add_argument("--mamba-heads", type=int, default=4,
                    help="state image size: 4 is about one KV block, 160 about 37 as in the "
                         "large16 model (then --host-mib N stands for N/4 GiB there)")
    a = ap.parse_args()
    reqs = mooncake.load(a.mooncake, a.window, mode=a.mode) if a.mooncake else None
    with tempfile.TemporaryDirectory(prefix="tap-split-sim-") as model_dir:
        args = make_server_args(model_dir, "--max-running-requests", str(a.max_running))
        store_dir = os.path.join(model_dir, "tier") if a.store else None
        stats = simulate(args, mix=a.mix, scale=a.scale, seed=a.seed, kv_tokens=a.kv_tokens,
                         mamba_slots=a.mamba_slots, chunk=a.chunk, ignore_echo=a.ignore_echo,
                         in_pass=a.zero_split, host_mib=a.host_mib,
                         env=dict(kv.split("=", 1) for kv in a.env), inflight=a.inflight,
                         restore_steps=a.restore_steps, write_steps=a.write_steps, reqs=reqs,
                         mamba_heads=a.mamba_heads,
                         census=a.census, replicas=a.replicas, store_dir=store_dir,
                         step_ms=a.step_ms)
    trace = f"mooncake {a.mode} {a.window}" if a.mooncake else f"mix {a.mix} x{a.scale}"
    print(f"{trace}, {stats['all']['requests']} requests; KV {a.kv_tokens} tokens, "
          f"{a.mamba_slots} mamba slots, chunk {a.chunk}"
          f"{', echo rule ignored' if a.ignore_echo else ''}"
          f"{', taps in the pass (zero-split)' if a.zero_split else ', split fallback'}"
          + (f"; {a.replicas} caches, round robin" if a.replicas > 1 else "")
          + ("; a shared file tier" if a.store else ""))
    pages = stats.pop("device pages")
    counts = stats.pop("cache counts")
    call_times = stats.pop("cache call times")
    served, queued = stats.pop("served", None), stats.pop("queue steps", None)
    misses, census = stats.pop("misses", None), stats.pop("step pages", None)
    missed = stats.pop("census", None)
    header = (f"{'kind':<10} {'requests':>8} {'prompt tok':>11} {'cached tok':>11} "
              f"{'from host':>10} {'passes':>7} {'splits':>7} {'oracle':>10} {'of oracle':>9} "
              f"{'bound (a)':>10} {'of (a)':>7} {'bound (b)':>10} {'of (b)':>7}")
    print(header + "\n" + "-" * len(header))
    for kind in sorted(stats, key=lambda k: (k == "all", k)):
        s = stats[kind]
        share = f"{100 * s['cached'] / s['oracle']:.1f} %" if s["oracle"] else "-"
        of_a, of_b = (f"{100 * s['cached'] / s[b]:.1f} %" if s[b] else "-" for b in ("bound a", "bound b"))
        print(f"{kind:<10} {s['requests']:>8} {s['prompt']:>11,} {s['cached']:>11,} "
              f"{s['from host']:>10,} {s['passes']:>7} {s['splits']:>7} {s['oracle']:>10,} {share:>9} "
              f"{s['bound a']:>10,} {of_a:>7} {s['bound b']:>10,} {of_b:>7}")
    print(f"host hits (requests served partly from host): {stats['all']['host hits']}; restores "
          f"dropped {counts['restores_dropped']}, run beside the pass in flight (with "
          f"--host-restore-overlap on) {counts['restores_overlapped']}; prefetches for a refused "
          f"head (--host-prefetch on) {counts['prefetches']}, {counts['prefetched_blocks']} blocks")
    if served:
        print("continuing turns by where their prefix came from (turns, mean steps queued): " + ", ".join(
            f"{k} {served[k]} ({queued[k] / served[k]:.1f})" for k in ("device", "host tail", "host", "miss")
            if served[k]))
    if misses and a.misses:
        print("continuing turns served from nothing (what the device held for them when they "
              "arrived):\n  " + "\n  ".join(misses))
    if missed:
        tokens, requests, lines = missed
        print(f"missed tokens (oracle - served) by what became of the deepest snapshot on the "
              f"shared prefix: {sum(tokens.values()):,} tokens, {sum(requests.values())} requests")
        for fate, n in tokens.most_common():
            print(f"  {n:>10,} tokens  {requests.get(fate, 0):>5} requests  {fate}")
        if a.misses:
            print("  " + "\n  ".join(lines))
    if census:
        print("device pages at the end of a step, mean: " + ", ".join(
            f"{k} {v / census['steps']:.1f}" for k, v in census.items() if k != "steps")
            + f" (of {a.kv_tokens // PAGE}; a running request's pages are its whole sequence's, a "
            "prefix it shares counted again)")
    n = pages["samples"]
    if n:
        print(f"device pages held after a request, mean: {pages['held'] / n:.1f} of "
              f"{a.kv_tokens // PAGE}; snapshot tails {pages['tails'] / n:.1f}, of them superseded "
              f"{pages['superseded tails'] / n:.1f}; blocks no snapshot needs {pages['dead'] / n:.1f}")
    print("cache counters: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if v))
    print(f"the cache's calls on this CPU (copies skipped; HPC_CACHE_PROFILE=1 adds a profile): {call_times}")
    print("splits by tap source: " + ", ".join(
        f"{k[len('split at '):]} {v}" for k, v in sorted(stats["all"].items())
        if k.startswith("split at ")))


if __name__ == "__main__":
    main()
