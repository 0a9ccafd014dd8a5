"""A compiled grammar and one sequence's walk through it (structured output, text/structured.py),
with the reasoning parsers' think block in front of it.

With a reasoning parser the grammar constrains only what follows the thinking
(text/reasoning.py `grammar_after`); the thinking itself is free. A guide goes through these
states (`opens` and `after` are the parser's markers, b"" when it has none):

    opening    only with `opens` (qwen3): the mask is the grammar's first tokens plus the tokens
               that spell the start of `opens`; a token of the grammar's starts it (the output
               opens no think block), tokens completing `opens` go on to thinking
    thinking   until the tokens' bytes spell `after`: no mask, every token accepted
    grammar    the grammar's mask and checks; end of sequence only in its final states

A guide without markers starts in `grammar`; with only `after` (deepseek_r1, whose template
opened the block) in `thinking`.

The grammar itself is walked by the engine's matcher (a `Walk`): outlines-core's Guide over its
Index (`OutlinesWalk`), or llguidance's LLMatcher (text/grammar_llg.py); the states above and the
end-of-sequence rule are the same for both.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Protocol, Sequence

import numpy as np


class Walk(Protocol):
    """One sequence's matcher in a grammar engine."""

    def advance(self, token_id: int) -> bool:
        """Consumes a token; False (state unchanged) when the grammar does not allow it."""

    def write(self, row: np.ndarray) -> None:
        """Writes the allowed tokens into `row` (num_words uint32, zeroed)."""

    def is_final(self) -> bool:
        """The output so far matches the whole grammar."""


class OutlinesWalk:
    """outlines-core's Guide over a compiled Index."""

    __slots__ = ("index", "guide")

    def __init__(self, index):
        from outlines_core import Guide

        self.index = index
        self.guide = Guide(index)

    def advance(self, token_id: int) -> bool:
        try:
            self.guide.advance(token_id, return_tokens=False)
        except ValueError:
            return False
        return True

    def write(self, row: np.ndarray) -> None:
        self.guide.write_mask_into(row.ctypes.data, row.shape[0], 4)

    def is_final(self) -> bool:
        return self.index.is_final_state(self.guide.get_state())


class OpeningMasks:
    """Per marker, the tokens that go on spelling it after each of its prefixes: row k allows
    the tokens t with (marker[:k] + bytes(t)) a prefix of the marker or starting with it.
    Built once per marker over the vocabulary, shared by every grammar of a compiler."""

    def __init__(self, token_bytes: dict[int, bytes], num_words: int):
        self._token_bytes = token_bytes
        self._num_words = num_words
        self._rows: dict[bytes, np.ndarray] = {}
        self._lock = threading.Lock()

    def rows(self, marker: bytes) -> np.ndarray:
        with self._lock:
            rows = self._rows.get(marker)
            if rows is None:
                rows = np.zeros((len(marker), self._num_words), dtype="<u4")
                for token_id, spelled in self._token_bytes.items():
                    if not spelled or token_id >> 5 >= self._num_words:
                        continue
                    for k in range(len(marker)):
                        so_far = marker[:k] + spelled
                        if so_far.startswith(marker) or marker.startswith(so_far):
                            rows[k, token_id >> 5] |= np.uint32(1 << (token_id & 31))
                self._rows[marker] = rows
            return rows


class Grammar:
    """A compiled grammar, shared by every request that uses it; `walk` makes one sequence's
    matcher (an OutlinesWalk over an Index, or llguidance's)."""

    def __init__(
        self,
        walk: Callable[[], Walk],
        eos_token_ids: Sequence[int],
        num_words: int,
        token_bytes: Optional[dict[int, bytes]] = None,
        openings: Optional[OpeningMasks] = None,
    ):
        self.walk = walk
        self.num_words = num_words  # 32-bit words of one bitmask (ceil(vocab_size / 32))
        # The end-of-sequence bits, per word they fall in (OR'ed, so that each word is set once).
        words: dict[int, int] = {}
        for token_id in eos_token_ids:
            words[token_id >> 5] = words.get(token_id >> 5, 0) | (1 << (token_id & 31))
        self.eos_words = np.fromiter(words.keys(), dtype=np.int64, count=len(words))
        self.eos_bits = np.fromiter(words.values(), dtype=np.uint32, count=len(words))
        # What every token spells (special ones too): the markers are read from them.
        self.token_bytes = token_bytes or {}
        self.openings = openings or OpeningMasks(self.token_bytes, num_words)

    def new_guide(self, after: bytes = b"", opens: bytes = b"") -> "GuideState":
        """A sequence's walk; `after`/`opens`: the reasoning parser's markers (module doc)."""
        return GuideState(self, after, opens)


