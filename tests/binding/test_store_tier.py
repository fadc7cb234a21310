"""The shared tier through HybridRadixCache (design §5.6): two caches over SGLang's real pools
share a file tier; the second resumes a session the first served, at the same state, read back
into its host tier while the request waited in the queue. Faults cost reuse, never an output."""
from __future__ import annotations

import glob
import os
import threading
import time

import pytest

from hpc_radix.sglang_version import req_slots, prefix_len
from hpc_radix.index import PromptKey
from hpc_radix.patches.scheduler_hooks import _around_next_round
from hpc_radix.binding.store.policy import _Offer
from hpc_radix.binding.store.objects import anchor_prefix
from hpc_radix.binding.store.worker import Probe
from sglang_harness import (build_cache, make_server_args, model_with_weights,
                            sglang_init_next_round_input)
from sglang_harness import ramp_prompt as prompt

torch = pytest.importorskip("torch")


TURN1 = prompt(200)
OUTPUT = [7] * 10
TURN2 = TURN1 + OUTPUT + prompt(40, seed=3)


@pytest.fixture
def setup(tmp_path):
    args = model_with_weights(tmp_path / "model")
    env = {"HPC_CACHE_FULL_CHECK": "1", "HPC_HOST_CACHE_MIB": "1",
           "HPC_CACHE_STORE_DIR": str(tmp_path / "tier")}
    return args, env, tmp_path / "tier"


def server(args, env):
    h = build_cache(args, env=env)
    assert h.cache.host.memory.wait(60)
    h.cache._poll_host()
    return h


def settle(h, rounds=3):
    """Let every copy land and the tier's thread answer, as the scheduler's polls do."""
    for _ in range(rounds):
        h.cache.host.drain()
        h.cache._poll_host()
        assert h.cache.store_worker.drain()


def first_server(args, env):
    h = server(args, env)
    h.serve(h.new_req(TURN1), OUTPUT)
    settle(h)
    return h


def next_round(h, req) -> bool:
    """A scheduler round for a queued request, through the plugin's hook on SGLang's own
    ``Req.init_next_round_input`` (unwrapped where a test applied the hooks): SGLang matches
    it unless the cache holds it back, then the adder asks whether it waits."""
    _around_next_round(sglang_init_next_round_input, req, h.cache)
    return h.cache.coalesce_wait(req)


def read_back(h, req):
    """The request's match asks the tier; it waits in the queue until the read-back is in."""
    waited = next_round(h, req)
    settle(h)
    return waited


def objects(tier):
    return glob.glob(os.path.join(tier, "objects", "*", "*"))


def test_a_second_server_resumes_a_session_the_first_served(setup):
    args, env, tier = setup
    a = first_server(args, env)
    stats = a.cache.store_worker.stats
    assert stats["store_states_written"] == 2 and stats["store_blocks_written"] == 3  # tap 192, endpoint 210
    endpoint = max(a.cache.index.snapshots(), key=lambda s: s.frontier)
    image_a = [bytes(a.cache.host.memory.view(x).numpy()) for x in endpoint.host_slab_ids]

    b = server(args, env)                           # a replica: new pools, the same directory
    nxt = b.new_req(TURN2)
    assert read_back(b, nxt)
    assert b.cache.store_worker.store.writer.cpu_ms > 0     # read and checked by its process
    s = max(b.cache.index.snapshots(), key=lambda s: s.frontier)
    assert s.frontier == 210 and all(n.on_host and n.device_page < 0 for n in s.anchor.path())
    assert s.role is endpoint.role          # its hits count for the role it had where written
    assert [bytes(b.cache.host.memory.view(x).numpy()) for x in s.host_slab_ids] == image_a
    assert not next_round(b, nxt)                   # answered: admitted now
    assert b.admit(nxt) == 210                      # a host hit of what the tier read back
    b.cache.host.drain()
    assert b.state_of(int(req_slots(nxt).mamba_pool_idx)) == 210.0
    row = b.req_pool.req_to_token[req_slots(nxt).req_pool_idx]
    assert b.kv.full_kv_pool.k_buffer[0][row[:210], 0, 0].tolist() == [t % 251 for t in TURN1 + OUTPUT]
    b.complete(nxt, [4] * 3)
    settle(b)
    b.check_idle()
    counts = b.cache.store_worker.stats
    assert counts["store_states_read"] == 1 and counts["store_read_tokens"] == 210
    assert 0 < counts["store_fill_ms"] <= counts["store_fill_ms"] + counts["store_fill_wait_ms"] \
        <= counts["store_hit_answered_ms"]
    for h in (a, b):
        h.cache.release_host_resources()


def test_a_restart_after_a_crash_warms_from_the_tier(setup):
    """Nothing is saved at a stop: what the tier has is all a restart needs (a SIGKILL loses
    only writes still queued)."""
    args, env, tier = setup
    first_server(args, env)                          # never stopped: as if killed
    b = server(args, env)
    assert not b.cache.index.sizes.snapshots         # lazily: nothing loaded at startup
    nxt = b.new_req(TURN2)
    read_back(b, nxt)
    assert b.admit(nxt) == 210
    b.complete(nxt)
    settle(b)
    b.check_idle()


def test_a_prompt_the_cache_holds_deeper_asks_nothing(setup):
    args, env, tier = setup
    a = first_server(args, env)
    asked = a.cache.store_worker.stats["store_probes"]       # (by the first turn: nothing there)
    nxt = a.new_req(TURN2)
    assert not read_back(a, nxt)                     # its own endpoint at 210 is the deepest
    assert a.cache.store_worker.stats["store_probes"] == asked
    assert a.admit(nxt) == 210
    a.complete(nxt)
    settle(a)


