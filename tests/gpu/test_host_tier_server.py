"""End-to-end: the host tier behind `--radix-cache hybrid` on the tiny random-weight Qwen3.5.

One server whose device pool is far smaller than the conversations it serves, with a host tier:
a conversation pushed off the device comes back from host, and its next turn agrees with a cold
run of the same prompt (design §13.3).
"""
from __future__ import annotations

import os
import re

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from server import Chat, Server, agreement, assert_clean_log, first_token_gap  # noqa: E402

FLAGS = ["--radix-cache", "hybrid", "--mem-fraction-static", "0.15", "--cuda-graph-max-bs", "4",
         "--max-running-requests", "8", "--attention-backend", "triton",
         "--chunked-prefill-size", "512", "--max-total-tokens", "8192",
         "--host-cache-mib", "1024", "--enable-cache-report"]


# when the host tier is pinned (--host-cache-pin): HPC_GPU_HOST_PINS=startup,on-demand runs both
PINS = [p for p in os.environ.get("HPC_GPU_HOST_PINS", "startup").split(",") if p]
# --host-restore-overlap: off and on (the default), each a server of its own; the first copies by
# the Triton kernel (--host-copy kernel) and waits for a restore before the pass (the default), the
# second copies on the copy engines (the default), makes a pass wait for a restore layer by layer
# (--host-restore-wait layer) and prefetches for a head refused for want of pages (--host-prefetch on)
OVERLAPS = [o for o in os.environ.get("HPC_GPU_HOST_OVERLAP", "off,on").split(",") if o]


@pytest.fixture(scope="module", params=[(p, o) for p in PINS for o in OVERLAPS],
                ids=lambda po: f"pin-{po[0]}-overlap-{po[1]}")
def server(model, tmp_path_factory, request):
    pin, overlap = request.param
    log = os.environ.get("HPC_GPU_LOG_DIR") or str(tmp_path_factory.mktemp("logs"))
    path = ["--host-copy", "kernel"] if overlap == "off" else ["--host-restore-wait", "layer"]
    srv = Server(model, FLAGS + ["--host-cache-pin", pin, "--host-restore-overlap", overlap,
                                 "--host-prefetch", overlap] + path,
                 os.path.join(log, f"server-host-{pin}-overlap-{overlap}.log"),
                 port=31110 + request.param_index,   # its own: the last one may still hold its port
                 env={"HPC_CACHE_FULL_CHECK": "1"})
    srv.model_dir, srv.overlap = model, overlap
    yield srv
    text = srv.log_text()
    srv.stop()
    assert "host tier of 1024 MiB" in text
    kernel = overlap == "off"
    assert ("host copies by the Triton copy kernel (--host-copy kernel)" if kernel else
            "host copies by the copy engines (cuMemcpyBatchAsync, CUDA driver") in text
    assert ("waits for its host restores whole, before its first layer (--host-restore-wait pass"
            if kernel else "waits for its host restores layer by layer (copied in up to 4 parts of consecutive layers, a batched copy") in text
    by_layer = [sum(int(n) for n in re.findall(rf"{k} \+(\d+)", text))
                for k in ("passes_waiting_by_layer", "restore_layer_waits")]
    assert (by_layer == [0, 0]) if kernel else (by_layer[0] > 0 and by_layer[1] >= by_layer[0]), by_layer
    assert_clean_log(text, ("Traceback", "AssertionError", "leak", "device-side assert"))


def test_a_conversation_pushed_off_the_device_comes_back_from_host(server):
    chat = Chat(server.model_dir, seed=5)
    server.flush()
    first = chat.render([("system", chat.text(600)), ("user", chat.text(1200))])
    r1 = server.generate(first, max_new_tokens=24)
    # other conversations fill the 8192-token device pool several times over
    for _ in range(8):
        server.generate(chat.render([("system", chat.text(900)), ("user", chat.text(2500))]),
                        max_new_tokens=8)
    second = first + r1.output_ids + chat.encode(
        "<|im_end|>\n<|im_start|>user\n" + chat.text(200) + "<|im_end|>\n<|im_start|>assistant\n")
    warm = server.generate(second, max_new_tokens=24)
    whole = len(first) + len(r1.output_ids)
    assert warm.cached >= whole - 1, (warm.cached, whole)       # the endpoint, from host
    server.flush()
    cold = server.generate(second, max_new_tokens=24)
    assert first_token_gap(warm, cold) < 2e-2
    assert agreement(warm, cold) >= 0.5
    assert "host restore of" not in server.log_text()            # no restore fell back


def test_a_prompt_only_continuation_resumes_from_host_at_the_earlier_prompts_end(server):
    """Traffic whose next request goes on from an earlier prompt without its output (a
    sibling question on a document, Mooncake's conversation trace as replayed): the earlier
    prompt's tail state, kept on host, serves it at exactly that prompt's end."""
    chat = Chat(server.model_dir, seed=21)
    server.flush()
    first = chat.encode(chat.text(2400))
    first = first[:len(first) - len(first) % 64 - 23]          # ends off the page grid
    server.generate(first, max_new_tokens=8)
    for _ in range(8):                         # the 8192-token device pool, several times over
        server.generate(chat.encode(chat.text(3000)), max_new_tokens=4, logprobs=False)
    second = first + chat.encode(" " + chat.text(400))
    warm = server.generate(second, max_new_tokens=24)
    assert warm.cached == len(first), (warm.cached, len(first))
    server.flush()
    cold = server.generate(second, max_new_tokens=24)
    assert first_token_gap(warm, cold) < 2e-2
    assert agreement(warm, cold) >= 0.5


