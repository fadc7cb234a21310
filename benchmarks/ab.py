#!/usr/bin/env python3
"""A/B benchmark: the same model and traffic served with each prefix cache in turn.

Arms (ARMS): stock SGLang 0.5.17 with extra_buffer, stock + hierarchical cache
(HiCache, same host bytes as ours), hpc_radix (--radix-cache hybrid) and no cache.
Regimes (REGIMES) are rows of the report; each replays one deterministic trace
(benchmarks/workloads) with its own server flags. A server starts once per arm for
each run of consecutive regimes whose command line is identical; the cache is
flushed (/flush_cache) between regimes on one server.

    python benchmarks/ab.py --model tiny-qwen35 --out ab-out --scale 0.25 \\
        --arms stock,hicache,hybrid,nocache --regimes ample,long
    python benchmarks/ab.py --model DIR --dry-run          # commands + request counts
    python benchmarks/ab.py --report-from DIR [DIR ...] --out DIR   # report from saved results
    python benchmarks/ab.py --replicas 2 --route rr --arms hybridtier,hybrid,hicachel3 ...

With ``--replicas N`` every arm runs as N servers on the GPU(s), each with 1/N of the device
memory fraction and of the host bytes, and each request goes to one of them by ``--route``
(rr: the next server, so a session's turns alternate; sticky: by session, spilling to the
least loaded when its server is busy; least-loaded); ``--crash`` kills one server (SIGKILL)
halfway through the trace and starts it again.

Replay is closed-loop and lock-step (see workloads/trace.py): token-level streaming
/generate requests with input_ids, ignore_eos and fixed max_new_tokens, greedy by
default. TTFT = time to the first streamed chunk carrying output ids; reuse =
meta_info.cached_tokens. Any failed request makes its (regime, arm) invalid.
Writes OUT/report.md, OUT/summary.json, OUT/plots/*.png, OUT/results/*.json
(one per regime and arm, written as soon as it is done), OUT/traces/, OUT/logs/.
Needs only the standard library and `requests` (matplotlib optional, for plots).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gzip
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.workloads import (  # noqa: E402
    MIXES, TINY, clairvoyant_retention_bounds, clairvoyant_tap_bounds, describe, dump, load, mooncake,
    oracle_bounds, resolve,
)
from benchmarks.workloads.trace import prompt_digest  # noqa: E402

# --------------------------------------------------------------------------- tables
# Flags every server gets, then the model's, then the regime's, then the arm's.
BASE_ARGS = ["--attention-backend", "triton", "--cuda-graph-max-bs", "8",
             "--max-running-requests", "8"]
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
STACK_RATE_HZ = 250     # --py-spy samples per second and thread
MODEL_ARGS = {
    "tiny": ["--mem-fraction-static", "0.15"],  # tiny_qwen.py OUT
    "large": ["--load-format", "dummy", "--mem-fraction-static", "0.6"],  # tiny_qwen.py OUT --large
}
# {hicache} expands to the regime's HiCache host flags; {host_mib} to the hybrid host tier.
ARMS = {
    "stock": ["--mamba-radix-cache-strategy", "extra_buffer"],
    "hicache": ["--mamba-radix-cache-strategy", "extra_buffer", "--enable-hierarchical-cache",
                "{hicache}"],
    "hybrid": ["--radix-cache", "hybrid", "--mamba-radix-cache-strategy", "extra_buffer",
               "--host-cache-mib", "{host_mib}"],
    "nocache": ["--disable-radix-cache"],
    # stock with the hybrid cache's 64-token pages: SGLang's admission rounds every request up
    # to whole pages and reserves one more, which this separates from the cache's own cost
    "stock64": ["--mamba-radix-cache-strategy", "extra_buffer", "--page-size", "64"],
    # the hybrid cache without a host tier (the no-regression check of the ample regime)
    "devonly": ["--radix-cache", "hybrid", "--mamba-radix-cache-strategy", "extra_buffer",
                "--host-cache-mib", "0"],
    # the hybrid cache with a 64 MiB host tier: beside hybrid and devonly, whether what the
    # host tier costs while nothing is written grows with the pinned bytes
    "hostsmall": ["--radix-cache", "hybrid", "--mamba-radix-cache-strategy", "extra_buffer",
                  "--host-cache-mib", "64"],
    # the hybrid cache pinning its host tier only once the device cache fills (beside hybrid
    # and devonly: what pinned memory costs while nothing is written)
    "lazypin": ["--radix-cache", "hybrid", "--mamba-radix-cache-strategy", "extra_buffer",
                "--host-cache-mib", "{host_mib}", "--host-cache-pin", "on-demand"],
    # the hybrid cache holding 4 spare pages with its host tier, not 16: the device pages the
    # spares keep from cached content against the plain reads a restore then waits for
    "spares4": ["--radix-cache", "hybrid", "--mamba-radix-cache-strategy", "extra_buffer",
                "--host-cache-mib", "{host_mib}", "--cache-spare-pages", "4"],
    # the hybrid cache with its split fallback: exact taps end the prefill chunk
    "split": ["--radix-cache", "hybrid", "--mamba-radix-cache-strategy", "extra_buffer",
              "--host-cache-mib", "{host_mib}", "--cache-zero-split", "off"],
    # the hybrid cache reading every id plainly (waiting for the pass in flight)
    "plainreads": ["--radix-cache", "hybrid", "--mamba-radix-cache-strategy", "extra_buffer",
                   "--host-cache-mib", "{host_mib}", "--cache-settled-reads", "off"],
    # the hybrid cache with in-flight coalescing of shared new prefixes (§12.2)
    "coalesce": ["--radix-cache", "hybrid", "--mamba-radix-cache-strategy", "extra_buffer",
                 "--host-cache-mib", "{host_mib}", "--cache-coalesce", "on"],
    # the hybrid cache starting every host restore after the pass in flight (the default runs
    # restores into spares taken before the last batch build beside it)
    "nooverlap": ["--radix-cache", "hybrid", "--mamba-radix-cache-strategy", "extra_buffer",
                  "--host-cache-mib", "{host_mib}", "--host-restore-overlap", "off"],
    # the hybrid cache prefetching the host-only blocks of a head refused for want of pages
    "prefetch": ["--radix-cache", "hybrid", "--mamba-radix-cache-strategy", "extra_buffer",
                 "--host-cache-mib", "{host_mib}", "--host-prefetch", "on"],
    # the hybrid cache moving host-tier bytes by the Triton kernel (SMs) instead of the copy
    # engines (the default where the driver batches copies)
    "copykernel": ["--radix-cache", "hybrid", "--mamba-radix-cache-strategy", "extra_buffer",
                   "--host-cache-mib", "{host_mib}", "--host-copy", "kernel"],
    # the hybrid cache making a pass wait at each layer for that layer's restored bytes (the
    # default waits for all of a restore before the pass starts)
    "layerwait": ["--radix-cache", "hybrid", "--mamba-radix-cache-strategy", "extra_buffer",
                  "--host-cache-mib", "{host_mib}", "--host-restore-wait", "layer"],
    # the hybrid cache with extra_buffer tracking every 64 tokens in decode: under speculative
    # decoding with overlap scheduling a finished request's endpoint is the state tracked last
    "track64": ["--radix-cache", "hybrid", "--mamba-radix-cache-strategy", "extra_buffer",
                "--host-cache-mib", "{host_mib}", "--mamba-track-interval", "64"],
    # the hybrid cache without the flags of --speculative: in the same run as the speculative
    # arms, what speculative decoding costs the cache
    "nospec": ["--radix-cache", "hybrid", "--mamba-radix-cache-strategy", "extra_buffer",
               "--host-cache-mib", "{host_mib}"],
    # the hybrid cache with a shared file tier ({store_dir}: a fresh directory per run, shared
    # by the run's replicas)
    "hybridtier": ["--radix-cache", "hybrid", "--mamba-radix-cache-strategy", "extra_buffer",
                   "--host-cache-mib", "{host_mib}", "--cache-store-dir", "{store_dir}"],
    # the same, its objects written by threads of the scheduler's process, not by the tier's
    # writer process (--cache-store-writer threads, as every release before it)
    "tierthreads": ["--radix-cache", "hybrid", "--mamba-radix-cache-strategy", "extra_buffer",
                    "--host-cache-mib", "{host_mib}", "--cache-store-dir", "{store_dir}",
                    "--cache-store-writer", "threads"],
    # HiCache with its L3 file backend in the same kind of directory (STORE_ENV names it)
    "hicachel3": ["--mamba-radix-cache-strategy", "extra_buffer", "--enable-hierarchical-cache",
                  "{hicache}", "--hicache-storage-backend", "file"],
}
# the arms whose servers get a store directory, and how they are told it
STORE_ENV = {"hicachel3": "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"}
STORE_ARMS = ("hybridtier", "tierthreads", *STORE_ENV)
# --store-mib: the hybrid's flag budgets the shared directory; HiCache's LRU file evictor counts
# what its own server wrote, so each of N replicas gets 1/N (in bytes)
STORE_BUDGET_FLAG = {"hybridtier": "--cache-store-mib", "tierthreads": "--cache-store-mib"}
STORE_BUDGET_ENV = {"hicachel3": "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"}
NO_SPECULATION_ARMS = ("nospec",)
ARM_ORDER = list(ARMS)  # the report's order
HYBRID_ARMS = ("hybrid", "split", "plainreads", "coalesce", "lazypin", "spares4", "nooverlap", "prefetch",
               "copykernel", "layerwait", "track64", "nospec", "hybridtier", "tierthreads")
DEFAULT_ARMS = ["stock", "hicache", "hybrid", "nocache"]   # the others: on request
# mix: workload (workloads.MIXES); server: flags for all arms ({device_tokens}: a quarter of
# the trace's working set); hicache: HiCache host flags (None: no host tier, HiCache n/a);
# host_mib: hybrid host tier in MiB (None: the bytes HiCache allocated in this regime).
_PRESSURE = ["--max-total-tokens", "{device_tokens}", "--max-mamba-cache-size", "48"]
_AMPLE = dict(server=[], hicache=["--hicache-size", "2"], host_mib=None)
REGIMES = {
    "ample": dict(_AMPLE, mix="ample",
                  about="ample memory: agentic sessions + multi-turn chat + preamble fan-out"),
    "concurrency": dict(_AMPLE, mix="concurrency",
                        about="8 in flight; each round opens a new preamble shared by 8 "
                              "simultaneous requests"),
    "alignment": dict(_AMPLE, mix="alignment",
                      about="preambles of 64k+-1 / 256k+61 tokens, ChatML specials"),
    "plain": dict(_AMPLE, mix="plain",
                  about="ample memory: agentic sessions + chat with no chat special tokens"),
    "long": dict(_AMPLE, mix="long",
                 about="agent contexts growing to 64k-128k tokens (x scale), with compaction"),
    "long-host": dict(mix="long-host", server=_PRESSURE, hicache=["--hicache-ratio", "2"],
                      host_mib=None,
                      about="four agent contexts growing to 64k-128k tokens (x scale) in turn; "
                            "host pressure: host tier (same bytes for HiCache and hybrid) < "
                            "working set"),
    "device": dict(mix="pressure", server=_PRESSURE, hicache=None, host_mib=0,
                   about="device pressure, no host tier: working set >= 3x device cache"),
    "agent-device": dict(mix="agentic", server=["--max-total-tokens", "{device_tokens}",
                                                 "--max-mamba-cache-size", "40"],
                         hicache=None, host_mib=0,
                         about="coding agents alone (shared preambles, tool loops, subagents) under "
                               "device pressure, no host tier"),
    "host": dict(mix="pressure", server=_PRESSURE, hicache=["--hicache-ratio", "2"], host_mib=None,
                 about="host pressure: host tier (same bytes for HiCache and hybrid) < working set"),
    "host-tight": dict(mix="pressure", server=_PRESSURE, hicache=["--hicache-ratio", "1"], host_mib=None,
                       about="working set >= 2x the host tier (HiCache's host KV = the device pool)"),
}
# Mooncake's conversation trace (--mooncake FILE, workloads/mooncake.py): a window of a
# production chat service, its working set ~8x the device pool; HiCache --hicache-size 48.
_MOONCAKE = ["--max-total-tokens", "262144", "--max-mamba-cache-size", "64",
             "--chunked-prefill-size", "8192"]
# mooncake-*-24: the same with half the host (the working set >= 4x the host tier)
for _mode in ("exact", "blocks"):
    for _gb, _suffix in (("48", ""), ("24", "-24")):
        REGIMES[f"mooncake-{_mode}{_suffix}"] = dict(
            mix=f"mooncake-{_mode}", mooncake=_mode, server=_MOONCAKE, hicache=["--hicache-size", _gb],
            host_mib=None, about=f"Mooncake conversation trace replayed {_mode} (--mooncake), host "
                                 f"tier of HiCache's {_gb} GB")
DEFAULT_REGIMES = [r for r, conf in REGIMES.items() if "mooncake" not in conf]
REPEAT = "#"   # regime "host#2" (--replays 2): host's trace again, after a flush, on the same server
START = "@"    # regime "host@2" (--starts 2): host's trace on every arm's second server start


def base_regime(reg: str) -> str:
    return reg.split(START, 1)[0].split(REPEAT, 1)[0]


def started(reg: str, k: int) -> str:
    """The label of regime ``reg`` on the ``k``-th server start (the first keeps its name)."""
    return f"{reg}{START}{k}" if k > 1 else reg


def all_starts(regimes: list[str], starts: int, first: int = 1) -> list[str]:
    """Every regime's label on every server start (``first`` .. ``first + starts - 1``)."""
    return [started(reg, k) for k in range(first, first + starts) for reg in regimes]


