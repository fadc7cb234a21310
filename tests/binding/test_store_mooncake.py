"""The shared tier in a real Mooncake Store (design §5.6): a master with its HTTP metadata
server started here on 127.0.0.1 (``mooncake-transfer-engine-non-cuda``, installed by
scripts/install-cpu.sh with the libibverbs its binaries link), clients over TCP."""
from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import time

import pytest

from hpc_radix.sglang_version import req_slots
from hpc_radix.persistence import fingerprint_digest, pack_object, unpack_object

LIBS = os.path.join(sys.prefix, "opt", "ibverbs")
SONAMES = ("lib/x86_64-linux-gnu/libnl-3.so.200", "usr/lib/x86_64-linux-gnu/libnl-route-3.so.200",
           "usr/lib/x86_64-linux-gnu/libibverbs.so.1")
MASTER = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
FP = fingerprint_digest({"model": "tiny"})

if not (os.path.exists(MASTER) and all(os.path.exists(os.path.join(LIBS, s)) for s in SONAMES)):
    pytest.skip("Mooncake Store is not installed (scripts/install-cpu.sh installs it)",
                allow_module_level=True)
for so in SONAMES:      # the client links them too: loaded before its extension is imported
    ctypes.CDLL(os.path.join(LIBS, so), mode=ctypes.RTLD_GLOBAL)
LD_PATH = os.pathsep.join(os.path.join(LIBS, d) for d in ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master:
    def __init__(self, rpc: int, http: int, log):
        self.rpc, self.http = rpc, http
        self.proc = subprocess.Popen(
            [MASTER, "--enable_http_metadata_server=true", f"--rpc_port={rpc}",
             f"--http_metadata_server_port={http}", "--http_metadata_server_host=127.0.0.1",
             f"--metrics_port={_free_port()}"],     # (9003 by default: two runs would collide)
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "LD_LIBRARY_PATH": LD_PATH})
        # Tried once more after the deadline: a Mooncake client still connecting elsewhere in
        # this process can keep the GIL from this loop for longer than the deadline.
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", rpc), timeout=1).close()
                return
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError("the Mooncake master did not start") from None
                time.sleep(0.2)

    def stop(self):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def master(tmp_path):
    rpc, http = _free_port(), _free_port()
    with open(tmp_path / "master.log", "w") as log:
        m = Master(rpc, http, log)
        yield m
        m.stop()


def config(m: Master) -> dict:
    # as an operator writes it for SGLang's HiCache Mooncake backend
    return {"master_server_address": f"127.0.0.1:{m.rpc}", "protocol": "tcp", "device_name": "",
            "metadata_server": f"http://127.0.0.1:{m.http}/metadata", "local_hostname": "127.0.0.1",
            "global_segment_size": 64 << 20, "local_buffer_size": 64 << 20}


READER = """
import ctypes, json, os, sys
for so in json.loads(sys.argv[2]):
    ctypes.CDLL(so, mode=ctypes.RTLD_GLOBAL)
from hpc_radix.binding.store.mooncake import MooncakeStore
store = MooncakeStore(json.loads(sys.argv[1]))
data = store.get(sys.argv[3])
sys.stdout.buffer.write(data or b"")
"""


def test_an_object_one_server_puts_another_gets_whole(master):
    from hpc_radix.binding.store.mooncake import MooncakeStore

    store = MooncakeStore(config(master))
    key, payload = "ab" + "0" * 30, os.urandom(3 << 20)
    assert store.put(key, pack_object(key, 2, FP, [payload[:1000], payload[1000:]]))
    assert store.exists([key, "cd" + "1" * 30]) == [True, False]
    assert bytes(unpack_object(store.get(key), key, FP)[1]) == payload
    rest = bytearray(3 << 20)                       # read into a slab, past a head
    head = bytearray(store.read_into(key, [bytearray(0)]) - len(rest))   # (its size, nothing read)
    assert store.read_into(key, [head, rest]) == len(head) + len(rest)
    assert bytes(unpack_object(head, key, FP, [rest])[1]) + bytes(rest) == payload
    size = len(head) + len(rest)                    # buffers of another size (a torn or foreign
    for other in (size - 1, size + 4096):           # object's): its size, nothing read, no fault
        assert store.read_into(key, [bytearray(other)]) == size
    import json
    out = subprocess.run([sys.executable, "-c", READER, json.dumps(config(master)),
                          json.dumps([os.path.join(LIBS, s) for s in SONAMES]), key],
                         capture_output=True, timeout=120)
    kind, got = unpack_object(out.stdout, key, FP)          # another client, another process
    assert kind == 2 and bytes(got) == payload
    assert store.get("cd" + "1" * 30) is None and store.stats["store_misses"] == 1
    assert store.read_into("cd" + "1" * 30, [bytearray(10)]) is None and store._client is not None
    other = "ef" + "2" * 30                                  # bytes changed under the write:
    assert not store.put(other, pack_object(other, 2, FP, [payload]), unchanged=lambda: False)
    assert store.exists([other]) == [False] and store.stats["store_put_failures"] == 0   # taken back
    store.close()


