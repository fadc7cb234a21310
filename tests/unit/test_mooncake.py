"""Mooncake traces as token-level traces (benchmarks/workloads/mooncake.py).

Rows are hand-made in Mooncake's format (512-token hash blocks, replayed as 128 tokens each,
lengths scaled by 1/4). Expected shares are derived by hand in the comments and checked with
the oracle (the longest prefix shared with an earlier request, prompts only, each finished
before the next is sent).
"""
from __future__ import annotations

import json

import pytest

from benchmarks.workloads import mooncake, oracle_bounds


def row(hashes, input_length, output_length=40, timestamp=0):
    return {"timestamp": timestamp, "input_length": input_length,
            "output_length": output_length, "hash_ids": hashes}


ROWS = [
    row([1, 2, 3], 1100, timestamp=1000),      # r0: 128 + 128 + 19 = 275 tokens (1100 / 4)
    row([1, 2, 4, 5], 1700, timestamp=1500),   # r1: continues r0 (all but its last hash): 425
    row([1, 2, 6], 1200, timestamp=2000),      # r2: continues r0 too (a sibling of r1): 300
    row([7, 8], 600, timestamp=2500),          # r3: new, 150
    row([1, 9], 700, timestamp=3000),          # r4: shares one block only: new, 175
    row([1, 2, 4, 11, 10], 2200, timestamp=3500),   # r5: continues r1 (hashes 1 2 4): 550
]


def shares(reqs) -> dict:
    """id -> the oracle: each request sent after every earlier one finished, no outputs."""
    return oracle_bounds((r.id, 2 * i, 2 * i + 1, r.prompt, []) for i, r in enumerate(reqs))


def test_exact_continues_the_whole_earlier_prompt_partial_block_included():
    reqs = mooncake.convert(ROWS, mode="exact", block_tokens_per_hash=128, max_new_tokens=16)
    assert [len(r.prompt) for r in reqs] == [275, 425, 300, 150, 175, 550]
    assert [r.kind for r in reqs] == ["new", "continue", "continue", "new", "new", "continue"]
    assert [r.after for r in reqs] == [[], ["mc0"], ["mc0"], [], [], ["mc1"]]
    assert reqs[1].session == reqs[2].session == reqs[5].session == "mc0"
    assert reqs[1].prompt[:275] == reqs[0].prompt            # r0's 19 partial tokens included
    # r1 and r2 diverge after r0's prompt, at 275: off the 64-token grid
    assert shares(reqs) == {"mc0": 0, "mc1": 275, "mc2": 275, "mc3": 0, "mc4": 128, "mc5": 425}
    # outputs: output_length / 4 = 10, within [1, max_new_tokens]
    assert {r.max_new_tokens for r in reqs} == {10}


def test_blocks_rerenders_the_partial_last_block():
    reqs = mooncake.convert(ROWS, mode="blocks", block_tokens_per_hash=128)
    assert [len(r.prompt) for r in reqs] == [275, 425, 300, 150, 175, 550]
    # a continuation shares the earlier prompt's full blocks only: 256, 256, and r1's 384
    assert shares(reqs) == {"mc0": 0, "mc1": 256, "mc2": 256, "mc3": 0, "mc4": 128, "mc5": 384}
    assert [r.kind for r in reqs] == ["new", "continue", "continue", "new", "new", "continue"]


def test_arrivals_by_timestamp_and_output_cap():
    reqs = mooncake.convert(ROWS, by_timestamp=True, speedup=2.0, max_new_tokens=4)
    assert [r.t for r in reqs] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]
    assert {r.max_new_tokens for r in reqs} == {4}
    assert all(r.t == 0 for r in mooncake.convert(ROWS))     # closed loop


def test_window_and_bad_input(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    got = mooncake.load(str(path), mooncake.Window.parse("1,2"), mode="exact")
    assert [len(r.prompt) for r in got] == [425, 300]
    assert [r.kind for r in got] == ["new", "new"]           # r0 is outside the window
    assert mooncake.Window.parse("5") == mooncake.Window(0, 5)
    for bad in ("", "a,b", "1,0", "1,2,3"):
        with pytest.raises(ValueError, match="window"):
            mooncake.Window.parse(bad)
    with pytest.raises(ValueError, match="no request"):
        mooncake.load(str(path), mooncake.Window(10, 5))
    with pytest.raises(ValueError, match="mode 'whole'"):
        mooncake.convert(ROWS, mode="whole")
    path.write_text(json.dumps({"timestamp": 0, "hash_ids": [1]}) + "\n")
    with pytest.raises(ValueError, match="no 'input_length'"):
        mooncake.load(str(path), mooncake.Window(0, 1))
