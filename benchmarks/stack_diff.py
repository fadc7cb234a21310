#!/usr/bin/env python3
"""Where two servers' scheduler threads spend their time differently, from py-spy samples.

``ab.py --py-spy EXE`` records every server process's stacks during each replay
(OUT/logs/ARM-REGIME.stacks, py-spy's raw collapsed format: ``frame;frame;... count``). This
keeps the stacks of one thread (those with a frame matching ``--thread``, SGLang's scheduler
event loop by default), optionally only the part below a frame matching ``--under``, and
prints per function (file and name, lines merged) the time both spent in it, inclusive and
as the innermost frame, sorted by the difference B − A:

    python benchmarks/stack_diff.py OUT/logs/hicache-host.stacks OUT/logs/hybrid-host.stacks
    python benchmarks/stack_diff.py A B --under "run_batch (" --top 30
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import Counter

_LINE = re.compile(r":\d+\)$")


def function_of(frame: str) -> str:
    """``name (path/file.py:123)`` -> ``name (path/file.py)``."""
    return _LINE.sub(")", frame)


def load(path: str, thread: str, under: str | None) -> tuple[int, Counter, Counter]:
    """(samples, inclusive, innermost) of the matching stacks, per function."""
    total, inclusive, innermost = 0, Counter(), Counter()
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            if not any(thread in fr for fr in frames):
                continue
            if under is not None:
                at = next((i for i, fr in enumerate(frames) if under in fr), None)
                if at is None:
                    continue
                frames = frames[at:]
            n = int(count)
            total += n
            for fn in {function_of(fr) for fr in frames if not fr.startswith(("process ", "thread "))}:
                inclusive[fn] += n
            innermost[function_of(frames[-1])] += n
    return total, inclusive, innermost


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="stacks file A (the reference)")
    ap.add_argument("b", help="stacks file B")
    ap.add_argument("--thread", default="event_loop", help="keep stacks with a frame containing this")
    ap.add_argument("--under", help="only the frames below one containing this")
    ap.add_argument("--rate", type=float, default=250, help="py-spy's samples per second (ab.py: 250)")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args(argv)
    ms = 1e3 / a.rate
    (ta, ia, xa), (tb, ib, xb) = (load(p, a.thread, a.under) for p in (a.a, a.b))
    print(f"A {a.a}: {ta * ms / 1e3:.2f} s sampled\nB {a.b}: {tb * ms / 1e3:.2f} s sampled")
    for title, ca, cb in (("inclusive", ia, ib), ("innermost frame", xa, xb)):
        print(f"\n{title}, ms: A, B, B - A (largest differences first)")
        for fn in sorted(set(ca) | set(cb), key=lambda f: -abs(cb[f] - ca[f]))[:a.top]:
            print(f"{ca[fn] * ms:9.0f} {cb[fn] * ms:9.0f} {(cb[fn] - ca[fn]) * ms:+9.0f}  {fn}")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except BrokenPipeError:             # piped into head: the reader has what it wanted
        sys.stderr.close()
        raise SystemExit(0)
