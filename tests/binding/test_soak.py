"""Random multi-turn traffic through the cache in SGLang's call order, with a host tier under
pressure: two requests in flight with interleaved chunks, retries, aborts (before the first pass
and between chunks), flushes of the device tier. Every admitted prefix must hold exactly its tokens' KV and the state of exactly that
many tokens, wherever it came from (device, copy-on-write, host restore); after every request
SGLang's idle check must hold."""
from __future__ import annotations

import random

from hpc_radix.sglang_version import req_slots, prefix_len
import pytest

from sglang_harness import PAGE, build_cache

torch = pytest.importorskip("torch")

PREAMBLES = 3


class Traffic:
    def __init__(self, h, rng):
        self.h, self.rng = h, rng
        self.preambles = [[rng.randrange(1, 250) for _ in range(rng.randrange(60, 200))]
                          for _ in range(PREAMBLES)]
        self.histories: list[list[int]] = []      # prompt + output of finished turns
        self.stats = {"requests": 0, "cached": 0, "from_host": 0, "aborted": 0}

    def next_prompt(self) -> list[int]:
        rng = self.rng
        words = [rng.randrange(1, 250) for _ in range(rng.randrange(5, 150))]
        r = rng.random()
        if self.histories and r < 0.55:            # the next turn of a conversation
            return rng.choice(self.histories) + words
        if self.histories and r < 0.65:            # a retry of a whole earlier prompt + output
            return list(rng.choice(self.histories))
        return list(rng.choice(self.preambles)) + words

    def admit(self, tokens):
        h = self.h
        req = h.new_req(tokens)
        cached = h.admit(req)
        self.stats["requests"] += 1
        self.stats["cached"] += cached
        self.stats["from_host"] += req.host_hit_length
        assert cached < len(tokens)
        row = h.req_pool.req_to_token[req_slots(req).req_pool_idx]
        k = h.kv.full_kv_pool.k_buffer[0]
        assert k[row[:cached], 0, 0].tolist() == [t % 251 for t in tokens[:cached]], \
            f"request {req.rid}: the KV of its {cached}-token prefix is not its tokens'"
        assert h.state_of(int(req_slots(req).mamba_pool_idx)) == float(cached), \
            f"request {req.rid}: resumed from the state of another length"
        return req, cached

    def run(self, req, chunk):
        """Prefill in chunks (a generator: one chunk per step), then decode and finish."""
        h, n = self.h, len(req.origin_input_ids)
        pos = prefix_len(req)
        abort_at = self.rng.random() < 0.1
        if self.rng.random() < 0.05:             # cancelled before its first pass (a host
            self.stats["aborted"] += 1           # restore may still be in flight)
            h.finish(req, is_insert=False)
            return
        while pos < n:
            end = min(n, pos // PAGE * PAGE + chunk) if n - pos > chunk else n
            h.prefill_chunk(req, end, final=end == n)
            pos = end
            if abort_at and pos < n:
                self.stats["aborted"] += 1
                h.finish(req, is_insert=False)
                return
            yield
        output = [self.rng.randrange(1, 250) for _ in range(self.rng.randrange(1, 12))]
        h.decode(req, output)
        h.finish(req)
        self.histories.append(list(req.origin_input_ids) + output)

    def round(self, chunks=(64, 128, 192)):
        """One or two requests in flight, their chunks interleaved; then the copies land and
        SGLang's idle check must hold."""
        h, rng = self.h, self.rng
        runs = [self.run(self.admit(self.next_prompt())[0], rng.choice(chunks))
                for _ in range(rng.choice([1, 2]))]
        while runs:
            for r in list(runs):
                if next(r, StopIteration) is StopIteration:
                    runs.remove(r)
        h.cache.host.drain()
        h.cache._poll_host()
        h.check_idle()


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_with_host_pressure_serves_only_exact_prefixes(server_args, seed):
    h = build_cache(server_args, kv_pages=32, mamba_slots=24,
                               env={"HPC_CACHE_FULL_CHECK": "1", "HPC_HOST_CACHE_MIB": "1"}, zero_split=True)
    assert h.cache.host.memory.wait(60)
    rng = random.Random(seed)
    traffic = Traffic(h, rng)
    try:
        for _ in range(40):
            if rng.random() < 0.15:
                h.evict_all()                      # device pressure from elsewhere
            traffic.round()
        s = traffic.stats
        # the mix must exercise what it is for: reuse, host restores and aborts
        assert s["cached"] > 0 and s["from_host"] > 0 and h.cache.index.stats["host_evicted_snapshots"] + \
            h.cache.index.stats["host_swept_blocks"] > 0, s
    finally:
        h.cache.release_host_resources()


@pytest.mark.parametrize("seed", range(2))
def test_random_traffic_across_restarts_through_the_cache_file(server_args, tmp_path, seed):
    """The same traffic with --prefix-cache-file and a graceful restart every ten rounds (new
    SGLang pools, the same files): whatever the restarted cache loaded serves exact prefixes,
    and some of it is served."""
    env = {"HPC_CACHE_FULL_CHECK": "1", "HPC_HOST_CACHE_MIB": "1",
           "HPC_PREFIX_CACHE_FILE": str(tmp_path / "cache.bin")}
    rng = random.Random(100 + seed)
    traffic, restored = None, 0
    for life in range(3):
        h = build_cache(server_args, kv_pages=32, mamba_slots=24, env=env, zero_split=True)
        assert h.cache.host.memory.wait(60)
        h.cache._poll_host()
        if traffic is None:
            traffic = Traffic(h, rng)
        traffic.h = h
        if life:
            assert h.cache.index.snapshots, "the restart loaded nothing"
        before = traffic.stats["from_host"]
        try:
            for _ in range(10):
                traffic.round(chunks=(64, 128))
            if life:
                restored += traffic.stats["from_host"] - before
        finally:
            h.cache.release_host_resources()       # SIGTERM: save
    assert restored > 0, traffic.stats
