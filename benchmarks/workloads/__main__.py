"""Write a built-in workload as a trace file, or describe a trace file.

    python -m benchmarks.workloads ample --seed 0 --scale 0.25 --out ample.jsonl
    python -m benchmarks.workloads --describe trace.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys

from .generate import MIXES
from .oracle import describe
from .trace import dump, load


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("mix", nargs="?", choices=sorted(MIXES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--out")
    ap.add_argument("--describe", metavar="TRACE")
    a = ap.parse_args(argv)
    if a.describe:
        reqs = load(a.describe)
    elif a.mix:
        reqs = MIXES[a.mix](a.seed, a.scale)
        if a.out:
            dump(reqs, a.out)
    else:
        ap.error("give a mix or --describe")
    print(json.dumps(describe(reqs), indent=1))


if __name__ == "__main__":
    sys.exit(main())
