"""Structural tap hints from a ChatML (Qwen-style) prompt (design §7.1).

A rendered ChatML prompt is a run of messages
    <|im_start|>ROLE\\nCONTENT<|im_end|>\\n
ending, for a generation, with the unterminated opener <|im_start|>assistant\\n.
From the token ids alone this finds
  * message_boundaries: the position of every <|im_start|>;
  * OPENER: the final <|im_start|> when it begins the last message, unterminated,
    with the assistant role;
  * STRUCTURAL: the end of the leading system/developer block (just after its
    <|im_end|> and the newline that follows it). Qwen templates render tools
    inside the system message, so this is also the end of tools.

Pure Python + numpy: imports neither torch nor sglang.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence, Union

import numpy as np

from hpc_radix.index.taps import TapHint, TapSource

ROLE_WORDS = ("system", "developer", "user", "assistant", "tool")
LEADING_ROLES = ("system", "developer")
OPENER_ROLE = "assistant"

Encoder = Callable[[str], Sequence[int]]
RolePrefixes = Mapping[str, Sequence[int]]


@dataclass(frozen=True)
class PromptHints:
    hints: list[TapHint]
    message_boundaries: list[int]


@dataclass(frozen=True)
class ChatMLMarkers:
    """The token ids that delimit ChatML messages. Build once per tokenizer.

    roles: role word -> the ids its header starts with, right after <|im_start|>
        (empty: roles unknown, see `hints`).
    newline: the ids the template writes after <|im_end|> (empty: unknown).
    """
    im_start: int
    im_end: int
    roles: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    newline: tuple[int, ...] = ()

    @classmethod
    def build(cls, im_start: int, im_end: int,
              roles: Union[RolePrefixes, Encoder, None] = None,
              newline: Sequence[int] | None = None) -> "ChatMLMarkers":
        """`roles` is either the encoded role prefixes or an encoder (str -> ids,
        adding no special tokens) that encodes ROLE_WORDS and, unless `newline`
        is given, "\\n"."""
        if callable(roles):
            encode = roles
            prefixes = {w: tuple(encode(w)) for w in ROLE_WORDS}
            if newline is None:
                newline = encode("\n")
        else:
            prefixes = {w: tuple(ids) for w, ids in (roles or {}).items()}
        return cls(int(im_start), int(im_end), prefixes, tuple(newline or ()))

    def hints(self, token_ids: Sequence[int] | np.ndarray) -> PromptHints:
        ids = _as_array(token_ids)
        starts = np.flatnonzero(ids == self.im_start)
        ends = np.flatnonzero(ids == self.im_end)
        hints = []
        system_end = self._leading_block_end(ids, starts, ends)
        if system_end is not None:
            hints.append(TapHint(system_end, TapSource.STRUCTURAL))
        opener = self._generation_opener(ids, starts, ends)
        if opener is not None:
            hints.append(TapHint(opener, TapSource.OPENER))
        return PromptHints(hints, starts.tolist())

    def _role_is(self, ids: np.ndarray, start: int, words: Sequence[str]) -> bool:
        for w in words:
            prefix = self.roles.get(w)
            if prefix and _matches(ids, start + 1, prefix):
                return True
        return False

    def _generation_opener(self, ids, starts, ends) -> int | None:
        """The final <|im_start|> if its message is unterminated and, when roles
        are known, an assistant turn. Without roles, any unterminated final message
        counts: a rendered ChatML prompt leaves only the generation prompt open."""
        if not len(starts):
            return None
        last = int(starts[-1])
        if len(ends) and ends[-1] > last:
            return None
        if self.roles and not self._role_is(ids, last, (OPENER_ROLE,)):
            return None
        return last

    def _leading_block_end(self, ids, starts, ends) -> int | None:
        """End of the leading run of system/developer messages (terminated ones),
        past the newline after its <|im_end|>. Needs the roles: None without them."""
        if not self.roles:
            return None
        block_end = None
        for i, s in enumerate(starts.tolist()):
            if not self._role_is(ids, s, LEADING_ROLES):
                break
            j = np.searchsorted(ends, s)
            next_start = starts[i + 1] if i + 1 < len(starts) else len(ids)
            if j == len(ends) or ends[j] > next_start:
                break  # unterminated: not a complete block
            block_end = int(ends[j]) + 1
            if self.newline and _matches(ids, block_end, self.newline):
                block_end += len(self.newline)
        return block_end


def chatml_hints(token_ids: Sequence[int] | np.ndarray, im_start_id: int, im_end_id: int,
                 roles: Union[RolePrefixes, Encoder, None] = None, *,
                 newline: Sequence[int] | None = None) -> PromptHints:
    """One-shot form of ChatMLMarkers.build(...).hints(token_ids)."""
    return ChatMLMarkers.build(im_start_id, im_end_id, roles, newline).hints(token_ids)


def _as_array(token_ids) -> np.ndarray:
    if isinstance(token_ids, np.ndarray):
        return token_ids
    if isinstance(token_ids, array):       # SGLang's origin_input_ids: no copy
        return np.frombuffer(token_ids, dtype=f"i{token_ids.itemsize}")
    return np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))


def _matches(ids: np.ndarray, at: int, expected: Sequence[int]) -> bool:
    end = at + len(expected)
    return end <= len(ids) and ids[at:end].tolist() == list(expected)


def markers_from_tokenizer_dir(path: str) -> "ChatMLMarkers | None":
    """ChatML markers from a model directory's tokenizer.json, or None when the tokenizer has
    no <|im_start|>/<|im_end|> (the cache then plans no structural taps)."""
    import os

    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(file)
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    if im_start is None or im_end is None:
        return None
    return ChatMLMarkers.build(im_start, im_end,
                               lambda text: tok.encode(text, add_special_tokens=False).ids)
