"""Replayable token-level trace format (JSON Lines, one request per line).

Every workload, built-in or external, is a file in this format, and the runner
(benchmarks/ab.py) has one replay path for all of them.

    {"id": "agent/s0#3",       request id, unique in the file (default: "L<line number>")
     "session": "agent/s0",    conversation it belongs to (default: the id)
     "round": 3,               lock-step round (default 0); see Replay
     "t": 0.0,                 earliest send time, seconds after its round starts (default 0)
     "prompt": [ITEM, ...],    the prompt, concatenated from items:
         17                        a token id,
         {"blocks": [H, ...], "block_tokens": 64}
                                   one block of block_tokens tokens per hash H (ints); a hash
                                   always expands to the same tokens (chatml.block_tokens),
         {"ref": "agent/s0#2", "part": "prompt" | "output" | "full"}
                                   the resolved prompt, the output as received, or both
                                   (prompt + output) of an earlier request in the file;
     "blocks": [H, ...], "block_tokens": 64
                               shorthand for one trailing {"blocks": ...} item (Mooncake-style
                               traces: "blocks" alone, no "prompt");
     "max_new_tokens": 64,     fixed output length (sent with ignore_eos)
     "after": ["agent/s0#2"],  more requests that must have finished before this one is sent
     "abort_after_tokens": 8,  the client disconnects after this many output tokens; the
                               request's output is what it received (optional)
     "kind": "continue",       new | continue | compact | retry | resend (report grouping;
                               default: "continue" if the prompt has a ref, else "new")
     "tag": "coder"}           free text (workload / persona), optional

Replay: rounds run in order; a round starts when every request of the previous
round has finished. Within a round a request is sent once `t` has passed, every
request it references (`ref`, `after`) has finished, and fewer than the
concurrency limit are in flight; among ready requests, file order decides.
References point to earlier lines, never to a later round. So the traffic of
round r depends only on outputs of rounds <= r, which keeps arms in lock step.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from .chatml import TINY, Vocab, block_tokens

KINDS = ("new", "continue", "compact", "retry", "resend")
PARTS = ("prompt", "output", "full")


@dataclass
class Request:
    id: str
    prompt: list
    max_new_tokens: int
    session: str = ""
    round: int = 0
    t: float = 0.0
    after: list = field(default_factory=list)
    abort_after_tokens: int | None = None
    kind: str = ""
    tag: str = ""

    def __post_init__(self):
        self.session = self.session or self.id
        self.kind = self.kind or ("continue" if self.refs() else "new")

    def refs(self) -> list[str]:
        return [it["ref"] for it in self.prompt if isinstance(it, dict) and "ref" in it]

    def deps(self) -> list[str]:
        return list(dict.fromkeys(self.refs() + list(self.after)))

    def to_json(self) -> str:
        d = {"id": self.id, "session": self.session, "round": self.round, "t": self.t,
             "kind": self.kind, "prompt": self.prompt, "max_new_tokens": self.max_new_tokens}
        if self.after:
            d["after"] = self.after
        if self.abort_after_tokens is not None:
            d["abort_after_tokens"] = self.abort_after_tokens
        if self.tag:
            d["tag"] = self.tag
        return json.dumps(d, separators=(",", ":"))


def ref(rid: str, part: str = "full") -> dict:
    return {"ref": rid, "part": part}


def from_dict(d: Mapping, line: int = 0) -> Request:
    prompt = list(d.get("prompt", []))
    if "blocks" in d:
        prompt.append({"blocks": list(d["blocks"]), "block_tokens": int(d.get("block_tokens", 64))})
    return Request(id=str(d.get("id", f"L{line}")), prompt=prompt,
                   max_new_tokens=int(d["max_new_tokens"]), session=str(d.get("session", "")),
                   round=int(d.get("round", 0)), t=float(d.get("t", 0.0)),
                   after=[str(a) for a in d.get("after", [])],
                   abort_after_tokens=d.get("abort_after_tokens"), kind=d.get("kind", ""),
                   tag=str(d.get("tag", "")))


def validate(reqs: Sequence[Request]) -> None:
    seen: dict[str, Request] = {}
    for r in reqs:
        if r.id in seen:
            raise ValueError(f"duplicate request id {r.id!r}")
        if r.kind not in KINDS:
            raise ValueError(f"{r.id}: unknown kind {r.kind!r}")
        if r.max_new_tokens < 1:
            raise ValueError(f"{r.id}: max_new_tokens must be >= 1")
        for it in r.prompt:
            if isinstance(it, dict) and "ref" in it and it.get("part", "full") not in PARTS:
                raise ValueError(f"{r.id}: bad part {it.get('part')!r}")
            elif not isinstance(it, (int, dict)) or isinstance(it, bool):
                raise ValueError(f"{r.id}: bad prompt item {it!r}")
        for dep in r.deps():
            if dep not in seen:
                raise ValueError(f"{r.id}: depends on {dep!r}, which is not an earlier line")
            if seen[dep].round > r.round:
                raise ValueError(f"{r.id}: depends on {dep!r} of a later round")
        seen[r.id] = r


def dump(reqs: Iterable[Request], path: str) -> None:
    reqs = list(reqs)
    validate(reqs)
    with open(path, "w") as f:
        for r in reqs:
            f.write(r.to_json() + "\n")


def load(path: str) -> list[Request]:
    with open(path) as f:
        reqs = [from_dict(json.loads(line), i + 1) for i, line in enumerate(f) if line.strip()]
    validate(reqs)
    return reqs


def resolve(req: Request, done: Mapping[str, tuple[list[int], list[int]]],
            vocab: Vocab = TINY) -> list[int]:
    """The prompt's token ids; `done` maps request id -> (resolved prompt, output)."""
    out: list[int] = []
    for it in req.prompt:
        if isinstance(it, int):
            out.append(it)
        elif "ref" in it:
            prompt, output = done[it["ref"]]
            part = it.get("part", "full")
            if part != "output":
                out.extend(prompt)
            if part != "prompt":
                out.extend(output)
        else:
            n = int(it.get("block_tokens", 64))
            for h in it["blocks"]:
                out.extend(block_tokens(h, n, vocab))
    return out


def fake_output(req: Request, vocab: Vocab = TINY) -> list[int]:
    """A stand-in output (deterministic, unique per request) for dry runs and tests."""
    n = req.max_new_tokens if req.abort_after_tokens is None else req.abort_after_tokens
    h = int.from_bytes(hashlib.sha1(req.id.encode()).digest()[:8], "little")
    return block_tokens(h, n, vocab)


def simulate(reqs: Sequence[Request], vocab: Vocab = TINY) -> dict[str, tuple[list[int], list[int]]]:
    """Resolve every prompt with fake outputs: id -> (prompt, output)."""
    done: dict[str, tuple[list[int], list[int]]] = {}
    for r in reqs:
        done[r.id] = (resolve(r, done, vocab), fake_output(r, vocab))
    return done


def prompt_digest(ids: Sequence[int]) -> str:
    return hashlib.sha1(json.dumps(list(ids), separators=(",", ":")).encode()).hexdigest()[:16]
