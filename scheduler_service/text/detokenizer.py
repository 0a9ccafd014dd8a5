"""Incremental detokenization and stop strings, one instance per request.

Decoding one token at a time is wrong for byte-level BPE: a character can span tokens, and a
token's text can depend on its neighbours. The tokenizer's stream decoder (Tokenizer.decode_stream)
decodes a small window with and without the newest tokens and gives the difference once it no
longer ends in a partial character. Text that could still grow into a stop string is held back
until it cannot.
"""

from __future__ import annotations

from typing import Optional, Sequence

from scheduler_service.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], stop_strings: Sequence[str]
    ):
        self._next_text = tokenizer.decode_stream(prompt_token_ids)
        self._stop_strings = tuple(s for s in stop_strings if s)
        self._longest_stop = max((len(s) for s in self._stop_strings), default=0)
        # With stop strings: all text produced so far (the stop match cut off once found) and how
        # much of it was sent. Without (most requests): only the pieces not sent yet.
        self.text = ""
        self._num_chars_sent = 0
        self._unsent: list[str] = []

    def add_token(self, token_id: int) -> Optional[str]:
        """Appends one token; returns the stop string if the text now contains one."""
        delta = self._next_text(token_id)
        if not delta:
            return None  # an incomplete character: wait for the next token
        if not self._stop_strings:  # nothing to search or hold back
            self._unsent.append(delta)
            return None
        search_from = max(len(self.text) - self._longest_stop + 1, 0)
        self.text += delta
        return self._find_stop(search_from)

    def _find_stop(self, search_from: int) -> Optional[str]:
        best_index, best_stop = None, None
        for stop in self._stop_strings:
            index = self.text.find(stop, search_from)
            if index != -1 and (best_index is None or index < best_index):
                best_index, best_stop = index, stop
        if best_stop is not None:
            self.text = self.text[:best_index]
        return best_stop

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is the start of some stop string."""
        for length in range(min(len(self.text), self._longest_stop - 1), 0, -1):
            tail = self.text[-length:]
            if any(stop.startswith(tail) for stop in self._stop_strings):
                return length
        return 0

    def take_text(self, final: bool = False) -> str:
        """The text not sent yet; the held-back tail too when the request is over."""
        if not self._stop_strings:
            unsent = self._unsent
            if not unsent:
                return ""
            self._unsent = []
            return unsent[0] if len(unsent) == 1 else "".join(unsent)
        end = len(self.text) if final else len(self.text) - self._held_back()
        if end <= self._num_chars_sent:
            return ""
        chunk = self.text[self._num_chars_sent : end]
        self._num_chars_sent = end
        return chunk


class NoText:
    """The detokenizer of a request whose text is made elsewhere (Request.detokenize False):
    every token adds no text here."""

    def add_token(self, token_id: int) -> Optional[str]:
        return None

    def take_text(self, final: bool = False) -> str:
        return ""


NO_TEXT = NoText()
