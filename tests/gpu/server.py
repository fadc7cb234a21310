"""A real SGLang server for the GPU tests: launch, token-level requests, stop."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import requests


def _check_port_free(port: int) -> None:
    """A server left on the port (by a run that was killed) would answer this test's requests
    in the new server's place."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn: TIME_WAIT is fine
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as err:
            raise RuntimeError(f"port {port} is taken ({err}); a server from an earlier run?") from None


class Server:
    def __init__(self, model: str, args: list[str], log_path: str, port: int, env=None):
        self.model = model
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        _check_port_free(port)
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model,
               "--host", "127.0.0.1", "--port", str(port), *args]
        self.cmd = cmd
        self.log = open(log_path, "w")
        # cwd outside the checkout: the installed package (with hpc_radix.kernels and
        # hpc_radix.patches mapped in) must win over the source tree
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=tempfile.gettempdir(),
                                     env={**os.environ, **(env or {})})
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.tail()}")
            if time.time() - t0 > 600:
                self.stop()
                raise RuntimeError("server start timed out")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        self.ready_at = time.time()
        self.ready_s = self.ready_at - t0

    def kernels_compiled_since_ready(self, names) -> list[str]:
        """The Triton kernels among ``names`` compiled after the server was ready (each compile
        writes ``NAME.json`` into Triton's cache directory, which loads never touch)."""
        cache = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
        found = []
        for root, _, files in os.walk(cache):
            for f in files:
                name = f[:-len(".json")]
                if name in names and os.path.getmtime(os.path.join(root, f)) > self.ready_at:
                    found.append(name)
        return sorted(found)

    def tail(self, lines: int = 60) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-lines:])

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def generate(self, ids, max_new_tokens=16, rid=None, logprobs=True, timeout=300,
                 extra_key=None):
        """``extra_key``: SGLang's cache namespace (a cache salt): another one shares nothing,
        so the request runs cold on a warm server."""
        body = {"input_ids": list(ids),
                "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                    "ignore_eos": True},
                "return_logprob": logprobs, "top_logprobs_num": 5 if logprobs else 0,
                "logprob_start_len": -1}
        if rid is not None:
            body["rid"] = rid
        if extra_key is not None:
            body["extra_key"] = extra_key
        r = requests.post(self.url + "/generate", json=body, timeout=timeout)
        r.raise_for_status()
        return Result(r.json())

    def generate_to_be_aborted(self, ids, rid: str, **kwargs) -> None:
        """A request the test aborts (from another thread): its error status is expected."""
        try:
            self.generate(ids, rid=rid, **kwargs)
        except Exception:  # noqa: BLE001 - the abort may end the request with an error status
            pass

    def abort(self, rid: str) -> None:
        requests.post(self.url + "/abort_request", json={"rid": rid}, timeout=30)

    def send_and_abort(self, prompts, tag: str, after_s: float, **kwargs) -> None:
        """Send ``prompts`` at once (rids ``tag-i``), abort them all ``after_s`` later, and
        wait for every one to end."""
        threads = [threading.Thread(target=self.generate_to_be_aborted, args=(ids, f"{tag}-{i}"),
                                    kwargs=kwargs) for i, ids in enumerate(prompts)]
        for t in threads:
            t.start()
        time.sleep(after_s)
        for i in range(len(prompts)):
            self.abort(f"{tag}-{i}")
        for t in threads:
            t.join()

    def flush(self) -> None:
        r = requests.post(self.url + "/flush_cache", timeout=60)
        assert r.status_code == 200, r.text

    def stop(self, graceful: bool = False) -> None:
        """SIGTERM to the whole process group, or (``graceful``) to the launcher only, as an
        operator's ``kill PID`` or a container stop does: only then does SGLang drain and let
        the scheduler call the cache's release_host_resources (a scheduler that receives
        SIGTERM itself dies at once). Whatever is left after 30 s is killed."""
        if self.proc.poll() is None:
            if graceful:
                self.proc.send_signal(signal.SIGTERM)
            else:
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()

    def kill(self) -> None:
        """SIGKILL to every process of the server at once: a crash, an OOM kill."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self.log.close()


class Result:
    def __init__(self, j):
        self.json = j
        self.output_ids = j["output_ids"]
        meta = j["meta_info"]
        self.cached = meta["cached_tokens"]
        self.prompt_tokens = meta["prompt_tokens"]
        # per output token: {token id: logprob} of its top 5
        self.tops = [{t[1]: t[0] for t in top} for top in meta.get("output_top_logprobs") or []]
        self.first_top = self.tops[0] if self.tops else {}
        self.token_logprobs = [t[0] for t in meta.get("output_token_logprobs") or []]


def first_token_gap(a: Result, b: Result) -> float:
    """Largest difference of the first token's top-5 logprobs (over the ids both report)."""
    common = set(a.first_top) & set(b.first_top)
    assert common, "no common top-5 token"
    return max(abs(a.first_top[t] - b.first_top[t]) for t in common)


