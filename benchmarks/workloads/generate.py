"""Built-in workloads, deterministic from (seed, scale), as lists of trace.Request.

agentic  main coding-agent sessions: a system + tools preamble (10-20k tokens at scale 1,
         never a multiple of 64) shared by persona; tool loops whose observations are fixed
         in advance while each assistant turn is the arm's own output fed back token for
         token; a subagent fan-out sharing a subagent preamble whose results return to the
         main session; a compaction that restarts from the summary (the compaction
         request's own output); a retry; an aborted request re-sent; and the "stripper"
         persona whose template drops earlier reasoning: its next prompt is the previous
         *prompt* (ending in the generation opener) + a fixed shorter answer, so reuse can
         only come from the opener, not from the previous endpoint.
long     agentic sessions that grow to 64k-128k tokens (scale 1) and compact.
chat     multi-turn chat, many clients, a few rounds each (like SGLang's bench_multiturn).
fanout   many short requests behind long shared system prompts, in waves of 8 that all
         start together; a group's first wave shares a prefix nobody has computed yet.
plain    agentic sessions and chat rendered with no special tokens (chatml.PlainVocab).
documents  Mooncake's shapes: users asking about one long document (siblings diverging off the
         64-token grid), asking again rounds later from their earlier prompt, its tail
         re-rendered.

`scale` multiplies token lengths (and some counts); each request's output length is fixed
(drawn from a range times sqrt(scale) <= 1) so arms decode equal work. MIXES combine
workloads per regime (merged by round; within a round, file order is send priority).
"""
from __future__ import annotations

from typing import Callable

from .chatml import TINY, Content, Vocab, plain
from .trace import Request, ref


def _odd(n: int, off: int = 37) -> int:
    """n, moved off multiples of 64 (block) and 256 (mamba track interval)."""
    return n if n % 64 else n + off


def _s(x: float, scale: float, lo: int = 1) -> int:
    return max(lo, int(round(x * scale)))


class _Build:
    def __init__(self, vocab: Vocab, seed, name: str, scale: float = 1.0):
        self.v, self.c, self.reqs = vocab, Content(f"{name}:{seed}", vocab), []
        self.out_scale = min(1.0, max(scale, 0.0625) ** 0.5)
        self.lens: dict[str, tuple[int, int]] = {}  # id -> (prompt, output) lengths

    def add(self, rid, prompt, max_new, session, rnd, **kw) -> Request:
        r = Request(id=rid, prompt=prompt, max_new_tokens=max_new, session=session,
                    round=rnd, **kw)
        self.reqs.append(r)
        out = max_new if r.abort_after_tokens is None else r.abort_after_tokens
        self.lens[rid] = (self.length(prompt), out)
        return r

    def out(self, lo: int, hi: int) -> int:
        """An output length: uniform in [lo, hi] * sqrt(scale) (<= 1), at least 8."""
        return max(8, round(self.c.randint(lo, hi) * self.out_scale))

    def length(self, prompt) -> int:
        n = 0
        for it in prompt:
            if isinstance(it, int):
                n += 1
            else:
                p, o = self.lens[it["ref"]]
                n += {"prompt": p, "output": o, "full": p + o}[it.get("part", "full")]
        return n

    def system(self, total: int, label: str) -> list[int]:
        """A system (+tools) message of exactly `total` rendered tokens."""
        head = self.v.text(f"You are {label}.\n# Tools\n")
        n = total - self.v.overhead("system") - len(head)
        return self.v.message("system", head + self.c.tokens(n))

    def user(self, n: int, head: str = "") -> list[int]:
        return self.v.message("user", self.v.text(head) + self.c.tokens(n))

    def tool(self, n: int) -> list[int]:
        return self.v.message("user", self.v.text("<tool_response>\n") + self.c.tokens(n)
                              + self.v.text("\n</tool_response>"))


