"""OpenAI request bodies in, `GenerateRequest` out; refusals back as OpenAI errors.

Every body becomes the same `generate_pb2.GenerateRequest` a gRPC client would send, so every
bound is checked once, by admission (intake.py). A refusal comes back as a typed `Rejected`
naming the public request's field; `rejected_error` names the body's parameter from that field
(`stopping.max_new_tokens` -> `max_tokens`). Errors use OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union, cast

import grpc
from pydantic import BaseModel, ConfigDict

from planserve.v1 import generate_pb2
from scheduler_service.api import completion_prompts
from scheduler_service.api.admission import Rejected
from scheduler_service.api.openai_errors import ApiError

_STATUS = {  # gRPC status of a rejected request -> HTTP status and OpenAI error type
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
}

# The public request's fields (a prefix of the field's path) -> the OpenAI body's parameter.
# `sampling.X` is X (temperature, top_p, top_k, seed, ...: the same names); a prompt field is
# `messages` in a chat body; any other field keeps its name (n, stream_interval).
_PARAMS = (
    ("stopping.max_new_tokens", "max_tokens"),
    ("stopping.min_new_tokens", "min_tokens"),
    ("stopping.ignore_eos", "ignore_eos"),
    ("stopping.stop_token_ids", "stop_token_ids"),
    ("stopping.stop", "stop"),
    ("top_logprobs", "top_logprobs"),  # completions spell it logprobs (the count)
    ("messages.messages", "messages"),
    ("messages", "messages"),
    ("token_ids.ids", "prompt"),
    ("text", "prompt"),
    ("prompt", "prompt"),
)


def _under(field: str, prefix: str) -> bool:
    """Whether `field` is `prefix` or a path below it (an index or a member)."""
    return field == prefix or field.startswith((prefix + "[", prefix + "."))


def openai_param(field: str, chat: bool) -> tuple[str, str]:
    """The public request's field -> (the OpenAI param, the same path spelled with it)."""
    if field.startswith("sampling."):
        rest = field[len("sampling.") :]
        name = rest.split("[", 1)[0].split(".", 1)[0]
        return name, rest
    for prefix, name in _PARAMS:
        if _under(field, prefix):
            if name == "prompt" and chat:
                name = "messages"
            elif name == "top_logprobs" and not chat:
                name = "logprobs"  # completions spell the count of alternatives so
            return name, name + field[len(prefix) :]
    return field, field


def rejected_error(rejected: Rejected, chat: bool, body: Optional["_Common"] = None) -> ApiError:
    """A request admission refused, as an OpenAI error naming the body's parameter."""
    status, type_ = _STATUS.get(rejected.code, (500, "server_error"))
    param = None
    message = rejected.message
    if rejected.code is grpc.StatusCode.INVALID_ARGUMENT and rejected.field is not None:
        field, detail = rejected.field, rejected.detail
        if field.startswith("structured_output") and body is not None:
            # Without response_format or guided_*, the grammar is the tools' (tool_requests.py).
            param = structured_param(body) or "tools"
            message = f"{param} ({field}): {detail}"
        else:
            param, path = openai_param(field, chat)
            message = f"{path}: {detail}"
    return ApiError(
        status,
        message,
        type_,
        param=param,
        code=rejected.code.name.lower(),
        retry_after_ms=rejected.retry_after_ms,
    )


