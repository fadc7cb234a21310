"""benchmarks/stack_diff.py: py-spy's raw collapsed stacks, one thread, per-function totals."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.stack_diff import load, main  # noqa: E402

STACKS = """\
process 1:"sched";thread (1): MainThread;event_loop (s.py:10);run_batch (s.py:20);forward (m.py:5) 30
process 1:"sched";thread (1): MainThread;event_loop (s.py:10);run_batch (s.py:21);forward (m.py:6);wait (w.py:1) 20
process 1:"sched";thread (1): MainThread;event_loop (s.py:10);schedule (s.py:30) 10
process 2:"detok";thread (2): MainThread;detok_loop (d.py:1) 99
"""


def test_one_thread_per_function_lines_merged(tmp_path):
    path = tmp_path / "a.stacks"
    path.write_text(STACKS)
    total, inclusive, innermost = load(str(path), "event_loop", None)
    assert total == 60                                    # the detokenizer's stacks are not kept
    assert inclusive["run_batch (s.py)"] == 50            # lines 20 and 21 are one function
    assert inclusive["forward (m.py)"] == 50 and inclusive["event_loop (s.py)"] == 60
    assert innermost["forward (m.py)"] == 30 and innermost["wait (w.py)"] == 20
    total, inclusive, _ = load(str(path), "event_loop", "run_batch (")
    assert total == 50 and "event_loop (s.py)" not in inclusive and "schedule (s.py)" not in inclusive


def test_differences_largest_first(tmp_path, capsys):
    a, b = tmp_path / "a.stacks", tmp_path / "b.stacks"
    a.write_text(STACKS)
    b.write_text(STACKS.replace("wait (w.py:1) 20", "wait (w.py:1) 70"))
    main([str(a), str(b), "--rate", "1000", "--top", "3"])
    out = capsys.readouterr().out
    inclusive = out.split("inclusive")[1].split("innermost")[0]
    rows = {" ".join(r[3:]): r[:3] for r in (line.split() for line in inclusive.splitlines()[1:]) if r}
    assert len(rows) == 3 and all(diff == "+50" for _, _, diff in rows.values())   # largest first
    assert rows.get("event_loop (s.py)", ["60", "110", "+50"]) == ["60", "110", "+50"]  # ms at 1 kHz
    innermost = out.split("innermost frame")[1]
    assert innermost.splitlines()[1].split() == ["20", "70", "+50", "wait", "(w.py)"]
