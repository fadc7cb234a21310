"""Mooncake's request traces (FAST'25 release) as token-level traces.

A Mooncake trace line is ``{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [h, ...]}``: one hash per 512-token block of the prompt, equal hashes for equal
blocks (chained: a hash stands for its whole prefix), the last block usually partial. There is
no text, so each hash is replayed as ``block_tokens`` stand-in tokens (``chatml.block_tokens``)
and every length is scaled by ``block_tokens / 512``.

The hashes hide what follows a partial last block: the next turn of that conversation has more
tokens in that block, so it carries a new hash there and shares one block less than it really
does. Two replays:

- ``blocks`` (as hashed): every hash is its own block of fresh tokens; a partial last block is
  the first tokens of its hash's block. A continuation shares the earlier prompt's full blocks
  only (its last block is re-rendered).
- ``exact``: a request whose hashes hold all but the last hash of an earlier, shorter prompt
  (at least two full blocks of it) *continues that whole prompt*: the block that was partial starts with the earlier prompt's
  partial tokens, then goes on with its own. The content of a hash is fixed at its first
  sighting, so later requests through the same hash see the same tokens.

Either way such a request is a ``continue`` turn of the earlier one's session and is sent
after it finished (``after``), as its user saw the answer first; any other request is ``new``.
A request's output is its ``output_length`` scaled, within ``[1, max_new_tokens]``.
Arrivals: closed loop in file order (``t`` = 0), or by timestamp (``t`` = seconds after the
window's first request, divided by ``speedup``).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from .chatml import TINY, Vocab, block_tokens
from .trace import Request

HASH_BLOCK = 512          # tokens per Mooncake hash block
MODES = ("exact", "blocks")
MIN_SHARED_BLOCKS = 2     # full blocks a continuation shares with the prompt it continues


@dataclass(frozen=True)
class Window:
    start: int = 0         # first line of the file (0-based)
    count: int = 800       # lines

    @classmethod
    def parse(cls, text: str) -> "Window":
        """``START,COUNT`` (or ``COUNT``)."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) > 2 or not all(p.isdigit() for p in parts) or int(parts[-1]) < 1:
            raise ValueError(f"window {text!r}: expected START,COUNT with COUNT >= 1")
        return cls(int(parts[0]), int(parts[1])) if len(parts) == 2 else cls(0, int(parts[0]))


def read_rows(path: str, window: Window) -> list[dict]:
    """The window's lines of a Mooncake trace file, checked."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < window.start or not line.strip():
                continue
            if len(rows) == window.count:
                break
            d = json.loads(line)
            for key in ("timestamp", "input_length", "output_length", "hash_ids"):
                if key not in d:
                    raise ValueError(f"{path}:{i + 1}: no {key!r}")
            if not d["hash_ids"] or d["input_length"] < 1:
                raise ValueError(f"{path}:{i + 1}: empty prompt")
            rows.append(d)
    if not rows:
        raise ValueError(f"{path}: no request in lines {window.start}..{window.start + window.count - 1}")
    return rows


def convert(rows: Sequence[Mapping], *, mode: str = "exact", block_tokens_per_hash: int = 128,
            max_new_tokens: int = 16, by_timestamp: bool = False, speedup: float = 1.0,
            vocab: Vocab = TINY, name: str = "mc") -> list[Request]:
    """Token-level requests for ``rows`` (Mooncake lines, in file order)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    if block_tokens_per_hash < 1 or max_new_tokens < 1 or speedup <= 0:
        raise ValueError("block tokens, max new tokens and speedup must be positive")
    B, scale = block_tokens_per_hash, block_tokens_per_hash / HASH_BLOCK
    content: dict[int, list[int]] = {}            # hash -> its block's tokens (fixed at first sighting)
    prompts: list[tuple[list[int], list[int]]] = []   # (hashes, tokens) of earlier requests
    last_of: dict[tuple, int] = {}                # full-block hashes -> latest request ending there
    session_of: list[str] = []
    t0 = rows[0]["timestamp"] if rows else 0
    out = []
    for i, row in enumerate(rows):
        hashes = [int(h) for h in row["hash_ids"]]
        n = min(len(hashes) * B, max(1, math.ceil(row["input_length"] * scale)))
        n = max(n, (len(hashes) - 1) * B + 1)
        parent = _continued(hashes, last_of, prompts)
        tokens: list[int] = []
        for k, h in enumerate(hashes):
            if h not in content:
                fresh = block_tokens(h, B, vocab)
                if mode == "exact" and parent is not None and k == len(prompts[parent][0]) - 1:
                    inherited = prompts[parent][1][k * B:]
                    fresh = inherited + fresh[len(inherited):]
                content[h] = fresh
            tokens.extend(content[h])
        tokens = tokens[:n]
        if parent is not None and mode == "exact" and len(tokens) <= len(prompts[parent][1]):
            parent = None                          # not longer: a sibling, not a continuation
        rid = f"{name}{i}"
        session = session_of[parent] if parent is not None else rid
        session_of.append(session)
        prompts.append((hashes, tokens))
        last_of[tuple(hashes[:-1])] = i
        new = max(1, min(max_new_tokens, round(row["output_length"] * scale)))
        t = (row["timestamp"] - t0) / 1000 / speedup if by_timestamp else 0.0
        out.append(Request(id=rid, prompt=tokens, max_new_tokens=new, session=session, t=t,
                           after=[f"{name}{parent}"] if parent is not None else [],
                           kind="continue" if parent is not None else "new", tag=mode))
    return out


def _continued(hashes: list[int], last_of: Mapping[tuple, int],
               prompts: Sequence[tuple[list[int], list[int]]]) -> int | None:
    """The latest earlier request whose hashes but its last are a prefix of ``hashes`` and
    which is not the same prompt: the longest such prefix wins. At least MIN_SHARED_BLOCKS
    full blocks must be shared: nearly every prompt of the conversation trace starts with the
    same system block, and one block followed by a partial one says nothing about whether a
    prompt goes on from another."""
    for k in range(len(hashes) - 1, MIN_SHARED_BLOCKS - 1, -1):
        j = last_of.get(tuple(hashes[:k]))
        if j is not None and prompts[j][0] != hashes:
            return j
    return None


def load(path: str, window: Window, **kwargs) -> list[Request]:
    return convert(read_rows(path, window), **kwargs)