@pytest.fixture
def journals_fresh(monkeypatch):
    """The journals count as just read (a busy test machine may starve the read thread)."""
    from hpc_radix.binding.store import directory

    monkeypatch.setattr(directory, "JOURNAL_FRESH_S", 1e9)


def test_a_server_alone_on_its_tier_asks_only_for_what_it_let_go(setup, journals_fresh):
    """Alone on its directory, a server knows every state there: a prompt that passes none
    beyond the cache's deepest waits for no answer. After a flush (the cache empty, the tier
    as it was) the session's next turn asks and resumes from the tier."""
    args, env, tier = setup
    a = first_server(args, env)
    stats = a.cache.store_worker.stats
    assert stats["store_probes"] == 0 and stats["store_probes_skipped"] == 1    # TURN1: nothing there
    fresh = a.new_req(prompt(300, seed=11))
    assert not next_round(a, fresh)                  # admitted in its first round
    assert stats["store_probes"] == 0 and stats["store_probes_skipped"] == 2
    a.admit(fresh)
    a.complete(fresh)
    settle(a)
    a.cache.reset()                                  # /flush_cache
    a.req_pool.clear()
    a.allocator.clear()
    nxt = a.new_req(TURN2)
    assert read_back(a, nxt)                         # its states went with the flush: asked
    assert stats["store_probes"] == 1 and stats["store_states_read"] == 1
    assert a.admit(nxt) == 210
    a.complete(nxt)
    settle(a)
    a.check_idle()


def resumes_from_the_tier(b) -> None:
    """Server b's next turn of the session asks the tier, waits, and resumes from its read."""
    nxt = b.new_req(TURN2)
    assert read_back(b, nxt)
    assert b.admit(nxt) == 210
    b.complete(nxt)
    settle(b)


def test_a_server_learns_of_anothers_states_from_its_journal(setup, journals_fresh):
    """Two servers started on an empty directory: the first one's states reach the second's
    directory through the first's journal, read a few times a second, not at the next
    listing; the second's next turn of the session asks and resumes from them."""
    args, env, tier = setup
    b = server(args, env)                            # started first, the directory empty
    b.cache.store_worker.store.RESCAN_S = 1e9        # no listing: the journal alone tells
    a = first_server(args, env)
    b.cache.store_worker._read_journals()            # (its read thread's, every 0.25 s)
    directory = b.cache.store_worker.directory
    assert directory.complete
    assert directory.deepest_anchor(PromptKey(TURN2).buf, None, 0, len(TURN2)) == 3
    resumes_from_the_tier(b)
    for h in (a, b):
        h.cache.release_host_resources()


def test_a_writer_without_a_journal_makes_every_request_ask(setup):
    """States a listing shows that no journal told of (a server of an older build writes
    there): another server's states show only at listings, so every request asks."""
    args, env, tier = setup
    b = server(args, env)
    b.cache.store_worker.store.RESCAN_S = 1e9
    a = server(args, env)
    a.cache.store_worker.store.journal = lambda key: None     # keeps no journal
    a.serve(a.new_req(TURN1), OUTPUT)
    settle(a)
    for path in objects(tier):                       # written a while ago
        os.utime(path, (time.time() - 60,) * 2)
    b.cache.store_worker.store.RESCAN_S = 0.0
    b.cache.store_worker._relist()
    b.cache.store_worker._read_journals()
    assert not b.cache.store_worker.directory.complete
    resumes_from_the_tier(b)
    for h in (a, b):
        h.cache.release_host_resources()


