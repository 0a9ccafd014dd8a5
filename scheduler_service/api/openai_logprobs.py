"""Logprobs in OpenAI's two JSON shapes, from the scheduler's TokenLogprob entries.

vLLM's `prompt_logprobs` (and the offline API's logprobs): per position, the token's and its
alternatives' {logprob, rank, decoded_token} by token id (`ranked`).

Completions (legacy): {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: lp}],
"text_offset": [...]}; chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}.
A token's text is its own decode (byte-level pieces that are not valid UTF-8 alone decode with
replacement characters; `bytes` carries the exact UTF-8 of that text, as OpenAI does).
An echoed prompt's first token has no logprob (nothing comes before it): it is `Unscored`, and
the legacy shape gives it null, as OpenAI does.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from scheduler_service.core.request import TokenLogprob
from scheduler_service.text.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Unscored(TokenLogprob):
    """A token without a logprob: an echoed prompt's first."""


def _text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def ranked(
    entry: TokenLogprob, tokenizer: Tokenizer
) -> dict[int, tuple[float, Optional[int], str]]:
    """One position as vLLM gives it: token id -> (logprob, rank, decoded token), for the
    position's token and its alternatives, ranked 1 .. k in order (the token's rank is None
    where it is not among them)."""
    ranks: dict[int, Optional[int]] = {t: rank for rank, (t, _) in enumerate(entry.top, start=1)}
    position = {t: (lp, ranks[t], _text(tokenizer, t)) for t, lp in entry.top}
    position[entry.token_id] = (
        entry.logprob,
        ranks.get(entry.token_id),
        _text(tokenizer, entry.token_id),
    )
    return position


def prompt_logprobs_json(entries: list[TokenLogprob], tokenizer: Tokenizer) -> list:
    """vLLM's `prompt_logprobs` of a response: null for the first prompt token, then per token
    {"<id>": {"logprob", "rank", "decoded_token"}}."""
    positions = [
        {
            str(token_id): {"logprob": logprob, "rank": rank, "decoded_token": text}
            for token_id, (logprob, rank, text) in ranked(entry, tokenizer).items()
        }
        for entry in entries
    ]
    return [None, *positions]


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = _text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            dict(item(e.token_id, e.logprob), top_logprobs=[item(t, lp) for t, lp in e.top])
            for e in entries
        ]
    }


class CompletionLogprobs:
    """Accumulates the legacy shape over a completion's chunks (text offsets run on)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._offset = 0

    def add(self, entries: Optional[list[TokenLogprob]]) -> dict:
        shape: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries or []:
            text = _text(self._tokenizer, e.token_id)
            shape["tokens"].append(text)
            if isinstance(e, Unscored):
                shape["token_logprobs"].append(None)
                shape["top_logprobs"].append(None)
            else:
                shape["token_logprobs"].append(e.logprob)
                shape["top_logprobs"].append({_text(self._tokenizer, t): lp for t, lp in e.top})
            shape["text_offset"].append(self._offset)
            self._offset += len(text)
        return shape


def merge_completion(shapes: list[dict]) -> dict:
    merged: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for shape in shapes:
        for key in merged:
            merged[key].extend(shape[key])
    return merged
