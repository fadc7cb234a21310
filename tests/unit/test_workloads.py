"""Workload generation, trace format, oracle and A/B report (benchmarks/), CPU only."""
import json
import random

import pytest

from benchmarks import ab
from benchmarks.workloads import (
    MIXES, TINY, PrefixIndex, agentic, chat, describe, dump, fanout, load, long_agentic,
    oracle_bounds, resolve, simulate,
)
from benchmarks.workloads.chatml import BYTE_ID, byte_level_encode  # noqa: E402
from benchmarks.workloads.trace import Request, from_dict, ref, validate  # noqa: E402

V = TINY
OPENER = V.opener()


def _split(ids, tok):
    return [i for i, t in enumerate(ids) if t == tok]


# ------------------------------------------------------------------ tokens / template

def test_byte_ids_match_tiny_tokenizer():
    assert sorted(BYTE_ID) == list(range(256))
    assert byte_level_encode("!") == [0] and byte_level_encode("~") == [93]
    assert byte_level_encode("\n") == [198] and byte_level_encode(" ") == [220]
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    text = "<|im_start|>user\nhello é\n<|im_end|>\n"
    assert tok.encode(text).ids == V.header("user") + V.text("hello é\n") + V.end()


# ------------------------------------------------------------------ determinism

@pytest.mark.parametrize("mix", sorted(MIXES))
def test_same_seed_same_file_other_seed_differs(tmp_path, mix):
    paths = []
    for i, seed in enumerate((3, 3, 4)):
        p = tmp_path / f"{i}.jsonl"
        dump(MIXES[mix](seed, 0.1), str(p))
        paths.append(p.read_bytes())
    assert paths[0] == paths[1]
    assert paths[0] != paths[2]


def test_content_never_uses_special_ids():
    reqs = MIXES["ample"](0, 0.1)
    done = simulate(reqs)
    specials = V.specials
    for r in reqs:
        prompt = done[r.id][0]
        assert all(0 <= t < 259 for t in prompt)
        # specials appear only as template tokens: every im_start is followed by a role header
        for i in _split(prompt, V.im_start):
            assert any(prompt[i:i + len(V.header(role))] == V.header(role)
                       for role in ("system", "user", "assistant"))
        assert prompt[-len(OPENER):] == OPENER
        assert sum(t in specials for t in prompt) % 2 == 0 or prompt[-len(OPENER):] == OPENER


# ------------------------------------------------------------------ structure

def test_agentic_structure():
    reqs = agentic(1, 1.0)
    validate(reqs)
    by = {r.id: r for r in reqs}
    done = simulate(reqs)
    firsts = [r for r in reqs if r.round == 0]
    assert len(firsts) == 6
    for r in firsts:  # preamble: one system block of 10-20k tokens, not a multiple of 64
        p = done[r.id][0]
        end = _split(p, V.im_end)[0] + 2
        assert 10_000 <= end <= 20_000 and end % 64 and end % 256
    # sessions of one persona share their whole system block, other personas do not
    pre = {}
    for r in firsts:
        p = done[r.id][0]
        pre.setdefault(r.tag, set()).add(tuple(p[:_split(p, V.im_end)[0] + 2]))
    assert set(pre) == {"coder", "reviewer", "stripper"} and all(len(s) == 1 for s in pre.values())
    # every later turn of a normal session embeds the previous prompt + output token for token
    for r in reqs:
        if r.kind == "continue" and r.tag in ("coder", "reviewer"):
            prev = r.refs()[0]
            pp, po = done[prev]
            assert done[r.id][0][:len(pp) + len(po)] == pp + po
    # subagent fan-out: 3 per spawning session share the subagent preamble, results return
    subs = [r for r in reqs if r.tag == "subagent" and r.kind == "new"]
    assert len(subs) == 6
    heads = {tuple(done[r.id][0][:_split(done[r.id][0], V.im_end)[0] + 2]) for r in subs}
    assert len(heads) == 1
    back = [r for r in reqs if any(by[x].tag == "subagent" for x in r.refs())
            and r.tag != "subagent"]
    assert len(back) == 2 and all(len(r.refs()) == 4 for r in back)
    # retry and abort + re-send: same prompt, after the original
    for kind in ("retry", "resend"):
        (r,) = [x for x in reqs if x.kind == kind]
        orig = by[r.after[0]]
        assert r.prompt == [ref(orig.id, "prompt")] and orig.round == r.round
        assert (orig.abort_after_tokens is not None) == (kind == "resend")
    assert sum(r.abort_after_tokens is not None for r in reqs) == 1
    assert max(len(x) for x in (r.deps() for r in reqs if r.round == 0)) == 0