CONT_KINDS = ("continue", "compact", "retry", "resend")  # "continuing turns"
NEW_LONG_MIN = 1024  # a "new long prompt": kind new with at least this many tokens
REPREFILL_MIN_ORACLE = 256  # whole-prompt re-prefill: cached == 0 although oracle >= this


# --------------------------------------------------------------------------- plan
@functools.lru_cache(maxsize=None)
def model_config(model: str | None) -> dict | None:
    """The model directory's config.json (None without one); read once."""
    if not model:
        return None
    try:
        with open(os.path.join(model, "config.json")) as f:
            return json.load(f)
    except OSError:
        return None


def model_kind(model: str, given: str | None) -> str:
    if given:
        return given
    c = model_config(model)
    return "large" if c and c.get("vocab_size", 0) > 4096 else "tiny"


def context_len(model: str, kind: str) -> int:
    """The model's max_position_embeddings (RoPE table size): prompts + outputs must fit."""
    try:
        return int(model_config(model)["max_position_embeddings"])
    except (TypeError, KeyError, ValueError):
        return 131072 if kind == "large" else 32768


def state_bytes(model: str | None) -> tuple[int, int] | None:
    """(KV bytes per token, recurrent-state bytes per slot) from config.json, bf16 KV, fp32 SSM."""
    c = model_config(model)
    if c is None:
        return None
    kinds = c.get("layer_types", [])
    attn, gdn = kinds.count("full_attention"), kinds.count("linear_attention")
    kv = attn * 2 * c["num_key_value_heads"] * c["head_dim"] * 2
    kd = c["linear_key_head_dim"] * c["linear_num_key_heads"]
    vd = c["linear_value_head_dim"] * c["linear_num_value_heads"]
    ssm = c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"] * 4
    conv = (2 * kd + vd) * (c["linear_conv_kernel_dim"] - 1) * 2
    return kv, gdn * (ssm + conv)


def _flag(args: list, name: str):
    """The value of the last ``name`` in ``args`` (SGLang's parser keeps the last, so
    ``--server-args`` can override a regime's own flag), or None."""
    values = [args[i + 1] for i, x in enumerate(args[:-1]) if x == name]
    return values[-1] if values else None


def build_traces(a, regimes: list[str]) -> dict:
    """Write each regime's trace (one file per mix), load it back, and describe it."""
    os.makedirs(os.path.join(a.out, "traces"), exist_ok=True)
    info, by_path = {}, {}
    for reg in regimes:
        conf = REGIMES.get(base_regime(reg), {})
        if base_regime(reg) == "trace":
            path = a.trace
        elif "mooncake" in conf:
            w = a.mooncake_window
            path = os.path.join(a.out, "traces", f"{conf['mix']}-{w.start}-{w.count}.jsonl")
            if path not in by_path:
                dump(mooncake.load(a.mooncake, w, mode=conf["mooncake"],
                                   block_tokens_per_hash=a.mooncake_block_tokens,
                                   max_new_tokens=a.mooncake_max_new,
                                   by_timestamp=a.mooncake_speedup is not None,
                                   speedup=a.mooncake_speedup or 1.0), path)
        else:
            mix = REGIMES[base_regime(reg)]["mix"]
            path = os.path.join(a.out, "traces", f"{mix}-seed{a.seed}-x{a.scale:g}.jsonl")
            if path not in by_path:
                dump(MIXES[mix](a.seed, a.scale, TINY), path)
        if path not in by_path:
            reqs = load(path)
            if a.crash:
                reqs = split_single_round(reqs)
            by_path[path] = {"path": path, "reqs": reqs, "stats": describe(reqs)}
        info[reg] = by_path[path]           # regimes sharing a mix share one trace
    return info


def split_single_round(reqs: list) -> list:
    """A one-round trace (Mooncake's) as two rounds at its middle request, so that ``--crash``
    kills the server halfway, between them, with nothing in flight."""
    if len({r.round for r in reqs}) > 1:
        return reqs
    half = len(reqs) // 2
    t0 = min((r.t for r in reqs[half:]), default=0.0)
    return reqs[:half] + [dataclasses.replace(r, round=r.round + 1, t=r.t - t0) for r in reqs[half:]]


def device_tokens(stats: dict) -> int:
    need = max(stats["working_set"] // 4, int(stats["max_request"] * 1.25) + 256)
    return int(math.ceil(need / 1024) * 1024)


def regime_conf(reg: str) -> dict:
    return REGIMES.get(base_regime(reg)) or dict(REGIMES["ample"], mix="trace", about="custom trace (ample flags)")


def host_mib_arg(text: str) -> dict:
    """``MIB`` (every regime) or ``REGIME=MIB,...`` -> {regime or "*": MiB}."""
    out = {}
    for part in text.split(","):
        reg, _, mib = part.rpartition("=")
        if reg and reg not in REGIMES and reg != "trace":
            raise argparse.ArgumentTypeError(f"{reg!r} is not a regime ({', '.join(REGIMES)})")
        if not mib.strip().isdigit():
            raise argparse.ArgumentTypeError(f"{part!r}: MiB must be a whole number")
        out[reg or "*"] = int(mib)
    return out


def host_mib_for(a, reg: str, measured: dict, dev_tokens: int | None) -> tuple[int, str]:
    conf = regime_conf(reg)
    if conf["host_mib"] is not None:
        return conf["host_mib"], "regime table"
    base = base_regime(reg)
    given = a.host_mib.get(base, a.host_mib.get("*")) if a.host_mib else None
    if given is not None:
        return given, "--host-mib"
    if base in measured:
        return measured[base], "measured: HiCache's allocation in this regime"
    size = _flag(conf["hicache"], "--hicache-size")
    if size is not None:
        return int(float(size) * 1e9 / 2**20), "computed from --hicache-size"
    ratio, geo = float(_flag(conf["hicache"], "--hicache-ratio") or 2), state_bytes(a.model)
    if geo and dev_tokens:
        slots = int(_flag(conf["server"], "--max-mamba-cache-size") or 48)
        return int(ratio * (dev_tokens * geo[0] + slots * geo[1]) / 2**20), \
            "estimated from config.json (HiCache not run)"
    return 1024, "default guess (HiCache not run, no config.json)"


def server_cmd(a, arm: str, reg: str, kind: str, host_mib: int, dev_tokens: int | None) -> list[str]:
    conf = regime_conf(reg)
    args = []
    for x in BASE_ARGS + MODEL_ARGS[kind] + conf["server"] + ARMS[arm]:
        if x == "{hicache}":
            args += conf["hicache"]
        else:
            args.append(x.format(device_tokens=dev_tokens, host_mib=host_mib,
                                 store_dir=store_dir(a, arm, reg)))
    args += shlex.split(a.server_args or "")
    if arm not in NO_SPECULATION_ARMS:
        args += shlex.split(a.speculative or "")
    if a.store_mib and arm in STORE_BUDGET_FLAG:
        args += [STORE_BUDGET_FLAG[arm], str(a.store_mib)]
    args += shlex.split(a.arm_args.get(arm, ""))
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", a.model,
            "--host", "127.0.0.1", "--port", str(a.port), *args]


def store_dir(a, arm: str, reg: str) -> str:
    """The shared-tier directory of one arm's run of a regime (made empty when it starts)."""
    return os.path.abspath(os.path.join(a.out, "store", f"{arm}-{reg}"))


def replica_cmd(cmd: list[str], n: int, i: int, port: int) -> list[str]:
    """Server ``i`` of ``n`` sharing the machine: its own port, 1/n of the token pool, the
    mamba slots and the host bytes (--host-cache-mib, --hicache-size), so that n servers hold
    what one does. --mem-fraction-static stays: SGLang takes it of the whole GPU with every
    other process's memory counted as used, and each replica holds all of the weights, so a
    1/n fraction leaves a large model no room; the capped pools carry the split instead."""
    out, shares = list(cmd), {"--max-total-tokens": int, "--max-mamba-cache-size": int,
                              "--host-cache-mib": int, "--hicache-size": float}
    for k, x in enumerate(out[:-1]):
        if x == "--port":
            out[k + 1] = str(port)
        elif x in shares and n > 1:
            value = shares[x](out[k + 1]) / n
            out[k + 1] = f"{value:.4g}" if shares[x] is float else str(int(value))
    return out


