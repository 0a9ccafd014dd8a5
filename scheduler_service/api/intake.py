"""Public request in, validated `Request` out: the edge of the public API for requests.

Every bound is checked here, before anything is queued, and a violation names the field and
the bound (admission.py turns `InvalidRequest` into an INVALID_ARGUMENT `Rejected` carrying both).
"""

from __future__ import annotations

import secrets
import time
import uuid
from typing import Optional

from planserve.v1 import generate_pb2
from scheduler_service.core.request import Request, Sampling, Stopping
from scheduler_service.engine.client import EngineFacts
from scheduler_service.text import structured
from scheduler_service.text.tokenizer import Tokenizer

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_MAX_NEW_TOKENS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_SAMPLES = 16
MAX_TENANT_CHARS = 128
MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 256
MAX_STREAM_INTERVAL = 1024
# The sampling bounds are the engine's (EngineFacts.bounds, from Describe; planserve/contract.py).


class InvalidRequest(ValueError):
    """A field out of its bound: `field` is its path in the GenerateRequest, `detail` the bound
    it broke and the value it had."""

    def __init__(self, field: str, detail: str):
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail


def prompt_token_ids(
    pb: generate_pb2.GenerateRequest, facts: EngineFacts, tokenizer: Tokenizer
) -> list[int]:
    kind = pb.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("prompt", "one of text, token_ids or messages must be set")
    if kind == "text":
        if not pb.text:
            raise InvalidRequest("text", "must not be empty")
        return tokenizer.encode(pb.text)
    if kind == "token_ids":
        ids = list(pb.token_ids.ids)
        if not ids:
            raise InvalidRequest("token_ids.ids", "must not be empty")
        if max(ids) >= facts.vocab_size:  # (one C pass; the loop only names the first)
            for index, token_id in enumerate(ids):
                if token_id >= facts.vocab_size:
                    raise InvalidRequest(
                        f"token_ids.ids[{index}]",
                        f"{token_id} is outside the vocabulary [0, {facts.vocab_size})",
                    )
        return ids
    messages = pb.messages.messages
    if not messages:
        raise InvalidRequest("messages.messages", "must hold at least one message")
    for index, message in enumerate(messages):
        if message.role not in ("system", "user", "assistant"):
            raise InvalidRequest(
                f"messages.messages[{index}].role",
                f"must be system, user or assistant, got {message.role!r}",
            )
    if not tokenizer.has_chat_template:
        raise InvalidRequest("messages", "the served model has no chat template")
    return tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in messages])


def _bounded(
    params, name: str, default: float, low: float, high: float, low_open: bool = False
) -> float:
    """A float field's value (or default), rejected outside [low, high] ((low, high] when
    low_open); NaN fails every comparison and is rejected too."""
    if not params.HasField(name):
        return default
    value = getattr(params, name)
    inside = (low < value if low_open else low <= value) and value <= high
    if not inside:
        bracket = "(" if low_open else "["
        raise InvalidRequest(
            f"sampling.{name}", f"must be in {bracket}{low:g}, {high:g}], got {value}"
        )
    return value


def _logit_bias(params, facts: EngineFacts) -> tuple[tuple[int, float], ...]:
    most_entries, most_bias = facts.bounds.max_logit_bias_entries, facts.bounds.max_logit_bias
    if len(params.logit_bias) > most_entries:
        raise InvalidRequest(
            "sampling.logit_bias",
            f"at most {most_entries} entries, got {len(params.logit_bias)}",
        )
    for token_id, bias in params.logit_bias.items():
        if token_id >= facts.vocab_size:
            raise InvalidRequest(
                f"sampling.logit_bias[{token_id}]",
                f"{token_id} is outside the vocabulary [0, {facts.vocab_size})",
            )
        if not -most_bias <= bias <= most_bias:
            raise InvalidRequest(
                f"sampling.logit_bias[{token_id}]",
                f"must be in [{-most_bias:g}, {most_bias:g}], got {bias}",
            )
    return tuple(sorted(params.logit_bias.items()))