def test_compaction_restarts_from_summary():
    for reqs in (agentic(2, 0.5), long_agentic(2, 0.2)):
        done = simulate(reqs)
        compacts = [r for r in reqs if r.kind == "compact"]
        assert compacts
        for c in compacts:
            nxt = [r for r in reqs if r.session == c.session and r.kind == "new"
                   and r.round > c.round]
            assert nxt, c.id
            restart = nxt[0]
            assert {"ref": c.id, "part": "output"} in restart.prompt
            summary = done[c.id][1]
            rp, cp = done[restart.id][0], done[c.id][0]
            sys_end = _split(cp, V.im_end)[0] + 2
            assert rp[:sys_end] == cp[:sys_end]  # same preamble
            assert len(rp) < len(cp)  # shorter than the history it replaces
            assert any(rp[i:i + len(summary)] == summary for i in range(len(rp)))


def test_long_contexts_reach_64k_to_128k():
    stats = describe(long_agentic(0, 1.0))
    assert 64_000 <= stats["max_prompt"] <= 128_000 and stats["max_request"] < 131_072
    assert stats["kinds"].get("compact", 0) >= 1


def test_stripped_persona_strips_the_output():
    reqs = agentic(5, 0.3)
    done = simulate(reqs)
    strip = [r for r in reqs if r.tag == "stripper" and r.kind == "continue"]
    assert strip
    for r in strip:
        prev = r.prompt[0]["ref"]
        pp, po = done[prev]
        p = done[r.id][0]
        assert r.prompt[0] == ref(prev, "prompt")
        assert p[:len(pp)] == pp and pp[-len(OPENER):] == OPENER  # reuse up to the opener
        assert p[len(pp):len(pp) + len(po)] != po  # ... but not the previous output
        answer = p[len(pp):_split(p[len(pp):], V.im_end)[0] + len(pp)]
        assert 8 <= len(answer) < len(po)


def test_fanout_shares_preamble_in_waves():
    reqs = fanout(0, 0.5, lengths=(4000, 3000), per_group=16)
    done = simulate(reqs)
    for g in (0, 1):
        grp = [r for r in reqs if r.session.startswith(f"fan/g{g}/")]
        heads = {tuple(done[r.id][0][:_split(done[r.id][0], V.im_end)[0] + 2]) for r in grp}
        assert len(heads) == 1
        n = len(next(iter(heads)))
        assert n % 64 and abs(n - [2000, 1500][g]) < 64
        first = [r for r in grp if r.round == g]
        assert len(first) == 8 and all(r.t == 0 for r in first)  # 8 at once on a new prefix
        in_round = [r for r in reqs if r.round == g]
        assert in_round[:8] == first  # ... and first in their round, so they start together


def test_chat_rounds():
    reqs = chat(0, 0.5, clients=5, rounds=3)
    assert len(reqs) == 15 and {r.round for r in reqs} == {0, 1, 2}
    assert all(r.kind == ("new" if r.round == 0 else "continue") for r in reqs)


# ------------------------------------------------------------------ trace format

def test_trace_round_trip_and_blocks(tmp_path):
    reqs = MIXES["ample"](0, 0.1)
    p = tmp_path / "t.jsonl"
    dump(reqs, str(p))
    back = load(str(p))
    assert [r.to_json() for r in back] == [r.to_json() for r in reqs]
    ext = tmp_path / "ext.jsonl"
    ext.write_text("\n".join(json.dumps(d) for d in [
        {"t": 0.5, "blocks": [1, 2, 3], "block_tokens": 16, "max_new_tokens": 4},
        {"t": 1.0, "blocks": [1, 2, 9], "block_tokens": 16, "max_new_tokens": 4},
        {"id": "x", "round": 1, "prompt": [5, {"ref": "L1", "part": "full"}, 7],
         "max_new_tokens": 2, "after": ["L2"]},
    ]) + "\n")
    a, b, x = load(str(ext))
    assert (a.id, a.session, a.kind, a.t) == ("L1", "L1", "new", 0.5)
    assert x.kind == "continue" and x.deps() == ["L1", "L2"]
    done = {}
    for r in (a, b):
        done[r.id] = (resolve(r, done), [300, 301])
    assert len(done["L1"][0]) == 48 and done["L1"][0][:32] == done["L2"][0][:32]
    assert done["L1"][0][32:] != done["L2"][0][32:]
    assert resolve(x, done) == [5] + done["L1"][0] + [300, 301, 7]


