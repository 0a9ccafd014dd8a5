"""The OpenAI-compatible HTTP door: /v1/completions, /v1/chat/completions, /v1/models, /health.

A FastAPI app served by uvicorn inside the scheduler's own event loop, beside the gRPC server
(api/http_server.py). A body becomes the GenerateRequest a gRPC client would send
(openai_requests.py) and goes through the same admission (admission.py) and output path
(streams.py) as Generate; its outputs are shaped here as OpenAI's JSON or server-sent events.

Extensions beyond OpenAI's fields (vLLM spells them the same): `top_k`, `ignore_eos`,
`return_token_ids` (each choice gets the `token_ids` it generated), `stream_interval` (tokens
per streamed chunk), and structured output as `guided_json`, `guided_regex`, `guided_choice`
besides OpenAI's `response_format` (json_schema, json_object). `/tokenize` and `/detokenize`
take and give vLLM's JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any, AsyncIterator, Mapping, Optional, cast

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from planserve.v1 import generate_pb2
from scheduler_service.api import chat_outputs, chat_prompt, gateway, lora_http
from scheduler_service.api.admission import Admission, Rejected, Serving
from scheduler_service.api.chat_outputs import ChatOutput
from scheduler_service.api.json_route import post_json
from scheduler_service.api.openai_errors import ApiError
from scheduler_service.api.openai_logprobs import CompletionLogprobs, chat_logprobs
from scheduler_service.api.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Common,
    chat_turns,
    rejected_error,
    to_pb,
)
from scheduler_service.api.openai_usage import Totals
from scheduler_service.api.sse_chunks import DONE, SseChunks
from scheduler_service.api.sse_direct import DirectSse, writer_of
from scheduler_service.api.streams import (
    Collected,
    EventStream,
    LastEvents,
    finish_reason_name,
    outputs_of,
    placed,
    unless_disconnected,
)
from scheduler_service.api.tool_requests import ToolPlan
from scheduler_service.config import SchedulerConfig, parse_objective_priorities
from scheduler_service.core.request import Request, RequestOutput
from scheduler_service.text import tool_parsers


def _error_response(
    http: HttpRequest, error: ApiError, headers: Optional[Mapping[str, str]] = None
) -> JSONResponse:
    """OpenAI's error shape; Anthropic's on /v1/messages (its clients read error.message)."""
    if http.url.path.startswith("/v1/messages"):
        body = {"type": "error", "error": {"type": error.type, "message": error.message}}
        return JSONResponse(status_code=error.status, content=body, headers=headers)
    return error.response(headers)


class OpenAIApp:
    """The FastAPI app over the gRPC doors' admission (which holds the serving state)."""

    def __init__(self, admission: Admission, config: Optional[SchedulerConfig] = None):
        """config: the tool settings' source, when not the admission's (tests serve one
        engine through doors with different parsers)."""
        self.admission = admission
        config = config or admission.config
        self.tool_parser: Optional[tool_parsers.ToolParser] = None
        if config.enable_auto_tool_choice:
            self.tool_parser = tool_parsers.create(config.tool_call_parser)
        self.reasoning_parser = config.reasoning_parser
        # The gateway's headers are read only when trusted (None: ignored).
        self._gateway_objectives = (
            parse_objective_priorities(config.gateway_objective_priorities)
            if config.trust_gateway_headers
            else None
        )
        self.app = FastAPI(
            title="planserve OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None
        )
        # Starlette types a handler as taking any Exception; each of these gets its own class.
        self.app.add_exception_handler(ApiError, self._api_error)  # type: ignore[arg-type]
        self.app.add_exception_handler(RequestValidationError, self._validation_error)  # type: ignore[arg-type]
        self.app.add_exception_handler(StarletteHTTPException, self._http_error)  # type: ignore[arg-type]
        self.app.get("/health")(self.health)
        self.app.get("/v1/models")(self.models)
        post_json(self.app, "/v1/completions", self.completions)
        post_json(self.app, "/v1/chat/completions", self.chat_completions)
        self.app.post("/tokenize")(self.tokenize)
        self.app.post("/detokenize")(self.detokenize)
        lora_http.add_routes(self.app, admission)

    @staticmethod
    async def _api_error(http: HttpRequest, error: ApiError) -> JSONResponse:
        return _error_response(http, error)

    @staticmethod
    async def _http_error(http: HttpRequest, error: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        error_ = ApiError(error.status_code, str(error.detail), type_)
        return _error_response(http, error_, error.headers)

    @staticmethod
    async def _validation_error(http: HttpRequest, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":
            invalid = f"body: not valid JSON ({first.get('ctx', {}).get('error')})"
            return _error_response(http, ApiError(400, invalid))
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        message = f"{where}: {first.get('msg', 'invalid request')}"
        return _error_response(http, ApiError(400, message, param=param))

    def serving(self, model: Optional[str] = None) -> Serving:
        """The serving state; 503 before the engine answered Describe, 404 for a model that is
        neither the base model nor a LoRA adapter served."""
        serving = self.admission.serving
        if serving is None:
            raise ApiError(
                503, "the model service has not answered Describe yet", "service_unavailable"
            )
        name = serving.facts.model_name
        if (
            model is not None
            and model != name
            and model not in self.admission.loras.registry.adapters
        ):
            raise ApiError(
                404,
                f"The model `{model}` does not exist; this server serves `{name}`",
                param="model",
                code="model_not_found",
            )
        return serving

    async def health(self) -> JSONResponse:
        if self.admission.serving is None:
            return JSONResponse(status_code=503, content={"status": "starting"})
        return JSONResponse(content={"status": "ok"})

    async def models(self) -> dict:
        return lora_http.models(self.serving().facts, self.admission.loras.registry)

    async def completions(self, body: CompletionRequest, http: HttpRequest):
        return await self._handle(body, http, chat=False)

    async def chat_completions(self, body: ChatCompletionRequest, http: HttpRequest):
        return await self._handle(body, http, chat=True)

    async def tokenize(self, body: TokenizeRequest) -> dict:
        self.serving(body.model)
        pb = generate_pb2.TokenizeRequest(add_special_tokens=body.add_special_tokens)
        if body.messages is not None:
            chat_turns(body.messages, pb.messages, only_text=False)
        elif body.prompt is not None:
            pb.text = body.prompt
        try:
            reply = self.admission.tokenize(pb)
        except Rejected as rejected:
            raise rejected_error(rejected, body.messages is not None) from None
        return {
            "count": len(reply.token_ids),
            "max_model_len": reply.max_model_len,
            "tokens": list(reply.token_ids),
        }

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.serving(body.model)
        for index, token in enumerate(body.tokens):
            if not 0 <= token < 1 << 32:
                raise ApiError(400, f"tokens[{index}]: {token} is not a token id", param="tokens")
        try:
            reply = self.admission.detokenize(generate_pb2.DetokenizeRequest(token_ids=body.tokens))
        except Rejected as rejected:  # the body calls the public request's token_ids tokens
            message = rejected.message.replace("token_ids", "tokens", 1)
            raise ApiError(400, message, param="tokens", code=rejected.code.name.lower()) from None
        return {"prompt": reply.text}

    async def admit(
        self, body: _Common, chat: bool, http: Optional[HttpRequest] = None
    ) -> tuple[Serving, Request, Optional[ToolPlan]]:
        """Admits one body of any door (`http`: its request, for X-Request-Id and the gateway's
        headers)."""
        serving = self.serving(body.model)
        reasoning = ""  # a chat's output is split, and its grammar waits for the thinking
        if isinstance(body, ChatCompletionRequest):
            reasoning = self.reasoning_parser
            parser = self.tool_parser.name if self.tool_parser is not None else None
            pb, plan = chat_prompt.chat_request_pb(body, parser, serving.tokenizer)
        else:
            pb, plan = to_pb(body, uuid.uuid4().hex), None
        if body.model != serving.facts.model_name:
            pb.lora_name = body.model  # an adapter (self.serving checked the name)
        headers = http.headers if http is not None else {}
        pb.request_id = gateway.request_id(headers, pb.request_id)
        gateway.apply(pb, body.priority, body.cache_salt, headers, self._gateway_objectives)
        try:
            request = await self.admission.admit(pb, reasoning)
            # Behind frontend processes: the engine core's answer, before a response starts.
            await placed(serving.frontend, request)
            return serving, request, plan
        except Rejected as rejected:
            raise rejected_error(rejected, chat, body) from None

    async def _handle(self, body: _Common, http: HttpRequest, chat: bool):
        serving, req, plan = await self.admit(body, chat, http)
        response = _Response(serving, req, body, chat)
        if chat:
            response.chat_outputs = chat_outputs.for_samples(
                req, plan, self.tool_parser, self.reasoning_parser
            )
        if body.stream:
            return EventStream(response.events(http.scope))
        return await unless_disconnected(http, response.collect())


class _Response:
    """One admitted request's answer: whole (collect) or as server-sent events (events)."""

    def __init__(self, serving: Serving, req: Request, body: _Common, chat: bool):
        self.serving, self.req, self.body, self.chat = serving, req, body, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + req.request_id
        self.created = int(time.time())
        self.totals = Totals(req)
        # Chat with tools or a reasoning parser: each sample split (chat_outputs.py).
        self.chat_outputs: Optional[list[ChatOutput]] = None

    def logprobs_of(self, entries, completion: Optional[CompletionLogprobs] = None):
        if self.req.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(self.serving.tokenizer, entries or [])
        return (completion or CompletionLogprobs(self.serving.tokenizer)).add(entries)

    async def collect(self) -> dict:
        req, collected = self.req, Collected(self.req.n)
        async with contextlib.aclosing(outputs_of(self.serving.frontend, req)) as stream:
            async for output in stream:
                collected.add(output)
                if output.finish_reason is not None:
                    self.totals.add(output)
        choices = []
        for index, sample in enumerate(collected.samples):
            choice: dict[str, Any] = {"index": index}
            reason = finish_reason_name(sample.finish_reason)
            if self.chat_outputs is not None:
                split = self.chat_outputs[index]
                choice["message"] = split.message(sample.text, sample.finish_reason)
                reason = split.finish_reason(sample.finish_reason)
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": sample.text}
            else:
                choice["text"] = sample.text
            choice["logprobs"] = self.logprobs_of(sample.logprobs)
            choice["finish_reason"] = reason
            if self.body.return_token_ids:
                choice["token_ids"] = sample.token_ids
            choices.append(choice)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.req.lora_name or self.serving.facts.model_name,
            "choices": choices,
            "usage": self.totals.as_dict(),
        }

    def _split_chunks(self, output: RequestOutput, sse: SseChunks) -> list[str]:
        """One output of a split chat sample as chunks: its deltas (chat_outputs.py), the first
        carrying the output's logprobs and token ids, then the finish reason on its own."""
        assert self.chat_outputs is not None
        split = self.chat_outputs[output.index]
        deltas = split.deltas(output.text, output.finish_reason)
        if output.finish_reason is not None:
            deltas.append({})  # the finishing chunk, after the calls
        chunks = []
        for number, delta in enumerate(deltas):
            choice: dict[str, Any] = {"index": output.index, "delta": delta, "logprobs": None}
            if number == 0:
                choice["logprobs"] = self.logprobs_of(output.logprobs)
                if self.body.return_token_ids:
                    choice["token_ids"] = output.token_ids
            last = output.finish_reason is not None and number == len(deltas) - 1
            choice["finish_reason"] = split.finish_reason(output.finish_reason) if last else None
            chunks.append(sse.chunk([choice]))
        return chunks

    async def events(self, scope: Mapping[str, Any]) -> AsyncIterator[str]:
        """Chunks as server-sent events. The request is queued only once the response
        started, so a client gone before that leaves nothing behind; one gone later (the
        response task is cancelled on disconnect) aborts it. The common chunk is written where
        its output arrives (api/sse_direct.py), the others here."""
        req, chat = self.req, self.chat
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        sse = SseChunks(
            self.id,
            "chat.completion.chunk" if chat else "text_completion",
            self.created,
            self.req.lora_name or self.serving.facts.model_name,
            include_usage,
        )
        chunks = _Chunks(self, sse)
        writer = writer_of(scope)  # (none with --no-sse-direct-writes; a split chat: the task)
        if writer is not None and self.chat_outputs is None:
            direct = DirectSse(chunks.running).take_over(cast(asyncio.Queue, req.outputs))
            direct.attach(writer)
            req.outputs = direct
        async with contextlib.aclosing(outputs_of(self.serving.frontend, req)) as stream:
            if chat:  # the role first, once per choice
                for index in range(req.n):
                    delta = {"role": "assistant", "content": ""}
                    role = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
                    yield sse.chunk([role])
            samples_left, last = req.n, []  # the last sample's final chunks go out with [DONE]
            async for output in stream:
                if output.finish_reason is not None:
                    self.totals.add(output)
                    samples_left -= 1
                elif _says_nothing(output):
                    continue
                if self.chat_outputs is not None:
                    texts = self._split_chunks(output, sse)
                else:
                    texts = [chunks.of(output)]
                if samples_left:
                    for text in texts:
                        yield text
                else:
                    last.extend(texts)
        if include_usage:
            last.append(sse.chunk([], self.totals.as_dict()))
        yield LastEvents("".join(last) + DONE)


def _says_nothing(output: RequestOutput) -> bool:
    """An output that ends nothing and has no text or token ids yet: no chunk."""
    return output.finish_reason is None and not output.text and not output.token_ids


class _Chunks:
    """A response's chunk of an output (not a split chat's: _split_chunks), made by the response
    task or where the output arrives (`running`, api/sse_direct.py), in the outputs' order."""

    def __init__(self, response: _Response, sse: SseChunks):
        self.response, self.sse, req = response, sse, response.req
        # Most chunks: text (or a chat delta) alone, made from a template (api/sse_chunks.py).
        self.plain = req.logprobs is None and not response.body.return_token_ids
        self.logprobs = [CompletionLogprobs(response.serving.tokenizer) for _ in range(req.n)]

    def running(self, output: RequestOutput) -> str:
        """The chunk of an output that does not end its sample ("" for none)."""
        return "" if _says_nothing(output) else self.of(output)

    def of(self, output: RequestOutput) -> str:
        response, sse = self.response, self.sse
        reason = finish_reason_name(output.finish_reason)
        if self.plain:
            return (sse.delta if response.chat else sse.text)(output.index, output.text, reason)
        choice: dict[str, Any] = {"index": output.index}
        if response.chat:
            choice["delta"] = {"content": output.text} if output.text else {}
        else:
            choice["text"] = output.text
        choice["logprobs"] = response.logprobs_of(output.logprobs, self.logprobs[output.index])
        choice["finish_reason"] = reason
        if response.body.return_token_ids:
            choice["token_ids"] = output.token_ids
        return sse.chunk([choice])
