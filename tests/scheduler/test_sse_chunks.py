"""api/sse_chunks.py: a streamed response's chunks from templates are, byte for byte, what json's
encoder writes for the whole chunk object (OpenAI's shape: id, object, created, model, choices,
and usage where the client asked for it), for any text, model name and finish reason."""
from __future__ import annotations

import json
from typing import Any, Optional

from hypothesis import given
from hypothesis import strategies as st

from scheduler_service.api.sse_chunks import DONE, SseChunks

_ENCODER = json.JSONEncoder(separators=(",", ":"))
REASONS = st.sampled_from([None, "stop", "length", "tool_calls", "abort"])


def expected(head: dict, choices: list[dict], with_usage: bool, usage: Optional[dict]) -> str:
    payload: dict[str, Any] = {**head, "choices": choices}
    if with_usage:
        payload["usage"] = usage
    return f"data: {_ENCODER.encode(payload)}\n\n"


def response(chat: bool, model: str, with_usage: bool, response_id: str = "cmpl-7"):
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": response_id, "object": obj, "created": 1764201600, "model": model}
    return head, SseChunks(response_id, obj, 1764201600, model, with_usage)


@given(text=st.text(), model=st.text(min_size=1), index=st.integers(0, 7), reason=REASONS,
       with_usage=st.booleans())
def test_a_completion_chunk_is_the_encoders_bytes(text, model, index, reason, with_usage):
    head, sse = response(False, model, with_usage)
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
    assert sse.text(index, text, reason) == expected(head, [choice], with_usage, None)


@given(content=st.text(), model=st.text(min_size=1), index=st.integers(0, 7), reason=REASONS,
       with_usage=st.booleans())
def test_a_chat_delta_is_the_encoders_bytes(content, model, index, reason, with_usage):
    head, sse = response(True, model, with_usage, "chatcmpl-\u00e9\"x")
    delta = {"content": content} if content else {}
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
    assert sse.delta(index, content, reason) == expected(head, [choice], with_usage, None)


def test_any_other_chunk_and_the_usage_chunk():
    head, sse = response(True, "SmolLM2 \u2603", True)
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}
    split = {"index": 1, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\""}}]},
             "logprobs": {"content": [{"token": "a", "logprob": -0.25}]}, "finish_reason": None,
             "token_ids": [5, 6]}
    assert sse.chunk([role]) == expected(head, [role], True, None)
    assert sse.chunk([role, split]) == expected(head, [role, split], True, None)
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
             "prompt_tokens_details": {"cached_tokens": 0}}
    assert sse.chunk([], usage) == expected(head, [], True, usage)
    head, sse = response(False, "m", False)
    assert sse.chunk([split]) == expected(head, [split], False, None)
    assert DONE == "data: [DONE]\n\n"