class Router:
    """Which replica serves each request (``--route``); counts each one's requests in flight."""

    def __init__(self, n: int, policy: str, max_inflight: int):
        self.n, self.policy = n, policy
        self.busy_at = max(1, max_inflight // n)       # sticky spills beyond this
        self.inflight = [0] * n
        self.down: set[int] = set()
        self._next = 0

    def pick(self, req) -> int:
        up = [i for i in range(self.n) if i not in self.down]
        if self.policy == "rr":
            while self._next % self.n not in up:
                self._next += 1
            i, self._next = self._next % self.n, self._next + 1
        else:
            i = zlib.crc32(str(req.session).encode()) % self.n if self.policy == "sticky" else -1
            if i not in up or self.inflight[i] >= self.busy_at:
                i = min(up, key=lambda k: self.inflight[k])
        self.inflight[i] += 1
        return i

    def done(self, i: int) -> None:
        self.inflight[i] -= 1


def _arm_rank(arm: str) -> int:
    return ARM_ORDER.index(arm) if arm in ARM_ORDER else len(ARM_ORDER)


@contextlib.contextmanager
def stack_samples(exe: str | None, server: "Server", path: str):
    """py-spy samples of the server's processes (every thread, idle ones too) while the body
    runs, written to ``path`` as raw collapsed stacks; nothing without ``exe``."""
    if not exe:
        yield
        return
    cmd = [exe, "record", "--pid", str(server.proc.pid), "--subprocesses", "--idle", "--threads",
           "--nonblocking", "--rate", str(STACK_RATE_HZ), "--format", "raw", "-o", path]
    with open(path + ".log", "w") as log:
        sampler = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield
        finally:
            sampler.send_signal(signal.SIGINT)      # py-spy writes its file on SIGINT
            try:
                sampler.wait(60)
            except subprocess.TimeoutExpired:
                sampler.kill()


def applicable(arm: str, reg: str) -> bool:
    return not (arm == "hicache" and regime_conf(reg)["hicache"] is None)


# --------------------------------------------------------------------------- server
class Server:
    def __init__(self, cmd: list[str], log_path: str, port: int, env: dict | None = None):
        self.cmd, self.log_path, self.url = cmd, log_path, f"http://127.0.0.1:{port}"
        self.env = {**SERVER_ENV, **(env or {})}
        self.proc = None

    def start(self, timeout: float) -> float:
        self.launch()
        return self.wait_ready(timeout)

    def launch(self) -> None:
        self.t0 = time.time()
        self.log = open(self.log_path, "w")
        self.log.write("launch: " + shlex.join(self.cmd) + "\n")
        self.log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **self.env},
                                     cwd=os.path.dirname(os.path.abspath(self.log_path)))

    def wait_ready(self, timeout: float) -> float:
        import requests
        t0 = self.t0
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode} (log {self.log_path})")
            if time.time() - t0 > timeout:
                raise RuntimeError(f"server not ready after {timeout:.0f} s (log {self.log_path})")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.time() - t0
            except requests.RequestException:
                pass
            time.sleep(1)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def warmup(self) -> None:
        """Two identical requests (JIT for prefill, decode and a cache hit), then two bursts of
        eight concurrent requests of 100-2,900 tokens, the second continuing the first (batched
        prefills with and without a prefix, decode at every batch size), then a flush: kernels
        that compile on their first shape do it here, not in the first arm's measured replay."""
        from concurrent.futures import ThreadPoolExecutor

        ids = [(i * 7919) % 188 for i in range(700)]
        for _ in range(2):
            self.generate(ids)
        burst = [[(i * 7919 + k * 31) % 188 for i in range(100 + k * 400)] for k in range(8)]
        with ThreadPoolExecutor(len(burst)) as pool:
            for extra in (0, 50):
                list(pool.map(self.generate, [b + b[:extra] for b in burst]))
        if not self.flush(required=False):
            print("   warm-up: /flush_cache kept refusing; its requests stay cached (their tokens are "
                  "not the traces')", flush=True)

    def generate(self, ids: list[int], max_new_tokens: int = 8) -> None:
        import requests
        requests.post(self.url + "/generate", timeout=600, json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True,
                                                  "temperature": 0}}).raise_for_status()

    def flush(self, required: bool = True) -> bool:
        """/flush_cache until it succeeds. HiCache with an L3 backend (SGLang 0.5.17) submits the
        backups queued by the last finished requests only with its next batch, and refuses to
        flush until they are done: a one-token request now and then may let them go (it did
        not on an H100: the warm-up then goes on after 10 s, its requests cached)."""
        import requests
        for k in range(30 if required else 10):
            r = requests.post(self.url + "/flush_cache", timeout=60)
            if r.status_code == 200:
                return True
            if k % 5 == 4:
                self.generate([1], max_new_tokens=1)
            time.sleep(1)
        if required:
            raise RuntimeError(f"/flush_cache kept failing: {r.status_code} {r.text[:200]}")
        return False

    def log_text(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        if getattr(self, "log", None):
            self.log.close()

    def kill(self) -> None:
        """SIGKILL to all of the server's processes: a crash (nothing is saved)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self.log.close()


class Replicas:
    """The ``--replicas`` servers of one arm, started together (one is a plain server run)."""

    def __init__(self, cmd: list[str], log_path: str, port: int, n: int, env: dict | None = None):
        stem = log_path[:-len(".log")]
        self.servers = [Server(replica_cmd(cmd, n, i, port + i),
                               log_path if n == 1 else f"{stem}.r{i}.log", port + i, env)
                        for i in range(n)]
        self.retired: list[Server] = []        # crashed servers, for their logs
        self.urls = [s.url for s in self.servers]

    @property
    def proc(self):
        return self.servers[0].proc

    def start(self, timeout: float) -> float:
        for s in self.servers:
            s.launch()
        return max(s.wait_ready(timeout) for s in self.servers)

    def alive(self) -> bool:
        return all(s.alive() for s in self.servers)

    def warmup(self) -> None:
        for s in self.servers:
            s.warmup()

    def flush(self) -> None:
        for s in self.servers:
            s.flush()

    def log_text(self) -> str:
        return "".join(s.log_text() for s in self.retired + self.servers)

    def mark(self) -> list[int]:
        """Where each server's log is now (``log_since``)."""
        return [len(s.log_text()) for s in self.servers]

    def log_since(self, mark: list[int]) -> str:
        return "".join(s.log_text()[m:] for s, m in zip(self.servers, mark))

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def crash(self, i: int, timeout: float) -> float:
        """SIGKILL server ``i`` and start it again with the same flags; seconds until ready."""
        old = self.servers[i]
        old.kill()
        self.retired.append(old)
        new = self.servers[i] = Server(old.cmd, old.log_path[:-len(".log")] + ".restart.log",
                                       int(old.url.rsplit(":", 1)[1]), old.env)
        return new.start(timeout)


def crash_halfway(a, server: Replicas, res: dict):
    """``--crash``: before the middle round, the last server is killed and started again."""
    if not a.crash:
        return None

    def between(k: int, rounds: list, router) -> None:
        if k == len(rounds) // 2:
            i = len(server.servers) - 1
            print(f"   crash: SIGKILL to server {i} before round {k} of {len(rounds)}", flush=True)
            res["crash"] = {"round": rounds[k], "server": i,
                            "restart_s": server.crash(i, a.server_timeout)}
    return between


def hicache_host_mib(log: str, model: str | None = None) -> int | None:
    """Host MiB HiCache allocated (KV + Mamba pools), from its log lines (GB with 2 decimals;
    the KV pool exactly, from its token count, when config.json is readable)."""
    total, geo = 0.0, state_bytes(model)
    for line in re.findall(r"Allocating .*? GB host memory.*", log):
        tokens = re.search(r"KV host pool: (\d+) tokens", line)
        if tokens and geo:
            total += int(tokens.group(1)) * geo[0]
        else:
            total += float(re.search(r"(\d+\.\d+) GB host memory", line).group(1)) * 1e9
    return int(total / 2**20) if total else None


# --------------------------------------------------------------------------- replay
_local = threading.local()


def _record(req, **fields) -> dict:
    """A request's result record: who it is, then ``fields``."""
    return {"id": req.id, "session": req.session, "round": req.round, "kind": req.kind,
            "tag": req.tag, **fields}


def send(url: str, req, prompt: list[int], a, epoch: float) -> dict:
    """One streaming /generate request; returns its record (status ok | aborted | failed)."""
    import requests
    sess = getattr(_local, "session", None) or requests.Session()
    _local.session = sess
    sp = {"max_new_tokens": req.max_new_tokens, "ignore_eos": True, "temperature": a.temperature}
    if a.temperature > 0:
        sp["sampling_seed"] = zlib.crc32(f"{a.seed}:{req.id}".encode()) & 0x7FFFFFFF
    # rid: the request's id in the server's log (e.g. --enable-request-time-stats-logging)
    body = {"input_ids": prompt, "sampling_params": sp, "stream": True,
            "rid": f"{req.id}@{os.getpid()}.{time.monotonic_ns()}"}
    rec = _record(req, n_prompt=len(prompt), max_new=req.max_new_tokens,
                  prompt_digest=prompt_digest(prompt), status="failed", error=None,
                  ttft=None, cached=None, cached_host=0, output=[], rid=body["rid"])
    t0 = time.perf_counter()
    rec["sent"] = t0 - epoch
    meta, out, aborted = {}, [], False
    try:
        with sess.post(url + "/generate", json=body, stream=True,
                       timeout=(10, a.request_timeout)) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                if line[6:].strip() == b"[DONE]":
                    break
                d = json.loads(line[6:])
                if "error" in d:
                    raise RuntimeError(f"server error: {d['error']}")
                if d.get("output_ids"):
                    if rec["ttft"] is None:
                        rec["ttft"] = time.perf_counter() - t0
                    out = list(d["output_ids"])
                meta = d.get("meta_info") or meta
                if req.abort_after_tokens is not None and len(out) >= req.abort_after_tokens:
                    aborted = True  # leaving the with-block closes the connection
                    break
        rec["finished"] = time.perf_counter() - epoch
        rec["latency"] = rec["finished"] - rec["sent"]
        rec["output"], rec["n_out"] = out, len(out)
        rec["cached"] = meta.get("cached_tokens")
        rec["cached_host"] = (meta.get("cached_tokens_details") or {}).get("host", 0) or 0
        rec["verify_steps"] = meta.get("spec_verify_ct")     # speculative decoding only
        if aborted:
            rec["status"] = "aborted"
        elif len(out) != req.max_new_tokens:
            rec["error"] = f"got {len(out)} output tokens, expected {req.max_new_tokens}"
        elif meta.get("prompt_tokens") not in (None, len(prompt)):
            rec["error"] = f"server saw {meta.get('prompt_tokens')} prompt tokens, sent {len(prompt)}"
        elif rec["cached"] is None:
            rec["error"] = "no meta_info.cached_tokens"
        else:
            rec["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - every failure is recorded, the run goes on
        rec["error"] = f"{type(e).__name__}: {e}"[:500]
    return rec


def replay(reqs, urls: list[str], a, alive, deadline: float | None,
           between_rounds=None, memory: list | None = None) -> tuple[list, float]:
    """Lock-step replay over the servers at ``urls`` (routed by ``--route``); returns (records
    in trace order, wall seconds). ``between_rounds(k, rounds, router)`` runs before round k;
    ``memory``: ((device KV, device state, host bytes), block bytes, state bytes) for bound (b)."""
    router = Router(len(urls), a.route, a.max_inflight)
    done: dict[str, tuple[list, list]] = {}
    recs: dict[str, dict] = {}
    bad: set[str] = set()
    epoch = time.perf_counter()
    rounds = sorted({r.round for r in reqs})

    def skip(req, why):
        recs[req.id] = _record(req, status="failed", error=why, n_prompt=None)
        bad.add(req.id)

    with ThreadPoolExecutor(a.max_inflight) as ex:
        for k, rnd in enumerate(rounds):
            if between_rounds is not None:
                between_rounds(k, rounds, router)
            pending = [r for r in reqs if r.round == rnd]
            inflight: dict = {}
            r0 = time.perf_counter()
            while pending or inflight:
                stop = None if alive() else "server exited"
                if deadline is not None and time.time() > deadline:
                    stop = "deadline reached"
                now = time.perf_counter()
                for req in list(pending):
                    if stop:
                        skip(req, stop)
                    elif any(d in bad for d in req.deps()):
                        skip(req, "a request it depends on failed")
                    elif len(inflight) >= a.max_inflight:
                        break
                    elif all(d in done for d in req.deps()) and now >= r0 + req.t:
                        prompt = resolve(req, done)
                        i = router.pick(req)
                        inflight[ex.submit(send, urls[i], req, prompt, a, epoch)] = (req, prompt, i)
                    else:
                        continue
                    pending.remove(req)
                if not inflight:
                    if pending:
                        time.sleep(0.005)
                    continue
                fin, _ = wait(list(inflight), timeout=0.05, return_when=FIRST_COMPLETED)
                for f in fin:
                    req, prompt, i = inflight.pop(f)
                    router.done(i)
                    rec = recs[req.id] = f.result()
                    rec["replica"] = i
                    if rec["status"] == "failed":
                        bad.add(req.id)
                    else:
                        done[req.id] = (prompt, rec["output"])
    wall = time.perf_counter() - epoch
    events = [(rid, recs[rid]["sent"], recs[rid]["finished"], p, o) for rid, (p, o) in done.items()]
    bounds = [("oracle", oracle_bounds(events)), ("bound_a", clairvoyant_tap_bounds(events))]
    if memory:
        bounds.append(("bound_b", clairvoyant_retention_bounds(events, *memory)))
    for field, by_id in bounds:
        for rid, v in by_id.items():
            recs[rid][field] = v
    return [recs[r.id] for r in reqs], wall


# --------------------------------------------------------------------------- metrics
def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _dist(xs: list[float]) -> dict:
    return {"n": len(xs), "mean": sum(xs) / len(xs) if xs else None, "p50": _pct(xs, 0.5),
            "p90": _pct(xs, 0.9), "p99": _pct(xs, 0.99)}


_TIME_STATS = re.compile(r"ReqTimeStats\(rid=([^,]+),.*queue_duration=([\d.]+)ms")


def attach_time_stats(recs: list[dict], log_text: str) -> int:
    """Each record's time in SGLang's waiting queue (``queue_ms``), from the server's
    ``--enable-request-time-stats-logging`` lines; returns how many records got one."""
    queue = {m.group(1): float(m.group(2)) for m in _TIME_STATS.finditer(log_text)}
    found = 0
    for r in recs:
        if r.get("rid") in queue:
            r["queue_ms"] = queue[r["rid"]]
            found += 1
    return found


_CACHE_COUNTERS = re.compile(r"hybrid radix cache: in the last interval (.*?)(?:; |$)", re.M)
_COUNTER = re.compile(r"(\w+) \+(\d+)")
# what the report prints of them, in this order
REPORTED_COUNTERS = ("host_hits", "host_hit_tokens", "restores_dropped", "restores_overlapped",
                     "passes_waiting_by_layer", "prefetched_blocks",
                     "captures_without_slot", "store_states_read", "store_read_tokens",
                     "store_writes_dropped", "store_writes_overtaken", "store_probes",
                     "store_probes_skipped", "store_wait_timeouts", "store_answered_ms",
                     "store_hit_answered_ms", "store_fill_wait_ms", "store_fill_ms", "store_sync_ms",
                     "store_read_cpu_ms", "store_write_cpu_ms",
                     "scheduler_ms", "device_read_ms")


def cache_counters(log_text: str) -> dict:
    """The hybrid cache's counters summed over its "in the last interval" log lines (one a
    minute while they change, and one at each /flush_cache), {} for other caches."""
    total: dict = {}
    for line in _CACHE_COUNTERS.findall(log_text):
        for k, v in _COUNTER.findall(line):
            total[k] = total.get(k, 0) + int(v)
    return total


_PHASES = re.compile(r"scheduler phases: ([\d.]+) s, \d+ iterations; (.*)$", re.M)
_PHASE = re.compile(r"(GPU waits|[a-z_]+(?: them)?) (\d+)")
REPORTED_PHASES = ("schedule", "launch", "results", "GPU waits", "outside them")


PHASES_SETTLE_S = 1.5    # the phases log's interval (patches/scheduler_phases.INTERVAL_S) and a margin


def scheduler_phases(log_text: str) -> dict:
    """Seconds in each phase of SGLang's scheduler loop, summed over the once-a-second lines
    ``HPC_SCHEDULER_PHASES=1`` logs (any cache), plus "seconds" covered; {} without them."""
    total: dict = {}
    for secs, rest in _PHASES.findall(log_text):
        total["seconds"] = total.get("seconds", 0.0) + float(secs)
        for name, ms in _PHASE.findall(rest):
            total[name] = total.get(name, 0.0) + int(ms) / 1e3
    return total


_GPU = re.compile(r"gpu: extend (\d+) ms in (\d+) passes \(([\d,]+) tokens; gdn (\d+), attention (\d+)\), "
                  r"decode (\d+) ms in (\d+) steps$", re.M)
GPU_FIELDS = ("extend_ms", "extend_passes", "extend_tokens", "gdn_ms", "attention_ms", "decode_ms",
              "decode_steps")


def gpu_time(log_text: str) -> dict:
    """The GPU's time in the forward passes over the replay (the ``gpu:`` lines beside the
    phases, CUDA events): extend and decode ms, passes, extend tokens, and the extend passes'
    GDN and full-attention layers' ms; {} without them."""
    total: dict = {}
    for values in _GPU.findall(log_text):
        for k, v in zip(GPU_FIELDS, values):
            total[k] = total.get(k, 0) + int(v.replace(",", ""))
    return total


def _own_work(phases: dict) -> float:
    """Seconds the scheduler thread worked in its loop: schedule, launch and results less the
    GPU waits (in results)."""
    return sum(phases.get(k, 0.0) for k in ("schedule", "launch", "results")) - phases.get("GPU waits", 0.0)


def _gpu_idle(gpu: dict, phases: dict | None) -> str:
    """', no pass running X s of Y' from the GPU and phase lines of one window ('' without phases):
    the time the GPU ran no forward pass (host-tier copies run on streams of their own)."""
    if not phases:
        return ""
    busy = (gpu["extend_ms"] + gpu["decode_ms"]) / 1e3
    return f", no pass running {phases['seconds'] - busy:.2f} s of {phases['seconds']:.1f}"


_ADMISSION = re.compile(r"admission: admitted (\d+), refused for memory (\d+)(?: \(short ([\d,]+) tokens "
                        r"mean; free ([\d,]+), evictable ([\d,]+)\))?, other (\d+); blocked (\d+) ms; "
                        r"retracted (\d+)(?:; admitted/refused by source: (.*))?$", re.M)
_BY_SOURCE = re.compile(r"(\w+) (\d+)/(\d+)")
CENSUS_SOURCES = {"device": "device hits", "host": "host hits", "miss": "misses"}   # as logged


def admission_census(log_text: str) -> dict:
    """SGLang's PrefillAdder over the replay (the ``admission:`` lines beside the phases):
    requests admitted, refused for want of KV tokens (with the tokens missing, free and
    evictable, summed over the refusals), other outcomes, seconds the queue stood still after a
    refusal, decode retractions, and admissions and refusals by where the prefix was matched
    (``admitted_host``, ``refused_host``, ...); {} without them."""
    total: dict = {}
    for adm, ref, short, free, evictable, other, blocked, retracted, sources in _ADMISSION.findall(log_text):
        for src, took, refused in _BY_SOURCE.findall(sources):
            for k, v in ((f"admitted_{src}", int(took)), (f"refused_{src}", int(refused))):
                total[k] = total.get(k, 0) + v
        n = int(ref)
        for k, v in (("admitted", int(adm)), ("refused", n), ("other", int(other)),
                     ("retracted", int(retracted)), ("blocked_s", int(blocked) / 1e3)):
            total[k] = total.get(k, 0) + v
        for k, v in (("short_tokens", short), ("free_tokens", free), ("evictable_tokens", evictable)):
            total[k] = total.get(k, 0) + (int(v.replace(",", "")) * n if v else 0)
    return total


def _accept_length(recs: list) -> float | None:
    spec = [r for r in recs if r.get("verify_steps")]
    steps = sum(r["verify_steps"] for r in spec)
    return sum(r["n_out"] for r in spec) / steps if steps else None


def _share_of_bound(recs: list, field: str) -> dict:
    """Σ of the bound ``field`` over ``recs`` and Σ cached as a share of it."""
    bound = sum(r[field] for r in recs)
    return {"tokens": bound, "share": sum(r["cached"] or 0 for r in recs) / bound if bound else None}


def _bound_by_kind(ok: list, field: str) -> dict | None:
    """The arm's share of a bound, all requests and per kind (None: not recorded)."""
    if not ok or not all(field in r for r in ok):
        return None
    return {kind: _share_of_bound(rs, field) for kind, rs in (
        ("all", ok), ("continuing", [r for r in ok if r["kind"] in CONT_KINDS]),
        ("new", [r for r in ok if r["kind"] == "new"]))}


def metrics(res: dict) -> dict:
    recs = res["records"]
    ok = [r for r in recs if r["status"] in SERVED]
    failed = [r for r in recs if r["status"] == "failed"]
    cached = sum(r["cached"] or 0 for r in ok)
    oracle = sum(r.get("oracle", 0) for r in ok)
    prompt = sum(r["n_prompt"] for r in ok)
    n_out = sum(r["n_out"] for r in ok)
    wall = res.get("wall_s") or 0
    ms = lambda rs: [r["ttft"] * 1e3 for r in rs if r.get("ttft") is not None]  # noqa: E731
    queued = [r for r in ok if r["kind"] in CONT_KINDS and r.get("queue_ms") is not None]
    return {
        "valid": not failed and res.get("complete", True) and not res.get("error"),
        "requests": len(recs), "failed": len(failed),
        "errors": ([res["error"]] if res.get("error") else []) + sorted({r["error"] for r in failed})[:5],
        "prompt_tokens": prompt, "cached_tokens": cached, "oracle_tokens": oracle,
        "cached_share_of_oracle": cached / oracle if oracle else None,
        "cached_from_host": sum(r.get("cached_host") or 0 for r in ok),
        "prefilled_tokens": prompt - cached,
        "lost_tokens": sum(max(0, r.get("oracle", 0) - (r["cached"] or 0)) for r in ok),
        "whole_prompt_reprefills": sum((r["cached"] or 0) == 0 and r.get("oracle", 0)
                                       >= REPREFILL_MIN_ORACLE for r in ok),
        "above_oracle": sum((r["cached"] or 0) > r.get("oracle", 0) for r in ok),
        # bound (a): infinite memory, a state wherever a later request resumes; (b): those
        # taps in the regime's device pools and host bytes, kept by clairvoyant retention (None:
        # results recorded before they were)
        "bound_a": _bound_by_kind(ok, "bound_a"),
        "bound_b": _bound_by_kind(ok, "bound_b"),
        "ttft_ms_continuing": _dist(ms([r for r in ok if r["kind"] in CONT_KINDS])),
        "ttft_ms_new_long": _dist(ms([r for r in ok if r["kind"] == "new"
                                      and r["n_prompt"] >= NEW_LONG_MIN])),
        "ttft_ms_all": _dist(ms(ok)),
        "queue_ms_continuing": _dist([r["queue_ms"] for r in queued]),
        # what the cache and the passes take once admitted: TTFT less the queue
        "admitted_ms_continuing": _dist([r["ttft"] * 1e3 - r["queue_ms"] for r in queued
                                         if r.get("ttft") is not None]),
        "output_tokens": n_out, "output_tok_per_s": n_out / wall if wall else None,
        # speculative decoding: output tokens per target verify step (1 + accepted drafts)
        "accept_length": _accept_length(ok),
        "wall_s": wall,
        # the rounds from the middle on (--crash kills a server before them)
        "cached_second_half": sum(r["cached"] or 0 for r in _second_half(recs) if r["status"] in SERVED),
        "crash": res.get("crash"),
        "cache_counters": res.get("cache_counters") or {},
        "scheduler_phases": res.get("scheduler_phases") or {},
        "admission": res.get("admission") or {},
        "gpu_time": res.get("gpu_time") or {},
    }


def _second_half(recs: list) -> list:
    """The records from the middle round on, or of a one-round trace from its middle request on
    (where ``--crash`` splits it): the same requests in a run with and without a crash."""
    rounds = sorted({r["round"] for r in recs})
    if len(rounds) == 1:
        return recs[len(recs) // 2:]
    return [r for r in recs if r["round"] >= rounds[len(rounds) // 2]]


SERVED = ("ok", "aborted")     # the statuses of records that count (an abort is the client's)
PAGE_TOKENS = 64     # the hybrid cache's block: less than this from host is a snapshot's tail


def served_from(r: dict) -> str:
    """Where a server served a request: "device", "host tail" (under one 64-token page from
    host: a snapshot's tail), "host" (more from host) or "miss"."""
    if not r.get("cached"):
        return "miss"
    host = r.get("cached_host") or 0
    return "device" if not host else "host tail" if host < PAGE_TOKENS else "host"


def served_join(res_a: dict, res_b: dict) -> list[dict]:
    """Continuing turns both runs served, grouped by where each served them: how many, and the
    mean TTFT and waiting-queue ms of each run (None where not logged)."""
    other = {r["id"]: r for r in res_b["records"] if r["status"] == "ok"}
    groups: dict = {}
    for r in res_a["records"]:
        o = other.get(r["id"])
        if r["status"] == "ok" and o is not None and r["kind"] in CONT_KINDS:
            groups.setdefault((served_from(r), served_from(o)), []).append((r, o))

    def mean(side, key, scale=1.0):
        xs = [x[key] * scale for x in side if x.get(key) is not None]
        return sum(xs) / len(xs) if xs else None

    return [{"served": list(where), "n": len(pairs),
             "ttft_ms": [mean(side, "ttft", 1e3) for side in zip(*pairs)],
             "queue_ms": [mean(side, "queue_ms") for side in zip(*pairs)]}
            for where, pairs in sorted(groups.items())]


def reuse_matched_ttft(base: dict, hybrid: dict) -> dict | None:
    """The requests the hybrid reused at least as many tokens of as ``base`` did (both served
    them): how many, and the hybrid's first-token time over base's per request (geometric
    mean, median, p90, how many over 1.1x): a cost of the hybrid's own that the reuse does
    not pay for shows here. None without such requests."""
    other = {r["id"]: r for r in base["records"] if r["status"] == "ok" and r.get("ttft")}
    per = sorted(r["ttft"] / other[r["id"]]["ttft"] for r in hybrid["records"]
                 if r["status"] == "ok" and r.get("ttft") and r["id"] in other
                 and r["cached"] >= other[r["id"]]["cached"])
    if not per:
        return None
    return {"n": len(per), "geomean": _geomean(per), "median": per[len(per) // 2],
            "p90": per[min(len(per) - 1, int(0.9 * len(per)))],
            "slower": sum(x > 1.1 for x in per)}


def _ratio(x, y):
    return x / y if x is not None and y else None


def ratios(m: dict, base: dict) -> dict:
    out = {k: _ratio(m[k], base[k]) for k in ("cached_tokens", "prefilled_tokens",
                                              "output_tok_per_s", "wall_s")}
    for k in ("ttft_ms_continuing", "ttft_ms_new_long", "ttft_ms_all"):
        out[k] = {s: _ratio(m[k][s], base[k][s]) for s in ("mean", "p50", "p90", "p99")}
    return out


def agreement(res: dict, ref: dict) -> tuple[int, int]:
    """(same output, compared): requests whose prompt was identical in both runs."""
    ref_out = {r["id"]: (r.get("prompt_digest"), r.get("output")) for r in ref["records"]
               if r["status"] == "ok"}
    same = n = 0
    for r in res["records"]:
        if r["status"] == "ok" and ref_out.get(r["id"], (None,))[0] == r.get("prompt_digest"):
            n += 1
            same += ref_out[r["id"]][1] == r.get("output")
    return same, n


# --------------------------------------------------------------------------- report
def _f(x, nd=0, pct=False):
    if x is None:
        return "–"
    return f"{100 * x:.1f}%" if pct else f"{x:,.{nd}f}"


def _quad(d: dict, nd=0) -> str:
    return "/".join(_f(d[s], nd) for s in ("mean", "p50", "p90", "p99")) if d.get("n") else "–"


def summarize(results: list[dict], notes: list[str] | None = None, missing=()) -> dict:
    regs: dict[str, dict] = {}
    for res in results:
        regs.setdefault(res["regime"], {})[res["arm"]] = res
    metas = list(dict.fromkeys(r["meta"] for r in results if r.get("meta")))
    summary = {"valid": True, "complete": not missing, "missing": [f"{a}/{r}" for a, r in missing],
               "notes": metas + list(notes or []), "regimes": {}}
    nocache_of_trace = {}   # a trace's no-cache outputs, from whichever regime or start ran them
    for reg, arms in sorted(regs.items(), key=lambda kv: START in kv[0]):
        if "nocache" in arms and arms["nocache"].get("trace"):
            nocache_of_trace.setdefault(arms["nocache"]["trace"], (reg, arms["nocache"]))
    bases = {base_regime(r) for r in regs}
    order = DEFAULT_REGIMES + sorted(bases - set(DEFAULT_REGIMES))
    for reg, arms in sorted(regs.items(), key=lambda kv: (order.index(base_regime(kv[0])), kv[0])):
        ms = {arm: metrics(res) for arm, res in arms.items()}
        entry = {"arms": ms, "ratios_to_stock": {}, "agreement_with_nocache": {}, "info": {}}
        ref_reg, reference = (reg, arms["nocache"]) if "nocache" in arms else nocache_of_trace.get(
            next(iter(arms.values())).get("trace"), (None, None))
        if reference is not None and ref_reg != reg:
            entry["nocache_from"] = ref_reg   # the same trace, replayed by nocache there
        entry["output_reference"] = "nocache"
        if reference is None:     # no no-cache replay of this trace: a cache every run agreed with
            ref_arm = next((a for a in ("stock", "hicache") if a in arms), None)
            if ref_arm is not None:
                reference, entry["output_reference"] = arms[ref_arm], ref_arm
        for arm, res in arms.items():
            entry["info"][arm] = {k: res.get(k) for k in ("cmd", "host_mib", "host_mib_source",
                                                          "server_ready_s", "model", "trace",
                                                          "trace_stats", "device_tokens", "about",
                                                          "shared_with")}
            if "stock" in ms and arm != "stock":
                entry["ratios_to_stock"][arm] = ratios(ms[arm], ms["stock"])
            if reference is not None and arm not in ("nocache", entry["output_reference"]):
                entry["agreement_with_nocache"][arm] = agreement(res, reference)
            summary["valid"] &= ms[arm]["valid"]
        base = "hicache" if "hicache" in arms else "stock"
        if base in arms and "hybrid" in arms and ms[base]["valid"] and ms["hybrid"]["valid"]:
            entry["served_join"] = {"arms": [base, "hybrid"],
                                    "rows": served_join(arms[base], arms["hybrid"])}
            entry["reuse_matched_ttft"] = {"base": base,
                                           **(reuse_matched_ttft(arms[base], arms["hybrid"]) or {})}
        summary["regimes"][reg] = entry
    spread = across_starts(summary["regimes"])
    if spread:
        summary["across_starts"] = spread
    return summary


STARTS_REFERENCES = ("stock", "hicache", "devonly")   # each arm's ratios per start are to these


def across_starts(regimes: dict) -> dict:
    """For each regime run on more than one server start (``--starts``): every valid arm's
    continuing-turn TTFT mean and p90 and output tok/s per start, and each arm's ratio to the
    reference arms per start with their geometric mean. {regime: {"starts": [k, ...],
    "arms": {arm: {metric: [per start]}}, "ratios": {"arm/ref": {metric: [per start, ...]}}}}"""
    metrics_of = {"ttft_cont_mean": lambda m: m["ttft_ms_continuing"]["mean"],
                  "ttft_cont_p90": lambda m: m["ttft_ms_continuing"]["p90"],
                  "out_tok_per_s": lambda m: m["output_tok_per_s"]}
    groups: dict[str, dict[int, dict]] = {}
    for reg, e in regimes.items():
        label, _, k = reg.partition(START)
        groups.setdefault(label, {})[int(k or 1)] = {
            arm: {name: get(m) for name, get in metrics_of.items()}
            for arm, m in e["arms"].items() if m["valid"]}
    out = {}
    for label, by_start in groups.items():
        if len(by_start) < 2:
            continue
        starts = sorted(by_start)
        arms = sorted({arm for s in by_start.values() for arm in s}, key=_arm_rank)
        entry = {"starts": starts, "arms": {}, "ratios": {}}
        for arm in arms:
            entry["arms"][arm] = {name: [by_start[k].get(arm, {}).get(name) for k in starts]
                                  for name in metrics_of}
        for ref in (r for r in STARTS_REFERENCES if r in arms):
            for arm in arms:
                if arm in (ref, "nocache"):
                    continue
                per = {name: [_ratio(by_start[k].get(arm, {}).get(name), by_start[k].get(ref, {}).get(name))
                              for k in starts] for name in metrics_of}
                entry["ratios"][f"{arm}/{ref}"] = {name: vals + [_geomean(vals)]
                                                    for name, vals in per.items()}
        out[label] = entry
    return out


def _geomean(values: list) -> float | None:
    """Geometric mean of the ratios, None when any is missing."""
    if not values or any(v is None or v <= 0 for v in values):
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def render(summary: dict, plots: dict[str, str], plot_note: str | None) -> str:
    L = ["# hpc_radix A/B report", ""]
    L.append("**All runs valid.**" if summary["valid"] else
             "**INVALID: at least one request failed or a run did not complete; see the rows "
             "marked INVALID. Their numbers do not compare.**")
    if summary.get("missing"):
        L.append("\n**INCOMPLETE: not run: " + ", ".join(summary["missing"]) + "** (arm/regime).")
    L += [""] + [f"- {n}" for n in summary["notes"]] + [""]
    L += ["Columns: *cached* = Σ server-reported `cached_tokens`; *% oracle* = cached / Σ oracle "
          "(oracle: per request, the longest prefix any prompt+output that finished before it was "
          "sent shares with it, ≤ n−1; a server can exceed it by sharing with requests still "
          "running or finishing while this one queued); *prefilled* = prompt − cached; *re-prefills* = requests with "
          f"cached = 0 although oracle ≥ {REPREFILL_MIN_ORACLE}; TTFT in ms as mean/p50/p90/p99 "
          f"for continuing turns ({', '.join(CONT_KINDS)}) and new prompts ≥ {NEW_LONG_MIN} tokens; "
          "*tok/s* = output tokens / wall time. Ratios are arm / stock (TTFT, prefilled, wall: "
          "lower is better).", ""]
    for reg, e in summary["regimes"].items():
        info = next(iter(e["info"].values()))
        st = info.get("trace_stats") or {}
        L.append(f"## {reg}")
        L.append("")
        if info.get("about"):
            L.append(f"{info['about']}. Trace `{os.path.basename(info.get('trace') or '')}`: "
                     f"{st.get('requests')} requests, {st.get('sessions')} sessions, "
                     f"{st.get('rounds')} rounds, longest prompt {_f(st.get('max_prompt'))}, "
                     f"working set ≈ {_f(st.get('working_set'))} tokens.")
        if info.get("device_tokens"):
            ws = st.get("working_set") or 0
            L.append(f"Device cache `--max-total-tokens {info['device_tokens']}` "
                     f"(working set / device = {ws / info['device_tokens']:.1f}).")
        for arm in ("hicache", "hybrid"):
            if e["info"].get(arm, {}).get("host_mib") is not None:
                i = e["info"][arm]
                L.append(f"{arm} host tier: {i['host_mib']} MiB ({i['host_mib_source']}).")
        L += ["", "| arm | valid | requests | prompt tok | oracle tok | cached tok | % oracle | "
              "from host | prefilled tok | re-prefills | TTFT cont ms | TTFT new-long ms | "
              "out tok/s | wall s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for arm in sorted(e["arms"], key=_arm_rank):
            m = e["arms"][arm]
            valid = "yes" if m["valid"] else "**INVALID** (%s)" % (
                f"{m['failed']} failed" if m["failed"] else "server failed" if m["errors"]
                else "incomplete")
            L.append(f"| {arm} | {valid} | {m['requests']} | {_f(m['prompt_tokens'])} | "
                     f"{_f(m['oracle_tokens'])} | {_f(m['cached_tokens'])} | "
                     f"{_f(m['cached_share_of_oracle'], pct=True)} | {_f(m['cached_from_host'])} | "
                     f"{_f(m['prefilled_tokens'])} | {m['whole_prompt_reprefills']} | "
                     f"{_quad(m['ttft_ms_continuing'])} | {_quad(m['ttft_ms_new_long'])} | "
                     f"{_f(m['output_tok_per_s'], 1)} | {_f(m['wall_s'], 1)} |")
        for field, what in (("bound_a", "Bound (a), infinite memory and a state wherever a later "
                                         "request resumes (never above the oracle)"),
                            ("bound_b", "Bound (b), those states and the KV in the regime's device "
                                         "pools (KV in the KV pool, states in the mamba slots) and "
                                         "host bytes, kept by clairvoyant retention")):
            bounded = {arm: m[field] for arm, m in e["arms"].items() if m.get(field)}
            if bounded:
                L += ["", what + ", and each arm's cached tokens as a share of it: " + "; ".join(
                    f"{arm} {_f(b['all']['share'], pct=True)} of {_f(b['all']['tokens'])} "
                    f"(continuing turns {_f(b['continuing']['share'], pct=True)}, new "
                    f"prompts {_f(b['new']['share'], pct=True)})"
                    for arm, b in sorted(bounded.items(), key=lambda x: _arm_rank(x[0]))) + "."]
        accept = {arm: m["accept_length"] for arm, m in e["arms"].items() if m.get("accept_length")}
        if accept:
            L += ["", "Speculative decoding, output tokens per verify step (1 + accepted drafts; "
                  "random weights accept few): " + "; ".join(
                      f"{arm} {v:.2f}" for arm, v in sorted(accept.items(), key=lambda kv: _arm_rank(kv[0])))
                  + "."]
            arms = e["arms"]
            if all(arms.get(x, {}).get("valid") for x in ("hybrid", "nospec")) and arms["nospec"]["cached_tokens"]:
                with_spec, without = arms["hybrid"]["cached_tokens"], arms["nospec"]["cached_tokens"]
                L.append(f"The hybrid cached {_f(with_spec)} tokens with speculative decoding and "
                         f"{_f(without)} without (nospec): {100 * (with_spec / without - 1):+.2f} %.")
        queued = {arm: m["queue_ms_continuing"] for arm, m in e["arms"].items()
                  if (m.get("queue_ms_continuing") or {}).get("n")}
        if queued:
            L += ["", "Continuing turns' time in SGLang's waiting queue, mean/p50/p90/p99 ms "
                  "(`--enable-request-time-stats-logging`): " + "; ".join(
                      f"{arm} {_quad(d)}" for arm, d in sorted(queued.items(), key=lambda kv: _arm_rank(kv[0])))
                  + ". TTFT minus it, the time from admission to the first token: " + "; ".join(
                      f"{arm} {_quad(e['arms'][arm]['admitted_ms_continuing'])}"
                      for arm in sorted(queued, key=_arm_rank)) + "."]
        crashed = {arm: m for arm, m in e["arms"].items() if m.get("crash")}
        if crashed:
            L += ["", "Crash (--crash): " + "; ".join(
                f"{arm}: server {m['crash']['server']} killed (SIGKILL) before round "
                f"{m['crash']['round']}, ready again {m['crash']['restart_s']:.0f} s later; from that "
                f"round on {m['cached_second_half']:,} tokens reused"
                for arm, m in sorted(crashed.items(), key=lambda kv: _arm_rank(kv[0]))) + "."]
        counted = {arm: m["cache_counters"] for arm, m in e["arms"].items() if m.get("cache_counters")}
        if counted:
            L += ["", "Hybrid cache counters over the replay (its log line at the flush after it): "
                  + "; ".join(f"{arm}: " + ", ".join(f"{k} {c.get(k, 0):,}" for k in REPORTED_COUNTERS)
                              for arm, c in sorted(counted.items(), key=lambda kv: _arm_rank(kv[0])))
                  + "."]
        phased = {arm: m["scheduler_phases"] for arm, m in e["arms"].items()
                  if m.get("scheduler_phases")}
        if phased:
            L += ["", "SGLang's scheduler thread over the replay (`HPC_SCHEDULER_PHASES=1`), "
                  "seconds: " + "; ".join(
                      f"{arm} " + ", ".join(f"{k} {p.get(k, 0):.2f}" for k in REPORTED_PHASES)
                      + f" of {p['seconds']:.1f} (own work {_own_work(p):.2f})"
                      for arm, p in sorted(phased.items(), key=lambda kv: _arm_rank(kv[0])))
                  + ". Results includes the GPU waits; outside them is the loop's idle time; own "
                  "work is schedule, launch and results less the GPU waits."]
        timed = {arm: m["gpu_time"] for arm, m in e["arms"].items() if m.get("gpu_time")}
        if timed:
            L += ["", "The GPU's time in the forward passes over the replay (CUDA events, "
                  "`HPC_SCHEDULER_PHASES=1`): " + "; ".join(
                      f"{arm} extend {g['extend_ms'] / 1e3:.2f} s in {g['extend_passes']:,} passes "
                      f"({g['extend_tokens']:,} tokens, "
                      f"{1e3 * g['extend_ms'] / max(g['extend_tokens'], 1):.1f} µs each; GDN layers "
                      f"{g['gdn_ms'] / 1e3:.2f} s, full attention {g['attention_ms'] / 1e3:.2f} s), "
                      f"decode {g['decode_ms'] / 1e3:.2f} s in {g['decode_steps']:,} steps"
                      + _gpu_idle(g, phased.get(arm))
                      for arm, g in sorted(timed.items(), key=lambda kv: _arm_rank(kv[0]))) + "."]
        censused = {arm: m["admission"] for arm, m in e["arms"].items() if m.get("admission")}
        if censused:
            L += ["", "SGLang's PrefillAdder over the replay: " + "; ".join(
                f"{arm} admitted {c['admitted']}, refused for want of KV tokens {c['refused']}"
                + (f" (missing {c['short_tokens'] / c['refused']:,.0f} tokens mean, free "
                   f"{c['free_tokens'] / c['refused']:,.0f}, evictable "
                   f"{c['evictable_tokens'] / c['refused']:,.0f})" if c["refused"] else "")
                + f", queue stopped {c['blocked_s']:.2f} s after refusals, {c['retracted']} retracted"
                + "".join(f"; {label} admitted {c[f'admitted_{src}']}, refused {c[f'refused_{src}']}"
                          for src, label in CENSUS_SOURCES.items() if f"admitted_{src}" in c)
                for arm, c in sorted(censused.items(), key=lambda kv: _arm_rank(kv[0]))) + "."]
        join = e.get("served_join")
        if join and join["rows"]:
            a, b = join["arms"]
            L += ["", f"Continuing turns by where {a} and {b} served them (joined by request; "
                  "device: from device only, host tail: under 64 tokens from host, a snapshot's "
                  "tail, host: more from host, miss: nothing cached), "
                  f"mean ms {a} / {b}:", "",
                  f"| {a} | {b} | turns | TTFT | waiting queue |", "|---|---|---|---|---|"]
            for row in join["rows"]:
                L.append(f"| {row['served'][0]} | {row['served'][1]} | {row['n']} | "
                         + " | ".join(" / ".join(_f(x) for x in row[k]) for k in ("ttft_ms", "queue_ms"))
                         + " |")
        matched = e.get("reuse_matched_ttft")
        if matched and matched.get("n"):
            L += ["", f"Requests the hybrid reused at least as much of as {matched['base']} "
                  f"({matched['n']}): its first token at {_f(matched['geomean'], 2)}× "
                  f"{matched['base']}'s per request (geometric mean; median "
                  f"{_f(matched['median'], 2)}×, p90 {_f(matched['p90'], 2)}×; "
                  f"{matched['slower']} over 1.1×)."]
        if e["ratios_to_stock"]:
            L += ["", "Ratios to stock:", "",
                  "| arm | cached × | prefilled × | TTFT cont × | TTFT new-long × | out tok/s × | "
                  f"wall × | same output as {e.get('output_reference', 'nocache')} |",
                  "|---|---|---|---|---|---|---|---|"]
            for arm, r in e["ratios_to_stock"].items():
                if not (e["arms"][arm]["valid"] and e["arms"]["stock"]["valid"]):
                    L.append(f"| {arm} | invalid run |" + " |" * 6)
                    continue
                same, n = e["agreement_with_nocache"].get(arm, (0, 0))
                L.append(f"| {arm} | {_f(r['cached_tokens'], 2)} | {_f(r['prefilled_tokens'], 2)} | "
                         f"{_quad(dict(r['ttft_ms_continuing'], n=1), 2)} | "
                         f"{_quad(dict(r['ttft_ms_new_long'], n=1), 2)} | "
                         f"{_f(r['output_tok_per_s'], 2)} | {_f(r['wall_s'], 2)} | "
                         f"{f'{same}/{n}' if n else '–'} |")
            if e.get("nocache_from"):
                L.append(f"\nOutputs compared with nocache's replay of the same trace in {e['nocache_from']}.")
        elif e["agreement_with_nocache"]:          # no stock arm: the output check alone
            L.append(f"\nSame output as {e.get('output_reference', 'nocache')} (requests): " + ", ".join(
                f"{arm} {same}/{n}" for arm, (same, n) in e["agreement_with_nocache"].items()))
        errs = [(arm, m["errors"]) for arm, m in e["arms"].items() if m["errors"]]
        for arm, er in errs:
            L.append(f"\n{arm} errors: " + "; ".join(f"`{x}`" for x in er))
        if reg in plots:
            L += ["", f"![{reg}]({plots[reg]})"]
        L += ["", "<details><summary>server command lines</summary>", ""]
        for arm, i in e["info"].items():
            if i.get("cmd"):
                L.append(f"- {arm} (ready in {_f(i.get('server_ready_s'), 0)} s): "
                         f"`{shlex.join(i['cmd'])}`"
                         + (f" — the same replay as regime {i['shared_with']} (same server, "
                            "same trace)" if i.get("shared_with") else ""))
        L += ["", "</details>", ""]
    for label, sp in summary.get("across_starts", {}).items():
        heads = [f"start {k}" for k in sp["starts"]]
        L += [f"## {label}: across server starts", "",
              "Continuing-turn TTFT mean / p90 ms and output tok/s of each arm on each start of "
              "its server (every second round ran the arms in reverse order):", "",
              "| arm | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
        for arm, v in sp["arms"].items():
            L.append(f"| {arm} | " + " | ".join(
                f"{_f(t)} / {_f(p)} / {_f(o, 1)}" for t, p, o in
                zip(v["ttft_cont_mean"], v["ttft_cont_p90"], v["out_tok_per_s"])) + " |")
        L += ["", "Ratios per start (TTFT cont mean / p90, out tok/s) and their geometric mean:", "",
              "| ratio | " + " | ".join(heads) + " | geometric mean |",
              "|---|" + "---|" * (len(heads) + 1)]
        for pair, v in sp["ratios"].items():
            L.append(f"| {pair} | " + " | ".join(
                f"{_f(t, 2)} / {_f(p, 2)} / {_f(o, 2)}" for t, p, o in
                zip(v["ttft_cont_mean"], v["ttft_cont_p90"], v["out_tok_per_s"])) + " |")
        L.append("")
    if plot_note:
        L += [f"_{plot_note}_", ""]
    return "\n".join(L)


def make_plots(results: list[dict], outdir: str) -> tuple[dict, str | None]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return {}, f"plots skipped: matplotlib not importable ({type(e).__name__})"
    os.makedirs(os.path.join(outdir, "plots"), exist_ok=True)
    regs: dict[str, list] = {}
    for res in results:
        regs.setdefault(res["regime"], []).append(res)
    paths = {}
    for reg, runs in regs.items():
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        for res in sorted(runs, key=lambda r: _arm_rank(r["arm"])):
            ok = [r for r in res["records"] if r["status"] in SERVED]
            t = sorted(r["ttft"] * 1e3 for r in ok if r.get("ttft") is not None)
            if t:
                ax1.step(t, [(i + 1) / len(t) for i in range(len(t))], where="post", label=res["arm"])
            per: dict[int, list] = {}
            for r in ok:
                c, o = per.setdefault(r["round"], [0, 0])
                per[r["round"]] = [c + (r["cached"] or 0), o + r.get("oracle", 0)]
            xs = [x for x in sorted(per) if per[x][1]]
            ax2.plot(xs, [per[x][0] / per[x][1] for x in xs], marker="o", label=res["arm"])
        ax1.set(xscale="log", xlabel="TTFT (ms)", ylabel="fraction of requests",
                title=f"{reg}: TTFT distribution")
        ax2.set(xlabel="round", ylabel="Σ cached / Σ oracle", title=f"{reg}: cached share per round")
        for ax in (ax1, ax2):
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        rel = f"plots/{reg}.png"
        fig.savefig(os.path.join(outdir, rel), dpi=100)
        plt.close(fig)
        paths[reg] = rel
    return paths, None


def write_report(results: list[dict], outdir: str, notes: list[str] | None = None,
                 missing=()) -> dict:
    summary = summarize(results, notes, missing)
    plots, note = make_plots(results, outdir)
    if note:
        summary["notes"].append(note)
    with open(os.path.join(outdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(outdir, "report.md"), "w") as f:
        f.write(render(summary, plots, note))
    return summary


def load_results(dirs: list[str]) -> list[dict]:
    """The per-run results of ``dirs`` (``results/*.json``, or ``*.json.gz`` as committed)."""
    out = {}
    for d in dirs:
        rd = os.path.join(d, "results")
        for name in sorted(os.listdir(rd)) if os.path.isdir(rd) else []:
            if name.endswith((".json", ".json.gz")):
                with (gzip.open if name.endswith(".gz") else open)(os.path.join(rd, name), "rt") as f:
                    res = json.load(f)
                out[(res["regime"], res["arm"])] = res  # later directories win
    return list(out.values())


# --------------------------------------------------------------------------- main
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-qwen35",
                    help="model directory (default %(default)s; "
                         "python tests/gpu/tiny_qwen.py DIR [--large] writes one)")
    ap.add_argument("--model-kind", choices=sorted(MODEL_ARGS),
                    help="flag set (default: large if config.json's vocab_size > 4096)")
    ap.add_argument("--out", default="ab-out", help="output directory (default %(default)s)")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS), help="comma list of %s" % ",".join(ARMS))
    ap.add_argument("--regimes", default=",".join(DEFAULT_REGIMES),
                    help="comma list of %s (and 'trace' with --trace)" % ",".join(REGIMES))
    ap.add_argument("--replays", type=int, default=1,
                    help="replay each regime's trace this many times on the same server, "
                         "flushed in between (the repeats are reported as REGIME#2, ...)")
    ap.add_argument("--starts", type=int, default=1,
                    help="start every arm's server this many times, the arms in reverse order on "
                         "every second round (the repeats are reported as REGIME@2, ...), and "
                         "report each ratio per start: on the H200 the same server command's TTFT "
                         "differed between starts far more than between replays on one server")
    ap.add_argument("--first-start", type=int, default=1, metavar="K",
                    help="number this run's starts from K (its order as round K's): a series "
                         "of starts split over several runs, reported together by --report-from")
    ap.add_argument("--note", action="append", default=[],
                    help="with --report-from: a line for the report's notes (repeatable), e.g. "
                         "which runs the directories come from")
    ap.add_argument("--trace", help="replay this trace file as regime 'trace' (ample flags)")
    ap.add_argument("--mooncake", metavar="FILE",
                    help="Mooncake trace file for the mooncake-* regimes (FAST25-release/traces/ "
                         "of kvcache-ai/Mooncake; workloads/mooncake.py)")
    ap.add_argument("--mooncake-window", type=_window, default=mooncake.Window(0, 800),
                    metavar="START,COUNT", help="lines of the Mooncake file (default 0,800)")
    ap.add_argument("--mooncake-block-tokens", type=int, default=128,
                    help="tokens each 512-token hash block is replayed as (default %(default)s)")
    ap.add_argument("--mooncake-max-new", type=int, default=16,
                    help="output tokens at most (the trace's scaled output length below it)")
    ap.add_argument("--mooncake-speedup", type=float, metavar="X",
                    help="send by the trace's timestamps, X times faster (default: closed loop "
                         "in file order)")
    ap.add_argument("--scale", type=float, default=1.0, help="workload size (0.25: quick run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-inflight", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--host-mib", type=host_mib_arg, metavar="MIB|REGIME=MIB,...",
                    help="hybrid host tier where the regime copies HiCache's, for every such "
                         "regime or per regime (host=3909,host-tight=1978: HiCache's bytes "
                         "from an earlier run's report, when HiCache is not run again)")
    ap.add_argument("--server-args", help="extra flags for every server (one string)")
    ap.add_argument("--speculative", metavar="FLAGS",
                    help="speculative-decoding flags for every arm but nospec (one string, "
                         "after --server-args)")
    ap.add_argument("--arm-args", action="append", default=[], metavar="ARM=FLAGS",
                    help="extra flags for one arm's servers, after --server-args (repeatable; "
                         "hybrid='--disable-overlap-schedule')")
    ap.add_argument("--replicas", type=int, default=1, metavar="N",
                    help="run every arm as N servers sharing the GPU(s) and the host bytes")
    ap.add_argument("--route", choices=("rr", "sticky", "least-loaded"), default="rr",
                    help="which replica serves a request (default %(default)s: round robin)")
    ap.add_argument("--store-mib", type=int, default=None, metavar="MIB",
                    help="the store arms' disk budget, all replicas together (hybridtier: "
                         "--cache-store-mib; hicachel3: its file evictor's cap, 1/N per replica)")
    ap.add_argument("--crash", action="store_true",
                    help="SIGKILL one server before the middle round and start it again")
    ap.add_argument("--server-timeout", type=float, default=600)
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--deadline-s", type=float,
                    help="stop starting servers / sending requests after this many seconds")
    ap.add_argument("--py-spy", metavar="EXE",
                    help="sample every server process's stacks during each replay with this "
                         "py-spy executable (OUT/logs/ARM-REGIME.stacks, raw collapsed stacks; "
                         "benchmarks/stack_diff.py compares two)")
    ap.add_argument("--dry-run", action="store_true", help="print plan (commands, request counts)")
    ap.add_argument("--report-from", nargs="+", metavar="DIR",
                    help="only write a report from DIRs' results/ (into --out)")
    a = ap.parse_args(argv)
    if os.path.isdir(a.model):            # the servers start in their log directory
        a.model = os.path.abspath(a.model)
    a.arms = [x for x in a.arms.split(",") if x]
    a.regimes = [x for x in a.regimes.split(",") if x]
    if a.trace and "trace" not in a.regimes:
        a.regimes.append("trace")
    for x in a.arms:
        if x not in ARMS:
            ap.error(f"unknown arm {x}")
    arm_args = {}
    for x in a.arm_args:
        arm, sep, flags = x.partition("=")
        if not sep or arm not in a.arms:
            ap.error(f"--arm-args {x!r}: ARM=FLAGS with ARM one of the arms run ({','.join(a.arms)})")
        arm_args[arm] = f"{arm_args.get(arm, '')} {flags}".strip()
    a.arm_args = arm_args
    for x in a.regimes:
        if x not in REGIMES and not (x == "trace" and a.trace):
            ap.error(f"unknown regime {x}")
        if "mooncake" in REGIMES.get(x, {}) and not a.mooncake:
            ap.error(f"regime {x} needs --mooncake FILE")
    if a.mooncake and not os.path.isfile(a.mooncake):
        ap.error(f"--mooncake {a.mooncake}: no such file")
    if a.replicas < 1:
        ap.error(f"--replicas={a.replicas}: must be at least 1")
    uncapped = [x for x in a.regimes if x in REGIMES and a.replicas > 1
                and "--max-total-tokens" not in REGIMES[x]["server"]]
    if uncapped:
        ap.error(f"--replicas={a.replicas} needs regimes whose device pool is capped "
                 f"(--max-total-tokens), which replicas split: {','.join(uncapped)} is not")
    if a.replays < 1:
        ap.error(f"--replays={a.replays}: must be at least 1")
    a.regimes = [f"{reg}{REPEAT}{k}" if k > 1 else reg
                 for reg in a.regimes for k in range(1, a.replays + 1)]
    if a.starts < 1:
        ap.error(f"--starts={a.starts}: must be at least 1")
    if a.first_start < 1:
        ap.error(f"--first-start={a.first_start}: must be at least 1")
    a.arms = run_order(a.arms, host_mib_given=a.host_mib is not None)
    return a


def _window(text: str):
    try:
        return mooncake.Window.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def run_order(arms: list[str], host_mib_given: bool) -> list[str]:
    """The arms in the order given (with a deadline, the first ones are the ones sure to run),
    except that HiCache goes before the hybrid arms that read their host bytes from its log
    when --host-mib does not give them."""
    arms = list(dict.fromkeys(arms))
    hybrid_at = [i for i, arm in enumerate(arms) if arm in HYBRID_ARMS]
    if not host_mib_given and "hicache" in arms and hybrid_at and hybrid_at[0] < arms.index("hicache"):
        arms.remove("hicache")
        arms.insert(hybrid_at[0], "hicache")
    return arms


def start_rounds(arms: list[str], starts: int, first: int = 1) -> list[tuple[int, str]]:
    """[(start, arm)] in the order the servers start: every arm once per round, the order
    reversed on every second round (ABBA), so that a drift of the host over the run does not
    favour the arms that start first. ``first`` numbers the rounds of a run that continues
    another one's series (``--first-start``)."""
    return [(k, arm) for k in range(first, first + starts)
            for arm in (arms if k % 2 else arms[::-1])]


def bound_b_memory(a, reg: str, cmd: list, measured: dict, dev: int | None) -> list | None:
    """((device KV bytes, device state bytes, host bytes), a 64-token block's KV bytes, a
    state's bytes) of bound (b): the regime's device pool and mamba slots and the hybrid's
    host bytes, whatever the arm (all replicas together); None without config.json or a
    capped pool."""
    geo, served = state_bytes(a.model), _flag(cmd, "--max-total-tokens")
    slots = _flag(cmd, "--max-mamba-cache-size")
    if geo is None or served is None or slots is None:
        return None
    host = host_mib_for(a, reg, measured, dev)[0] << 20
    return [[int(served) * geo[0], int(slots) * geo[1], host], PAGE_TOKENS * geo[0], geo[1]]


def plan_runs(a, kind, traces, measured, start: int = 1) -> list[tuple[str, list[str], list[str], dict]]:
    """[(arm, regimes, cmd, per-regime extras)] with consecutive identical commands merged, for
    the ``start``-th start of every server."""
    runs = []
    for arm in a.arms:
        for reg in (started(r, start) for r in a.regimes):
            if not applicable(arm, reg):
                continue
            dev = device_tokens(traces[reg]["stats"]) if "{device_tokens}" in regime_conf(reg)["server"] else None
            mib, src = host_mib_for(a, reg, measured, dev) if arm in HYBRID_ARMS else (None, None)
            cmd = server_cmd(a, arm, reg, kind, mib, dev)
            served = _flag(cmd, "--max-total-tokens")     # the pool the server will have
            extra = {"device_tokens": served and int(served), "host_mib": mib,
                     "host_mib_source": src,
                     "bound_b_memory": bound_b_memory(a, reg, cmd, measured, dev)}
            if runs and runs[-1][0] == arm and runs[-1][2] == cmd:
                runs[-1][1].append(reg)
                runs[-1][3][reg] = extra
            else:
                runs.append((arm, [reg], cmd, {reg: extra}))
    return runs


def main(argv=None):
    a = parse(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.report_from:
        s = write_report(load_results(a.report_from), a.out, a.note)
        print(f"wrote {a.out}/report.md (valid={s['valid']})")
        return 0 if s["valid"] else 1
    kind = model_kind(a.model, a.model_kind)
    traces = build_traces(a, list(dict.fromkeys(
        a.regimes + all_starts(a.regimes, a.starts, a.first_start))))
    ctx, too_long = context_len(a.model, kind), []
    for reg in list(a.regimes):
        need = traces[reg]["stats"]["max_request"]
        if need >= ctx:
            too_long.append(f"regime {reg} skipped: its longest request needs {need} tokens, the "
                            f"model's context is {ctx} (lower --scale or use the large model)")
            a.regimes.remove(reg)
            print(too_long[-1], flush=True)
    if a.dry_run:
        for reg in a.regimes:
            st = traces[reg]["stats"]
            print(f"[{reg}] {traces[reg]['path']}: " + json.dumps(st))
        if a.starts > 1:
            print(f"# the plan below, then {a.starts - 1} more start(s) of every server, the arms "
                  "in reverse order on every second one")
        for arm, regs, cmd, extra in plan_runs(a, kind, traces, {}, a.first_start):
            print(f"\n# {arm}: regimes {','.join(regs)}"
                  + "".join(f"\n#   {r}: {v['host_mib']} MiB host ({v['host_mib_source']})"
                            for r, v in extra.items() if v["host_mib"] is not None))
            print(" ".join(f"{k}={v}" for k, v in SERVER_ENV.items()), shlex.join(cmd))
        return 0

    t_start = time.time()
    deadline = t_start + a.deadline_s if a.deadline_s else None
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    os.makedirs(os.path.join(a.out, "results"), exist_ok=True)
    results, notes, measured = [], too_long, {}
    spent = {"server": [], "replay": []}   # seconds measured so far: what the next arm will take
    server = None

    def on_term(*_):  # stop the server first so that requests in flight fail at once
        notes.append("interrupted (SIGTERM): the run in progress is not reported")
        if server is not None:
            server.stop()
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_term)
    try:
        for k, arm in start_rounds(a.arms, a.starts, a.first_start):
            # Re-plan per arm: hybrid's host tier copies what HiCache measured before it.
            for _, regs, cmd, extra in [r for r in plan_runs(a, kind, traces, measured, k) if r[0] == arm]:
                tag = f"{arm}-{regs[0]}" + (f"-{regs[-1]}" if len(regs) > 1 else "")
                if deadline and time.time() + _time_needed(spent, len(regs)) > deadline:
                    notes.append(f"{arm} on {','.join(regs)} not run: deadline")
                    continue
                print(f"== {arm}: {','.join(regs)}\n   {shlex.join(cmd)}", flush=True)
                server = Replicas(cmd, os.path.join(a.out, "logs", tag + ".log"), a.port, a.replicas,
                                  store_env(a, arm, regs[0]))
                try:
                    ready = server.start(min(a.server_timeout, deadline - time.time())
                                         if deadline else a.server_timeout)
                    server.warmup()
                except Exception as e:  # noqa: BLE001
                    notes.append(f"{arm} on {','.join(regs)}: server failed: {e}")
                    print("   " + notes[-1], flush=True)
                    tail = "\n".join(server.log_text().splitlines()[-30:])
                    print(tail, flush=True)
                    server.stop()
                    for reg in regs:
                        results.append(_save(a, {"regime": reg, "arm": arm, "cmd": _portable(cmd),
                                                 "complete": False, "records": [],
                                                 "error": str(e), **_ctx(a, reg, traces, extra)}))
                    continue
                if arm == "hicache":
                    mib = hicache_host_mib(server.log_text(), a.model)
                    for reg in regs if mib else ():
                        measured[base_regime(reg)] = mib
                        extra[reg].update(host_mib=mib, host_mib_source="its log")
                print(f"   ready in {ready:.0f} s", flush=True)
                spent["server"].append(ready)
                replayed = {}  # trace path -> (regime, result): one server, same trace, same run
                for i, reg in enumerate(regs):
                    res = {"regime": reg, "arm": arm, "cmd": _portable(cmd), "server_ready_s": ready,
                           **_ctx(a, reg, traces, extra)}
                    replay_key = (traces[reg]["path"], reg.partition(REPEAT)[2])
                    same = replayed.get(replay_key)
                    if same:  # the same server and traffic: reuse that replay, say so
                        res.update({k: same[1][k] for k in ("wall_s", "records", "complete")},
                                   shared_with=same[0])
                        results.append(_save(a, res))
                        print(f"   {reg}: the replay of {same[0]} (same command and trace)", flush=True)
                        continue
                    try:
                        if i:
                            server.flush()
                        if os.environ.get("HPC_SCHEDULER_PHASES"):
                            # The server logs its phases once a second for the second just ended:
                            # let the one holding the warm-up's tail be written before the window
                            # opens, or the replay's census counts the warm-up's requests too.
                            time.sleep(PHASES_SETTLE_S)
                        start = server.mark()
                        with stack_samples(a.py_spy, server,
                                           os.path.join(a.out, "logs", f"{arm}-{reg}.stacks")):
                            recs, wall = replay(traces[reg]["reqs"], server.urls, a, server.alive,
                                                deadline, crash_halfway(a, server, res),
                                                res.get("bound_b_memory"))
                        attach_time_stats(recs, server.log_text())
                        since = server.log_since(start)
                        res["scheduler_phases"] = scheduler_phases(since)
                        res["admission"] = admission_census(since)
                        res["gpu_time"] = gpu_time(since)
                        # (only the hybrid logs counters; HiCache + L3 on 0.5.17 may refuse flushes)
                        res["cache_counters"] = (_counters_after_flush(server, start)
                                                 if arm in HYBRID_ARMS else {})
                        spent["replay"].append(wall)
                        res.update(wall_s=wall, records=recs, complete=not any(
                            r["error"] in ("deadline reached", "server exited") for r in recs))
                        replayed[replay_key] = (reg, res)
                    except Exception as e:  # noqa: BLE001 - e.g. /flush_cache refused
                        res.update(records=[], complete=False, error=f"{type(e).__name__}: {e}")
                    results.append(_save(a, res))
                    m = metrics(res)
                    print(f"   {reg}: valid={m['valid']} cached={m['cached_tokens']} "
                          f"oracle={m['oracle_tokens']} wall={m['wall_s']:.1f}s "
                          f"ttft_p50_ms={m['ttft_ms_all']['p50']} errors={m['errors'][:2]}",
                          flush=True)
                server.stop()
                server = None
    finally:
        if server is not None:
            server.stop()
        notes.append(f"total wall time {time.time() - t_start:.0f} s")
        got = {(r["arm"], r["regime"]) for r in results}
        missing = [(arm, reg) for arm in a.arms
                   for reg in all_starts(a.regimes, a.starts, a.first_start)
                   if applicable(arm, reg) and (arm, reg) not in got]
        s = write_report(results, a.out, notes, missing)
        print(f"wrote {a.out}/report.md (valid={s['valid']})", flush=True)
    return 0 if s["valid"] else 1


WARM_START_S = 120.0     # a server start once the first has filled the JIT caches (56-109 s seen)


def _time_needed(spent: dict, n_regimes: int) -> float:
    """Seconds one more server is expected to take for ``n_regimes`` replays: the latest start,
    but at most ``WARM_START_S`` after the first alone (it paid the cold JIT caches: 210 s once,
    when the next ones took 77-109 s), the slowest replay so far and a stop's margin; 120 s
    before anything was measured. The server's start is bounded by the deadline anyway."""
    if not spent["server"] or not spent["replay"]:
        return 120.0
    start = spent["server"][-1] if len(spent["server"]) > 1 else min(spent["server"][0], WARM_START_S)
    return start + n_regimes * max(spent["replay"]) + 15.0


def store_env(a, arm: str, reg: str) -> dict:
    """A store arm's directory, emptied (a run starts with nothing stored), and the
    environment that names it where a flag does not."""
    if arm not in STORE_ARMS:
        return {}
    path = store_dir(a, arm, reg)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    env = {STORE_ENV[arm]: path} if arm in STORE_ENV else {}
    if a.store_mib and arm in STORE_BUDGET_ENV:
        env[STORE_BUDGET_ENV[arm]] = str(a.store_mib * 2**20 // a.replicas)
    return env


def _portable(cmd: list[str]) -> list[str]:
    """A command as results record it: absolute paths cut to their last part, so a report
    names no machine's directories."""
    return [os.path.basename(x.rstrip("/")) if os.path.isabs(x) else x for x in cmd]


def _ctx(a, reg, traces, extra) -> dict:
    model, = _portable([a.model])
    meta = (f"model {model} ({model_kind(a.model, a.model_kind)}), scale {a.scale:g}, "
            f"seed {a.seed}, max in flight {a.max_inflight}, temperature {a.temperature:g}")
    if a.replicas > 1:
        meta += (f", {a.replicas} servers per arm (each 1/{a.replicas} of the token pool, mamba "
                 f"slots and host bytes shown), requests routed {a.route}")
    return {"model": model, "meta": meta, "trace": os.path.basename(traces[reg]["path"]),
            "trace_stats": traces[reg]["stats"], "about": regime_conf(reg)["about"],
            **extra.get(reg, {})}


def _counters_after_flush(server, start: int) -> dict:
    """Flush the server's cache (the hybrid cache then logs its counters since its last line)
    and sum what it logged from ``start`` (the log's length when the replay began) on; {}
    when the flush fails."""
    try:
        server.flush()
    except Exception:  # noqa: BLE001 - the results stand; the report just lacks the counters
        return {}
    time.sleep(0.5)                    # the scheduler logs the line as it flushes
    return cache_counters(server.log_since(start))


def _save(a, res: dict) -> dict:
    with open(os.path.join(a.out, "results", f"{res['regime']}__{res['arm']}.json"), "w") as f:
        json.dump(res, f)
    return res


if __name__ == "__main__":
    sys.exit(main())
