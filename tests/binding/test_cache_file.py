"""--prefix-cache-file through HybridRadixCache: a conversation saved at shutdown comes back in
a new cache (new SGLang pools, the same data file) and its next turn restores from it."""
from __future__ import annotations

import json
import os

from hpc_radix.sglang_version import req_slots
import pytest

from sglang_harness import build_cache, make_server_args, model_with_weights
from sglang_harness import ramp_prompt as prompt

torch = pytest.importorskip("torch")


@pytest.fixture
def setup(tmp_path):
    # a weights file: its name, size and mtime are fingerprinted and must survive the JSON
    args = model_with_weights(tmp_path / "model")
    env = {"HPC_CACHE_FULL_CHECK": "1", "HPC_HOST_CACHE_MIB": "1",
           "HPC_PREFIX_CACHE_FILE": str(tmp_path / "cache.bin")}
    return args, env, str(tmp_path / "cache.bin")


def first_server(args, env):
    h = build_cache(args, env=env)
    assert h.cache.host.memory.wait(60)
    first = h.new_req(prompt(200))
    h.serve(first, [7] * 10)
    h.cache.host.drain()
    h.cache.release_host_resources()                 # SIGTERM: save
    return h


def test_a_saved_conversation_resumes_from_host_after_a_restart(setup, caplog):
    args, env, path = setup
    first_server(args, env)
    assert os.path.getsize(path) > 0 and os.path.exists(path + ".slabs")
    with caplog.at_level("INFO"):
        h = build_cache(args, env=env)                # the restart: new pools, same files
    assert "loaded 2 of 2 saved snapshots" in caplog.text      # the tap at 192 and the endpoint
    idx = h.cache.index
    assert all(n.device_page < 0 and n.on_host for n in idx.tree.nodes())
    nxt = h.new_req(prompt(200) + [7] * 10 + prompt(40, seed=3))
    assert h.admit(nxt) == 210                        # restored from the loaded host tier
    h.cache.host.drain()
    assert h.state_of(int(req_slots(nxt).mamba_pool_idx)) == 210.0
    row = h.req_pool.req_to_token[req_slots(nxt).req_pool_idx]
    assert h.kv.full_kv_pool.k_buffer[0][row[:210], 0, 0].tolist() == \
        [t % 251 for t in prompt(200) + [7] * 10]
    h.complete(nxt, [4] * 3)
    h.cache.host.drain()
    h.check_idle()
    h.cache.release_host_resources()


def test_another_model_starts_cold_with_one_warning(setup, tmp_path, caplog):
    args, env, path = setup
    first_server(args, env)
    config = tmp_path / "model" / "config.json"
    c = json.loads(config.read_text())
    c["rms_norm_eps"] = 1e-5
    config.write_text(json.dumps(c))
    with caplog.at_level("WARNING"):
        h = build_cache(args, env=env)
    assert "saved by another setup (config:" in caplog.text and not h.cache.index.sizes.snapshots
    h.cache.release_host_resources()


def test_slabs_written_over_since_the_save_are_dropped(setup, caplog):
    args, env, path = setup
    h = first_server(args, env)
    from hpc_radix.persistence import read_cache_file

    _, records, _ = read_cache_file(path)
    shared = int(records[0].node_slabs[0])              # block 0: on both snapshots' path
    with open(path + ".slabs", "r+b") as f:             # a later server reused that slab
        f.seek(shared * h.cache.host.layout.slab_bytes)
        f.write(b"\xff" * 64)
    with caplog.at_level("INFO"):
        h = build_cache(args, env=env)
    assert "loaded 0 of 2 saved snapshots (2 dropped" in caplog.text
    assert not h.cache.index.sizes.snapshots
    h.check_idle()
    h.cache.release_host_resources()


def test_a_damaged_index_starts_cold(setup, caplog):
    args, env, path = setup
    first_server(args, env)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(path, "wb").write(bytes(data))
    with caplog.at_level("WARNING"):
        h = build_cache(args, env=env)
    assert "prefix cache file not loaded" in caplog.text and not h.cache.index.sizes.snapshots
    h.cache.release_host_resources()


def test_the_cache_file_benchmark_runs_and_keeps_a_full_tier(tmp_path, capsys):
    """benchmarks/micro/cache_file_bench.py on a small tier: everything it filled survives."""
    from benchmarks.micro import cache_file_bench

    assert cache_file_bench.main(["--dir", str(tmp_path), "--mib", "16", "--blocks", "4",
                                  "--slab-kib", "64", "--image-bytes", str(256 << 10)]) == 0
    out = capsys.readouterr().out
    assert "survived:" in out and "(100.0 %)" in out