def test_trace_validation():
    with pytest.raises(ValueError):
        validate([Request("a", [ref("b")], 4), Request("b", [1], 4)])  # forward reference
    with pytest.raises(ValueError):
        validate([Request("a", [1], 4, round=2), Request("b", [ref("a")], 4, round=1)])
    with pytest.raises(ValueError):
        validate([Request("a", [1], 4), Request("a", [1], 4)])
    with pytest.raises(ValueError):
        validate([from_dict({"prompt": [1], "max_new_tokens": 1, "kind": "bogus"})])


# ------------------------------------------------------------------ oracle

def _ev(rid, sent, fin, prompt, out=()):
    return (rid, sent, fin, list(prompt), list(out))


def test_oracle_hand_made():
    A = list(range(100))
    ev = [
        _ev("a", 0, 1, A, [900, 901]),
        _ev("b", 2, 3, A + [900, 901, 5]),             # continues a: shares 102
        _ev("c", 2, 3, A),                              # repeat: capped at n-1 = 99
        _ev("d", 0.5, 4, A[:70] + [7] * 30),            # sent before a finished: 0
        _ev("e", 5, 6, A[:70] + [7] * 10 + [8] * 5),    # 70 with a, 80 with d
        _ev("f", 5, 6, [1000] + A),                     # different first token: 0
        _ev("g", 3, 7, A[:64]),                         # one full block repeat: 63
        _ev("h", 3.5, None, A + [1, 2, 3]),             # failed: never counts
        _ev("i", 8, 9, A + [1, 2, 3, 4]),               # h failed, so only a's 100 counts
    ]
    got = oracle_bounds(ev)
    assert got == {"a": 0, "b": 102, "c": 99, "d": 0, "e": 80, "f": 0, "g": 63, "h": 100, "i": 100}


def test_oracle_only_finished_strictly_before_send():
    A = list(range(10))
    got = oracle_bounds([_ev("a", 0, 1.0, A), _ev("b", 1.0, 2, A + [1]), _ev("c", 1.5, 2, A + [1])])
    assert got == {"a": 0, "b": 0, "c": 10}


def _random_events(seed: int, n: int, failed_share: float = 0.0) -> list:
    """n requests on random cuts of one 400-token base, sent and finished at random times
    (``failed_share`` of them never finishing)."""
    rng = random.Random(seed)
    base = [rng.randrange(50) for _ in range(400)]
    ev = []
    for i in range(n):
        cut = rng.randrange(0, 400)
        p = base[:cut] + [rng.randrange(50) for _ in range(rng.randrange(1, 150))]
        s = rng.uniform(0, 100)
        failed = failed_share and rng.random() <= failed_share
        ev.append(_ev(str(i), s, None if failed else s + rng.uniform(0.1, 10), p,
                      [rng.randrange(50) for _ in range(rng.randrange(0, 80))]))
    return ev


def test_oracle_matches_brute_force():
    ev = _random_events(7, 60, failed_share=0.1)
    got = oracle_bounds(ev)

    def lcp(x, y):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n
    for rid, s, _, p, _ in ev:
        best = max([lcp(p, q + o) for _, _, f, q, o in ev if f is not None and f < s], default=0)
        assert got[rid] == max(0, min(len(p) - 1, best)), rid


def test_oracle_is_fast_on_a_long_agent_trace():
    import time
    reqs = long_agentic(0, 1.0)
    done = simulate(reqs)
    ev = [(r.id, i, i + 0.5, *done[r.id]) for i, r in enumerate(reqs)]
    assert sum(len(p) for p, _ in done.values()) > 2_000_000
    t = time.time()
    got = oracle_bounds(ev)
    assert time.time() - t < 10
    cont = [r for r in reqs if r.kind == "continue"]
    assert all(got[r.id] >= len(done[r.refs()[0]][0]) for r in cont)