def agentic(seed=0, scale=1.0, vocab: Vocab = TINY, *, n_main=6, rounds=12, long=False,
            name="agent") -> list[Request]:
    b, v = _Build(vocab, seed, name, scale), vocab
    c = b.c
    if long:
        personas = {"coder": _odd(_s(16000, scale, 300))}
        obs_range, first_extra = (_s(3000, scale), _s(8000, scale)), _s(40000, scale)
        compact_at = _s(122000, scale, 2000)
    else:
        personas = {"coder": _odd(_s(16000, scale, 300)), "reviewer": _odd(_s(11000, scale, 300), 91),
                    "stripper": _odd(_s(13000, scale, 300), 5)}
        obs_range, first_extra, compact_at = (_s(150, scale, 16), _s(2500, scale, 32)), 0, None
    pre = {p: b.system(n, f"a {p} agent") for p, n in personas.items()}
    sub_pre = b.system(_odd(_s(6000, scale, 200), 19), "a subagent")
    names = list(personas)
    # Features of the short sessions: which session does what, in which round.
    fan_at, n_sub, compact_round = 3, 3, max(4, rounds - 4)
    retry_at, abort_at = (1, 2), (2, min(4, rounds - 1))  # (session, round)

    sessions = [{"id": f"{name}/s{i}", "persona": names[i % len(names)], "prev": None,
                 "k": 0, "resume": 0, "summary": None} for i in range(n_main)]

    def history(s) -> list:
        """The next prompt's start: the previous turn as this persona's template renders it."""
        prev = s["prev"]
        if s["persona"] == "stripper":  # reasoning stripped: previous prompt + a short answer
            return [ref(prev.id, "prompt")] + c.tokens(max(8, prev.max_new_tokens // 4)) + v.end()
        return [ref(prev.id, "full")] + v.end()

    def emit(s, prompt, max_new, rnd, **kw) -> Request:
        r = b.add(f"{s['id']}#{s['k']}", prompt, max_new, s["id"], rnd, tag=s["persona"], **kw)
        s["k"] += 1
        s["prev"] = r
        return r

    subs: dict[str, list[Request]] = {}
    for rnd in range(rounds):
        for i, s in enumerate(sessions):
            if rnd < s["resume"]:
                continue
            out = b.out(32, 128)
            if s["prev"] is None:  # first turn
                task = b.user(c.randint(_s(200, scale), _s(800, scale)) + first_extra, "Task:\n")
                emit(s, pre[s["persona"]] + task + v.opener(), out, rnd, kind="new")
                continue
            if s["summary"] is not None:  # restart from the compaction summary
                p = (pre[s["persona"]] + v.header("user") + v.text("Summary of the work so far:\n")
                     + [ref(s["summary"].id, "output")] + c.tokens(_s(150, scale)) + v.end()
                     + v.opener())
                s["summary"] = None
                emit(s, p, out, rnd, kind="new")
                continue
            hist = history(s)
            if s["id"] in subs:  # subagent results come back as one tool response
                body = v.header("user") + v.text("<tool_response>\n")
                for j, r in enumerate(subs.pop(s["id"])):
                    body += v.text(f"[subagent {j}]\n") + [ref(r.id, "output")] + v.text("\n")
                emit(s, hist + body + v.text("</tool_response>") + v.end() + v.opener(), out, rnd)
                continue
            obs = b.tool(c.randint(*obs_range))
            if (not long and i % 3 == 1 and rnd == compact_round) or (
                    long and b.length(hist) + len(obs) + obs_range[1] + 300 > compact_at):
                ask = b.user(_s(60, scale, 16), "Compact: summarize the conversation so far.\n")
                s["summary"] = emit(s, hist + ask + v.opener(), b.out(256, 256), rnd,
                                    kind="compact")
                continue
            abort = not long and (i, rnd) == abort_at
            r = emit(s, hist + obs + v.opener(), out, rnd,
                     abort_after_tokens=min(8, out // 4) if abort else None)
            if abort or (not long and (i, rnd) == retry_at):  # re-sent right after, same prompt
                emit(s, [ref(r.id, "prompt")], out, rnd, after=[r.id],
                     kind="resend" if abort else "retry")
            if not long and i % 3 == 0 and rnd == fan_at:  # spawn subagents, wait two rounds
                res = []
                for j in range(n_sub):
                    sid = f"{s['id']}/sub{j}"
                    t0 = b.user(c.randint(_s(100, scale), _s(400, scale)), "Subtask:\n")
                    r0 = b.add(f"{sid}#0", sub_pre + t0 + v.opener(), b.out(32, 96), sid,
                               rnd + 1, tag="subagent", kind="new")
                    o1 = b.tool(c.randint(*obs_range))
                    res.append(b.add(f"{sid}#1", [ref(r0.id, "full")] + v.end() + o1 + v.opener(),
                                     b.out(32, 96), sid, rnd + 2, tag="subagent"))
                subs[s["id"]] = res
                s["resume"] = rnd + 3
    return _by_round(b.reqs)


def long_agentic(seed=0, scale=1.0, vocab: Vocab = TINY, *, n_main=2, rounds=18,
                 name="long") -> list[Request]:
    return agentic(seed, scale, vocab, n_main=n_main, rounds=rounds, long=True, name=name)


def chat(seed=0, scale=1.0, vocab: Vocab = TINY, *, clients=24, rounds=4, system_len=None,
         name="chat") -> list[Request]:
    b, v = _Build(vocab, seed, name, scale), vocab
    system = b.system(system_len or _odd(_s(300, scale, 40), 13), "a helpful assistant")
    prev: dict[int, Request] = {}
    for rnd in range(rounds):
        for i in range(clients):
            sid = f"{name}/c{i}"
            turn = b.user(b.c.randint(_s(256, scale), _s(1024, scale)))
            if i in prev:
                p, kind = [ref(prev[i].id, "full")] + v.end() + turn + v.opener(), "continue"
            else:
                p, kind = system + turn + v.opener(), "new"
            prev[i] = b.add(f"{sid}#{rnd}", p, b.out(48, 128), sid, rnd, kind=kind)
    return b.reqs


def fanout(seed=0, scale=1.0, vocab: Vocab = TINY, *, lengths=(8019, 5045), per_group=16,
           wave=8, stagger=1, exact=False, name="fan") -> list[Request]:
    """Group g's preamble has lengths[g]*scale tokens (kept off multiples of 64; exactly
    lengths[g] if `exact`); its requests go out in waves of `wave`, one wave per round,
    the first in round g*stagger."""
    b, v = _Build(vocab, seed, name, scale), vocab
    for g, n in enumerate(lengths):
        n = n if exact else _odd(_s(n, scale, 200), n % 64 or 37)
        pre = b.system(n, f"support bot {g}")
        for q in range(per_group):
            sid = f"{name}/g{g}/q{q}"
            p = pre + b.user(b.c.randint(_s(40, scale, 8), _s(300, scale, 16))) + v.opener()
            b.add(f"{sid}#0", p, b.out(16, 48), sid, g * stagger + q // wave, kind="new",
                  tag=f"g{g}w{q // wave}")
    # a new preamble's first wave goes first in its round, so its 8 requests start together
    return sorted(b.reqs, key=lambda r: (r.round, not r.tag.endswith("w0")))


def documents(seed=0, scale=1.0, vocab: Vocab = TINY, *, docs=4, askers=3, rounds=8,
              rerender=40, name="doc") -> list[Request]:
    """The shapes of Mooncake's conversation trace: several users ask about one long document
    (siblings: the same system + document, off the 64-token grid, then their own question),
    one document per round in turn; each asks again ``docs`` rounds later (a long gap, other
    documents' traffic in between) with a prompt that goes on from its earlier *prompt* (not
    its output) whose last ``rerender`` tokens the client rendered anew."""
    b, v = _Build(vocab, seed, name, scale), vocab
    c = b.c
    heads = [b.system(_odd(_s(600, scale, 64), 29), f"a reader of document {d}")
             + b.user(_odd(_s(c.randint(5000, 9000), scale, 256), 7 + d), "Document:\n")
             for d in range(docs)]
    last: dict[str, list[int]] = {}
    for rnd in range(rounds):
        d = rnd % docs
        for a in range(askers):
            sid = f"{name}/d{d}/u{a}"
            question = b.user(c.randint(_s(60, scale, 16), _s(400, scale, 32)), "Question:\n")
            if sid in last:                # the earlier prompt, its last tokens re-rendered
                prompt = last[sid][:-rerender] + c.tokens(rerender) + question + v.opener()
                kind, after = "continue", [f"{sid}#{rnd - docs}"]
            else:
                prompt, kind, after = heads[d] + question + v.opener(), "new", []
            last[sid] = prompt
            b.add(f"{sid}#{rnd}", prompt, b.out(16, 64), sid, rnd, kind=kind, after=after,
                  tag=f"doc{d}")
    return b.reqs


def _by_round(reqs: list[Request]) -> list[Request]:
    """Stable sort by round; references stay valid since they never point to a later round."""
    return sorted(reqs, key=lambda r: r.round)


def merge(*traces: list[Request]) -> list[Request]:
    """Run workloads side by side: round r of each runs in round r."""
    return _by_round([r for tr in traces for r in tr])


def _alignment(seed, scale, vocab=TINY):
    # Preambles just off 64/256 boundaries (at scale 1: 4095, 4097, 3037, 6399 tokens).
    lengths = tuple(max(_s(n, scale, 200) // 64 * 64 + d, 200 + d) for n, d in
                    ((4096, -1), (4096, 1), (3000, 61), (6400, -1)))
    return merge(fanout(seed, scale, vocab, lengths=lengths, per_group=8, exact=True, name="align"),
                 chat(seed, scale, vocab, clients=8, rounds=3, system_len=lengths[0], name="alchat"))


MIXES: dict[str, Callable[..., list[Request]]] = {
    "ample": lambda seed, scale, vocab=TINY: merge(
        agentic(seed, scale, vocab), chat(seed, scale, vocab, clients=_s(24, scale, 8)),
        fanout(seed, scale, vocab)),
    "concurrency": lambda seed, scale, vocab=TINY: merge(
        fanout(seed, scale, vocab, lengths=(6011, 4047, 7093, 3021), per_group=16, name="cfan"),
        chat(seed, scale, vocab, clients=8, rounds=3, name="cchat")),
    "alignment": _alignment,
    "long": long_agentic,
    # four long sessions in turn: their contexts (~130k each) outgrow a device pool of one and a
    # host tier of two, so every turn restores or re-prefills its history
    "long-host": lambda seed, scale, vocab=TINY: long_agentic(seed, scale, vocab, n_main=4,
                                                              name="longh"),
    "documents": documents,
    "pressure": lambda seed, scale, vocab=TINY: merge(
        agentic(seed, scale, vocab, n_main=9), chat(seed, scale, vocab, clients=_s(32, scale, 12)),
        fanout(seed, scale, vocab, lengths=(8019, 5045, 6089), per_group=16)),
    "plain": lambda seed, scale, vocab=TINY: merge(
        agentic(seed, scale, plain(vocab), name="plain"),
        chat(seed, scale, plain(vocab), clients=_s(24, scale, 8), name="pchat")),
    "agentic": agentic,
    "chat": chat,
    "fanout": fanout,
}
