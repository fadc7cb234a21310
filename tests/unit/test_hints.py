"""ChatML structural hints on token sequences shaped like the tiny test model's
tokenizer (tests/gpu/tiny_qwen.py), built here without `tokenizers`."""
import re
import time

import numpy as np

from hpc_radix.binding.hints import ChatMLMarkers, chatml_hints
from hpc_radix.index.taps import PlannedTap, Placement, TapHint, TapSource, plan_taps

from benchmarks.workloads.chatml import BYTE_ID  # the tiny tokenizer's byte ids

# --- tiny_qwen.py's vocabulary: byte-level BPE without merges. The vocab is
# sorted(ByteLevel.alphabet()) -> id, i.e. GPT-2's bytes_to_unicode characters in
# code-point order, then the 3 specials appended in order.


ENDOFTEXT, IM_START, IM_END = 256, 257, 258
SPECIALS = {"<|endoftext|>": ENDOFTEXT, "<|im_start|>": IM_START, "<|im_end|>": IM_END}
NL = BYTE_ID[ord("\n")]


def encode(text: str) -> list[int]:
    ids = []
    for piece in re.split(r"(<\|endoftext\|>|<\|im_start\|>|<\|im_end\|>)", text):
        if piece in SPECIALS:
            ids.append(SPECIALS[piece])
        else:
            ids.extend(BYTE_ID[b] for b in piece.encode("utf-8"))
    return ids


def render(messages, add_generation_prompt=True) -> str:
    """tiny_qwen.CHAT_TEMPLATE."""
    out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


ROLES = {w: encode(w) for w in ("system", "developer", "user", "assistant", "tool")}


def test_vocabulary_matches_tiny_qwen():
    assert BYTE_ID[ord("!")] == 0 and BYTE_ID[ord("~")] == 93
    assert BYTE_ID[ord("¡")] == 94 and BYTE_ID[0xFF] == 187
    assert NL == 198 and BYTE_ID[ord(" ")] == 220  # as in Qwen's own vocabulary
    assert sorted(BYTE_ID) == list(range(256))
    assert encode("<|im_start|>a\n") == [257, 64, 198]


def test_chat_prompt_hints():
    sys_text = "You are terse." * 3
    msgs = [{"role": "system", "content": sys_text}, {"role": "user", "content": "Hi é"}]
    ids = encode(render(msgs))
    system_len = 1 + len("system\n") + len(sys_text) + 2  # + <|im_end|> "\n"
    user_len = 1 + len("user\n") + len("Hi é".encode()) + 2
    got = chatml_hints(ids, IM_START, IM_END, ROLES, newline=[NL])
    assert got.message_boundaries == [0, system_len, system_len + user_len]
    assert got.hints == [TapHint(system_len, TapSource.STRUCTURAL),
                         TapHint(system_len + user_len, TapSource.OPENER)]
    assert ids[system_len + user_len:] == encode("<|im_start|>assistant\n")


def test_encoder_callable_equals_role_prefixes_with_newline():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
    ids = encode(render(msgs))
    by_encoder = chatml_hints(ids, IM_START, IM_END, encode)
    assert by_encoder == chatml_hints(ids, IM_START, IM_END, ROLES, newline=[NL])
    assert by_encoder == chatml_hints(np.asarray(ids, dtype=np.int32), IM_START, IM_END, encode)
    # <|im_start|>system\ns<|im_end|>\n is 1 + 7 + 1 + 1 + 1 = 11 tokens; 4 messages of 11, 9
    # ("user\n" is 5), 14 ("assistant\n" is 10), 9 tokens
    assert by_encoder.message_boundaries == [0, 11, 20, 34, 43]
    assert [(h.position, h.source) for h in by_encoder.hints] == \
        [(11, TapSource.STRUCTURAL), (43, TapSource.OPENER)]


def test_without_newline_the_system_end_is_just_after_im_end():
    ids = encode(render([{"role": "system", "content": "s"}]))
    got = chatml_hints(ids, IM_START, IM_END, ROLES)
    assert [(h.position, h.source) for h in got.hints] == \
        [(10, TapSource.STRUCTURAL), (11, TapSource.OPENER)]


