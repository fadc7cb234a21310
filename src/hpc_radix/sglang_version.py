"""The SGLang releases hpc_radix is tested with, what it does beside another one, and the
SGLang surfaces whose names moved between releases (docs/sglang-versions.md).

The one place that answers the version question (docs/operations.md, "SGLang versions"):
inside the tested range the startup log names the release; above it the server starts with a
warning naming the range (a newer release may have moved a hook; each hook that does not apply
names itself and its fallback in the startup log); below it ``--radix-cache hybrid`` refuses
to start, naming the release.
"""
from __future__ import annotations

import re
from importlib import metadata
from typing import Optional

from hpc_radix.errors import HybridConfigError

TESTED = ("0.5.17",)          # the releases the CPU and GPU suites run on, oldest first

_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
# Hook targets (by their 0.5.17 names) that a later release calls otherwise, from that release
# on. patches/ asks ``target`` for every name it hooks, so a move is written here only.
MOVED = {
    # where an admission takes the request's tree lock
    f"{_ADDER}._req_inc_lock_ref": ((0, 5, 23), f"{_ADDER}._commit_prefill_admission"),
}


def installed() -> str:
    return metadata.version("sglang")


def release(version: str) -> tuple[int, ...]:
    """``0.5.17.post1`` and ``0.5.17rc0`` -> (0, 5, 17): the release a version belongs to."""
    m = re.match(r"\d+(?:\.\d+)*", version.strip())
    if m is None:
        raise HybridConfigError(f"SGLang version {version!r}: not a release number")
    return tuple(int(x) for x in m.group(0).split("."))


def tested_range() -> str:
    return TESTED[0] if len(TESTED) == 1 else f"{TESTED[0]} to {TESTED[-1]}"


def check(version: Optional[str] = None) -> Optional[str]:
    """None inside the tested range, a warning above it; below it HybridConfigError."""
    version = version or installed()
    if release(version) < release(TESTED[0]):
        raise HybridConfigError(
            f"--radix-cache hybrid: SGLang {version} is older than the releases hpc_radix is "
            f"tested with ({tested_range()}); install one of those")
    if release(version) > release(TESTED[-1]):
        return (f"SGLang {version} is newer than the releases hpc_radix is tested with "
                f"({tested_range()}): the hybrid cache starts, and the startup log names each "
                "hook that did not apply and what it falls back to")
    return None


def describe(version: Optional[str] = None) -> str:
    """What the startup log says: the release running and the tested range."""
    return f"SGLang {version or installed()} (tested: {tested_range()})"


def target(name: str, version: Optional[str] = None) -> str:
    """What the installed SGLang (or ``version``) calls the surface 0.5.17 calls ``name``."""
    moved = MOVED.get(name)
    if moved is not None and release(version or installed()) >= moved[0]:
        return moved[1]
    return name
