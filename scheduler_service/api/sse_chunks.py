"""One streamed OpenAI response's server-sent events, as text.

Every chunk of a response repeats its id, object, creation time and model, and most carry one
choice of a plain shape (a completion's text or a chat delta, no logprobs, no token ids): the
repeated parts are encoded once per response, and a plain choice by a template around its one
JSON string, with the same bytes json's encoder writes for the whole payload. Streaming a token
at a time makes this text once per token and stream, on the doors' event loop.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii
from typing import Any, Optional

# One encoder for the chunks' other parts: json.dumps with options builds an encoder a call.
_JSON = json.JSONEncoder(separators=(",", ":"))
DONE = "data: [DONE]\n\n"


def _finish(reason: Optional[str]) -> str:
    return "null" if reason is None else encode_basestring_ascii(reason)


class SseChunks:
    """The `data:` lines of one response: its constant fields, then choices and usage."""

    def __init__(self, response_id: str, obj: str, created: int, model: str, with_usage: bool):
        self._head = (
            f'data: {{"id":{encode_basestring_ascii(response_id)},'
            f'"object":{encode_basestring_ascii(obj)},"created":{int(created)},'
            f'"model":{encode_basestring_ascii(model)},"choices":['
        )
        # Where the client asked for usage, every chunk carries the key (null until the last).
        self._tail = '],"usage":null}\n\n' if with_usage else "]}\n\n"

    def chunk(self, choices: list[dict[str, Any]], usage: Optional[dict] = None) -> str:
        """A chunk of these choices (any shape), with `usage` where the client asked for it."""
        body = ",".join(_JSON.encode(choice) for choice in choices)
        if usage is None:
            return self._head + body + self._tail
        return f'{self._head}{body}],"usage":{_JSON.encode(usage)}}}\n\n'

    def text(self, index: int, text: str, finish_reason: Optional[str]) -> str:
        """A completion's plain choice: {"index", "text", "logprobs": null, "finish_reason"}."""
        return (
            f'{self._head}{{"index":{index},"text":{encode_basestring_ascii(text)},'
            f'"logprobs":null,"finish_reason":{_finish(finish_reason)}}}{self._tail}'
        )

    def delta(self, index: int, content: str, finish_reason: Optional[str]) -> str:
        """A chat chunk's plain choice: its delta {"content"} ({} for no text), logprobs null."""
        delta = f'{{"content":{encode_basestring_ascii(content)}}}' if content else "{}"
        return (
            f'{self._head}{{"index":{index},"delta":{delta},'
            f'"logprobs":null,"finish_reason":{_finish(finish_reason)}}}{self._tail}'
        )