def test_prefix_index_counts_distinct_tokens():
    idx = PrefixIndex()
    a = list(range(200))
    assert idx.insert(a) == 200
    assert idx.insert(a) == 0
    assert idx.insert(a[:128] + [7] * 72) == 72
    assert idx.longest(a[:130] + [5]) == 130


# ------------------------------------------------------------------ runner

def _fake_results():
    """Recorded results of two arms on a small trace, as ab.replay would save them."""
    reqs = chat(0, 0.2, clients=3, rounds=2)
    done = simulate(reqs)
    out = []
    for arm, hit, slow in (("stock", 0.5, 1.0), ("hybrid", 1.0, 0.5), ("nocache", 0.0, 2.0)):
        recs = []
        for i, r in enumerate(reqs):
            p, o = done[r.id]
            recs.append({"id": r.id, "session": r.session, "round": r.round, "kind": r.kind,
                         "tag": r.tag, "n_prompt": len(p), "max_new": r.max_new_tokens,
                         "prompt_digest": str(len(p)), "status": "ok", "error": None,
                         "ttft": 0.01 * slow * (1 + i), "sent": float(i), "finished": i + 0.5,
                         "latency": 0.5, "output": o if arm != "hybrid" or i else [1],
                         "n_out": len(o), "cached_host": 0, "cached": None})
        orc = oracle_bounds((x["id"], x["sent"], x["finished"], done[x["id"]][0], x["output"])
                            for x in recs)
        for x in recs:
            x["oracle"] = orc[x["id"]]
            x["cached"] = int(x["oracle"] * hit)
        out.append({"regime": "ample", "arm": arm, "cmd": ["python", "-m", "sglang.launch_server"],
                    "wall_s": 10.0 * slow, "complete": True, "records": recs,
                    "trace_stats": describe(reqs), "about": "test", "trace": "t.jsonl",
                    "host_mib": 512 if arm == "hybrid" else None,
                    "host_mib_source": "test" if arm == "hybrid" else None})
    return out


def test_report_from_recorded_results(tmp_path):
    results = _fake_results()
    s = ab.write_report(results, str(tmp_path), ["note"])
    e = s["regimes"]["ample"]
    assert s["valid"]
    st, hy, nc = (e["arms"][k] for k in ("stock", "hybrid", "nocache"))
    assert hy["cached_tokens"] == hy["oracle_tokens"] > 0
    assert hy["cached_share_of_oracle"] == 1.0 and nc["cached_tokens"] == 0
    assert nc["whole_prompt_reprefills"] == sum(
        r["oracle"] >= ab.REPREFILL_MIN_ORACLE for r in results[2]["records"])
    assert st["prefilled_tokens"] == st["prompt_tokens"] - st["cached_tokens"]
    assert e["ratios_to_stock"]["hybrid"]["ttft_ms_continuing"]["p50"] == pytest.approx(0.5)
    assert e["ratios_to_stock"]["nocache"]["wall_s"] == pytest.approx(2.0)
    same, n = e["agreement_with_nocache"]["hybrid"]
    assert n == len(results[1]["records"]) and same == n - 1
    md = (tmp_path / "report.md").read_text()
    assert "## ample" in md and "| hybrid | yes |" in md and "Ratios to stock" in md
    assert json.loads((tmp_path / "summary.json").read_text())["valid"] is True
    # a failed request makes the run invalid, and the report says so
    results[0]["records"][3].update(status="failed", error="HTTP 500: boom")
    s = ab.write_report(results, str(tmp_path))
    assert not s["valid"]
    md = (tmp_path / "report.md").read_text()
    assert "INVALID" in md and "HTTP 500: boom" in md


def test_report_from_saved_dirs(tmp_path):
    for i, res in enumerate(_fake_results()):
        d = tmp_path / f"job{i % 2}" / "results"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{res['regime']}__{res['arm']}.json").write_text(json.dumps(res))
    assert ab.main(["--report-from", str(tmp_path / "job0"), str(tmp_path / "job1"),
                    "--out", str(tmp_path / "merged")]) == 0
    assert "| nocache |" in (tmp_path / "merged" / "report.md").read_text()


