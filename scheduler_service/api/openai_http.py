"""The OpenAI-compatible HTTP door: /v1/completions, /v1/chat/completions, /v1/models, /health.

A FastAPI app served by uvicorn inside the scheduler's own event loop, beside the gRPC server
(api/http_server.py). A body becomes the GenerateRequest a gRPC client would send
(openai_requests.py) and goes through the same admission (admission.py) and output path
(streams.py) as Generate; its outputs are shaped as OpenAI's JSON or server-sent events by
openai_answers.py. A completion's list of prompts is a request per prompt, answered together
(completion_prompts.py, with `echo`).

Extensions beyond OpenAI's fields (vLLM spells them the same): `top_k`, `ignore_eos`,
`stop_token_ids`, `prompt_logprobs`, the chat template's options (chat_prompt.template_options),
`return_token_ids` (each choice gets the `token_ids` it generated), `stream_interval` (tokens
per streamed chunk), and structured output as `guided_json`, `guided_regex`, `guided_choice`
besides OpenAI's `response_format` (json_schema, json_object). `/tokenize` and `/detokenize`
take and give vLLM's JSON, as does `/tokenizer_info` with --enable-tokenizer-info-endpoint.
"""

from __future__ import annotations

import uuid
from typing import Mapping, Optional

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from planserve.v1 import generate_pb2
from scheduler_service.api import chat_outputs, chat_prompt, completion_prompts, gateway, lora_http
from scheduler_service.api.admission import Admission, Rejected, Serving
from scheduler_service.api.completion_prompts import Echo
from scheduler_service.api.json_route import post_json
from scheduler_service.api.openai_answers import Answer
from scheduler_service.api.openai_errors import ApiError
from scheduler_service.api.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Common,
    chat_turns,
    rejected_error,
    to_pb,
    token_ids,
)
from scheduler_service.api.streams import EventStream, placed, unless_disconnected
from scheduler_service.api.tool_requests import ToolPlan
from scheduler_service.config import SchedulerConfig, parse_objective_priorities
from scheduler_service.core.request import Request
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
        if config.enable_tokenizer_info_endpoint:
            self.app.get("/tokenizer_info")(self.tokenizer_info)
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

    async def tokenizer_info(self) -> dict:
        """vLLM's /tokenizer_info: the tokenizer's configuration as transformers names it (the
        special tokens by name, the chat template, model_max_length)."""
        facts = self.serving().facts
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",  # a tokenizer.json's, in transformers
            **facts.special_tokens,
            "chat_template": facts.chat_template or None,
            "model_max_length": facts.max_model_len,
        }

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.serving(body.model)
        ids = token_ids(body.tokens, "tokens")
        try:
            reply = self.admission.detokenize(generate_pb2.DetokenizeRequest(token_ids=ids))
        except Rejected as rejected:  # the body calls the public request's token_ids tokens
            message = rejected.message.replace("token_ids", "tokens", 1)
            raise ApiError(400, message, param="tokens", code=rejected.code.name.lower()) from None
        return {"prompt": reply.text}

    async def admit(
        self,
        body: _Common,
        chat: bool,
        http: Optional[HttpRequest] = None,
        prompt: Optional[completion_prompts.Prompt] = None,
        request_id: Optional[str] = None,
    ) -> tuple[Serving, Request, Optional[ToolPlan]]:
        """Admits one body of any door (`http`: its request, for X-Request-Id and the gateway's
        headers); a completion's, for one of its prompts (`request_id`: the prompt's, in a
        list of them)."""
        serving = self.serving(body.model)
        reasoning = ""  # a chat's output is split, and its grammar waits for the thinking
        if isinstance(body, ChatCompletionRequest):
            reasoning = self.reasoning_parser
            parser = self.tool_parser.name if self.tool_parser is not None else None
            pb, plan = chat_prompt.chat_request_pb(body, parser, serving.tokenizer)
        else:
            pb, plan = to_pb(body, request_id or uuid.uuid4().hex, prompt=prompt), None
        if body.model != serving.facts.model_name:
            pb.lora_name = body.model  # an adapter (self.serving checked the name)
        headers = http.headers if http is not None else {}
        if request_id is None:
            pb.request_id = gateway.request_id(headers, pb.request_id)
        gateway.apply(pb, body.priority, body.cache_salt, headers, self._gateway_objectives)
        try:
            request = await self.admission.admit(pb, reasoning)
            # Behind frontend processes: the engine core's answer, before a response starts.
            await placed(serving.frontend, request)
            return serving, request, plan
        except Rejected as rejected:
            raise rejected_error(rejected, chat, body) from None

    async def _completion_answer(self, body: CompletionRequest, http: HttpRequest) -> Answer:
        """A completion's answer over its requests, one per prompt, each admitted as a body of
        that prompt alone would be; all of them or none (a refusal aborts those before it)."""
        prompts = completion_prompts.prompts_of(body.prompt, self.admission.config.max_queue_len)
        response_id, requests = None, []
        serving = self.serving(body.model)
        try:
            if len(prompts) == 1:
                serving, request, _ = await self.admit(body, False, http, prompts[0])
                requests.append(request)
            else:
                response_id = gateway.request_id(http.headers, uuid.uuid4().hex)
                for position, prompt in enumerate(prompts):
                    request_id = f"{response_id}-{position}"
                    try:
                        serving, request, _ = await self.admit(
                            body, False, http, prompt, request_id
                        )
                    except ApiError as error:
                        raise completion_prompts.naming_prompt(error, position) from None
                    requests.append(request)
                try:
                    self.admission.check_room_for_all(requests)
                except Rejected as rejected:
                    raise rejected_error(rejected, False, body) from None
        except BaseException:
            for request in requests:
                serving.frontend.abort_request(request.request_id)
            raise
        echo = None
        if body.echo:
            echo = Echo(prompts, requests, serving.tokenizer, only_prompt=body.max_tokens == 0)
        return Answer(serving, requests, body, False, response_id, echo)

    async def _handle(self, body: _Common, http: HttpRequest, chat: bool):
        if isinstance(body, CompletionRequest):
            answer = await self._completion_answer(body, http)
        else:
            serving, req, plan = await self.admit(body, chat, http)
            answer = Answer(serving, [req], body, chat)
            answer.chat_outputs = chat_outputs.for_samples(
                req, plan, self.tool_parser, self.reasoning_parser
            )
        if body.stream:
            return EventStream(answer.events(http.scope))
        return await unless_disconnected(http, answer.collect())