class GuideState:
    """One sequence's walk through a grammar, behind its think block (the module's states)."""

    __slots__ = (
        "grammar",
        "walk",
        "failed",
        "_after",
        "_opens",
        "_prefix",
        "_waiting_for",
        "_tail",
    )

    def __init__(self, grammar: Grammar, after: bytes = b"", opens: bytes = b""):
        self.grammar = grammar
        self.walk = grammar.walk()
        self.failed = False  # a token outside the grammar came back (the mask was not applied)
        self._after, self._opens = after, opens
        # opening: the bytes of `opens` spelled so far (None once decided)
        self._prefix: Optional[bytes] = b"" if opens and after else None
        self._waiting_for = b"" if self._prefix is not None else after  # thinking until this
        self._tail = b""  # the last bytes seen while thinking (a marker may span tokens)

    @property
    def markers(self) -> tuple[bytes, bytes]:
        """(after, opens): what a guide for another process is made with (Grammar.new_guide)."""
        return self._after, self._opens

    def fork(self) -> "GuideState":
        """A fresh guide for a parallel sample: it draws its own first token."""
        return GuideState(self.grammar, self._after, self._opens)

    @property
    def active(self) -> bool:
        """Whether the grammar applies now (its tokens checked)."""
        return self._prefix is None and not self._waiting_for

    @property
    def masked(self) -> bool:
        """Whether this step's token has a mask (opening, or the grammar)."""
        return self._prefix is not None or not self._waiting_for

    @property
    def is_final(self) -> bool:
        """The output so far matches the whole grammar (end of sequence allowed)."""
        return self.active and self.walk.is_final()

    def _think(self, spelled: bytes) -> None:
        marker = self._waiting_for
        self._tail += spelled
        if marker in self._tail:
            self._waiting_for, self._tail = b"", b""
        else:
            self._tail = self._tail[-(len(marker) - 1) :] if len(marker) > 1 else b""

    def _open(self, token_id: int) -> bool:
        assert self._prefix is not None
        spelled = self._prefix + self.grammar.token_bytes.get(token_id, b"")
        if spelled.startswith(self._opens):  # a think block: the grammar waits for its end
            self._prefix, self._waiting_for = None, self._after
            self._think(spelled[len(self._opens) :])
            return True
        if spelled and self._opens.startswith(spelled):
            self._prefix = spelled
            return True
        self._prefix = None  # no think block: the grammar applies from the first token
        return self._advance(token_id)

    def _advance(self, token_id: int) -> bool:
        if not self.walk.advance(token_id):
            self.failed = True
            return False
        return True

    def accept(self, token_id: int) -> bool:
        """Advances by a sampled token; False (and the guide stays) when the grammar does not
        allow it."""
        if self._prefix is not None:
            return self._open(token_id)
        if self._waiting_for:
            self._think(self.grammar.token_bytes.get(token_id, b""))
            return True
        return self._advance(token_id)

    def write_mask(self, row: np.ndarray) -> None:
        """Writes the allowed tokens of the current state into `row` (num_words uint32,
        zeroed): bit t of word t // 32, little-endian. Only for a `masked` guide."""
        if self._prefix:  # inside the opening marker: only its next tokens
            row[:] = self.grammar.openings.rows(self._opens)[len(self._prefix)]
            return
        self.walk.write(row)
        # Every end-of-sequence id (an engine may know only one), in final states only.
        grammar = self.grammar
        if self.is_final:
            row[grammar.eos_words] |= grammar.eos_bits
        else:
            row[grammar.eos_words] &= ~grammar.eos_bits
        if self._prefix is not None:  # the first token: the grammar's, or the opening's
            row |= grammar.openings.rows(self._opens)[0]