def test_leading_run_of_system_and_developer_blocks():
    msgs = [{"role": "system", "content": "a"}, {"role": "developer", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "system", "content": "late"}]
    ids = encode(render(msgs, add_generation_prompt=False))
    got = chatml_hints(ids, IM_START, IM_END, encode)
    # system 11 tokens + developer ("developer\n" is 10) 14 tokens
    assert got.hints == [TapHint(25, TapSource.STRUCTURAL)]


def test_no_system_block_no_structural_hint():
    ids = encode(render([{"role": "user", "content": "hello"}]))
    got = chatml_hints(ids, IM_START, IM_END, encode)
    assert got.hints == [TapHint(13, TapSource.OPENER)]


def test_opener_needs_an_unterminated_final_assistant_turn():
    closed = encode(render([{"role": "user", "content": "x"}], add_generation_prompt=False))
    assert chatml_hints(closed, IM_START, IM_END, encode).hints == []
    open_user = encode("<|im_start|>user\nx<|im_end|>\n<|im_start|>user\npartial")
    assert chatml_hints(open_user, IM_START, IM_END, encode).hints == []
    # <|im_start|>user\nx<|im_end|>\n is 9 tokens. Without roles, any unterminated
    # final message is the opener
    assert chatml_hints(open_user, IM_START, IM_END).hints == [TapHint(9, TapSource.OPENER)]
    # continue_final_message: the assistant turn already has some content
    prefilled = encode("<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\nSure,")
    assert chatml_hints(prefilled, IM_START, IM_END, encode).hints == \
        [TapHint(9, TapSource.OPENER)]


def test_without_roles_only_boundaries_and_opener():
    ids = encode(render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]))
    got = chatml_hints(ids, IM_START, IM_END)
    assert got.message_boundaries == [0, 11, 20]
    assert got.hints == [TapHint(20, TapSource.OPENER)]


def test_degenerate_prompts():
    assert chatml_hints([], IM_START, IM_END, encode).hints == []
    assert chatml_hints(encode("plain text"), IM_START, IM_END, encode).message_boundaries == []
    # an unterminated system message is not a block, but it is the last message
    got = chatml_hints(encode("<|im_start|>system\nabc"), IM_START, IM_END, encode)
    assert got.hints == [] and got.message_boundaries == [0]


def test_hints_feed_the_planner():
    system = "S" * 1500
    turns = [{"role": "system", "content": system}]
    for i in range(20):
        turns.append({"role": "user", "content": f"question {i} " + "q" * 150})
        turns.append({"role": "assistant", "content": f"answer {i} " + "a" * 200})
    turns.append({"role": "user", "content": "last"})
    ids = encode(render(turns))
    markers = ChatMLMarkers.build(IM_START, IM_END, encode)
    got = markers.hints(ids)
    n = len(ids)
    system_end = 1 + 7 + 1500 + 2
    opener = n - 11  # <|im_start|>assistant\n
    plan = plan_taps(n, 0, got.hints, message_boundaries=got.message_boundaries,
                     max_new_taps=8, ladder_tokens=4096, min_gap_tokens=1024)
    assert got.hints == [TapHint(system_end, TapSource.STRUCTURAL),
                         TapHint(opener, TapSource.OPENER)]
    # the ladder's n - 4096 snaps back to the message boundary at or below it
    # (turns are ~200 tokens apart); n - 8192 lies within 1024 of the system end.
    rung = max(b for b in got.message_boundaries if b <= n - 4096)
    ex, flex = Placement.EXACT, Placement.FLEXIBLE
    assert plan == [PlannedTap(system_end // 64 * 64, TapSource.STRUCTURAL, ex, True),
                    PlannedTap(rung // 64 * 64, TapSource.LADDER, flex, False),
                    PlannedTap(opener // 64 * 64, TapSource.OPENER, ex, False)]


def test_100k_prompt_is_fast():
    turns = [{"role": "system", "content": "s" * 4000}]
    while sum(len(m["content"]) for m in turns) < 100_000:
        turns.append({"role": "user", "content": "u" * 300})
        turns.append({"role": "assistant", "content": "a" * 700})
    ids = encode(render(turns))[:100_000] + encode("<|im_start|>assistant\n")
    markers = ChatMLMarkers.build(IM_START, IM_END, encode)
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        got = markers.hints(ids)
        best = min(best, time.perf_counter() - t0)
    assert len(got.message_boundaries) > 150 and got.hints[-1].source == TapSource.OPENER
    assert best < 0.005, f"{best * 1e3:.2f} ms"
