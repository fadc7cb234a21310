"""The shared tier's file backend and object format, on real files (design §5.6): whole objects
or none, damaged and foreign objects are misses, the byte budget and a full disk keep serving."""
from __future__ import annotations

import concurrent.futures
import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from hpc_radix.binding.store.file import FileStore
from hpc_radix.errors import StoreObjectError
from hpc_radix.persistence import fingerprint_digest, pack_object, unpack_object

FP = fingerprint_digest({"model": "tiny", "page_size": 64})
KEY = "ab" + "0" * 30


def obj(key=KEY, payload=b"x" * 1000, kind=1, fp=FP):
    return pack_object(key, kind, fp, [payload[:len(payload) // 2], payload[len(payload) // 2:]])


def test_an_object_comes_back_whole_under_its_key(tmp_path):
    store = FileStore(str(tmp_path), 1 << 20)
    payload = os.urandom(5000)
    assert store.put(KEY, obj(payload=payload))
    assert store.exists([KEY, "cd" + "1" * 30]) == [True, False]
    kind, got = unpack_object(store.get(KEY), KEY, FP)
    assert kind == 1 and bytes(got) == payload
    assert store.get("cd" + "1" * 30) is None and store.stats["store_misses"] == 1
    again = FileStore(str(tmp_path), 1 << 20)       # a restart: the directory is the index
    assert again.exists([KEY]) == [True] and again.used == store.used > 5000


@pytest.mark.parametrize("damage, why", [
    (lambda b: b[:-1], "torn"),
    (lambda b: b[:10], "torn"),
    (lambda b: b[:-3] + bytes([b[-3] ^ 1]) + b[-2:], "checksum"),
    (lambda b: b"NOTANOBJ" + b[8:], "magic"),
])
def test_a_torn_or_damaged_object_is_refused_with_why(damage, why):
    data = b"".join(bytes(p) for p in obj())
    with pytest.raises(StoreObjectError, match=why):
        unpack_object(damage(data), KEY, FP)


def test_an_object_of_the_earlier_format_is_refused():
    """Format 1 (an xxh64 checksum) is a miss that says so, never a misread checksum."""
    import struct

    data = bytearray(b"".join(bytes(p) for p in obj()))
    struct.pack_into("<H", data, 8, 1)
    with pytest.raises(StoreObjectError, match="object format 1"):
        unpack_object(bytes(data), KEY, FP)


def test_another_setups_or_keys_object_is_refused():
    data = b"".join(bytes(p) for p in obj())
    with pytest.raises(StoreObjectError, match="fingerprint"):
        unpack_object(data, KEY, fingerprint_digest({"model": "other", "page_size": 64}))
    with pytest.raises(StoreObjectError, match="another key"):
        unpack_object(data, "cd" + "1" * 30, FP)


def test_an_object_is_read_straight_into_buffers_of_its_size(tmp_path):
    """A read-back goes into the host slabs it is for, past a head: only when the sizes agree."""
    store = FileStore(str(tmp_path), 1 << 20)
    payload = os.urandom(5000)
    assert store.put(KEY, obj(payload=payload))
    size = sum(memoryview(p).nbytes for p in obj(payload=payload))
    head, rest = bytearray(size - 4000), bytearray(4000)
    assert store.read_into(KEY, [head, rest]) == size
    kind, first = unpack_object(head, KEY, FP, [rest])
    assert kind == 1 and bytes(first) + bytes(rest) == payload
    short = bytearray(3999)
    assert store.read_into(KEY, [bytearray(size - 4000), short]) == size and not any(short)
    assert store.read_into("cd" + "1" * 30, [head, rest]) is None
    with pytest.raises(StoreObjectError, match="torn"):
        unpack_object(head, KEY, FP, [rest[:-1]])
    rest[0] ^= 1
    with pytest.raises(StoreObjectError, match="checksum"):
        unpack_object(head, KEY, FP, [rest])


def test_a_read_backs_checksum_keeping_the_gil_is_the_writers():
    """A read-back checks its object through xxhash's C functions, keeping the GIL (no wait to
    take it back after each slab beside the scheduler thread): the same digest as the writer's
    over any buffers, and it loads here."""
    import numpy as np
    from hpc_radix import persistence

    assert persistence._held_digest is not None
    parts = [b"", bytearray(os.urandom(4097)), np.frombuffer(os.urandom(1 << 20), np.uint8),
             memoryview(os.urandom(300))[7:200], os.urandom(1)]
    assert persistence._held_digest(parts) == persistence._digest(parts)
    assert persistence._held_digest(parts[1:3]) != persistence._digest(parts[2:4])


def test_the_budget_evicts_the_least_recently_used(tmp_path):
    size = sum(len(bytes(p)) for p in obj())
    store = FileStore(str(tmp_path), 3 * size)
    keys = [f"{i:02x}" + "f" * 30 for i in range(5)]
    for i, k in enumerate(keys[:3]):
        assert store.put(k, obj(k))
        os.utime(store.path_of(k), ns=(i * 10**9, i * 10**9))   # written in this order
    assert store.get(keys[0]) is not None                     # used again: newest now
    # over the budget: the least recently used go, down to EVICT_TO of it (the two oldest)
    assert store.put(keys[3], obj(keys[3]))
    assert store.exists(keys) == [True, False, False, True, False]
    assert store.used == 2 * size and store.stats["store_evicted"] == 2
    assert not store.put(keys[4], obj(keys[4], payload=b"y" * (4 * size)))   # never fits
    assert store.stats["store_put_failures"] == 1


def test_puts_side_by_side_make_room_for_each_other(tmp_path, monkeypatch):
    """The worker puts a write's objects several at a time: each counts its bytes before
    writing them, so the others make room for it (what is still being written cannot be
    evicted: the directory passes the budget by those objects at most, and is back within it
    once they are published), and a recount meanwhile keeps them counted."""
    size = sum(len(bytes(p)) for p in obj())
    store = FileStore(str(tmp_path), 3 * size)
    on_disk, write = [], store._write

    def slow_write(path, parts):                 # every put in flight at once
        write(path, parts)
        time.sleep(0.05)
        on_disk.append(sum(s for _, s, _ in store._walk()))
    monkeypatch.setattr(store, "_write", slow_write)
    keys = [f"{i:02x}" + "e" * 30 for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(lambda k: store.put(k, obj(k)), keys))
    assert max(on_disk) <= (3 + 3) * size and store.stats["store_evicted"] >= 4
    assert store.used == sum(s for _, s, _ in store._walk()) <= 3 * size
    store.RESCAN_S = 0.0
    k = "ff" + "e" * 30
    assert store.put(k, obj(k)) and store.used == sum(s for _, s, _ in store._walk()) <= 3 * size


def test_find_lists_the_directory_as_python_does_and_python_takes_over_without_it(
        tmp_path, monkeypatch, caplog):
    """The recount runs find in a child process (the tier's thread then waits for the GIL once,
    not at every object's stat); without find the objects are counted in Python, the same."""
    store = FileStore(str(tmp_path), 1 << 20)
    for i in range(3):
        k = f"{i:02x}" + "a" * 30
        assert store.put(k, obj(k, payload=b"z" * (1000 + i)))
        os.utime(store.path_of(k), ns=(0, 1_700_000_000_123_456_789 + i))
    assert sorted(store._scan()) == sorted(store._walk()) and len(store._scan()) == 3
    monkeypatch.setenv("PATH", str(tmp_path / "no-find-here"))
    again = FileStore(str(tmp_path), 1 << 20)
    assert not again._listed_by_find and "find cannot list" in caplog.text
    assert again.used == store.used and sorted(again._scan()) == sorted(store._walk())


def test_servers_sharing_a_directory_keep_one_budget_between_them(tmp_path):
    """Each server counts the others' writes (at its next recount) against the same budget."""
    size = sum(len(bytes(p)) for p in obj())
    one, two = FileStore(str(tmp_path), 4 * size), FileStore(str(tmp_path), 4 * size)
    one.RESCAN_S = two.RESCAN_S = 0.0
    for i in range(12):
        k = f"{i:02x}" + "d" * 30
        assert (one, two)[i % 2].put(k, obj(k))
        assert sum(s for _, s, _ in one._scan()) <= 4 * size
    assert one.stats["store_evicted"] + two.stats["store_evicted"] >= 8


def test_an_object_another_server_evicted_falls_behind_the_eviction_horizon(tmp_path):
    """What a server knows it stored is there until the horizon passes the moment it knew it,
    whichever server sharing the directory evicted it."""
    size = sum(len(bytes(p)) for p in obj())
    one, two = FileStore(str(tmp_path), 10 * size), FileStore(str(tmp_path), 2 * size)
    one.RESCAN_S = 0.0
    assert one.put(KEY, obj())
    seen = time.time()
    assert one.eviction_horizon() < seen
    time.sleep(0.02)          # file times follow a coarse clock: two's writes come after seen
    for i in range(3):
        k = f"{i:02x}" + "c" * 30
        assert two.put(k, obj(k))
    assert one.exists([KEY]) == [False] and one.stats["store_evicted"] == 0
    assert one.eviction_horizon() >= seen
    assert one.refresh([KEY, k]) == [False, True]


def test_a_write_never_takes_the_disks_last_free_share(tmp_path, caplog):
    store = FileStore(str(tmp_path), 1 << 30)
    assert store.put(KEY, obj())
    disk = os.statvfs(str(tmp_path))
    store.MIN_FREE = 1 - disk.f_bavail / disk.f_blocks + 0.001   # the disk is at its floor now
    k = "cd" + "1" * 30
    assert not store.put(k, obj(k)) and not store.exists([k])[0]
    assert store.exists([KEY]) == [False]              # what the tier held went first
    assert store.stats["store_put_failures"] == 1 and "disk free" in caplog.text
    store.MIN_FREE = 0.0
    assert store.put(k, obj(k))


def test_writes_ask_the_disk_for_its_free_space_only_now_and_then(tmp_path, monkeypatch):
    """Each file call of the tier's thread waits for the GIL beside a busy scheduler: with room
    to spare, the disk's free space is asked once per DISK_RECHECK_S, not at every write."""
    from hpc_radix.binding.store import file

    store, asked, real = FileStore(str(tmp_path), 1 << 30), [], file.shutil.disk_usage
    monkeypatch.setattr(file.shutil, "disk_usage", lambda path: asked.append(path) or real(path))
    for i in range(10):
        k = f"{i:02x}" + "e" * 30
        assert store.put(k, obj(k))
    assert len(asked) == 1


def test_a_full_disk_drops_writes_logs_once_and_keeps_serving(tmp_path, monkeypatch, caplog):
    store = FileStore(str(tmp_path), 1 << 20)
    assert store.put(KEY, obj())
    real = os.writev

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "writev", full)
    keys = [f"{i:02x}" + "e" * 30 for i in range(3)]
    assert not any(store.put(k, obj(k)) for k in keys)
    assert store.stats["store_put_failures"] == 3
    assert caplog.text.count("a write failed") == 1
    assert os.listdir(os.path.join(str(tmp_path), "tmp")) == []    # nothing half-written left
    assert store.get(KEY) is not None                               # reads go on
    monkeypatch.setattr(os, "writev", real)
    assert store.put(keys[0], obj(keys[0]))


WRITER = """
import sys
from hpc_radix.binding.store.file import FileStore
from hpc_radix.persistence import pack_object
store = FileStore(sys.argv[1], 1 << 34)
fp, key, fill, n = int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
for i in range(n):
    k = key if key != "-" else f"{i % 256:02x}{i:030x}"
    store.put(k, pack_object(k, 1, fp, [bytes([fill]) * (4 << 20)]))
print("done", flush=True)
"""


def _writer(tmp_path, key, fill, n):
    return subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(FP), key, str(fill), str(n)],
                            stdout=subprocess.PIPE, text=True)