def test_a_store_that_goes_away_costs_misses_and_comes_back(tmp_path, caplog):
    from hpc_radix.binding.store.mooncake import MooncakeStore

    rpc, http = _free_port(), _free_port()
    log = open(tmp_path / "master.log", "w")
    m = Master(rpc, http, log)
    caplog.set_level("INFO", logger="hpc_radix")
    store = MooncakeStore(config(m))
    key = "ab" + "0" * 30
    assert store.put(key, pack_object(key, 1, FP, [b"x" * 1000]))
    m.stop()                                                   # the store goes away mid-run
    assert store.get(key) is None
    assert not store.put(key, pack_object(key, 1, FP, [b"y" * 1000]))
    t0 = time.monotonic()
    assert store.exists([key]) == [False] and not store.put(key, [b"y"])   # down: no call
    assert time.monotonic() - t0 < 1 and store.stats["store_put_failures"] == 2
    assert caplog.text.count("serving from device and host") == 1      # logged once
    m = Master(rpc, http, log)                                 # back (empty): reconnects
    store.RECONNECT_S, store._next_try = 0.0, 0.0              # (not after 10 s, here)
    try:
        assert store.put(key, pack_object(key, 1, FP, [b"z" * 1000]))
        assert bytes(unpack_object(store.get(key), key, FP)[1]) == b"z" * 1000
        assert "reachable again" in caplog.text
    finally:
        store.close()
        m.stop()
        log.close()


def test_two_caches_share_a_session_through_mooncake(master, tmp_path):
    """The cache-level test of test_store_tier.py's first, through a real master: server A
    serves a turn, replica B (new pools, its own client) resumes the session at A's endpoint."""
    import json

    from sglang_harness import build_cache, make_server_args
    from test_store_tier import OUTPUT, TURN1, TURN2, read_back, settle

    (tmp_path / "model").mkdir()
    args = make_server_args(tmp_path / "model")
    env = {"HPC_CACHE_FULL_CHECK": "1", "HPC_HOST_CACHE_MIB": "1",
           "HPC_CACHE_STORE_CONFIG": json.dumps(config(master))}
    caches = []
    for _ in range(2):
        h = build_cache(args, env=env)
        assert h.cache.host.memory.wait(60) and h.cache.store_worker.store.name == "mooncake"
        h.cache._poll_host()
        caches.append(h)
    a, b = caches
    a.serve(a.new_req(TURN1), OUTPUT)
    settle(a)
    assert a.cache.store_worker.stats["store_states_written"] == 2
    endpoint = max(a.cache.index.snapshots(), key=lambda s: s.frontier)
    image_a = [bytes(a.cache.host.memory.view(x).numpy()) for x in endpoint.host_slab_ids]
    store_b = b.cache.store_worker.store
    store_b.get = None              # read straight into B's slabs, never through Python bytes
    nxt = b.new_req(TURN2)
    assert read_back(b, nxt)
    s = max(b.cache.index.snapshots(), key=lambda s: s.frontier)
    assert [bytes(b.cache.host.memory.view(x).numpy()) for x in s.host_slab_ids] == image_a
    assert all(address in store_b._regions for address, _ in b.cache.host.memory.regions())
    assert b.admit(nxt) == 210
    b.cache.host.drain()
    assert b.state_of(int(req_slots(nxt).mamba_pool_idx)) == 210.0
    b.complete(nxt)
    settle(b)
    b.check_idle()
    for h in caches:
        h.cache.release_host_resources()


@pytest.fixture
def model_args(tmp_path):
    """Server arguments of a model directory (built before the test's log capture starts:
    SGLang's argument parsing sets logging up anew)."""
    from sglang_harness import make_server_args

    (tmp_path / "model").mkdir()
    return make_server_args(tmp_path / "model")


def test_a_store_unreachable_at_start_costs_reuse_only_and_is_used_once_up(tmp_path, model_args, caplog):
    """No master yet: the first connection takes Mooncake's client about 90 s to give up, on
    the tier's thread; the cache serves meanwhile (requests wait --cache-store-wait-ms at most),
    logs once, and writes to the store once the master is there."""
    import json

    from sglang_harness import build_cache
    from test_store_tier import OUTPUT, TURN1, prompt

    rpc, http = _free_port(), _free_port()
    cfg = {"master_server_address": f"127.0.0.1:{rpc}", "protocol": "tcp", "device_name": "",
           "metadata_server": f"http://127.0.0.1:{http}/metadata", "local_hostname": "127.0.0.1",
           "global_segment_size": 64 << 20, "local_buffer_size": 64 << 20}
    h = build_cache(model_args, env={
        "HPC_CACHE_FULL_CHECK": "1", "HPC_HOST_CACHE_MIB": "1", "HPC_CACHE_STORE_WAIT_MS": "50",
        "HPC_CACHE_STORE_CONFIG": json.dumps(cfg)})
    assert h.cache.host.memory.wait(60)
    caplog.set_level("INFO")
    t0 = time.monotonic()
    first = h.new_req(TURN1)
    first.init_next_round_input(h.cache)            # asks the tier: its thread blocks connecting
    time.sleep(0.1)
    first.init_next_round_input(h.cache)            # the next round ...
    assert not h.cache.coalesce_wait(first)         # ... waited 50 ms at most
    assert h.admit(first) == 0
    h.complete(first, OUTPUT)
    h.cache.host.drain()
    h.cache._poll_host()
    assert time.monotonic() - t0 < 30               # served while the store could not be reached
                                                    # (its client alone would hold the GIL 90 s)
    with open(tmp_path / "master.log", "w") as log:
        m = Master(rpc, http, log)
        try:
            worker = h.cache.store_worker
            assert worker.drain(timeout=180)        # the connection gave up; its queue was served
            assert caplog.text.count("serving from device and host") == 1
            worker.store._next_try = 0.0            # (tried again after 10 s otherwise)
            h.serve(h.new_req(prompt(200, seed=5)), OUTPUT)
            for _ in range(3):
                h.cache.host.drain()
                h.cache._poll_host()
                assert worker.drain(timeout=60)
            assert worker.stats["store_states_written"] >= 1
            h.check_idle()
            h.cache.release_host_resources()
        finally:
            m.stop()
