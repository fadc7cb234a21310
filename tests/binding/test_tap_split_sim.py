"""benchmarks/micro/tap_split_sim.py: the pressure trace replayed through the real cache."""
from benchmarks.micro import tap_split_sim


def test_echoing_clients_cost_fewer_prefill_passes(server_args):
    with_rule = tap_split_sim.simulate(server_args, mix="pressure", scale=0.03)["all"]
    without = tap_split_sim.simulate(server_args, mix="pressure", scale=0.03, ignore_echo=True)["all"]
    assert with_rule["requests"] == without["requests"] == 218
    # every prompt fits one 8192-token chunk: one pass per request plus one per split
    for s in (with_rule, without):
        assert s["passes"] == s["requests"] + s["splits"]
        assert 0 < s["cached"] < s["prompt"]
    # the opener is not tapped for clients that send their outputs back
    assert with_rule["split at opener"] < without["split at opener"]
    assert with_rule["passes"] < without["passes"]


def test_with_a_host_tier_it_counts_host_hits_and_what_the_device_pages_hold(server_args):
    from hpc_radix.kernels import host_copy

    kernel = host_copy._copy_items_kernel
    stats = tap_split_sim.simulate(server_args, mix="pressure", scale=0.03, kv_tokens=2048,
                                   in_pass=True, host_mib=64)
    s, pages = stats["all"], stats["device pages"]
    assert 0 < s["from host"] < s["cached"] < s["prompt"]    # pushed off a 32-page device
    assert pages["samples"] == s["requests"] == 218
    assert 0 < pages["tails"] <= pages["held"] <= 32 * 218
    assert pages["superseded tails"] <= pages["tails"]
    assert host_copy._copy_items_kernel is kernel            # the copies skipped only inside


def test_in_flight_replay_schedules_through_the_real_adder_and_classifies_the_turns(server_args):
    """8 in flight on a 32-page device: every request served once its turn came, the idle
    check clean at the end (``replay_concurrent`` runs it), each continuing turn classified,
    and requests queued behind refusals for memory (steps waited)."""
    stats = tap_split_sim.simulate(server_args, mix="pressure", scale=0.03, kv_tokens=2048,
                                   in_pass=True, host_mib=64, inflight=8)
    s, served, queued = stats["all"], stats["served"], stats["queue steps"]
    assert s["requests"] == s["passes"] == 218
    assert 0 < s["from host"] < s["cached"] < s["prompt"]
    # bound (b), clairvoyant retention in the device's and host tier's bytes: 64 MiB hold it all
    assert s["bound b"] == s["bound a"] <= s["oracle"]
    continuing = sum(stats[k]["requests"] for k in tap_split_sim.CONT_KINDS if k in stats)
    assert sum(served.values()) == continuing > 0
    assert set(served) <= {"device", "host tail", "host", "miss"} and served["host"] > 0
    assert sum(queued.values()) > 0                # the 32 pages cannot hold 8 requests at once
    census = stats["step pages"]                   # free, spare and evictable pages are apart
    assert census["steps"] > 218 and census["running requests"] > 0 and census["evictable"] > 0
    assert census["free"] + census["spare"] + census["evictable"] <= 32 * census["steps"]
    one_at_a_time = tap_split_sim.simulate(server_args, mix="pressure", scale=0.03, kv_tokens=2048,
                                           in_pass=True, host_mib=64)["all"]
    assert one_at_a_time["cached"] != s["cached"]   # requests in flight hold pages: another replay


def test_in_flight_replay_lists_what_the_device_held_for_each_turn_served_from_nothing(server_args):
    """Device only: every continuing turn served from nothing is listed once, with the KV and
    the deepest device snapshot the index held for it when it arrived."""
    stats = tap_split_sim.simulate(server_args, mix="pressure", scale=0.03, kv_tokens=2048,
                                   in_pass=True, inflight=8)
    misses, served = stats["misses"], stats["served"]
    s, cont = stats["all"], stats["continue"]      # 32 pages: clairvoyant retention loses some
    assert 0 < s["bound b"] < s["bound a"]
    # bound (b) is Belady's rule over finished requests, not a proof: requests in flight share
    # and sizes are not weighed, so the cache can pass it a little (0.5.23's replay: 1.01x)
    assert cont["cached"] <= 1.1 * cont["bound b"]
    assert served["miss"] > 0 and sum(misses.values()) == served["miss"] == len(misses)
    assert all(" tokens, on arrival KV " in m and " queued " in m for m in misses)


def test_restores_landing_steps_later_keep_the_replay_whole(server_args):
    """Host restores held in flight for two steps (requests admitted meanwhile share the blocks
    being restored): every request served, the idle check clean, host hits still counted."""
    stats = tap_split_sim.simulate(server_args, mix="pressure", scale=0.03, kv_tokens=2048,
                                   in_pass=True, host_mib=64, inflight=8, restore_steps=2)
    s = stats["all"]
    assert s["requests"] == s["passes"] == 218
    assert 0 < s["from host"] < s["cached"] < s["prompt"] and stats["served"]["host"] > 0


def test_the_census_accounts_for_every_missed_token_once(server_args):
    """--census: each request served less than its oracle has its missed tokens put under
    one fate (what became of the deepest snapshot on the shared prefix) or beyond it."""
    stats = tap_split_sim.simulate(server_args, mix="pressure", scale=0.03, kv_tokens=2048,
                                   in_pass=True, host_mib=1, inflight=8, census=True)
    tokens, requests, lines = stats["census"]
    assert len(lines) == sum(requests.values()) > 0
    missed = sum(int(line.split(" of ")[1].split()[0]) - int(line.split("served ")[1].split()[0])
                 for line in lines)
    assert sum(tokens.values()) == missed
    fates = {f.split(" (")[0].split(":")[0] for f in tokens}
    assert fates <= {"no snapshot", "evicted before arrival", "evicted while queued",
                     "held, not used", "beyond the deepest snapshot"}
    assert any(f.startswith("evicted") for f in tokens)     # 32 pages and 256 host slabs evict


def test_two_replicas_over_a_shared_tier_read_each_others_states(server_args, tmp_path):
    """Requests in turn over two caches sharing a file tier: continuing turns that land on
    the other replica resume from states read back from it, and the replay ends (a request
    waiting for the tier is matched again each round, as SGLang does)."""
    kw = dict(mix="pressure", scale=0.03, kv_tokens=2048, in_pass=True, host_mib=64, replicas=2)
    shared = tap_split_sim.simulate(server_args, store_dir=str(tmp_path / "tier"), **kw)
    alone = tap_split_sim.simulate(server_args, **kw)
    assert shared["all"]["requests"] == alone["all"]["requests"] == 218
    assert shared["cache counts"]["store_states_read"] > 0
    assert shared["all"]["cached"] > alone["all"]["cached"]
