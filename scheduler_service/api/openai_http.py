"""The OpenAI-compatible HTTP door: /v1/completions, /v1/chat/completions, /v1/models, /health.

A FastAPI app served by uvicorn inside the scheduler's own event loop, beside the gRPC server.
Every request body becomes the same `generate_pb2.GenerateRequest` a gRPC client would send and
goes through `GenerationServicer._accept`, so every bound is checked in one place (intake.py);
its outputs are the same `RequestOutput`s, shaped here as OpenAI's JSON or server-sent events.
Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.

Extensions beyond OpenAI's fields (vLLM spells them the same): `top_k`, `ignore_eos`,
`return_token_ids` (each choice gets the `token_ids` it generated), `stream_interval` (tokens
per streamed chunk), and structured output as `guided_json`, `guided_regex`, `guided_choice`
besides OpenAI's `response_format` (json_schema, json_object). `/tokenize` and `/detokenize`
take and give vLLM's JSON.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import time
import uuid
from typing import Any, AsyncIterator, Optional, Union

import grpc
import structlog
import uvicorn
from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from planserve.v1 import generate_pb2
from scheduler_service.api.openai_logprobs import CompletionLogprobs, chat_logprobs
from scheduler_service.core.request import FinishReason, Request, RequestOutput

log = structlog.get_logger("planserve.openai")

# How finish reasons read in OpenAI's responses; the others are their lowercased names.
_FINISH_REASONS = {FinishReason.EOS: "stop", FinishReason.STOP: "stop",
                   FinishReason.LENGTH: "length"}

_STATUS = {  # gRPC status of a rejected request -> HTTP status and OpenAI error type
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
}

# intake.py's field names (the gRPC request's) -> the OpenAI request's.
_PARAMS = [
    (re.compile(r"^stopping\.max_new_tokens"), "max_tokens"),
    (re.compile(r"^stopping\.stop\b"), "stop"),
    (re.compile(r"^stopping\.ignore_eos"), "ignore_eos"),
    (re.compile(r"^stopping\.min_new_tokens"), "min_tokens"),
    (re.compile(r"^top_logprobs"), "top_logprobs"),
    (re.compile(r"^sampling\.(\w+)"), None),  # temperature, top_p, top_k, seed: same names
    (re.compile(r"^messages\.messages"), "messages"),
    (re.compile(r"^messages"), "messages"),
    (re.compile(r"^(text|token_ids\.ids|prompt)"), "prompt"),
]


def finish_reason_name(reason: Optional[FinishReason]) -> Optional[str]:
    if reason is None:
        return None
    return _FINISH_REASONS.get(reason, reason.name.lower())


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 retry_after_ms: Optional[int] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)
        self.retry_after_ms = retry_after_ms

    def response(self, headers: Optional[dict] = None) -> JSONResponse:
        if self.retry_after_ms is not None:
            # HTTP's Retry-After counts whole seconds; round up so a client never comes too early.
            headers = dict(headers or {}, **{"Retry-After": str(-(-self.retry_after_ms // 1000))})
        return JSONResponse(status_code=self.status, headers=headers, content={"error": {
            "message": self.message, "type": self.type, "param": self.param,
            "code": self.code}})


def _openai_param(field: str, chat: bool) -> tuple[str, str]:
    """intake's field name -> (the OpenAI param, the same path spelled with it)."""
    for pattern, name in _PARAMS:
        match = pattern.match(field)
        if match:
            if name is None:
                name = match.group(1)
            elif name == "prompt" and chat:
                name = "messages"
            elif name == "top_logprobs" and not chat:
                name = "logprobs"  # completions spell the count of alternatives so
            rest = field[match.end():]
            return name, name + rest
    return field, field


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
    n: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False  # extension
    return_token_ids: bool = False  # extension
    logprobs: Optional[Any] = None  # completions: int (alternatives); chat: bool
    top_logprobs: Optional[int] = None  # chat
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None  # extension
    min_p: Optional[float] = None  # extension
    logit_bias: Optional[dict[str, float]] = None  # token id (as a string) -> bias
    min_tokens: Optional[int] = None  # extension
    user: Optional[str] = None
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


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[Any]] = None


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


