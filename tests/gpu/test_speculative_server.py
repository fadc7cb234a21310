"""End-to-end: `--radix-cache hybrid` under speculative decoding with the model's MTP head
(design §12.4) on the tiny random-weight Qwen3.5, against stock SGLang with the same
speculative decoding. The target verifies every drafted token, so each turn's greedy output
must agree with stock's however well the random draft guesses; the hybrid's turns resume from
its endpoints, tails and host copies, and cache within 0.5 % of what the hybrid without
speculative decoding caches; requests aborted mid-decode leave nothing behind.
"""
from __future__ import annotations

import os
import re
import shlex
import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from server import (Chat, Server, assert_clean_log, assert_turns_agree,  # noqa: E402
                    serve_sessions)

SPEC = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3"]
BASE = ["--mem-fraction-static", "0.15", "--cuda-graph-max-bs", "4", "--max-running-requests", "8",
        "--attention-backend", "triton", "--chunked-prefill-size", "512", "--max-total-tokens", "8192",
        "--mamba-radix-cache-strategy", "extra_buffer", "--enable-cache-report",
        "--disable-overlap-schedule"] + shlex.split(os.environ.get("HPC_GPU_SERVER_ARGS", ""))
COMMON = BASE + SPEC
ENV = {"HPC_CACHE_FULL_CHECK": "1"}


def spec_args(overlap: bool) -> list:
    """COMMON, or with overlap scheduling (SGLang's default, which runs its second speculative
    worker) and tracking every 64 tokens, so that most turns end past a tracked state."""
    if not overlap:
        return COMMON
    return [a for a in COMMON if a != "--disable-overlap-schedule"] + ["--mamba-track-interval", "64"]


@pytest.fixture(scope="module")
def stock_turns(model, tmp_path_factory):
    """Stock + NEXTN's turns, the reference of every case: on the GPU its outputs with and
    without overlap scheduling were the same token for token."""
    logs = os.environ.get("HPC_GPU_LOG_DIR") or str(tmp_path_factory.mktemp("logs"))
    stock = Server(model, COMMON, os.path.join(logs, "server-spec-stock.log"), port=31300)
    try:
        return serve_sessions(stock, Chat(model, seed=41), max_new_tokens=24)
    finally:
        stock.stop()


@pytest.fixture(scope="module")
def unspeculated_turns(model, tmp_path_factory):
    """The same sessions on the hybrid with a host tier and no speculative decoding (served on
    first use: only the host-tier case compares with them)."""
    logs = os.environ.get("HPC_GPU_LOG_DIR") or str(tmp_path_factory.mktemp("logs"))
    turns = []

    def of() -> list:
        if not turns:
            hybrid = Server(model, BASE + ["--radix-cache", "hybrid", "--host-cache-mib", "1024"],
                            os.path.join(logs, "server-spec-reference.log"), port=31303,
                            env=ENV)
            try:
                turns.extend(serve_sessions(hybrid, Chat(model, seed=41), max_new_tokens=24))
            finally:
                hybrid.stop()
        return turns
    return of


@pytest.mark.parametrize("host_mib,overlap", [(0, False), (1024, False), (0, True)],
                         ids=["host0", "host1024", "host0-overlap"])
def test_speculative_turns_resume_and_agree_with_stock(model, tmp_path, stock_turns, host_mib, overlap,
                                                       unspeculated_turns):
    """With overlap scheduling (SGLang's default) endpoints are the states tracked last, every
    64 tokens here so that most turns end past one, and the turns cache less than without
    speculation; their outputs still agree with stock's. A turn may resume at its earlier
    prompt's exact tail where stock resumes at a tracked state: another chunk grid, where a
    random-weight model's near tie may flip (on the GPU, turn 9 of the overlap case)."""
    logs = os.environ.get("HPC_GPU_LOG_DIR") or str(tmp_path)
    hybrid = Server(model, spec_args(overlap) + ["--radix-cache", "hybrid", "--host-cache-mib", str(host_mib)],
                    os.path.join(logs, f"server-spec-hybrid-{host_mib}{'-overlap' * overlap}.log"),
                    port=31301 + bool(host_mib) + 3 * overlap, env=ENV)
    try:
        got = serve_sessions(hybrid, Chat(model, seed=41), max_new_tokens=24)
        # every continuing turn against a cold run of the same prompt on this server
        colds = []
        for ids, _ in got[4:]:
            hybrid.flush()
            colds.append((ids, hybrid.generate(ids, max_new_tokens=24)))
        abort_while_decoding(hybrid, Chat(model, seed=43))
        hybrid.generate(ids, max_new_tokens=4, logprobs=False)
        time.sleep(1)                             # idle: SGLang checks its pools
        assert hybrid.alive()
        text = hybrid.log_text()
    finally:
        hybrid.stop()
    assert "the draft model's KV is cached with the target's" in text
    assert ("endpoint is the state tracked last" in text) == overlap
    assert sum(r.cached for _, r in got[4:]) > 0
    if host_mib:
        assert "(a block with its draft model's KV)" in text    # host hits bring it back
        assert re.search(r"host_hits \+[1-9]", text), "no turn came back from host"
    assert got[-1][1].cached > 0
    assert_turns_agree(got[4:], colds)
    assert_turns_agree(got, stock_turns)
    if host_mib:   # what speculation costs the cache: the turns both served alike
        pairs = [(a.cached, b.cached) for (ids, a), (ids_ref, b) in zip(got, unspeculated_turns())
                 if ids == ids_ref]
        with_spec, without = (sum(x) for x in zip(*pairs))
        assert len(pairs) >= 4 and abs(with_spec - without) <= 0.005 * without, pairs
    assert_clean_log(text)


def abort_while_decoding(server, chat, n=4):
    """Requests aborted while they decode speculatively (between a draft and its verify, or
    with the next verify queued under overlap): nothing may leak, which SGLang's idle check and
    the cache's full check (HPC_CACHE_FULL_CHECK) see."""
    prompts = [chat.render([("user", chat.text(400))]) for _ in range(n)]
    server.send_and_abort(prompts, "verify", 0.5, max_new_tokens=400, logprobs=False)