def test_dry_run_and_plan(tmp_path, capsys):
    assert ab.main(["--dry-run", "--out", str(tmp_path), "--scale", "0.1",
                    "--regimes", "ample,device,host"]) == 0
    text = capsys.readouterr().out
    # stock 2 (device+host share one server), hicache 2 (none for device), hybrid 3, nocache 2
    assert text.count("sglang.launch_server") == 9
    assert "--radix-cache hybrid" in text and "--disable-radix-cache" in text
    assert "--host-cache-mib 0" in text and "--hicache-ratio 2" in text
    a = ab.parse(["--scale", "0.1", "--regimes", "device,host", "--out", str(tmp_path)])
    traces = ab.build_traces(a, a.regimes)
    st = traces["device"]["stats"]
    dev = ab.device_tokens(st)
    assert st["working_set"] >= 3 * dev * 0.99 or dev > st["max_request"]
    runs = ab.plan_runs(a, "tiny", traces, {"host": 777})
    assert [(arm, regs) for arm, regs, _, _ in runs] == [
        ("stock", ["device", "host"]), ("hicache", ["host"]), ("hybrid", ["device"]),
        ("hybrid", ["host"]), ("nocache", ["device", "host"])]
    assert "777" in runs[3][2]
    # the tight host regime: HiCache's host KV pool equals the device pool, a quarter of the
    # working set; hybrid gets the same bytes
    assert ab.main(["--dry-run", "--out", str(tmp_path), "--scale", "0.1", "--regimes", "host-tight"]) == 0
    text = capsys.readouterr().out
    assert "--hicache-ratio 1" in text and text.count("sglang.launch_server") == 4


def test_help_runs():
    with pytest.raises(SystemExit) as e:
        ab.parse(["--help"])
    assert e.value.code == 0


def test_hicache_host_bytes_from_log(tmp_path):
    cfg = {"layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_key_value_heads": 2,
           "head_dim": 256, "linear_key_head_dim": 128, "linear_num_key_heads": 2,
           "linear_value_head_dim": 128, "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4,
           "max_position_embeddings": 32768, "vocab_size": 512}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    kv, state = ab.state_bytes(str(tmp_path))
    assert kv == 2048 and state == 3 * (4 * 128 * 128 * 4 + 1024 * 3 * 2)
    assert ab.context_len(str(tmp_path), "tiny") == 32768
    assert ab.model_kind(str(tmp_path), None) == "tiny"
    log = ("[x] Allocating full hierarchical KV host pool: 40960 tokens, 0.08 GB host memory.\n"
           "[x] Allocating 0.08 GB host memory for hierarchical Mamba cache (layout=page_first).\n")
    assert ab.hicache_host_mib(log) == int(0.16e9 / 2**20)
    assert ab.hicache_host_mib(log, str(tmp_path)) == int((40960 * 2048 + 0.08e9) / 2**20)
    assert ab.hicache_host_mib("no such line") is None


def test_plain_mix_carries_no_special_tokens():
    from benchmarks.workloads import MIXES, TINY

    reqs = MIXES["plain"](0, 0.1)
    ids = [t for r in reqs for t in r.prompt if isinstance(t, int)]
    assert ids and not set(ids) & TINY.specials
    assert {r.kind for r in reqs} >= {"new", "continue"}


def test_documents_have_mooncakes_shapes():
    from benchmarks.workloads.generate import documents
    from benchmarks.workloads.oracle import _lcp

    reqs = documents(0, 0.5, docs=3, askers=3, rounds=6, rerender=40)
    texts = {rid: p for rid, (p, _) in simulate(reqs).items()}
    by_id = {r.id: r for r in reqs}
    # siblings: one document, then their own question; they part off the 64-token grid
    a, b_ = texts["doc/d0/u0#0"], texts["doc/d0/u1#0"]
    shared = _lcp(a, b_)
    assert shared > 1000 and shared % 64 and a[:shared] == b_[:shared]
    # the next question, docs rounds later, goes on from the earlier prompt with its last 40
    # tokens re-rendered (not from its output), sent after it
    again = by_id["doc/d0/u0#3"]
    assert again.kind == "continue" and again.after == ["doc/d0/u0#0"] and again.round == 3
    assert _lcp(texts[again.id], a) == len(a) - 40
    # other documents' traffic in between
    assert {r.tag for r in reqs if 0 < r.round < 3} == {"doc1", "doc2"}


