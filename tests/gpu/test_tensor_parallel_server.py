"""End-to-end: `--radix-cache hybrid` with a host tier and a cache file under `--tp 2` on the tiny
random-weight Qwen3.5 (needs two GPUs). Every rank must decide alike (design §12.3): the servers
run with HPC_TP_CHECK=1, which stops them at the first step the ranks' caches differ.
"""
from __future__ import annotations

import os
import re

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]

from server import (Chat, Server, agreement, assert_clean_log, assert_turns_agree,  # noqa: E402
                    first_token_gap, serve_sessions)

COMMON = ["--tp", "2", "--mem-fraction-static", "0.15", "--cuda-graph-max-bs", "4",
          "--max-running-requests", "8", "--attention-backend", "triton",
          "--chunked-prefill-size", "512", "--max-total-tokens", "8192",
          "--mamba-radix-cache-strategy", "extra_buffer", "--enable-cache-report"]
HYBRID = COMMON + ["--radix-cache", "hybrid", "--host-cache-mib", "1024"]
CHECK = {"HPC_TP_CHECK": "1", "HPC_CACHE_FULL_CHECK": "1"}


def clean(text: str) -> None:
    assert_clean_log(text, ("Traceback", "diverged", "leak", "device-side assert"))


def test_ranks_serve_sessions_from_host_alike_and_as_stock_tp2_does(model, tmp_path):
    logs = os.environ.get("HPC_GPU_LOG_DIR") or str(tmp_path)
    chat = Chat(model, seed=31)
    stock = Server(model, COMMON, os.path.join(logs, "server-tp2-stock.log"), port=31200)
    try:
        want = serve_sessions(stock, chat)
    finally:
        stock.stop()
    hybrid = Server(model, HYBRID, os.path.join(logs, "server-tp2-hybrid.log"), port=31201, env=CHECK)
    try:
        got = serve_sessions(hybrid, Chat(model, seed=31))
        text = hybrid.log_text()
    finally:
        hybrid.stop()
    assert [ids for ids, _ in got] != [] and len(got) == len(want)
    assert re.search(r"host_hits \+[1-9]", text), "no turn came back from host"
    assert sum(r.cached for _, r in got[4:]) > 0
    assert_turns_agree(got, want)
    clean(text)


def test_a_tp2_restart_loads_every_ranks_file_alike(model, tmp_path):
    logs = os.environ.get("HPC_GPU_LOG_DIR") or str(tmp_path)
    path = str(tmp_path / "cache.bin")
    flags = HYBRID + ["--prefix-cache-file", path]
    chat = Chat(model, seed=9)
    first = chat.render([("system", chat.text(500)), ("user", chat.text(900))])
    a = Server(model, flags, os.path.join(logs, "server-tp2-save.log"), port=31202, env=CHECK)
    try:
        r1 = a.generate(first, max_new_tokens=16)
    finally:
        a.stop(graceful=True)
    assert os.path.exists(path + ".tp0") and os.path.exists(path + ".tp1")
    second = first + r1.output_ids + chat.encode(
        "<|im_end|>\n<|im_start|>user\n" + chat.text(150) + "<|im_end|>\n<|im_start|>assistant\n")
    b = Server(model, flags, os.path.join(logs, "server-tp2-load.log"), port=31203, env=CHECK)
    try:
        text = b.log_text()
        loaded = re.findall(r"loaded (\d+) of (\d+) saved snapshots", text)
        assert len(loaded) == 2 and loaded[0] == loaded[1] and int(loaded[0][0]) >= 1, loaded
        warm = b.generate(second, max_new_tokens=16)
        b.flush()
        cold = b.generate(second, max_new_tokens=16)
        clean(b.log_text())
    finally:
        b.stop(graceful=True)
    assert warm.cached >= len(first) + len(r1.output_ids) - 1, warm.cached
    assert first_token_gap(warm, cold) < 2e-2 and agreement(warm, cold) >= 0.5
