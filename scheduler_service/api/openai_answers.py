"""The OpenAI doors' answers: one admitted body's outputs as OpenAI's JSON, whole or as
server-sent events.

An answer reads one request, or a completion's one per prompt (api/completion_prompts.py), whose
outputs it renumbers to their choices: prompt p's n samples are choices p*n .. p*n+n-1. `echo`
(completion_prompts.Echo) leads each choice with its prompt. The common streamed chunk is
written where its output arrives (api/sse_direct.py) when the answer reads one request as it
comes; the others are made by the answer's task.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any, AsyncGenerator, AsyncIterator, Mapping, Optional, cast

from scheduler_service.api.admission import Serving
from scheduler_service.api.chat_outputs import ChatOutput
from scheduler_service.api.completion_prompts import Echo
from scheduler_service.api.openai_logprobs import (
    CompletionLogprobs,
    chat_logprobs,
    prompt_logprobs_json,
)
from scheduler_service.api.openai_requests import _Common
from scheduler_service.api.openai_usage import Totals
from scheduler_service.api.sse_chunks import DONE, SseChunks
from scheduler_service.api.sse_direct import DirectSse, writer_of
from scheduler_service.api.streams import (
    Collected,
    LastEvents,
    Sample,
    finish_reason_name,
    outputs_of,
    outputs_of_each,
)
from scheduler_service.core.request import Request, RequestOutput


class Answer:
    """One admitted body's answer, whole (collect) or as server-sent events (events), over its
    requests: one, or a completion's one per prompt (`response_id` then names the answer)."""

    def __init__(
        self,
        serving: Serving,
        requests: list[Request],
        body: _Common,
        chat: bool,
        response_id: Optional[str] = None,
        echo: Optional[Echo] = None,
    ):
        self.serving, self.requests, self.body, self.chat = serving, requests, body, chat
        self.req = requests[0]  # every request of a body asks for the same (n, logprobs, model)
        self.num_choices = self.req.n * len(requests)
        self.id = ("chatcmpl-" if chat else "cmpl-") + (response_id or self.req.request_id)
        self.created = int(time.time())
        self.totals = Totals(requests)
        self.echo = echo
        # Chat with tools or a reasoning parser: each sample split (chat_outputs.py).
        self.chat_outputs: Optional[list[ChatOutput]] = None

    def _outputs(self) -> AsyncGenerator[RequestOutput, None]:
        """The requests' outputs, each index its choice's (a request read as it comes: its
        own outputs, untouched)."""
        if len(self.requests) == 1 and self.echo is None:
            return outputs_of(self.serving.frontend, self.req)
        return self._choices_outputs()

    async def _choices_outputs(self) -> AsyncGenerator[RequestOutput, None]:
        n = self.req.n
        each = outputs_of_each(self.serving.frontend, self.requests)
        async with contextlib.aclosing(each) as stream:
            async for position, output in stream:
                if position:
                    output = dataclasses.replace(output, index=position * n + output.index)
                yield output if self.echo is None else self.echo.output(output)

    def logprobs_of(self, entries, completion: Optional[CompletionLogprobs] = None):
        if self.req.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(self.serving.tokenizer, entries or [])
        return (completion or CompletionLogprobs(self.serving.tokenizer)).add(entries)

    async def collect(self) -> dict:
        collected = Collected(self.num_choices)
        async with contextlib.aclosing(self._outputs()) as stream:
            async for output in stream:
                collected.add(output)
                if output.finish_reason is not None:
                    self.totals.add(output)
        choices = [self._choice(index, sample) for index, sample in enumerate(collected.samples)]
        answer: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.req.lora_name or self.serving.facts.model_name,
            "choices": choices,
            "usage": self.totals.as_dict(),
        }
        if self.body.prompt_logprobs is not None:  # vLLM's: per choice, or the chat's one prompt
            n, samples, tokenizer = self.req.n, collected.samples, self.serving.tokenizer
            entries = [samples[p * n].prompt_logprobs for p in range(len(self.requests))]
            shapes = [  # by prompt, from its sample 0 (None: it ended before any output)
                None if e is None else prompt_logprobs_json(e, tokenizer) for e in entries
            ]
            if self.chat:
                answer["prompt_logprobs"] = shapes[0]
            else:
                for choice in choices:
                    choice["prompt_logprobs"] = shapes[choice["index"] // n]
        return answer

    def _choice(self, index: int, sample: Sample) -> dict[str, Any]:
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
        return choice

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
        one_as_it_comes = len(self.requests) == 1 and self.echo is None
        if writer is not None and self.chat_outputs is None and one_as_it_comes:
            direct = DirectSse(chunks.running).take_over(cast(asyncio.Queue, req.outputs))
            direct.attach(writer)
            req.outputs = direct
        async with contextlib.aclosing(self._outputs()) as stream:
            if chat:  # the role first, once per choice
                for index in range(req.n):
                    delta = {"role": "assistant", "content": ""}
                    role = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
                    yield sse.chunk([role])
            # The last sample's final chunks go out with [DONE].
            samples_left, last = self.num_choices, []
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

    def __init__(self, response: Answer, sse: SseChunks):
        self.response, self.sse, req = response, sse, response.req
        # Most chunks: text (or a chat delta) alone, made from a template (api/sse_chunks.py).
        self.plain = req.logprobs is None and not response.body.return_token_ids
        self.logprobs = [
            CompletionLogprobs(response.serving.tokenizer) for _ in range(response.num_choices)
        ]

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