def test_a_truncated_data_file_loads_nothing_wrong(setup, caplog):
    args, env, path = setup
    first_server(args, env)
    with open(path + ".slabs", "r+b") as f:              # a disk that filled up, a bad copy
        f.truncate(os.path.getsize(path + ".slabs") // 3)
    with caplog.at_level("INFO"):
        h = build_cache(args, env=env)
    assert "loaded 0 of 2 saved snapshots (2 dropped" in caplog.text
    assert not h.cache.index.sizes.snapshots
    h.serve(h.new_req(prompt(200) + [7] * 10), [1])      # cold, and the tier still serves
    h.cache.host.drain()
    h.check_idle()
    h.cache.release_host_resources()


def test_each_data_parallel_scheduler_keeps_its_own_file(setup):
    """With --dp-size 2 every scheduler has a host tier of its own: one file per rank, so two
    schedulers never write over each other's slabs or index."""
    _, env, path = setup
    model = os.path.join(os.path.dirname(path), "model")
    try:
        h = build_cache(make_server_args(model, "--dp-size", "2"), env=env)
        assert h.cache.options.prefix_cache_file == path + ".dp0"
        h.serve(h.new_req(prompt(200)), [7] * 4)
        h.cache.host.drain()
        h.cache.release_host_resources()
    finally:
        make_server_args(model)                   # the scheduler's global args as before
    assert os.path.exists(path + ".dp0") and not os.path.exists(path)


def test_a_data_file_that_cannot_be_opened_is_a_clear_startup_error(setup):
    args, env, path = setup
    os.mkdir(path + ".slabs")                            # something else has that name
    from hpc_radix.options import OptionError

    with pytest.raises(OptionError, match=r"--prefix-cache-file: cannot open its data file .*slabs"):
        build_cache(args, env=env)


def test_a_full_disk_is_logged_and_what_missed_the_file_never_loads(setup, monkeypatch, caplog):
    """The background writer hits ENOSPC: the error is logged once, serving goes on, the save
    still writes its index, and the restart drops the snapshots whose slabs missed the file."""
    import errno

    from hpc_radix.binding.host import memory as host

    args, env, path = setup
    real_pwrite = os.pwrite

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(host.os, "pwrite", full)
    with caplog.at_level("INFO"):
        first_server(args, env)
    assert caplog.text.count("No space left on device") == 1 and "saved 2 snapshots" in caplog.text
    monkeypatch.setattr(host.os, "pwrite", real_pwrite)
    caplog.clear()
    with caplog.at_level("INFO"):
        h = build_cache(args, env=env)
    assert "loaded 0 of 2 saved snapshots (2 dropped" in caplog.text
    h.cache.release_host_resources()


@pytest.fixture
def speculative_setup(setup, speculative_args, tmp_path):
    """``setup``'s model under speculative decoding (SGLang's server args resolved before the
    test's log capture starts: resolving them sets logging up anew)."""
    return speculative_args(tmp_path / "model"), *setup


def test_a_speculative_servers_file_brings_the_draft_kv_back_and_no_other_setup_takes_it(
        speculative_setup, caplog):
    """The blocks of a server with speculative decoding hold its draft model's KV: a restart
    with the draft restores it; one without a draft starts cold with a warning naming it."""
    spec, args, env, path = speculative_setup
    h = build_cache(spec, env=env)
    h.attach_draft()                                 # the host tier opens the file here
    assert h.cache.host.memory.wait(60)
    h.serve(h.new_req(prompt(200)), [7] * 10)
    h.cache.host.drain()
    h.cache.release_host_resources()

    with caplog.at_level("INFO"):
        h = build_cache(spec, env=env)
        draft = h.attach_draft()
    assert "loaded 2 of 2 saved snapshots" in caplog.text
    nxt = h.new_req(prompt(200) + [7] * 10 + prompt(40, seed=3))
    assert h.admit(nxt) == 210
    h.cache.host.drain()
    row = h.req_pool.req_to_token[req_slots(nxt).req_pool_idx][:210].long()
    assert draft.full_kv_pool.k_buffer[0][row, 0, 0].tolist() == [-(t % 251) - 1 for t in prompt(200) + [7] * 10]
    h.complete(nxt, [4] * 3)
    h.cache.host.drain()
    h.check_idle()
    h.cache.release_host_resources()

    caplog.clear()
    with caplog.at_level("WARNING"):
        h = build_cache(args, env=env)
    assert "saved by another setup (draft_model:" in caplog.text and not h.cache.index.sizes.snapshots
    h.cache.release_host_resources()