# --- request bodies ------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are accepted and ignored

    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # extension
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None  # extension
    n: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False  # extension
    return_token_ids: bool = False  # extension
    logprobs: Optional[Any] = None  # completions: int (alternatives); chat: bool
    top_logprobs: Optional[int] = None  # chat
    prompt_logprobs: Optional[int] = None  # extension: whole responses only
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None  # extension
    min_p: Optional[float] = None  # extension
    logit_bias: Optional[dict[str, float]] = None  # token id (as a string) -> bias
    min_tokens: Optional[int] = None  # extension
    user: Optional[str] = None
    priority: Optional[int] = None  # extension, vLLM's: lower is handled first (api/gateway.py)
    cache_salt: Optional[str] = None  # extension: requests share cached prefixes per salt
    stream_interval: Optional[int] = None  # extension: tokens per streamed chunk
    # Structured output: OpenAI's response_format, or vLLM's guided_* (at most one of them).
    response_format: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None  # vLLM's EBNF grammars: refused, never ignored


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = 16  # OpenAI's default for completions
    echo: bool = False
    suffix: Optional[str] = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Optional[Union[str, list[ContentPart]]] = None
    tool_calls: Optional[list[Any]] = None  # an assistant turn's calls (content may be null)
    tool_call_id: Optional[str] = None  # a tool turn's call; both read in chat_prompt.py


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[Any]] = None  # checked and planned in tool_requests.py
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    # Extensions (vLLM's): how the chat template renders the conversation (chat_prompt.py).
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a prompt or chat messages."""

    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    tokens: list[int]


# --- request mapping -----------------------------------------------------------------------

_GUIDED = ("response_format", "guided_json", "guided_regex", "guided_choice")


def structured_param(body: _Common) -> Optional[str]:
    """Which of response_format / guided_* the body constrains its output with (None: none);
    a response_format of type "text" constrains nothing."""
    used = [name for name in _GUIDED if getattr(body, name) is not None]
    if body.response_format is not None and body.response_format.get("type") == "text":
        used.remove("response_format")
    if len(used) > 1:
        raise ApiError(
            400, f"{used[1]}: only one of {', '.join(_GUIDED)} may be set", param=used[1]
        )
    return used[0] if used else None


def _structured_to_pb(body: _Common, pb: generate_pb2.GenerateRequest) -> None:
    if body.guided_grammar is not None:
        raise ApiError(
            400,
            "guided_grammar: not supported (use guided_json, guided_regex or guided_choice)",
            param="guided_grammar",
        )
    param = structured_param(body)
    if param is None:
        return
    out = pb.structured_output
    if param == "guided_regex":
        out.regex = body.guided_regex or ""  # set: structured_param chose it
    elif param == "guided_choice":
        out.choice.choices.extend(body.guided_choice)
        out.choice.SetInParent()
    elif param == "guided_json":
        schema = body.guided_json
        out.json_schema = schema if isinstance(schema, str) else json.dumps(schema)
    else:
        _response_format_to_pb(body.response_format or {}, out)


def _response_format_to_pb(response_format: dict, out) -> None:
    kind = response_format.get("type")
    if kind == "json_object":
        out.json_object = True
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(
                400,
                "response_format.json_schema.schema: must be a JSON schema object",
                param="response_format",
            )
        out.json_schema = json.dumps(schema)
    else:
        raise ApiError(
            400,
            f"response_format.type: must be text, json_object or json_schema, got {kind!r}",
            param="response_format",
        )


def token_ids(ids: list[int], param: str) -> list[int]:
    """`ids` as the public request takes them (uint32), else a 400 naming the first outside;
    the vocabulary's bound is admission's to check."""
    for index, token_id in enumerate(ids):
        if not 0 <= token_id < 1 << 32:
            raise ApiError(400, f"{param}[{index}]: {token_id} is not a token id", param=param)
    return ids


def _set(message, field: str, value, param: str) -> None:
    try:
        setattr(message, field, value)
    except (ValueError, TypeError, OverflowError):
        raise ApiError(400, f"{param}: {value!r} is out of range", param=param) from None


def chat_turns(messages: list[ChatMessage], target, only_text: bool = True) -> None:
    """Chat messages into `target` (a common_pb2 Messages): content parts joined, OpenAI's
    `developer` role read as `system`. `only_text`: a part other than text is refused."""
    target.SetInParent()
    for index, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            if only_text:
                for part in content:
                    if part.type != "text":
                        raise ApiError(
                            400,
                            f"messages[{index}].content: only text parts are supported, got "
                            f"{part.type!r}",
                            param="messages",
                        )
            content = "".join(part.text or "" for part in content)
        role = "system" if message.role == "developer" else message.role
        target.messages.add(role=role, content=content or "")


def _sampling_to_pb(body: _Common, pb: generate_pb2.GenerateRequest) -> None:
    if body.temperature is not None:
        pb.sampling.temperature = body.temperature
    if body.top_p is not None:
        pb.sampling.top_p = body.top_p
    if body.top_k is not None and body.top_k > 0:  # vLLM's "-1 (or 0) means off"
        _set(pb.sampling, "top_k", body.top_k, "top_k")
    if body.seed is not None:
        _set(pb.sampling, "seed", body.seed % (1 << 64), "seed")
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        if getattr(body, name) is not None:
            _set(pb.sampling, name, getattr(body, name), name)
    for key, bias in (body.logit_bias or {}).items():
        try:
            pb.sampling.logit_bias[int(key)] = bias
        except (ValueError, TypeError, OverflowError):
            raise ApiError(
                400, f"logit_bias: key {key!r} is not a token id", param="logit_bias"
            ) from None


def _stopping_to_pb(body: _Common, pb: generate_pb2.GenerateRequest) -> None:
    if body.min_tokens is not None:
        _set(pb.stopping, "min_new_tokens", body.min_tokens, "min_tokens")
    if body.stop is not None:
        pb.stopping.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    pb.stopping.stop_token_ids.extend(token_ids(body.stop_token_ids or [], "stop_token_ids"))
    pb.stopping.ignore_eos = body.ignore_eos


def to_pb(
    body: _Common,
    request_id: str,
    prompt_ids: Optional[list[int]] = None,
    prompt: Optional[completion_prompts.Prompt] = None,
) -> generate_pb2.GenerateRequest:
    """The GenerateRequest a gRPC client would send for this body (checked by admission).
    `prompt`: a completion's, one of completion_prompts.prompts_of(body.prompt)."""
    pb = generate_pb2.GenerateRequest(request_id=request_id)
    _logprobs_to_pb(body, pb)
    if isinstance(body, CompletionRequest):
        assert prompt is not None, "a completion is given one of its body's prompts"
        if body.suffix:
            raise ApiError(400, "suffix: not supported", param="suffix")
        completion_prompts.prompt_to_pb(prompt, body.echo, pb)
        max_tokens = completion_prompts.max_new_tokens(body.max_tokens, body.echo)
    else:
        body = cast(ChatCompletionRequest, body)
        if prompt_ids is not None:  # rendered by the door (tools, or tool turns in the history)
            pb.token_ids.ids.extend(prompt_ids)
        else:
            chat_turns(body.messages, pb.messages)
        max_tokens = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
    if max_tokens is not None:
        _set(pb.stopping, "max_new_tokens", max_tokens, "max_tokens")
    _sampling_to_pb(body, pb)
    _stopping_to_pb(body, pb)
    if body.n is not None:
        _set(pb, "n", body.n, "n")
    if body.stream_interval is not None:
        _set(pb, "stream_interval", body.stream_interval, "stream_interval")
    _structured_to_pb(body, pb)
    return pb


def _logprobs_to_pb(body: _Common, pb: generate_pb2.GenerateRequest) -> None:
    """Completions: logprobs = k alternatives; chat: logprobs = true and top_logprobs = k."""
    if body.prompt_logprobs is not None:
        if body.stream:
            raise ApiError(
                400, "prompt_logprobs: not available with stream true", param="prompt_logprobs"
            )
        _set(pb, "prompt_logprobs", body.prompt_logprobs, "prompt_logprobs")
    if isinstance(body, CompletionRequest):
        if body.logprobs is None:
            return
        if isinstance(body.logprobs, bool) or not isinstance(body.logprobs, int):
            raise ApiError(
                400, "logprobs: must be an integer count of alternatives", param="logprobs"
            )
        pb.logprobs = True
        _set(pb, "top_logprobs", body.logprobs, "logprobs")
        return
    if body.logprobs not in (None, False, True):
        raise ApiError(400, "logprobs: must be a boolean", param="logprobs")
    if body.logprobs:
        pb.logprobs = True
        if body.top_logprobs is not None:
            _set(pb, "top_logprobs", body.top_logprobs, "top_logprobs")
    elif body.top_logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