def _structured_param(body: _Common) -> Optional[str]:
    """Which of response_format / guided_* the body constrains its output with (None: none);
    a response_format of type "text" constrains nothing."""
    used = [name for name in _GUIDED if getattr(body, name) is not None]
    if body.response_format is not None and body.response_format.get("type") == "text":
        used.remove("response_format")
    if len(used) > 1:
        raise ApiError(400, f"{used[1]}: only one of {', '.join(_GUIDED)} may be set",
                       param=used[1])
    return used[0] if used else None


def _structured_to_pb(body: _Common, pb: generate_pb2.GenerateRequest) -> None:
    if body.guided_grammar is not None:
        raise ApiError(400, "guided_grammar: not supported (use guided_json, guided_regex or "
                       "guided_choice)", param="guided_grammar")
    param = _structured_param(body)
    if param is None:
        return
    out = pb.structured_output
    if param == "guided_regex":
        out.regex = body.guided_regex
    elif param == "guided_choice":
        out.choice.choices.extend(body.guided_choice)
        out.choice.SetInParent()
    elif param == "guided_json":
        schema = body.guided_json
        out.json_schema = schema if isinstance(schema, str) else json.dumps(schema)
    else:
        response_format = body.response_format
        kind = response_format.get("type")
        if kind == "json_object":
            out.json_object = True
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ApiError(400, "response_format.json_schema.schema: must be a JSON schema "
                               "object", param="response_format")
            out.json_schema = json.dumps(schema)
        else:
            raise ApiError(400, "response_format.type: must be text, json_object or "
                           f"json_schema, got {kind!r}", param="response_format")


def _set(message, field: str, value, param: str) -> None:
    try:
        setattr(message, field, value)
    except (ValueError, TypeError, OverflowError):
        raise ApiError(400, f"{param}: {value!r} is out of range", param=param) from None


def _to_pb(body: _Common, request_id: str) -> generate_pb2.GenerateRequest:
    pb = generate_pb2.GenerateRequest(request_id=request_id)
    _logprobs_to_pb(body, pb)
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise ApiError(400, "echo: not supported", param="echo")
        if body.suffix:
            raise ApiError(400, "suffix: not supported", param="suffix")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, "prompt: one prompt per request (a batch of "
                               f"{len(prompt)} is not supported)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            pb.text = prompt
        else:
            try:
                pb.token_ids.ids.extend(prompt)
            except (ValueError, TypeError):
                raise ApiError(400, "prompt: token ids must be in the vocabulary",
                               param="prompt") from None
            if not prompt:
                pb.token_ids.SetInParent()
        max_tokens = body.max_tokens
    else:
        if body.tools:
            raise ApiError(400, "tools: not supported", param="tools")
        pb.messages.SetInParent()
        for index, message in enumerate(body.messages):
            content = message.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.type != "text":
                        raise ApiError(400, f"messages[{index}].content: only text parts are "
                                       f"supported, got {part.type!r}", param="messages")
                    parts.append(part.text or "")
                content = "".join(parts)
            role = "system" if message.role == "developer" else message.role
            pb.messages.messages.add(role=role, content=content or "")
        max_tokens = (body.max_completion_tokens if body.max_completion_tokens is not None
                      else body.max_tokens)
    if max_tokens is not None:
        _set(pb.stopping, "max_new_tokens", max_tokens, "max_tokens")
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
            raise ApiError(400, f"logit_bias: key {key!r} is not a token id",
                           param="logit_bias") from None
    if body.min_tokens is not None:
        _set(pb.stopping, "min_new_tokens", body.min_tokens, "min_tokens")
    if body.stop is not None:
        pb.stopping.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    pb.stopping.ignore_eos = body.ignore_eos
    if body.n is not None:
        _set(pb, "n", body.n, "n")
    if body.stream_interval is not None:
        _set(pb, "stream_interval", body.stream_interval, "stream_interval")
    _structured_to_pb(body, pb)
    return pb