def _sampling(pb: generate_pb2.GenerateRequest, facts: EngineFacts) -> Sampling:
    params, bounds = pb.sampling, facts.bounds
    temperature = params.temperature if params.HasField("temperature") else DEFAULT_TEMPERATURE
    if not temperature >= 0:  # also rejects NaN
        raise InvalidRequest("sampling.temperature", f"must be >= 0, got {temperature}")
    top_p = params.top_p if params.HasField("top_p") else DEFAULT_TOP_P
    if not 0 < top_p <= 1:
        raise InvalidRequest("sampling.top_p", f"must be in (0, 1], got {top_p}")
    top_k = 0
    if params.HasField("top_k"):
        if params.top_k < 1:
            raise InvalidRequest("sampling.top_k", f"must be >= 1 when set, got {params.top_k}")
        top_k = params.top_k
    # An unseeded request still gets a seed, so that preemption and recompute reproduce it.
    seed = params.seed if params.HasField("seed") else secrets.randbits(63)
    return Sampling(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        min_p=_bounded(params, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_bounded(
            params, "repetition_penalty", 1.0, 0.0, bounds.max_repetition_penalty, low_open=True
        ),
        presence_penalty=_bounded(
            params, "presence_penalty", 0.0, -bounds.max_penalty, bounds.max_penalty
        ),
        frequency_penalty=_bounded(
            params, "frequency_penalty", 0.0, -bounds.max_penalty, bounds.max_penalty
        ),
        logit_bias=_logit_bias(params, facts),
    )


def _stopping(
    pb: generate_pb2.GenerateRequest,
    num_prompt_tokens: int,
    facts: EngineFacts,
    capacity_tokens: int,
) -> Stopping:
    stopping = pb.stopping
    # A sequence may never outgrow the model nor the whole KV cache (alone, it always fits).
    room = min(facts.max_model_len, capacity_tokens) - num_prompt_tokens
    max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    if stopping.HasField("max_new_tokens"):
        max_new_tokens = stopping.max_new_tokens
        if not 1 <= max_new_tokens <= facts.max_model_len:
            raise InvalidRequest(
                "stopping.max_new_tokens",
                f"must be in [1, {facts.max_model_len}] (the model's max length), "
                f"got {max_new_tokens}",
            )
    if len(stopping.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest("stopping.stop", f"at most {MAX_STOP_STRINGS} stop strings")
    for index, stop in enumerate(stopping.stop):
        if not 1 <= len(stop) <= MAX_STOP_STRING_CHARS:
            raise InvalidRequest(
                f"stopping.stop[{index}]", f"length must be in [1, {MAX_STOP_STRING_CHARS}]"
            )
    for index, token_id in enumerate(stopping.stop_token_ids):
        if token_id >= facts.vocab_size:
            raise InvalidRequest(
                f"stopping.stop_token_ids[{index}]",
                f"{token_id} is outside the vocabulary [0, {facts.vocab_size})",
            )
    min_new_tokens = stopping.min_new_tokens if stopping.HasField("min_new_tokens") else 0
    if min_new_tokens > max_new_tokens:
        raise InvalidRequest(
            "stopping.min_new_tokens",
            f"must be in [0, max_new_tokens {max_new_tokens}], got {min_new_tokens}",
        )
    return Stopping(
        min_new_tokens=min_new_tokens,
        max_new_tokens=min(max_new_tokens, room),
        stop_strings=tuple(stopping.stop),
        stop_token_ids=frozenset(stopping.stop_token_ids),
        ignore_eos=stopping.ignore_eos,
    )


def _stream_interval(pb: generate_pb2.GenerateRequest) -> int:
    if not pb.HasField("stream_interval"):
        return 1
    if not 1 <= pb.stream_interval <= MAX_STREAM_INTERVAL:
        raise InvalidRequest(
            "stream_interval", f"must be in [1, {MAX_STREAM_INTERVAL}], got {pb.stream_interval}"
        )
    return pb.stream_interval


def _structured(pb: generate_pb2.GenerateRequest) -> Optional[structured.StructuredSpec]:
    """The grammar's spec (checked, not compiled: the server compiles it off the event loop)."""
    if not pb.HasField("structured_output"):
        return None
    try:
        return structured.spec_from_pb(pb.structured_output)
    except structured.StructuredOutputError as error:
        raise InvalidRequest(error.field, error.message) from None


def _check_logprobs(pb: generate_pb2.GenerateRequest, most: int) -> int:
    """top_logprobs (returned) and prompt_logprobs within the engine's max_top_logprobs."""
    top_logprobs = pb.top_logprobs if pb.HasField("top_logprobs") else 0
    if top_logprobs > most:
        raise InvalidRequest("top_logprobs", f"must be in [0, {most}], got {top_logprobs}")
    if pb.HasField("top_logprobs") and not pb.logprobs:
        raise InvalidRequest("top_logprobs", "needs logprobs set")
    if pb.HasField("prompt_logprobs") and pb.prompt_logprobs > most:
        raise InvalidRequest("prompt_logprobs", f"must be in [0, {most}], got {pb.prompt_logprobs}")
    return top_logprobs


def to_request(
    pb: generate_pb2.GenerateRequest, facts: EngineFacts, tokenizer: Tokenizer, capacity_tokens: int
) -> Request:
    prompt = prompt_token_ids(pb, facts, tokenizer)
    if len(prompt) >= facts.max_model_len:
        raise InvalidRequest(
            "prompt",
            f"{len(prompt)} tokens; must be below the model's max length {facts.max_model_len}",
        )
    if len(prompt) >= capacity_tokens:
        raise InvalidRequest(
            "prompt",
            f"{len(prompt)} tokens; must be below the KV cache's capacity {capacity_tokens}",
        )
    if len(pb.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters")
    if len(pb.tenant) > MAX_TENANT_CHARS:
        raise InvalidRequest("tenant", f"at most {MAX_TENANT_CHARS} characters")
    if len(pb.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest("cache_salt", f"at most {MAX_CACHE_SALT_CHARS} characters")
    if pb.HasField("deadline_ms") and pb.deadline_ms < 1:
        raise InvalidRequest("deadline_ms", f"must be >= 1 when set, got {pb.deadline_ms}")
    if pb.HasField("ttft_target_ms") and pb.ttft_target_ms < 1:
        raise InvalidRequest("ttft_target_ms", f"must be >= 1 when set, got {pb.ttft_target_ms}")
    n = pb.n if pb.HasField("n") else 1
    if not 1 <= n <= MAX_SAMPLES:
        raise InvalidRequest("n", f"must be in [1, {MAX_SAMPLES}], got {n}")
    top_logprobs = _check_logprobs(pb, facts.bounds.max_top_logprobs)
    arrival = time.monotonic()
    return Request(
        request_id=pb.request_id or uuid.uuid4().hex,
        prompt_token_ids=prompt,
        sampling=_sampling(pb, facts),
        stopping=_stopping(pb, len(prompt), facts, capacity_tokens),
        arrival_time=arrival,
        priority=pb.priority,
        deadline=arrival + pb.deadline_ms / 1000 if pb.HasField("deadline_ms") else None,
        first_token_due=(
            arrival + pb.ttft_target_ms / 1000 if pb.HasField("ttft_target_ms") else None
        ),
        tenant=pb.tenant,
        cache_salt=pb.cache_salt,
        n=n,
        stream_interval=_stream_interval(pb),
        structured=_structured(pb),
        logprobs=top_logprobs if pb.logprobs else None,
        prompt_logprobs=pb.prompt_logprobs if pb.HasField("prompt_logprobs") else None,
    )