def test_short_conversations_restore_beside_the_pass_in_flight(server):
    """Restores that fit in the spare pages (16 with a host tier; a 30-block one does not)
    run beside the pass in flight with --host-restore-overlap on, never with it off, and each
    resumed turn agrees with a cold run of its prompt."""
    chat = Chat(server.model_dir, seed=13)
    server.flush()
    start = len(server.log_text())
    firsts = [chat.render([("system", chat.text(120)), ("user", chat.text(150))]) for _ in range(3)]
    replies = [server.generate(ids, max_new_tokens=8) for ids in firsts]
    for _ in range(8):                         # the 8192-token device pool, several times over
        server.generate(chat.render([("system", chat.text(900)), ("user", chat.text(2500))]),
                        max_new_tokens=4, logprobs=False)
    seconds = [ids + r.output_ids + chat.encode(
        "<|im_end|>\n<|im_start|>user\n" + chat.text(60) + "<|im_end|>\n<|im_start|>assistant\n")
        for ids, r in zip(firsts, replies)]
    warms = [server.generate(ids, max_new_tokens=16) for ids in seconds]
    server.flush()                             # the cache logs its counters at a flush
    overlapped = sum(int(n) for n in re.findall(r"restores_overlapped \+(\d+)",
                                                  server.log_text()[start:]))
    for ids, r, warm in zip(firsts, replies, warms):
        assert warm.cached >= len(ids) + len(r.output_ids) - 1, warm.cached
    colds = [server.generate(ids, max_new_tokens=16) for ids in seconds]
    for warm, cold in zip(warms, colds):
        assert first_token_gap(warm, cold) < 2e-2 and agreement(warm, cold) >= 0.5
    assert (overlapped > 0) == (server.overlap == "on"), overlapped


def test_aborts_during_host_restores_leave_nothing_behind(server):
    """Conversations pushed off the device are resumed at once and aborted at once: wherever
    each restore was, nothing leaks (the fixture reads the log: SGLang's idle check, the
    cache's full check) and the same prompts then resume from host."""
    chat = Chat(server.model_dir, seed=11)
    server.flush()
    firsts = [chat.render([("system", chat.text(600)), ("user", chat.text(1500))])
              for _ in range(4)]
    for ids in firsts:
        server.generate(ids, max_new_tokens=4, logprobs=False)
    for _ in range(8):                         # the 8192-token device pool, several times over
        server.generate(chat.render([("system", chat.text(900)), ("user", chat.text(2500))]),
                        max_new_tokens=4, logprobs=False)
    tails = [ids + chat.encode(chat.text(100)) for ids in firsts]
    server.send_and_abort(tails, "restore", 0.01, max_new_tokens=4, logprobs=False)
    for ids, tail in zip(firsts, tails):
        again = server.generate(tail, max_new_tokens=4, logprobs=False)
        assert again.cached >= len(ids) - 64, (again.cached, len(ids))
    assert server.alive()


def test_no_cache_kernel_compiled_after_the_server_was_ready(server):
    """The kernels the cache launches (and SGLang's paged-allocator kernels, which only our
    64-token pages use) compile at startup, not in a user's request: on a cold Triton cache an
    A/B run's first requests waited ~300 ms for them. Runs after the tests above drove
    write-through, restores, taps and aborts through the server."""
    ours = {"_copy_items_kernel", "_copy_state_slots_kernel", "_fwd_h_taps_kernel",
            "alloc_extend_kernel", "alloc_decode_kernel"}
    assert server.kernels_compiled_since_ready(ours) == []


def test_a_session_survives_a_restart_through_the_cache_file(model, tmp_path):
    """A server with --prefix-cache-file serves a turn and stops (SIGTERM); a new server with
    the same file serves the next turn from the loaded host tier, as a cold run would."""
    path = str(tmp_path / "cache.bin")
    flags = FLAGS + ["--prefix-cache-file", path]
    chat = Chat(model, seed=9)
    first = chat.render([("system", chat.text(500)), ("user", chat.text(900))])
    logs = os.environ.get("HPC_GPU_LOG_DIR") or str(tmp_path)
    a = Server(model, flags, os.path.join(logs, "server-save.log"), port=31101)
    try:
        r1 = a.generate(first, max_new_tokens=16)
    finally:
        a.stop(graceful=True)                      # SIGTERM to the launcher: the index is saved
    saved = re.search(r"saved (\d+) snapshots", open(os.path.join(logs, "server-save.log")).read())
    assert saved and int(saved.group(1)) >= 1, "the graceful stop saved nothing"
    second = first + r1.output_ids + chat.encode(
        "<|im_end|>\n<|im_start|>user\n" + chat.text(150) + "<|im_end|>\n<|im_start|>assistant\n")
    b = Server(model, flags, os.path.join(logs, "server-load.log"), port=31102)
    try:
        text = b.log_text()
        loaded = re.search(r"loaded (\d+) of (\d+) saved snapshots", text)
        assert loaded and loaded.group(1) == loaded.group(2) == saved.group(1), loaded
        assert "host tier stopped" not in text
        warm = b.generate(second, max_new_tokens=16)
        b.flush()
        cold = b.generate(second, max_new_tokens=16)
    finally:
        b.stop(graceful=True)
    assert warm.cached >= len(first) + len(r1.output_ids) - 1, warm.cached
    assert first_token_gap(warm, cold) < 2e-2 and agreement(warm, cold) >= 0.5