@pytest.mark.parametrize("writer", ["process", "threads"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_bad_object_is_a_miss_and_the_request_prefills(setup, damage, writer, caplog):
    """Checked where it is read: in the writer process, or by threads of the server's."""
    args, env, tier = with_writer(setup, writer)
    first_server(args, env)
    for path in objects(tier):
        if ".s." in path:
            data = bytearray(open(path, "rb").read())
            if damage == "flip":
                data[len(data) // 2] ^= 1
            elif damage == "truncate":
                data = data[:len(data) // 2]
            else:                                    # another setup's object under this key
                data[20:28] = b"\x01" * 8
            open(path, "wb").write(bytes(data))
    b = server(args, env)
    nxt = b.new_req(TURN2)
    with caplog.at_level("INFO"):
        read_back(b, nxt)
    assert "shared tier object not used" in caplog.text
    assert b.cache.store_worker.stats["store_objects_refused"] == 1
    assert not b.cache.index.sizes.snapshots
    assert b.admit(nxt) == 0                         # cold, and right
    b.complete(nxt)
    settle(b)
    b.check_idle()


def test_a_fill_ends_only_after_every_object_read_into_its_slabs_ended(setup):
    """A fill reads its objects several at a time. When one is gone, the others may still be
    reading into the host slabs: the fill hands them back to the scheduler (which lets them go,
    to be written by whatever takes them next) only once every read ended. (The writer
    process answers a fill once every read of it ended: its pool's ``map``.)"""
    args, env, tier = with_writer(setup, "threads")
    first_server(args, env)
    b = server(args, env)
    worker, events = b.cache.store_worker, []
    read_into, fill = worker.store.read_into, worker._fill

    def reads(key, parts):
        if ".s." not in key:
            return None                              # a block gone since the query: at once
        time.sleep(0.3)
        size = read_into(key, parts)
        events.append("state read")
        return size

    def recorded_fill(p):
        fill(p)
        events.append("fill returned")
    worker.store.read_into, worker._fill = reads, recorded_fill
    nxt = b.new_req(TURN2)
    read_back(b, nxt)
    assert events == ["state read", "fill returned"]
    assert worker.stats["store_objects_refused"] == 1
    assert not b.cache.index.sizes.snapshots
    assert b.admit(nxt) == 0                         # cold, and right
    b.complete(nxt)
    settle(b)
    b.check_idle()


def test_a_probe_the_directory_named_the_anchor_of_is_read_back_without_a_poll_between(
        setup, journals_fresh):
    """The directory names the deepest anchor with a state: host slabs for it go with the
    question, and the worker reads the state the moment it found it, with no turn of the
    scheduler's loop between the answer and the read."""
    from hpc_radix.binding.device.requests import record_of

    args, env, tier = setup
    first_server(args, env)
    b = server(args, env)
    nxt = b.new_req(TURN2)
    assert next_round(b, nxt)
    probe = record_of(nxt).store_probe
    assert len(probe.reserved) == 3 + b.cache.index.host_image_slabs + 1   # blocks to 192, image, tail
    assert b.cache.store_worker.drain()             # the scheduler did not poll meanwhile
    assert probe.filled and probe.frontier == 210 and probe.slabs == probe.reserved
    settle(b)
    assert any(s.frontier == 210 for s in b.cache.index.snapshots())
    assert b.admit(nxt) == 210
    b.complete(nxt)
    settle(b)
    b.check_idle()


def test_slabs_given_with_a_probe_go_back_when_the_tier_lost_the_state_since(setup, journals_fresh):
    """The directory still names an anchor whose states another server evicted since: the
    slabs that went with the question go back, and the request prefills."""
    args, env, tier = setup
    first_server(args, env)
    b = server(args, env)
    for path in objects(tier):
        if ".s." in path:
            os.remove(path)
    slabs = b.cache.host.memory.slabs
    used = slabs.num_used
    nxt = b.new_req(TURN2)
    assert next_round(b, nxt)
    assert slabs.num_used > used                     # taken with the question
    settle(b)
    assert slabs.num_used == used and not b.cache.index.sizes.snapshots
    assert b.cache.store_worker.stats["store_probe_misses"] == 1
    assert not next_round(b, nxt) and b.admit(nxt) == 0
    b.complete(nxt)
    settle(b)
    b.check_idle()


def test_another_model_never_reads_the_tier(setup, tmp_path):
    args, env, tier = setup
    first_server(args, env)
    (tmp_path / "model" / "model.safetensors").write_bytes(b"\0" * 128)    # new weights
    b = server(args, env)
    nxt = b.new_req(TURN2)
    read_back(b, nxt)
    assert b.cache.store_worker.stats["store_probe_misses"] == 1
    assert b.admit(nxt) == 0


@pytest.mark.parametrize("writer", ["process", "threads"])
def test_a_tier_without_room_keeps_serving_and_counts(setup, writer):
    """A budget of a few objects: the threads put each object, evicting the others; the
    writer process reserves a write's objects together, so one larger than the budget is
    dropped whole (a state without its blocks is found by nobody). Either way the tier stays
    within its budget and the server serves."""
    args, env, tier = setup
    env = {**env, "HPC_CACHE_STORE_MIB": "1", "HPC_CACHE_STORE_WRITER": writer}
    h = server(args, env)
    h.cache.store_worker.store.budget = 3 * h.cache.host.layout.slab_bytes   # a few objects
    for seed in range(4):
        h.serve(h.new_req(prompt(200, seed=seed)), OUTPUT)
        settle(h)
    stats = h.cache.store_worker.store.stats
    assert stats["store_evicted" if writer == "threads" else "store_put_failures"] > 0
    assert h.cache.store_worker.store.used <= h.cache.store_worker.store.budget
    assert sum(os.path.getsize(o) for o in objects(tier)) <= h.cache.store_worker.store.budget
    h.check_idle()


def test_a_request_waiting_for_the_tier_is_not_walked_again_every_round(setup):
    """SGLang matches a queued request every round: while its probe is out, that match skips
    the index (a long prompt's walk), and the request keeps waiting; once answered, it is
    matched in full."""
    args, env, tier = setup
    first_server(args, env)
    b = server(args, env)
    gate, exists = threading.Event(), b.cache.store_worker.store.exists
    b.cache.store_worker.store.exists = lambda keys: gate.wait(10) and exists(keys)
    walks, match = [], b.cache.index.match
    b.cache.index.match = lambda *a, **k: walks.append(1) or match(*a, **k)
    matches, match_prefix = [], b.cache.match_prefix
    b.cache.match_prefix = lambda params: matches.append(1) or match_prefix(params)
    nxt = b.new_req(TURN2)
    assert next_round(b, nxt) and len(walks) == 1    # matched, probe out: waits
    assert prefix_len(nxt) == 0 and req_slots(nxt).mamba_pool_idx is None
    for _ in range(3):                               # SGLang does not even ask the cache
        assert next_round(b, nxt) and len(walks) == len(matches) == 1
        assert prefix_len(nxt) == 0 and req_slots(nxt).mamba_pool_idx is None
    sglang_init_next_round_input(nxt, b.cache)       # where the hook did not apply, SGLang's
    assert len(matches) == 2 and len(walks) == 1     # match returns nothing without a walk
    assert prefix_len(nxt) == 0 and b.cache.coalesce_wait(nxt)
    time.sleep(0.3)
    gate.set()
    settle(b)
    stats = b.cache.store_worker.stats               # the wait counts from the question on
    assert stats["store_answered_ms"] >= 300 and 0 < stats["store_read_ms"] <= stats["store_answered_ms"]
    assert not next_round(b, nxt) and len(walks) == 2 and len(matches) == 3   # answered
    assert b.admit(nxt) == 210


def held_writes(setup):
    """A server that served TURN1, with the writes it offered the tier held back (unwritten)."""
    from hpc_radix.binding.store.worker import Write
    args, env, _ = setup
    a = server(args, env)
    worker, held = a.cache.store_worker, []
    submit = worker.submit
    worker.submit = lambda job: held.append(job) or True if isinstance(job, Write) else submit(job)
    a.serve(a.new_req(TURN1), OUTPUT)
    settle(a)
    return worker, held


def test_a_write_whose_state_was_let_go_meanwhile_writes_none_of_its_blocks(setup):
    """A write queued behind others finds its state's slabs let go on host: it is dropped
    before its blocks take the writer's time and the store's bytes."""
    from hpc_radix.binding.store.worker import Write
    tier = setup[2]
    worker, held = held_writes(setup)
    assert held and not objects(tier)
    w = held[-1]
    stale = list(w.generations)
    stale[len(w.node_slabs)] += 1                   # its image's first slab, let go since
    worker._write(Write(**{**w.__dict__, "generations": stale}))
    assert not objects(tier) and worker.stats["store_writes_overtaken"] == 1
    worker._write(w)                                # as offered: blocks, then the state
    assert worker.stats["store_states_written"] == 1 and len(objects(tier)) > 1


def test_a_writes_objects_go_out_several_at_a_time(setup):
    """One writer thread putting a state and its blocks in turn fell behind the 8 GiB host's
    turnover on the GPU: a write's objects are put WRITE_THREADS at a time, and the state is
    told of (journal, directory) once all of them are stored. The pool's CPU time counts as
    the writes' (the GIL the scheduler thread waits for)."""
    from hpc_radix.binding.store.worker import WRITE_THREADS
    tier = setup[2]
    worker, held = held_writes(with_writer(setup, "threads"))
    w, write, lock = held[-1], worker.store._write, threading.Lock()
    running, most = [0], [0]

    def slow_write(path, parts):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        spin = time.thread_time() + 0.02              # CPU this put's thread spends
        while time.thread_time() < spin:
            pass
        write(path, parts)
        with lock:
            running[0] -= 1

    worker.store._write = slow_write
    worker._write(w)
    stats = worker.stats
    assert stats["store_states_written"] == 1 and stats["store_blocks_written"] == len(w.node_slabs) >= 2
    assert most[0] == min(WRITE_THREADS, len(w.node_slabs) + 1)
    assert len(objects(tier)) == len(w.node_slabs) + 1
    assert stats["store_write_cpu_ms"] >= 20 * len(objects(tier))


def with_writer(setup, writer: str):
    args, env, tier = setup
    return args, {**env, "HPC_CACHE_STORE_WRITER": writer}, tier


def test_a_servers_objects_are_written_by_its_writer_process_as_in_process(setup):
    """The file tier's checksums and file calls run in a process of its own, reading the host
    slabs through their shared memory (none of them waits for the scheduler's GIL): the
    objects it writes are byte for byte those written in the scheduler's process."""
    from hpc_radix.binding.store.worker import Write
    worker, held = held_writes(setup)
    tier, store, w = setup[2], worker.store, held[-1]
    assert store.writer.pid not in (None, os.getpid())
    worker._write(w)
    assert worker.stats["store_states_written"] == 1 and store.counters()["store_writer_process_cpu_ms"] > 0
    by_child = {os.path.basename(o): open(o, "rb").read() for o in objects(tier)}
    for o in objects(tier):
        os.unlink(o)
    store._count()
    writer, store.writer = store.writer, None        # the same write in this process
    worker._known.clear()
    worker._write(Write(**w.__dict__))
    store.writer = writer
    assert {os.path.basename(o): open(o, "rb").read() for o in objects(tier)} == by_child
    assert len(by_child) == 1 + len(w.node_slabs)
    threads = server(*with_writer(setup, "threads")[:2])   # --cache-store-writer threads
    assert threads.cache.store_worker.store.writer is None and not threads.cache.host.memory.shared.fds


def test_a_writer_process_killed_costs_no_object(setup, monkeypatch):
    """The writer process killed (out of memory, by hand): the puts in flight and those until
    it is started again are written in the scheduler's process; nothing torn is published, no
    temporary file stays, and it is started again (at most every RESTART_S)."""
    import signal

    from hpc_radix.binding.store import writer as writer_module
    from hpc_radix.binding.store.worker import Write
    tier = setup[2]
    worker, held = held_writes(setup)
    store = worker.store
    first = store.writer.pid
    os.kill(first, signal.SIGKILL)
    store.writer._process.wait()
    worker._write(held[-1])                          # in process: the child is gone
    assert worker.stats["store_states_written"] == 1 and store.stats["store_put_failures"] == 0
    assert len(objects(tier)) == 1 + len(held[-1].node_slabs) and not os.listdir(tier / "tmp")
    assert store.writer.pid == first                 # not started again within RESTART_S
    monkeypatch.setattr(writer_module, "RESTART_S", 0.0)
    w = held[-1]
    for cut in (4, 8):                               # new states: the first put finds it gone
        worker._write(Write(**{**w.__dict__, "tail": w.tail[:-cut]}))
    assert worker.stats["store_states_written"] == 3 and store.writer.pid != first
    assert store.writer.cpu_ms > 0 and not os.listdir(tier / "tmp")   # (the new one wrote)


def test_a_write_the_writer_process_cannot_make_is_dropped_and_the_server_serves(setup):
    """A file fault inside the writer process (here its temporary directory gone and a file in
    its place: every write fails, as on a full or lost disk) drops the write, counted and
    logged, leaves no object, and the server serves; once the fault is gone, writes land."""
    args, env, tier = setup
    h = server(args, env)
    os.rmdir(tier / "tmp")
    (tier / "tmp").write_bytes(b"")
    h.serve(h.new_req(TURN1), OUTPUT)
    settle(h)
    store = h.cache.store_worker.store
    assert store.stats["store_put_failures"] > 0 and not objects(tier)
    assert h.cache.store_worker.stats["store_states_written"] == 0
    assert h.cache.store_worker.stats["store_writer_unavailable"] == 0   # the process did it
    h.check_idle()
    os.unlink(tier / "tmp")
    os.mkdir(tier / "tmp")
    h.serve(h.new_req(prompt(300, seed=9)), OUTPUT)
    settle(h)
    assert h.cache.store_worker.stats["store_states_written"] > 0 and objects(tier)


def test_a_read_back_whose_writer_process_is_gone_is_read_by_threads(setup):
    """A request whose state the tier holds is served from it when the writer process is
    gone: its objects are read and checked by the server's own threads."""
    import signal

    args, env, tier = setup
    first_server(args, env)
    b = server(args, env)
    os.kill(b.cache.store_worker.store.writer.pid, signal.SIGKILL)
    b.cache.store_worker.store.writer._process.wait()
    nxt = b.new_req(TURN2)
    assert read_back(b, nxt)
    stats = b.cache.store_worker.stats
    assert stats["store_writer_unavailable"] == 1 and stats["store_states_read"] == 1
    assert not next_round(b, nxt) and b.admit(nxt) == 210


def test_no_put_starts_while_a_fill_runs(tmp_path, monkeypatch):
    """A request waits for its fill, nobody for a write: beside puts four at a time the H100's
    fills took 26 ms against 19, so a put waits (READS_FIRST_S at most) while a fill runs."""
    from hpc_radix.binding.store import worker as worker_module
    from hpc_radix.binding.host.memory import HostMemory
    from hpc_radix.binding.store.file import FileStore
    from hpc_radix.binding.store.worker import Probe, StoreWorker, Write
    from hpc_radix.index.keys import BLOCK_BYTES, TOKEN_BYTES
    from hpc_radix.index.slabs import SlabPool

    slab_pool = SlabPool(64 << 12, 1 << 12, online=False)
    memory = HostMemory(slab_pool, pin=False)
    memory.start()
    assert memory.wait(60)
    memory.poll()
    worker = StoreWorker(FileStore(str(tmp_path), 1 << 30), memory, 2, 7)
    monkeypatch.setattr(worker_module, "READS_FIRST_S", 10.0)    # (a slow fill's: 0.3 s)

    def write(seed: int) -> Write:
        tokens = bytes([seed]) * (3 * BLOCK_BYTES + 5 * TOKEN_BYTES)
        nodes, state = slab_pool.alloc(3), slab_pool.alloc(3)
        return Write(None, tokens[:3 * BLOCK_BYTES], tokens[3 * BLOCK_BYTES:], "endpoint",
                     "prompt_tail", 1, nodes, state, [slab_pool.generation(x) for x in nodes + state])

    first = write(1)
    worker.submit(first)
    assert worker.drain() and worker.stats["store_states_written"] == 1
    read_into, put_write, events = worker.store.read_into, worker.store._write, []

    def slow_state_read(key, parts):
        if ".s." in key:
            time.sleep(0.3)
            events.append(("state read", time.monotonic()))
        return read_into(key, parts)

    def recorded_put(path, parts):
        events.append(("put", time.monotonic()))
        put_write(path, parts)
    worker.store.read_into, worker.store._write = slow_state_read, recorded_put
    p = Probe(first.path + first.tail, None, 0, 0, 0)
    worker._probe(p)
    p.slabs = slab_pool.alloc(p.slab_count)
    filling = threading.Thread(target=worker._fill, args=(p,))
    filling.start()
    while not worker._filling:                       # the fill has begun
        time.sleep(0.001)
    worker.submit(write(2))                          # its puts wait for it
    filling.join()
    assert worker.drain() and p.filled and worker.stats["store_states_written"] == 2
    assert events[0][0] == "state read" and len(events) == 1 + 3 + 1   # its blocks and state
    worker.close()


@pytest.mark.parametrize("writer", ["process", "threads"])
def test_a_state_let_go_while_its_object_is_written_is_not_published(setup, writer):
    """Writes read the host slabs in place: a slab let go while its object is being written
    (the slab may be written over) leaves no object and no temporary file behind."""
    tier = setup[2]
    worker, held = held_writes(with_writer(setup, writer))
    w = held[-1]

    def let_go():
        worker.memory.slabs._lets_go[w.state_slabs[-1]] += 1

    if writer == "threads":
        write = worker.store._write

        def let_go_midway(path, parts):
            write(path, parts)
            if ".s." in os.path.basename(path):
                let_go()
        worker.store._write = let_go_midway
    else:                                            # between the writing and the publishing
        write = worker.store.writer.write
        worker.store.writer.write = lambda items, state_first: [write(items, state_first), let_go()][0]
    worker._write(w)
    stats = worker.stats
    assert stats["store_writes_overtaken"] == 1 and stats["store_states_written"] == 0
    assert stats["store_blocks_written"] and worker.store.stats["store_put_failures"] == 0
    assert objects(tier) and not [o for o in objects(tier) if ".s." in o]
    assert not os.listdir(tier / "tmp")


def test_writes_go_newest_first_and_a_full_queue_drops_the_oldest(setup, monkeypatch):
    """Under a backlog the oldest writes are the likeliest to find their slabs let go: the
    writer takes the newest first, and a full queue drops the oldest."""
    from hpc_radix.binding.store import worker as worker_module
    args, env, tier = setup
    a = server(args, env)
    worker, gate, order = a.cache.store_worker, threading.Event(), []
    monkeypatch.setattr(worker_module, "MAX_WRITES", 2)
    monkeypatch.setattr(worker, "_write", lambda w: order.append(w) if gate.wait(10) else None)
    jobs = [worker_module.Write(None, b"", b"", "endpoint", "endpoint", i, [], [], []) for i in range(4)]
    worker.submit(jobs[0])                          # taken at once: the writer waits at the gate
    time.sleep(0.2)
    for w in jobs[1:]:
        worker.submit(w)                            # 3 for 2 places: jobs[1] dropped
    gate.set()
    assert worker.drain()
    assert order == [jobs[0], jobs[3], jobs[2]] and worker.stats["store_writes_dropped"] == 1


def test_a_probe_asks_about_blocks_in_doubling_batches_up_to_the_first_missing(setup):
    """A new prompt the tier knows nothing of costs one small existence query, not one key per
    block of its whole length."""
    from hpc_radix.binding.store.objects import block_key, chain
    args, env, tier = setup
    worker = first_server(args, env).cache.store_worker       # TURN1's 3 blocks stored
    asked, exists = [], worker.store.exists
    worker.store.exists = lambda keys: asked.append(len(keys)) or exists(keys)
    keys = lambda tokens, n: [block_key(d, worker.fingerprint)  # noqa: E731
                              for d in chain(PromptKey(tokens).buf, None, n)[1:]]
    stored, other = keys(TURN1, 3), keys(prompt(2000, seed=9), 30)
    assert worker._stored_run(stored + other) == 3 and asked == [5]   # its own 3: not asked
    asked.clear()
    worker._horizon = time.time()                    # the store may have evicted them since
    assert worker._stored_run(stored + other) == 3 and asked == [8]
    asked.clear()
    assert worker._stored_run(other) == 0 and asked == [8]
    asked.clear()
    worker.store.exists = lambda keys: asked.append(len(keys)) or [True] * len(keys)
    assert worker._stored_run(other) == 30 and asked == [8, 16, 6]


def test_a_probe_asks_the_store_only_about_the_states_the_directory_names(setup, journals_fresh):
    """Where this server knows every state the store holds, a probe asks about those on the
    request's path, not about every tail length at its deepest anchors (a file call each,
    each a wait for the GIL beside the busy scheduler thread); a state named but evicted
    since is asked about and found gone: a miss. Where it cannot know, it asks about all."""
    args, env, tier = setup
    first_server(args, env)
    b = server(args, env)
    worker = b.cache.store_worker
    named = list(worker.directory.keys)
    assert named and worker.directory.known_states() is not None
    asked, exists = [], worker.store.exists

    def probed(keys):                                # (the write thread asks too: not counted)
        if threading.current_thread().name != "hpc-shared-tier-writes":
            asked.extend(keys)
        return exists(keys)

    worker.store.exists = probed
    states_asked = lambda: [k for k in asked if ".s." in k]      # noqa: E731
    resumes_from_the_tier(b)
    assert 0 < len(states_asked()) <= len(named)
    assert set(states_asked()) <= set(named)
    b.cache.release_host_resources()

    for path in objects(tier):                       # evicted, by a server with no journal
        if ".s." in path:
            os.remove(path)
    c = server(args, env)
    worker = c.cache.store_worker
    asked.clear()
    worker.store.exists = probed
    worker.directory.keys |= set(named)              # listed before they went
    worker.directory.anchors |= {anchor_prefix(k) for k in named}
    nxt = c.new_req(TURN2)
    read_back(c, nxt)
    assert 0 < len(states_asked()) <= len(named)
    assert worker.stats["store_probe_misses"] == 1 and c.admit(nxt) == 0
    c.complete(nxt)
    settle(c)

    worker.directory.listed = False                  # (a backend that cannot list: Mooncake)
    asked.clear()
    worker._probe(Probe(PromptKey(TURN2).buf, None, 0, 0, 0))
    assert len(states_asked()) > 4 * len(named)
    c.cache.release_host_resources()


def test_offered_paths_are_walked_only_after_a_write_through_landed(setup):
    """The scheduler polls far oftener than write-throughs land: a snapshot waiting for its
    path is looked at again only once something landed."""
    args, env, tier = setup
    a = first_server(args, env)
    policy, stats = a.cache.store, a.cache.store_worker.stats
    s = max(a.cache.index.snapshots(), key=lambda x: x.frontier)     # on host, path too
    policy.offer(s)
    queued = stats["store_writes_queued"]
    for _ in range(5):
        a.cache._poll_host()
    assert stats["store_writes_queued"] == queued and policy._offered    # nothing landed
    a.cache.host.memory.written([])                  # a write-through lands
    a.cache._poll_host()
    assert stats["store_writes_queued"] == queued + 1 and not policy._offered


def test_a_request_stops_waiting_after_the_wait_limit(setup):
    args, env, tier = setup
    first_server(args, env)
    b = server(args, {**env, "HPC_CACHE_STORE_WAIT_MS": "0"})
    nxt = b.new_req(TURN2)
    assert not next_round(b, nxt)                    # admitted at once (cold, unless the
    assert b.cache.store_worker.stats["store_wait_timeouts"] == 1    # read landed meanwhile) ...
    b.admit(nxt)
    settle(b)                                        # ... and the read-back serves the next one
    again = b.new_req(TURN2)
    assert b.admit(again) == 210


def test_a_flush_waits_for_a_read_back_copying_into_host_slabs(setup):
    """A flush clears the host slabs; a read-back still being copied into some of them would
    write over what takes them next. The flush waits for it (and drops what is queued)."""
    args, env, tier = setup
    first_server(args, env)
    b = server(args, env)
    worker, events = b.cache.store_worker, []
    fill, clear = worker._fill, b.cache.host.memory.slabs.clear

    started = threading.Event()

    def slow_fill(p):
        started.set()
        time.sleep(0.3)
        fill(p)
        events.append("filled")

    def recorded_clear():
        events.append("cleared")
        clear()
    worker._fill = slow_fill
    b.cache.host.memory.slabs.clear = recorded_clear
    nxt = b.new_req(TURN2)
    nxt.init_next_round_input(b.cache)
    assert worker.drain()
    b.cache._poll_host()                             # slabs allocated, the copy under way
    assert started.wait(10)
    b.cache.reset()                                  # SGLang's flush_cache
    assert events == ["filled", "cleared"]
    assert not b.cache.index.sizes.snapshots         # the read-back of the old index is dropped
    settle(b)
    assert not b.cache.index.sizes.snapshots


def test_a_fine_tune_with_the_same_file_names_and_sizes_never_reads_the_tier(setup, tmp_path):
    args, env, tier = setup
    first_server(args, env)
    (tmp_path / "model" / "model.safetensors").write_bytes(b"\1" * 64)    # same name, same size
    b = server(args, env)
    nxt = b.new_req(TURN2)
    read_back(b, nxt)
    assert b.cache.store_worker.stats["store_probe_misses"] == 1
    assert b.admit(nxt) == 0


def test_a_release_writing_another_object_format_never_reads_the_tier(setup, monkeypatch):
    """Keys name the objects' format: a server of another format neither reads the earlier
    objects nor takes them as present (it writes its own), so they never block its writes."""
    from hpc_radix import persistence

    args, env, tier = setup
    first_server(args, env)
    before = set(objects(tier))
    monkeypatch.setattr(persistence, "OBJECT_VERSION", persistence.OBJECT_VERSION + 1)
    b = server(args, env)
    nxt = b.new_req(TURN2)
    read_back(b, nxt)
    assert b.cache.store_worker.stats.get("store_objects_refused", 0) == 0
    assert b.admit(nxt) == 0
    b.complete(nxt)
    settle(b)
    assert b.cache.store_worker.stats["store_states_present"] == 0
    assert set(objects(tier)) - before                 # its own objects, beside the others
    b.check_idle()


def test_servers_of_one_model_elsewhere_on_disk_share(setup, tmp_path):
    """Replicas on other machines keep the model in another directory, copied at another time."""
    import shutil

    args, env, tier = setup
    first_server(args, env)
    shutil.copytree(tmp_path / "model", tmp_path / "copy")
    os.utime(tmp_path / "copy" / "model.safetensors", (1, 1))
    b = server(make_server_args(tmp_path / "copy"), env)
    nxt = b.new_req(TURN2)
    read_back(b, nxt)
    assert b.admit(nxt) == 210


def test_servers_loading_dummy_weights_share_whatever_their_random_seed(setup, tmp_path):
    """SGLang draws every server's --random-seed unless given, but fills dummy weights from a
    fixed seed of its own: replicas of one dummy-weight config hold the same bytes."""
    args, env, tier = setup
    first_server(make_server_args(tmp_path / "model", "--load-format", "dummy", "--random-seed", "1"), env)
    b = server(make_server_args(tmp_path / "model", "--load-format", "dummy", "--random-seed", "2"), env)
    nxt = b.new_req(TURN2)
    read_back(b, nxt)
    assert b.admit(nxt) == 210


def test_a_state_read_back_below_blocks_the_cache_holds_joins_them(setup):
    """The cache may hold a prompt's blocks deeper than any state on them (its snapshots there
    evicted or elsewhere): a state the tier has below the deepest of those blocks is read
    without blocks and joins the cache's own."""
    from types import SimpleNamespace

    from hpc_radix.index import PromptKey

    args, env, tier = setup
    first_server(args, env)                          # states at 192 and 210 in the tier
    b = server(args, env)
    turn = TURN1 + OUTPUT + prompt(100, seed=3)      # 310 tokens: 4 whole blocks matchable
    b.serve(b.new_req(turn + prompt(80, seed=4)), [5])     # B holds every block of the turn ...
    key = PromptKey(turn)
    # ... and is asked as if none of its states were on the path (local frontier 0)
    match = SimpleNamespace(deepest=None, matched_tokens=b.cache.index.match(key).matched_tokens)
    assert match.matched_tokens == 256                # a block past the state at 210
    probe, made_room = b.cache.store.probe(key, match, len(turn) - 1)
    b.cache.run(made_room)
    settle(b)
    assert probe.answered and probe.frontier == 210 and probe.first_block == 3
    assert b.cache.store_worker.stats["store_states_read"] == 1
    assert any(s.frontier == 210 for s in b.cache.index.snapshots())
    b.check_idle()


def test_a_budget_beyond_the_disk_is_cut_to_what_it_can_hold(setup):
    import shutil
    from collections import namedtuple
    from unittest import mock

    args, env, tier = setup
    usage = namedtuple("usage", "total used free")(1 << 40, 0, 100 << 20)
    with mock.patch.object(shutil, "disk_usage", lambda path: usage):
        h = server(args, {**env, "HPC_CACHE_STORE_MIB": "4096"})
    assert h.cache.store_worker.store.budget == int(0.9 * (100 << 20))
    h.cache.release_host_resources()


def test_blocks_the_budget_evicted_are_written_again_with_a_later_state(setup):
    """A block the tier once held may have been evicted since: a later state on its path
    writes it again, or the state could never be reached."""
    from hpc_radix.binding.store.objects import block_key, chain

    args, env, tier = setup
    h = server(args, env)
    store, worker = h.cache.store_worker.store, h.cache.store_worker
    store.budget = 45 << 10                          # about one session's objects
    h.serve(h.new_req(TURN1), OUTPUT)
    settle(h)
    h.serve(h.new_req(prompt(200, seed=7)), OUTPUT)  # pushes TURN1's objects out
    settle(h)
    keys = [block_key(d, worker.fingerprint) for d in chain(PromptKey(TURN1).buf, None, 3)[1:]]
    assert not all(store.exists(keys))
    h.serve(h.new_req(TURN2), [4] * 3)               # a state on TURN1's blocks again
    settle(h)
    assert all(store.exists(keys))


def test_states_of_a_role_requests_do_not_resume_from_stay_off_the_tier(setup):
    """Endpoints here were never resumed from (clients that do not echo outputs): the next
    one stays on host; the tap, of a role not yet judged, goes to the tier."""
    from hpc_radix.index.roles import Role
    args, env, tier = setup
    a = server(args, env)
    for _ in range(200):
        a.cache.index.roles.kept(Role.ENDPOINT)         # published, never hit
    a.serve(a.new_req(TURN1), OUTPUT)
    settle(a)
    stats = a.cache.store_worker.stats
    assert stats["store_writes_unvalued"] == 1 and stats["store_states_written"] == 1
    b = server(args, env)
    assert read_back(b, b.new_req(TURN2))
    tap = min(s.frontier for s in a.cache.index.snapshots())        # the ladder tap
    assert tap < 210 and [s.frontier for s in b.cache.index.snapshots()] == [tap]


def probe_answered_while_a_write_holds(setup, method: str) -> None:
    """Server b's own write holds inside its first call of ``method`` on the store until the
    test lets it go; a probe submitted meanwhile is answered before that."""
    args, env, tier = setup
    first_server(args, env)                          # the session the probe will find
    b = server(args, env)
    store = b.cache.store_worker.store
    gate, entered, call = threading.Event(), threading.Event(), getattr(store, method)

    def held(*a, **kw):                              # b's first call waits for the test
        if not entered.is_set():
            entered.set()
            assert gate.wait(10)
        return call(*a, **kw)
    setattr(store, method, held)
    b.serve(b.new_req(prompt(300, seed=5)), OUTPUT)
    for _ in range(3):
        b.cache.host.drain()
        b.cache._poll_host()                         # offers b's own snapshot: its write starts
    assert entered.wait(10)
    nxt = b.new_req(TURN2)
    assert next_round(b, nxt)                        # probe submitted while the write holds
    end = time.monotonic() + 10
    while not b.cache.store_worker.stats["store_probe_hits"] and time.monotonic() < end:
        time.sleep(0.01)
    assert b.cache.store_worker.stats["store_probe_hits"] == 1   # answered, the write still held
    assert not gate.is_set()
    gate.set()
    settle(b)
    assert b.admit(nxt) == 210


@pytest.mark.parametrize("writer, method", [("process", "put_new"), ("threads", "put_object"),
                                            ("threads", "refresh")])
def test_a_read_never_waits_behind_a_write(setup, writer, method):
    """Reads have their own thread: a waiting request's probe is answered while a write holds
    inside a store call (writing its objects, asking about its path's blocks): no request
    waits on a tier write."""
    probe_answered_while_a_write_holds(with_writer(setup, writer), method)


def test_a_tier_shortens_the_interpreters_switch_interval(setup):
    """The tier's thread waits for the GIL at each file call while the scheduler thread runs
    Python: with a tier the process hands it over within TIER_SWITCH_INTERVAL_S."""
    import sys

    from hpc_radix.binding.store.policy import TIER_SWITCH_INTERVAL_S

    args, env, _ = setup
    default = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        server(args, env)
        assert sys.getswitchinterval() == pytest.approx(TIER_SWITCH_INTERVAL_S)
    finally:
        sys.setswitchinterval(default)


def test_with_a_sync_budget_a_read_back_is_admitted_in_the_round_it_arrived(setup, journals_fresh):
    """--cache-store-sync-ms: the scheduler thread waits, within the round's budget, for the
    read-back its match asked for, and admits the request in that round at the state read."""
    args, env, tier = setup
    first_server(args, env)
    b = server(args, {**env, "HPC_CACHE_STORE_SYNC_MS": "10000"})
    nxt = b.new_req(TURN2)
    assert not next_round(b, nxt)                    # answered within the round: not held back
    assert b.cache.store_worker.stats["store_states_read"] == 1
    assert b.cache.store_worker.stats["store_sync_ms"] > 0
    assert b.admit(nxt) == 210
    b.complete(nxt)
    settle(b)
    b.check_idle()


def test_a_round_waits_for_read_backs_no_longer_than_its_sync_budget(setup, journals_fresh):
    """A read-back slower than the budget leaves the request waiting in the queue as without
    one, and the round's budget is spent: the next request's match waits for nothing."""
    args, env, tier = setup
    first_server(args, env)
    b = server(args, {**env, "HPC_CACHE_STORE_SYNC_MS": "100"})
    worker, events = b.cache.store_worker, []
    fill = worker._fill

    def slow_fill(p):
        time.sleep(1.0)
        fill(p)
        events.append("filled")
    worker._fill = slow_fill
    nxt = b.new_req(TURN2)
    assert next_round(b, nxt) and not events         # held back; the fill still under way
    spent = b.cache.store_worker.stats["store_sync_ms"]
    assert 0 < spent < 1000
    other = b.new_req(TURN2 + prompt(64, seed=5))
    assert next_round(b, other) and not events       # the same round: no budget left
    assert b.cache.store_worker.stats["store_sync_ms"] - spent < 50
    settle(b)
    assert events == ["filled", "filled"]
    for req in (nxt, other):
        assert not next_round(b, req)
        assert b.admit(req) == 210
        b.complete(req)
    settle(b)
    b.check_idle()


def test_an_offer_is_not_written_when_a_node_above_its_walk_left_host(setup):
    """The walk of an offered path goes on from where the last one stopped; a node above that
    point leaving host meanwhile must not let the write name its slab."""
    args, env, tier = setup
    a = first_server(args, env)
    s = max(a.cache.index.snapshots(), key=lambda x: x.frontier)     # on host, path too
    offer = _Offer(s, s.anchor.path(), time.monotonic() + 60)
    assert offer.path_on_host() and offer.landed == len(offer.path)
    top = offer.path[0]
    top.host_ready = False
    try:
        assert not offer.path_on_host() and offer.landed == 0
    finally:
        top.host_ready = True
    assert offer.path_on_host()