def first_divergence(a: Result, b: Result) -> int:
    """How many greedy tokens agree before the first that differs (all compared if none)."""
    return next((i for i, (x, y) in enumerate(zip(a.output_ids, b.output_ids)) if x != y),
                min(len(a.output_ids), len(b.output_ids)))


def agreement(a: Result, b: Result) -> float:
    """Fraction of greedy tokens that agree, up to the first divergence."""
    return first_divergence(a, b) / max(1, len(a.output_ids))


def diverges_at_tie(a: Result, b: Result, tol: float) -> bool:
    """The two greedy outputs first differ at a token the model ranks within ``tol`` of the
    other server's choice, on both servers (a random-weight model's near ties flip with the
    chunk grid, for example where two caches resume a turn at different positions)."""
    k = first_divergence(a, b)
    if k >= min(len(a.output_ids), len(b.output_ids), len(a.tops), len(b.tops)):
        return False
    x, y = a.output_ids[k], b.output_ids[k]
    return all(t in r.tops[k] for r in (a, b) for t in (x, y)) and \
        max(abs(r.tops[k][x] - r.tops[k][y]) for r in (a, b)) < tol


class Chat:
    """ChatML prompts rendered with the model's own tokenizer (specials included)."""

    def __init__(self, model_dir: str, seed: int = 0):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.rng = random.Random(seed)

    def text(self, n_chars: int) -> str:
        words = []
        while sum(len(w) + 1 for w in words) < n_chars:
            words.append("".join(self.rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(self.rng.randint(2, 9))))
        return " ".join(words)[:n_chars]

    def render(self, messages, generation=True) -> list[int]:
        s = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
        if generation:
            s += "<|im_start|>assistant\n"
        return self.tok.encode(s, add_special_tokens=False).ids

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids


def serve_sessions(server: Server, chat: "Chat", turns: int = 3, count: int = 4,
                   max_new_tokens: int = 16) -> list:
    """``count`` sessions of growing prompts (together several times an 8192-token pool), each
    turn continuing its session's prompt and output, ``turns`` rounds of them; the (prompt ids,
    Result) pairs in order."""
    convs = [[("system", chat.text(500)), ("user", chat.text(900 + 100 * i))] for i in range(count)]
    history, results = {}, []
    for _ in range(turns):
        for key, conv in enumerate(convs):
            ids = history.get(key) or chat.render(conv)
            r = server.generate(ids, max_new_tokens=max_new_tokens)
            results.append((ids, r))
            history[key] = ids + r.output_ids + chat.encode(
                "<|im_end|>\n<|im_start|>user\n" + chat.text(120) + "<|im_end|>\n<|im_start|>assistant\n")
    return results


def assert_clean_log(text: str, words=("Traceback", "leak", "device-side assert")) -> None:
    """No log line names a failure."""
    bad = [line for line in text.splitlines() if any(w in line for w in words)]
    assert not bad, bad[:5]


def assert_turns_agree(got: list, want: list, tol: float = 2e-2) -> None:
    """Each turn two servers were sent alike (the same prompt ids, from ``serve_sessions``):
    first-token logprobs within ``tol``, greedy outputs agreeing for at least half of the
    tokens, or else first differing at a near tie."""
    for turn, ((ids, a), (ids_ref, b)) in enumerate(zip(got, want)):
        if ids == ids_ref:
            assert first_token_gap(a, b) < tol, turn
            assert agreement(a, b) >= 0.5 or diverges_at_tie(a, b, tol), \
                (turn, a.cached, b.cached, a.output_ids, b.output_ids, agreement(a, b))
