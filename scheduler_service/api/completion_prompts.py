"""/v1/completions' prompts: several in one body, and `echo`.

A body's `prompt` may be a list of prompts (strings or token-id lists), as OpenAI's and vLLM's
APIs take them and evaluation harnesses send them: each becomes a request of its own, admitted
like any other, and the answer's choices run prompt by prompt, the n samples of prompt p being
choices p*n .. p*n+n-1 (vLLM's order).

`echo` puts each choice's prompt before its completion: the text, and with `logprobs` the
prompt tokens' logprobs (the first token's null, as OpenAI gives it), which is how a client
scores a text. `max_tokens` 0 with echo asks for the prompt alone: the request draws the one
token the scoring needs, and the answer drops it (finish reason `length`, no completion tokens).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union, cast

from planserve.v1 import generate_pb2
from scheduler_service.api.openai_errors import ApiError
from scheduler_service.api.openai_logprobs import Unscored
from scheduler_service.core.request import FinishReason, Request, RequestOutput, TokenLogprob
from scheduler_service.text.tokenizer import Tokenizer

Prompt = Union[str, list[int]]


def prompts_of(prompt: Union[Prompt, list[str], list[list[int]]], most: int) -> list[Prompt]:
    """A body's prompts from its `prompt`: one, or a list of at most `most` (the waiting
    queue's length: a list is queued at once, so a longer one could never be taken)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > most:
            raise ApiError(
                400,
                f"prompt: at most {most} prompts in one request (max_queue_len), got {len(prompt)}",
                param="prompt",
            )
        return cast(list[Prompt], list(prompt))  # (pydantic kept the list of one type)
    return [cast(Prompt, prompt)]


def prompt_to_pb(prompt: Prompt, echo: bool, pb: generate_pb2.GenerateRequest) -> None:
    """One prompt of a body into `pb` (its logprobs already set), with what echo asks."""
    if echo and pb.logprobs and not pb.HasField("prompt_logprobs"):
        pb.prompt_logprobs = pb.top_logprobs  # the prompt's, with as many alternatives
    if isinstance(prompt, str):
        pb.text = prompt
        return
    try:
        pb.token_ids.ids.extend(prompt)
    except (ValueError, TypeError):
        raise ApiError(400, "prompt: token ids must be in the vocabulary", param="prompt") from None
    if not prompt:
        pb.token_ids.SetInParent()


def naming_prompt(error: ApiError, position: int) -> ApiError:
    """A refusal of one prompt of a list, its message naming the prompt by its place."""
    if error.param == "prompt" and error.message.startswith("prompt"):
        error.message = f"prompt[{position}]{error.message[len('prompt') :]}"
    return error


def max_new_tokens(max_tokens: Optional[int], echo: bool) -> Optional[int]:
    """The request's max_new_tokens: the body's max_tokens, 1 for echo's prompt alone (0)."""
    return 1 if echo and max_tokens == 0 else max_tokens


class Echo:
    """What `echo` does to the outputs of an answer over `requests` (one per prompt, n samples
    each; an output's index is its choice's): each choice's first output is led by its prompt's
    text and, where logprobs are asked for, by the prompt's logprobs."""

    def __init__(
        self,
        prompts: list[Prompt],
        requests: list[Request],
        tokenizer: Tokenizer,
        only_prompt: bool,
    ):
        self._texts = [
            p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False)
            for p in prompts
        ]
        self._first_ids = [r.prompt_token_ids[0] for r in requests]
        self._n = requests[0].n
        self._only_prompt = only_prompt
        # Per prompt, the logprobs of its tokens after the first: sample 0's first output
        # carries them, and samples 1 .. n-1 fork only after it (core/forks.py).
        self._prompt_logprobs: dict[int, list[TokenLogprob]] = {}
        self._started: set[int] = set()

    def output(self, output: RequestOutput) -> RequestOutput:
        """The output as its choice shows it: the first led by the prompt; with the prompt
        alone (max_tokens 0), the drawn token left out and the reason `length` (an error, an
        abort or a deadline keeps its own)."""
        position = output.index // self._n
        if output.prompt_logprobs is not None:
            self._prompt_logprobs[position] = output.prompt_logprobs
        text, token_ids, logprobs = output.text, output.token_ids, output.logprobs
        finish_reason, usage = output.finish_reason, output.usage
        if self._only_prompt:
            text, token_ids, logprobs = "", [], [] if logprobs is not None else None
            if finish_reason in (FinishReason.EOS, FinishReason.STOP):  # (the dropped token's)
                finish_reason = FinishReason.LENGTH
            if usage is not None:
                usage = dataclasses.replace(usage, completion_tokens=0)
        if output.index not in self._started:
            self._started.add(output.index)
            text = self._texts[position] + text
            if logprobs is not None:
                lead = Unscored(self._first_ids[position], math.nan)
                logprobs = [lead, *self._prompt_logprobs.get(position, ()), *logprobs]
        return dataclasses.replace(
            output,
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=finish_reason,
            usage=usage,
        )
