"""End-to-end: the shared tier (--cache-store-dir) behind two `--radix-cache hybrid` servers on
one GPU, the tiny random-weight Qwen3.5. A session whose turns alternate servers resumes on each
from what the other wrote; a server killed with SIGKILL and started again serves its next turn
from the tier; B reads back within its scheduling round (--cache-store-sync-ms), A a round
later; B's objects are written by its writer process (the default), from shared pinned host
chunks, A's by threads of its own process (--cache-store-writer threads). Every warm turn agrees with a cold run of the same prompt (another cache
namespace, so nothing is shared) as a cold run with another chunk grid does (design §13.3)."""
from __future__ import annotations

import glob
import os
import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from server import Chat, Server, agreement, assert_clean_log, first_token_gap  # noqa: E402
from test_host_tier_server import FLAGS  # noqa: E402


def next_turn(chat, prompt, result):
    return prompt + result.output_ids + chat.encode(
        "<|im_end|>\n<|im_start|>user\n" + chat.text(300) + "<|im_end|>\n<|im_start|>assistant\n")


def states_in(tier) -> int:
    return len(glob.glob(os.path.join(tier, "objects", "*", "*.s.*")))


def written(tier, before: int, timeout: float = 60.0) -> None:
    """The servers wrote the turn's states (in the background, after the reply, each after
    its blocks): more states than ``before`` are there, and no object arrived for 2 s."""
    end, seen, still = time.time() + timeout, None, 0
    while time.time() < end and not (states_in(tier) > before and still >= 10):
        time.sleep(0.2)
        now = sum(in_tier(tier).values())
        seen, still = now, (still + 1 if now == seen else 0)
    assert states_in(tier) > before, "no state reached the shared tier"


def in_tier(tier) -> dict:
    names = glob.glob(os.path.join(tier, "objects", "*", "*"))
    return {"blocks": sum(".b." in n for n in names), "states": sum(".s." in n for n in names)}


def check_warm(server, prompt, warm, resumed_at: int, tag: str) -> None:
    assert warm.cached >= resumed_at - 1, (tag, warm.cached, resumed_at)
    cold = server.generate(prompt, max_new_tokens=16, extra_key=f"cold-{tag}")
    assert cold.cached == 0, cold.cached
    assert first_token_gap(warm, cold) < 2e-2, tag
    assert agreement(warm, cold) >= 0.5, tag


def test_a_session_alternating_servers_and_a_killed_server_resume_from_the_tier(model, tmp_path):
    tier = str(tmp_path / "tier")
    flags = FLAGS + ["--cache-store-dir", tier]
    logs = os.environ.get("HPC_GPU_LOG_DIR") or str(tmp_path)
    env = {"HPC_CACHE_FULL_CHECK": "1"}
    env_b = {**env, "HPC_CACHE_STORE_SYNC_MS": "40"}
    chat = Chat(model, seed=13)
    env_a = {**env, "HPC_CACHE_STORE_WRITER": "threads"}    # A's objects: its threads'; B's: its writer process's
    a = Server(model, flags, os.path.join(logs, "server-tier-a.log"), port=31121, env=env_a)
    b = Server(model, flags, os.path.join(logs, "server-tier-b.log"), port=31122, env=env_b)
    servers = [a, b]
    try:
        first = chat.render([("system", chat.text(500)), ("user", chat.text(1200))])
        before = states_in(tier)                              # (the warm-up requests' states)
        r1 = a.generate(first, max_new_tokens=16)
        written(tier, before)
        held = in_tier(tier)
        second = next_turn(chat, first, r1)
        before = states_in(tier)
        r2 = b.generate(second, max_new_tokens=16)            # the next turn on the other server
        if r2.cached < len(first):
            a.flush()                                         # (its counters go to its log)
            b.flush()
            time.sleep(1)
            raise AssertionError(f"{held} before the turn, {in_tier(tier)} after; A: "
                                 + " | ".join(l[-400:] for l in a.log_text().splitlines() if "in the last interval" in l)
                                 + " B: " + " | ".join(l[-400:] for l in b.log_text().splitlines() if "in the last interval" in l))
        check_warm(b, second, r2, len(first) + len(r1.output_ids), "b")
        assert "--cache-store-sync-ms 40" in b.log_text()
        written(tier, before)
        third = next_turn(chat, second, r2)
        before = states_in(tier)
        r3 = a.generate(third, max_new_tokens=16)             # and back
        check_warm(a, third, r3, len(second) + len(r2.output_ids), "a")
        written(tier, before)
        b.kill()                                              # a crash: nothing saved
        b = Server(model, flags, os.path.join(logs, "server-tier-b2.log"), port=31123, env=env_b)
        servers.append(b)
        fourth = next_turn(chat, third, r3)
        r4 = b.generate(fourth, max_new_tokens=16)            # the restarted server, from the tier
        check_warm(b, fourth, r4, len(third) + len(r3.output_ids), "restarted")
    finally:
        texts = []
        for s in servers:
            if s.alive():
                texts.append(s.log_text())
                s.stop()
    assert "written by threads" in texts[0]
    assert all("written by process" in t and "could not be pinned" not in t for t in texts[1:])
    for text in texts:
        assert "hybrid radix cache: shared tier: file at" in text
        assert_clean_log(text, ("Traceback", "AssertionError", "leak", "device-side assert"))