def test_clairvoyant_taps_reach_a_prompt_anywhere_and_an_output_only_at_its_end():
    from benchmarks.workloads import clairvoyant_tap_bounds

    A = list(range(1, 101))                       # a 100-token prompt
    O = [500, 501, 502, 503]                      # its output: endpoint after 103 tokens
    ev = [
        _ev("a", 0, 1, A, O),
        _ev("b", 2, 3, A[:70] + [7] * 30),        # leaves a's prompt at 70: a tap there
        _ev("c", 2, 3, A + O + [9] * 5),          # continues a's endpoint (103 of a + o[:3])
        _ev("d", 2, 3, A + O[:2] + [9] * 5),      # leaves a's output at 102: a's prompt end
        _ev("e", 2, 3, A[:64]),                   # repeats a block: 63 (n - 1)
    ]
    bounds = clairvoyant_tap_bounds(ev)
    assert bounds == {"a": 0, "b": 70, "c": 103, "d": 100, "e": 63}
    oracle = oracle_bounds(ev)
    assert oracle["d"] == 102 and all(bounds[k] <= oracle[k] for k in bounds)


def test_clairvoyant_taps_never_exceed_the_oracle_on_random_traffic():
    from benchmarks.workloads import clairvoyant_tap_bounds

    ev = _random_events(11, 80)
    bounds, oracle = clairvoyant_tap_bounds(ev), oracle_bounds(ev)
    assert all(bounds[k] <= oracle[k] for k in bounds) and sum(bounds.values()) > 0


def test_clairvoyant_retention_keeps_what_is_needed_soonest_and_never_beats_bound_a():
    """Bound (b): two sessions alternate; memory for one session's blocks and state keeps the
    session whose next turn comes first (Belady), the other starts over."""
    from benchmarks.workloads import clairvoyant_retention_bounds, clairvoyant_tap_bounds

    A, B = list(range(1000, 1128)), list(range(2000, 2128))      # two blocks each
    ev = [_ev("a1", 0, 1, A), _ev("b1", 2, 3, B),
          _ev("a2", 4, 5, A + [1] * 10), _ev("a3", 6, 7, A + [1] * 10 + [2]), _ev("b2", 8, 9, B + [3])]
    taps = clairvoyant_tap_bounds(ev)
    assert taps == {"a1": 0, "b1": 0, "a2": 128, "a3": 138, "b2": 128}
    bound = lambda kv, states, host: clairvoyant_retention_bounds(  # noqa: E731
        ev, (kv, states, host), block_bytes=1, state_bytes=1)
    assert bound(0, 0, 10**6) == taps                          # ample memory: bound (a)
    assert set(bound(0, 0, 0).values()) == {0}
    # room for 3 blocks and a state: after b1, a's path (next use: a2) is kept, b's goes
    for memory in ((0, 0, 4), (3, 1, 0), (2, 0, 2)):
        tight = bound(*memory)
        assert tight["a2"] == 128 and tight["b2"] == 0, memory
    # the device pools hold only their own kind: states need their blocks, blocks a state
    assert set(bound(0, 10, 0).values()) == set(bound(10, 0, 0).values()) == {0}
    assert bound(10, 10, 0) == taps
    ev_r = _random_events(13, 80)
    for cap in (0, 8, 64, 10**6):
        got, a = clairvoyant_retention_bounds(ev_r, (cap, cap // 4, cap), 1, 4), clairvoyant_tap_bounds(ev_r)
        assert all(got[k] <= a[k] for k in a)
    assert sum(clairvoyant_retention_bounds(ev_r, (0, 0, 10**6), 1, 4).values()) == sum(a.values())


def test_crash_splits_a_one_round_trace_at_its_middle_request():
    reqs = [Request(id=f"r{i}", prompt=[1, 2, i], max_new_tokens=1, t=float(i)) for i in range(5)]
    split = ab.split_single_round(reqs)
    assert [r.round for r in split] == [0, 0, 1, 1, 1]
    assert [r.t for r in split[2:]] == [0.0, 1.0, 2.0]      # times count from their round's start
    validate(split)
    recs = [{"round": r.round, "status": "ok", "cached": 1} for r in split]
    one_round = [{**r, "round": 0} for r in recs]
    # the crashed run's second half and the uncrashed run's are the same requests
    assert ab._second_half(recs) == recs[2:] and ab._second_half(one_round) == one_round[2:]
    assert ab.split_single_round(split) == split             # more rounds: the middle round