def test_a_writer_killed_mid_write_leaves_no_visible_partial_object(tmp_path):
    proc = _writer(tmp_path, "-", 7, 10**6)
    time.sleep(1.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    store = FileStore(str(tmp_path), 1 << 34)
    seen = 0
    for sub in os.listdir(store._objects):
        for key in os.listdir(os.path.join(store._objects, sub)):
            kind, payload = unpack_object(store.get(key), key, FP)     # every one whole
            assert bytes(payload[:1]) == b"\x07"
            seen += 1
    assert seen > 0


def test_two_servers_writing_one_key_leave_one_whole_object(tmp_path):
    procs = [_writer(tmp_path, KEY, fill, 40) for fill in (1, 2)]
    for p in procs:
        assert p.communicate(timeout=120)[0].strip() == "done"
    kind, payload = unpack_object(FileStore(str(tmp_path), 1 << 34).get(KEY), KEY, FP)
    assert len(set(bytes(payload))) == 1 and bytes(payload[:1]) in (b"\x01", b"\x02")


def test_the_directory_of_states_names_the_anchors_a_listing_shows(tmp_path):
    """A state's key begins with its anchor: the file backend's listing tells which anchors
    the tier holds states on, and a prompt that passes none past the cache's deepest state
    need not wait for the tier's answer."""
    from hpc_radix.binding.store.directory import StateDirectory
    from hpc_radix.binding.store.objects import anchor_prefix, block_key, chain, state_key

    tokens = bytes(range(256)) * 8                  # 8 blocks
    digests = chain(tokens, None, 8)
    skey = state_key(digests[5], tokens[5 * 256:5 * 256 + 40], FP)    # 5 blocks + 10 tokens
    assert anchor_prefix(skey) == digests[5][:8] and anchor_prefix(block_key(digests[5], FP)) is None
    store = FileStore(str(tmp_path), 1 << 20)
    assert store.put(skey, obj(skey))
    store.RESCAN_S = 0.0                             # (the listing is a few seconds old at most)
    d = StateDirectory()
    assert d.deepest_anchor(tokens, None, 0, 512) is None   # nothing listed yet: ask
    d.relist(store.listing())
    d.told([], journals_read=True)
    assert d.complete
    assert d.deepest_anchor(tokens, None, 64, 512) == 5   # past the cache's block 1
    assert d.deepest_anchor(tokens, None, 5 * 64, 512) == 0   # the cache's own block: not past
    assert d.deepest_anchor(tokens, None, 64, 5 * 64 - 1) == 0  # beyond what the match may use
    assert d.deepest_anchor(tokens, "salt", 64, 512) == 0       # another namespace's path
    assert d.deepest_anchor(bytes(reversed(tokens)), None, 64, 512) == 0


def test_states_no_journal_told_of_make_the_directory_incomplete(monkeypatch):
    """A listing with settled states on anchors neither this server nor any journal told of:
    a writer that keeps no journal, whose states show only at the next listing, so every
    request asks until none has appeared for FOREIGN_QUIET_S. A state written just before the
    listing may not be in its writer's journal yet: no sighting."""
    from hpc_radix.binding.store import directory
    from hpc_radix.binding.store.objects import chain, state_key

    tokens = bytes(range(256)) * 4
    digests = chain(tokens, None, 4)
    mine, told, theirs, untold = (state_key(digests[b], b"", FP) for b in (1, 2, 3, 4))
    old, now = time.time() - 100, time.time()
    d = directory.StateDirectory()
    d.relist((time.monotonic(), []))
    d.told([mine])
    d.told([told], journals_read=True)
    elsewhere = bytes(reversed(tokens))              # a path with no state on it
    d.relist((time.monotonic(), [(mine, old), (told, old), (theirs, now)]))    # theirs: just written
    assert d.complete and d.deepest_anchor(elsewhere, None, 64, 256) == 0
    assert d.deepest_anchor(tokens, None, 2 * 64, 256) == 3     # theirs, listed at block 3
    d.relist((time.monotonic(), [(mine, old), (told, old), (theirs, old), (untold, old)]))
    assert not d.complete and d.deepest_anchor(elsewhere, None, 64, 256) is None
    later = time.monotonic() + directory.FOREIGN_QUIET_S + 1
    monkeypatch.setattr(directory.time, "monotonic", lambda: later)
    assert not d.complete                            # the journals were not read since
    d.told([], journals_read=True)
    assert d.complete
    assert not directory.StateDirectory().complete   # never listed (Mooncake): always asks


def test_servers_sharing_a_directory_read_each_others_journals(tmp_path, monkeypatch):
    """Each server notes the states it stores in a journal of its own; the others read what
    was added since they last looked, a journal that starts afresh under a new name from its
    start, and drop a stopped server's."""
    from hpc_radix.binding.store import file

    one, two = FileStore(str(tmp_path), 1 << 20), FileStore(str(tmp_path), 1 << 20)
    assert one.journaled() == [] and two.journaled() == []
    one.journal("k1")
    one.journal("k2")
    assert two.journaled() == ["k1", "k2"] and two.journaled() == [] and one.journaled() == []
    monkeypatch.setattr(file, "JOURNAL_MAX", 8)
    one.journal("k3")                                # past the size: a new journal
    assert two.journaled() == ["k3"]
    with open(one._journal, "ab") as f:
        f.write(b"k4")                               # a line still being written
    assert two.journaled() == []
    with open(one._journal, "ab") as f:
        f.write(b"\n")
    assert two.journaled() == ["k4"]
    stale = os.path.join(tmp_path, "journal", "gone-1-abc")
    with open(stale, "w") as f:
        f.write("k9\n")
    os.utime(stale, (time.time() - 2 * file.TMP_STALE_S,) * 2)
    assert two.journaled() == [] and not os.path.exists(stale)
    one.close()
    assert os.listdir(os.path.join(tmp_path, "journal")) == []


def test_a_job_the_writer_process_fails_is_done_here_and_it_serves_on(tmp_path):
    """A fault inside the writer process (here a job it does not know) is answered, not left
    hanging: the caller does the job in its own process, and the next job is served."""
    from hpc_radix.binding.store.writer import SharedChunks, WriterProcess, WriterUnavailable

    writer = WriterProcess(SharedChunks())
    try:
        with pytest.raises(WriterUnavailable, match="AttributeError"):
            writer._ask(("no such job", []))
        tmp, final = tmp_path / "t", tmp_path / "sub" / "f"
        tmp.write_bytes(b"x")
        assert writer.publish([(str(tmp), str(final))], []) == [True] and final.read_bytes() == b"x"
        assert writer.restarts == 0
    finally:
        writer.close()


def test_a_write_of_a_long_prompts_objects_goes_by_the_writer_process(tmp_path):
    """A state of a 30k-token prompt carries its tokens (120 KB) in its write's message, past a
    packet's size: the message goes in packets, and the process writes the object."""
    from hpc_radix.binding.store.writer import PACKET_BYTES, SharedChunks, WriterProcess
    from hpc_radix.persistence import pack_object

    tokens = os.urandom(2 * PACKET_BYTES)
    writer = WriterProcess(SharedChunks())
    try:
        tmp, final = tmp_path / "t", tmp_path / "sub" / "f"
        assert writer.write([(str(tmp), str(final), KEY, 1, FP, [tokens])], False) == ["written"]
        assert writer.publish([(str(tmp), str(final))], []) == [True]
        assert final.read_bytes() == b"".join(bytes(p) for p in pack_object(KEY, 1, FP, [tokens]))
        assert writer.restarts == 0 and writer.cpu_ms > 0
    finally:
        writer.close()


def test_the_writer_process_serves_a_fill_while_a_write_is_in_flight(tmp_path):
    """The worker's write and read threads each have a connection: with one job in flight (a
    connection taken) another is served, not sent back to be done by threads."""
    from hpc_radix.binding.store.writer import SharedChunks, WriterProcess

    writer = WriterProcess(SharedChunks())
    try:
        in_flight = writer._free.get()               # the write thread's, busy
        assert writer.fill([]) == [] and writer.restarts == 0
        writer._free.put(in_flight)
    finally:
        writer.close()
