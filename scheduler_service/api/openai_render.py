"""vLLM's render endpoints: POST /v1/completions/render and /v1/chat/completions/render.

A body is turned into its prompt exactly as generation turns it (the same to_pb, the same intake:
the chat template, special tokens, every bound) and answered without being queued, in vLLM's
shape: the GenerateRequest a generation would run, `{"request_id", "token_ids", "features",
"sampling_params"}` (for completions a list, one per prompt of the body, as vLLM answers). A gateway
or a KV-aware router computes its prefix keys from these ids.
"""

from __future__ import annotations

import uuid
from typing import Optional

from scheduler_service.api import chat_prompt
from scheduler_service.api.admission import Rejected
from scheduler_service.api.completion_prompts import Prompt, prompts_of
from scheduler_service.api.openai_http import OpenAIApp
from scheduler_service.api.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    _Common,
    rejected_error,
    to_pb,
)
from scheduler_service.core.request import Request


def _rendered(request: Request, request_id: str) -> dict:
    sampling, stopping = request.sampling, request.stopping
    return {
        "request_id": request_id,
        "token_ids": list(request.prompt_token_ids),
        "features": None,  # no multimodal inputs
        "sampling_params": {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "min_p": sampling.min_p,
            "seed": sampling.seed,
            "presence_penalty": sampling.presence_penalty,
            "frequency_penalty": sampling.frequency_penalty,
            "repetition_penalty": sampling.repetition_penalty,
            "max_tokens": stopping.max_new_tokens,
            "min_tokens": stopping.min_new_tokens,
            "stop": list(stopping.stop_strings),
            "stop_token_ids": sorted(stopping.stop_token_ids),
            "ignore_eos": stopping.ignore_eos,
            "n": request.n,
        },
    }


def add_render_routes(openai: OpenAIApp) -> None:
    """Adds the two render routes to the OpenAI app (behind the token, as generation is)."""

    def render(body: _Common, chat: bool, prompt: Optional[Prompt] = None) -> dict:
        serving = openai.serving(body.model)
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if isinstance(body, ChatCompletionRequest):  # rendered as generation renders it
            parser = openai.tool_parser.name if openai.tool_parser is not None else None
            pb, _ = chat_prompt.chat_request_pb(body, parser, serving.tokenizer)
            pb.request_id = request_id
        else:
            pb = to_pb(body, request_id, prompt=prompt)
        try:
            request = openai.admission.render(pb)
        except Rejected as rejected:
            raise rejected_error(rejected, chat, body) from None
        return _rendered(request, request_id)

    @openai.app.post("/v1/completions/render")
    async def completions_render(body: CompletionRequest) -> list[dict]:
        """One rendering per prompt of the body."""
        prompts = prompts_of(body.prompt, openai.admission.config.max_queue_len)
        return [render(body, chat=False, prompt=prompt) for prompt in prompts]

    @openai.app.post("/v1/chat/completions/render")
    async def chat_completions_render(body: ChatCompletionRequest) -> dict:
        return render(body, chat=True)
