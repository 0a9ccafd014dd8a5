"""What `planserve.LLM.generate` returns, in vLLM's shapes: a RequestResult per prompt, a
CompletionOutput per sample, and with `logprobs` / `prompt_logprobs` asked for, a dict per
position from token id to its Logprob (the chosen token's, and the most likely alternatives',
ranked 1 .. k; the chosen token's rank is known only where it is among them)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from scheduler_service.api.openai_logprobs import ranked
from scheduler_service.api.streams import Collected, finish_reason_name
from scheduler_service.core.request import Request, TokenLogprob
from scheduler_service.text.tokenizer import Tokenizer

PositionLogprobs = dict[int, "Logprob"]


@dataclasses.dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: Optional[int] = None  # 1: the most likely token; None: not among the alternatives
    decoded_token: Optional[str] = None


@dataclasses.dataclass
class CompletionOutput:
    """One sample of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]  # "stop", "length", "cancelled", "deadline", "error"
    logprobs: Optional[list[PositionLogprobs]] = None  # per generated token, with logprobs


@dataclasses.dataclass
class RequestResult:
    """Everything generated for one prompt; `text`, `token_ids` and `finish_reason` are
    sample 0's. `prompt_logprobs` (with prompt_logprobs asked for): None for the first prompt
    token, then one dict per prompt token."""

    request_id: str
    prompt: Any
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> Optional[str]:
        return self.outputs[0].finish_reason


def _position(entry: TokenLogprob, tokenizer: Tokenizer) -> PositionLogprobs:
    return {token_id: Logprob(*value) for token_id, value in ranked(entry, tokenizer).items()}


def result_of(
    prompt: Any,
    request: Request,
    collected: Collected,
    tokenizer: Tokenizer,
) -> RequestResult:
    """One prompt's result from its request's gathered outputs."""
    outputs = []
    for index, sample in enumerate(collected.samples):
        logprobs = None
        if request.logprobs is not None:
            logprobs = [_position(entry, tokenizer) for entry in sample.logprobs]
        reason = finish_reason_name(sample.finish_reason)
        outputs.append(CompletionOutput(index, sample.text, sample.token_ids, reason, logprobs))
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
    if request.prompt_logprobs is not None:
        entries = collected.samples[0].prompt_logprobs or []
        prompt_logprobs = [None] + [_position(e, tokenizer) for e in entries]
    return RequestResult(
        request.request_id, prompt, list(request.prompt_token_ids), outputs, prompt_logprobs
    )