def _logprobs_to_pb(body: _Common, pb: generate_pb2.GenerateRequest) -> None:
    """Completions: logprobs = k alternatives; chat: logprobs = true and top_logprobs = k."""
    if isinstance(body, CompletionRequest):
        if body.logprobs is None:
            return
        if isinstance(body.logprobs, bool) or not isinstance(body.logprobs, int):
            raise ApiError(400, "logprobs: must be an integer count of alternatives",
                           param="logprobs")
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


# --- responses -----------------------------------------------------------------------------

def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class _Totals:
    """Usage over a request's n samples: one prompt, every sample's completion tokens."""

    def __init__(self, req: Request):
        self.prompt_tokens = len(req.prompt_token_ids)
        self.cached_tokens = 0
        self.completion_tokens = 0

    def add(self, output: RequestOutput) -> None:
        if output.usage is not None:
            self.completion_tokens += output.usage.completion_tokens
            self.cached_tokens = max(self.cached_tokens, output.usage.cached_tokens)

    def as_dict(self) -> dict:
        return _usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class OpenAIApp:
    """Builds the FastAPI app over a GenerationServicer (which holds the serving state)."""

    def __init__(self, servicer):
        self.servicer = servicer
        self.app = FastAPI(title="planserve OpenAI-compatible API", docs_url=None,
                           redoc_url=None, openapi_url=None)
        self.app.add_exception_handler(ApiError, self._api_error)
        self.app.add_exception_handler(RequestValidationError, self._validation_error)
        self.app.add_exception_handler(StarletteHTTPException, self._http_error)
        self.app.get("/health")(self.health)
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/completions")(self.completions)
        self.app.post("/v1/chat/completions")(self.chat_completions)
        self.app.post("/tokenize")(self.tokenize)
        self.app.post("/detokenize")(self.detokenize)

    @staticmethod
    async def _api_error(_, error: ApiError) -> JSONResponse:
        return error.response()

    @staticmethod
    async def _http_error(_, error: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return ApiError(error.status_code, str(error.detail), type_).response(error.headers)

    @staticmethod
    async def _validation_error(_, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":
            return ApiError(400, f"body: not valid JSON ({first.get('ctx', {}).get('error')})"
                            ).response()
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        return ApiError(400, f"{where}: {first.get('msg', 'invalid request')}",
                        param=param).response()

    def _serving(self):
        serving = self.servicer.serving
        if serving is None:
            raise ApiError(503, "the model service has not answered Describe yet",
                           "service_unavailable")
        return serving

    async def health(self) -> JSONResponse:
        if self.servicer.serving is None:
            return JSONResponse(status_code=503, content={"status": "starting"})
        return JSONResponse(content={"status": "ok"})

    async def models(self) -> dict:
        facts = self._serving().facts
        return {"object": "list", "data": [{
            "id": facts.model_name, "object": "model", "created": 0, "owned_by": "planserve",
            "max_model_len": facts.max_model_len}]}

    async def completions(self, body: CompletionRequest, http: HttpRequest):
        return await self._handle(body, http, chat=False)

    async def chat_completions(self, body: ChatCompletionRequest, http: HttpRequest):
        return await self._handle(body, http, chat=True)

    async def _accept(self, body: _Common, chat: bool) -> tuple[Any, Request]:
        serving = self._serving()
        if body.model != serving.facts.model_name:
            raise ApiError(404, f"The model `{body.model}` does not exist; this server serves "
                           f"`{serving.facts.model_name}`", param="model",
                           code="model_not_found")
        pb = _to_pb(body, uuid.uuid4().hex)
        from scheduler_service.server import Rejected  # server.py imports this module
        try:
            req = self.servicer._accept(serving, pb)
            await self.servicer._compile_grammar(serving, req)
            return serving, req
        except Rejected as rejected:
            raise _rejected_error(rejected, chat, body) from None

    async def tokenize(self, body: TokenizeRequest) -> dict:
        serving = self._serving_model(body.model)
        pb = generate_pb2.TokenizeRequest(add_special_tokens=body.add_special_tokens)
        if body.messages is not None:
            pb.messages.SetInParent()
            for message in body.messages:
                content = message.content
                if isinstance(content, list):
                    content = "".join(part.text or "" for part in content)
                role = "system" if message.role == "developer" else message.role
                pb.messages.messages.add(role=role, content=content or "")
        elif body.prompt is not None:
            pb.text = body.prompt
        from scheduler_service.server import Rejected
        try:
            reply = self.servicer.tokenize(serving, pb)
        except Rejected as rejected:
            raise _rejected_error(rejected, body.messages is not None) from None
        return {"count": len(reply.token_ids), "max_model_len": reply.max_model_len,
                "tokens": list(reply.token_ids)}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        serving = self._serving_model(body.model)
        for index, token in enumerate(body.tokens):
            if not 0 <= token < 1 << 32:
                raise ApiError(400, f"tokens[{index}]: {token} is not a token id",
                               param="tokens")
        from scheduler_service.server import Rejected
        try:
            reply = self.servicer.detokenize(
                serving, generate_pb2.DetokenizeRequest(token_ids=body.tokens))
        except Rejected as rejected:
            raise ApiError(400, rejected.message.replace("token_ids", "tokens", 1),
                           param="tokens", code=rejected.code.name.lower()) from None
        return {"prompt": reply.text}

    def _serving_model(self, model: Optional[str]):
        serving = self._serving()
        if model is not None and model != serving.facts.model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                           f"`{serving.facts.model_name}`", param="model",
                           code="model_not_found")
        return serving

    async def _handle(self, body: _Common, http: HttpRequest, chat: bool):
        serving, req = await self._accept(body, chat)
        response_id = ("chatcmpl-" if chat else "cmpl-") + req.request_id
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                self._stream(serving, req, body, chat, response_id, created, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        collect = asyncio.ensure_future(self._collect(serving, req))
        watch = asyncio.ensure_future(_disconnected(http))
        try:
            await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not collect.done():  # the client went away (or this handler was cancelled)
                collect.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await collect
        if collect.cancelled():
            raise ApiError(499, "client closed the request", "cancelled")
        texts, token_ids, reasons, totals, logprobs = collect.result()
        choices = []
        for index in range(req.n):
            choice: dict[str, Any] = {"index": index}
            if chat:
                choice["message"] = {"role": "assistant", "content": texts[index]}
            else:
                choice["text"] = texts[index]
            choice["logprobs"] = None
            if req.logprobs is not None:
                choice["logprobs"] = (
                    chat_logprobs(serving.tokenizer, logprobs[index]) if chat
                    else CompletionLogprobs(serving.tokenizer).add(logprobs[index]))
            choice["finish_reason"] = finish_reason_name(reasons[index])
            if body.return_token_ids:
                choice["token_ids"] = token_ids[index]
            choices.append(choice)
        return {"id": response_id, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": serving.facts.model_name, "choices": choices,
                "usage": totals.as_dict()}

    @staticmethod
    async def _collect(serving, req: Request):
        texts = [[] for _ in range(req.n)]
        token_ids = [[] for _ in range(req.n)]
        logprobs = [[] for _ in range(req.n)]
        reasons: list[Optional[FinishReason]] = [None] * req.n
        totals = _Totals(req)
        samples_left = req.n
        serving.loop.add_request(req)
        try:
            while samples_left:
                output = await req.outputs.get()
                texts[output.index].append(output.text)
                token_ids[output.index].extend(output.token_ids)
                logprobs[output.index].extend(output.logprobs or ())
                if output.finish_reason is not None:
                    reasons[output.index] = output.finish_reason
                    totals.add(output)
                    samples_left -= 1
        finally:
            if samples_left:
                serving.loop.abort_request(req.request_id)
        return ["".join(parts) for parts in texts], token_ids, reasons, totals, logprobs

    @staticmethod
    async def _stream(serving, req: Request, body: _Common, chat: bool, response_id: str,
                      created: int, include_usage: bool) -> AsyncIterator[str]:
        """Chunks as server-sent events. The request is queued only once the response
        started, so a client gone before that leaves nothing behind; one gone later (the
        response task is cancelled on disconnect) aborts it."""
        model = serving.facts.model_name
        object_ = "chat.completion.chunk" if chat else "text_completion"
        totals = _Totals(req)
        samples_left = req.n
        completion_logprobs = [CompletionLogprobs(serving.tokenizer) for _ in range(req.n)]

        def chunk(choices: list[dict]) -> str:
            payload = {"id": response_id, "object": object_, "created": created,
                       "model": model, "choices": choices}
            if include_usage:
                payload["usage"] = None
            return _sse(payload)

        serving.loop.add_request(req)
        try:
            if chat:  # the role first, once per choice
                for index in range(req.n):
                    yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
            while samples_left:
                output = await req.outputs.get()
                final = output.finish_reason is not None
                if final:
                    samples_left -= 1
                    totals.add(output)
                elif not output.text and not output.token_ids:
                    continue
                choice: dict[str, Any] = {"index": output.index}
                if chat:
                    choice["delta"] = {"content": output.text} if output.text else {}
                else:
                    choice["text"] = output.text
                choice["logprobs"] = None
                if req.logprobs is not None:
                    choice["logprobs"] = (
                        chat_logprobs(serving.tokenizer, output.logprobs or []) if chat
                        else completion_logprobs[output.index].add(output.logprobs))
                choice["finish_reason"] = finish_reason_name(output.finish_reason)
                if body.return_token_ids:
                    choice["token_ids"] = output.token_ids
                yield chunk([choice])
            if include_usage:
                yield _sse({"id": response_id, "object": object_, "created": created,
                            "model": model, "choices": [], "usage": totals.as_dict()})
            yield "data: [DONE]\n\n"
        finally:
            if samples_left:
                serving.loop.abort_request(req.request_id)


def _rejected_error(rejected, chat: bool, body: Optional[_Common] = None) -> ApiError:
    """A request the servicer rejected, as an OpenAI error naming the body's parameter."""
    status, type_ = _STATUS.get(rejected.code, (500, "server_error"))
    param = None
    message = rejected.message
    if rejected.code is grpc.StatusCode.INVALID_ARGUMENT and ":" in message:
        field, rest = message.split(":", 1)
        if field.startswith("structured_output") and body is not None:
            param = _structured_param(body)
            message = f"{param} ({field}):{rest}"
        else:
            param, path = _openai_param(field, chat)
            message = path + ":" + rest
    return ApiError(status, message, type_, param=param, code=rejected.code.name.lower(),
                    retry_after_ms=getattr(rejected, "retry_after_ms", None))


async def _disconnected(http: HttpRequest) -> None:
    """Returns when the client disconnects (the body was already read)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


class _Uvicorn(uvicorn.Server):
    """Leaves the process's signal handlers alone: the CLI owns SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """The OpenAI-compatible API on its own port, in the running event loop."""

    def __init__(self, servicer, host: str, port: int):
        self.app = OpenAIApp(servicer).app
        self._host, self._requested_port = host, port
        self.port: Optional[int] = None
        self._server: Optional[_Uvicorn] = None
        self._task: Optional[asyncio.Task] = None

    async def start(self) -> int:
        """Binds (port 0 picks a free one), serves and returns the bound port."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, self._requested_port))
        except OSError as error:
            sock.close()
            raise RuntimeError(f"http_port {self._requested_port} on {self._host}: "
                               f"{error.strerror or error}") from None
        sock.set_inheritable(True)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5, server_header=False)
        self._server = _Uvicorn(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped during start")
            await asyncio.sleep(0.01)
        log.info("openai http api serving", port=self.port)
        return self.port

    async def stop(self, grace_s: float = 5.0) -> None:
        if self._server is None or self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = max(grace_s, 0.1)
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), grace_s + 2)
        except asyncio.TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._server = self._task = None
