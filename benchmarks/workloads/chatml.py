"""ChatML rendered directly in token ids, for the byte-level test tokenizer.

The tokenizer of tests/gpu/tiny_qwen.py (also used by the --large dummy
model) is byte-level BPE without merges: ids 0..255 are the 256 bytes, numbered
in the sorted order of their GPT-2 byte-to-unicode characters, followed by the
specials <|endoftext|> (256), <|im_start|> (257) and <|im_end|> (258).

A ChatML turn is  <|im_start|>ROLE\\nCONTENT<|im_end|>\\n  and the generation
prompt (the "opener") is  <|im_start|>assistant\\n . Synthetic content is drawn
from `Vocab.content` (printable characters by default), never a special id.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Sequence


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what ByteLevel pre-tokenizers use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_CHARS = _bytes_to_unicode()
_ID_OF_CHAR = {c: i for i, c in enumerate(sorted(_CHARS.values()))}
BYTE_ID = [_ID_OF_CHAR[_CHARS[b]] for b in range(256)]  # byte value -> token id


def byte_level_encode(text: str) -> list[int]:
    """Encode text like the tiny model's tokenizer (no special tokens)."""
    return [BYTE_ID[b] for b in text.encode("utf-8")]


@dataclass(frozen=True)
class Vocab:
    """Token ids of the chat template and the range synthetic content uses."""
    endoftext: int = 256
    im_start: int = 257
    im_end: int = 258
    content: tuple[int, int] = (0, 188)  # half-open; 0..187 are the printable characters
    encode: Callable[[str], list[int]] = field(default=byte_level_encode, compare=False)

    @property
    def specials(self) -> frozenset[int]:
        return frozenset((self.endoftext, self.im_start, self.im_end))

    def text(self, s: str) -> list[int]:
        return list(self.encode(s))

    def header(self, role: str) -> list[int]:
        return [self.im_start] + self.text(role + "\n")

    def end(self) -> list[int]:
        """Closes a message: <|im_end|>\\n."""
        return [self.im_end] + self.text("\n")

    def message(self, role: str, content: Sequence[int]) -> list[int]:
        return self.header(role) + list(content) + self.end()

    def opener(self) -> list[int]:
        return self.header("assistant")

    def overhead(self, role: str) -> int:
        """Template tokens a message adds around its content."""
        return len(self.header(role)) + len(self.end())


TINY = Vocab()


@dataclass(frozen=True)
class PlainVocab(Vocab):
    """The same vocabulary under a template with no special tokens ("ROLE: CONTENT" blocks
    separated by blank lines), as raw /generate traffic, base models and custom templates send:
    no <|im_start|> for a cache to find message boundaries or the generation opener by."""

    def header(self, role: str) -> list[int]:
        return self.text(role + ": ")

    def end(self) -> list[int]:
        return self.text("\n\n")


def plain(vocab: Vocab) -> PlainVocab:
    return PlainVocab(vocab.endoftext, vocab.im_start, vocab.im_end, vocab.content, vocab.encode)


class Content:
    """Deterministic synthetic text (token ids in `vocab.content`) from a seed."""

    def __init__(self, seed, vocab: Vocab = TINY):
        self.rng = random.Random(str(seed))
        self.ids = range(*vocab.content)

    def tokens(self, n: int) -> list[int]:
        return self.rng.choices(self.ids, k=max(0, n))

    def randint(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)


def block_tokens(h: int, n: int, vocab: Vocab = TINY) -> list[int]:
    """The n tokens a trace's block hash h stands for (same h -> same tokens)."""
    return random.Random(f"block:{int(h)}").choices(range(*vocab.content), k=n)
