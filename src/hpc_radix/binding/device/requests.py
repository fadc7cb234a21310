"""What the cache keeps on SGLang's requests: one record per request (``record_of``) and the
request's prompt key, hashed once and extended as its tokens grow."""
from __future__ import annotations

import dataclasses
from array import array
from typing import Optional

import numpy as np

from hpc_radix.index import PromptKey
from hpc_radix.sglang_version import req_slots


@dataclasses.dataclass(slots=True)
class ReqRecord:
    """What the cache keeps on one of SGLang's requests (``record_of``), the one attribute it
    adds to ``Req``."""
    key: Optional[PromptKey] = None       # its prompt key, extended as its tokens grow
    slot: Optional[tuple] = None          # (its mamba_pool_idx, that slot's id) when a spare
    donation_epoch: Optional[int] = None  # the batch epoch its tracking buffer last changed in
    restore_refused: bool = False         # a restore refused after SGLang's budget: not retried
    idle_refusal_logged: float = float("-inf")   # when its refusal with nothing running was logged
    observed: bool = False                # the index learned from its match (observe)
    store_probe: Optional[object] = None  # its question to the shared tier (store/worker.Probe)
    waits_for_store: bool = False         # decided at this round's match: it waits for the answer


def record_of(req) -> ReqRecord:
    record = getattr(req, "_hpc_record", None)
    if record is None:
        record = req._hpc_record = ReqRecord()
    return record


def known_slot(req) -> Optional[int]:
    """The working slot's id when it came from a spare (and is still the request's)."""
    known = record_of(req).slot
    return known[1] if known is not None and known[0] is req_slots(req).mamba_pool_idx else None


def prompt_key(key, req) -> PromptKey:
    """The PromptKey of SGLang's RadixKey ``key`` (of request ``req``, or None), hashed once
    per request and extended as its tokens grow."""
    tokens = key.raw_token_ids()
    cached = record_of(req).key if req is not None else None
    # A request's tokens only grow (prompt, then outputs), so its key is extended.
    if (cached is not None and cached.namespace == key.extra_key
            and 0 < len(cached) <= len(tokens)
            and cached.tokens(len(cached) - 1, len(cached)) == _int32_bytes(tokens[len(cached) - 1:len(cached)])):
        if len(cached) < len(tokens):
            cached.extend(_int32_bytes(tokens[len(cached):]))
        return cached
    pkey = PromptKey(_int32_bytes(tokens), namespace=key.extra_key)
    if req is not None:
        record_of(req).key = pkey
    return pkey


def req_prompt_key(req) -> PromptKey:
    """The key of a request's prompt and outputs so far."""
    return prompt_key(_FullKey(_ReqTokens(req.origin_input_ids, req.output_ids), req.extra_key), req)


class _ReqTokens:
    """A request's prompt and outputs as one token sequence, not joined: a slice joins only
    the tokens it covers (``prompt_key`` extends a request's key by the tokens added since;
    joining the whole list each time cost ~0.1 ms a call)."""

    def __init__(self, prompt, out):
        self.prompt, self.out = prompt, out

    def __len__(self) -> int:
        return len(self.prompt) + len(self.out)

    def __getitem__(self, s: slice):
        start, stop, _ = s.indices(len(self))
        n = len(self.prompt)
        head = self.prompt[min(start, n):min(stop, n)]
        tail = self.out[max(start - n, 0):max(stop - n, 0)]
        return tail if not len(head) else head if not len(tail) else head + tail

    def __array__(self, dtype=None, copy=None):
        return np.concatenate([np.asarray(self.prompt, dtype=dtype), np.asarray(self.out, dtype=dtype)])


class _FullKey:
    """A RadixKey-like view of a request's whole token list."""

    def __init__(self, tokens, extra_key):
        self._tokens = tokens
        self.extra_key = extra_key

    def raw_token_ids(self):
        return self._tokens

    def __len__(self):
        return len(self._tokens)


def _int32_bytes(tokens) -> bytes:
    if isinstance(tokens, array):
        return np.frombuffer(tokens, dtype=np.int64 if tokens.itemsize == 8 else np.int32).astype("<i4").tobytes()
    return np.asarray(tokens, dtype="<i4").tobytes()
