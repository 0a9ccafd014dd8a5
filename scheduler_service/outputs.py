"""Stops and client-facing outputs: everything decided per generated token.

Stops are decided here, in the scheduler, never on the model side: eos (unless ignore_eos),
stop token ids, stop strings (on incrementally detokenized text), max_new_tokens and the
model's length. `to_pb` is the only place a public-API response chunk is built.
"""
from __future__ import annotations

from typing import Optional

from planserve.v1 import generate_pb2
from scheduler_service.detokenizer import IncrementalDetokenizer
from scheduler_service.request import FinishReason, Request, RequestOutput
from scheduler_service.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: frozenset[int], max_model_len: int):
        self._tokenizer = tokenizer
        self._eos_token_ids = eos_token_ids
        self._max_model_len = max_model_len
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def start(self, request: Request) -> None:
        self._detokenizers[request.request_id] = IncrementalDetokenizer(
            self._tokenizer, request.prompt_token_ids, request.stopping.stop_strings)

    def add_tokens(self, request: Request, token_ids: list[int]) -> RequestOutput:
        """Appends sampled tokens to the request (up to a stop) and says what the client gets.

        Sets request.finish_reason when a stop condition holds; tokens after the stop are
        dropped (they can only appear when a step returns several tokens).
        """
        detokenizer = self._detokenizers[request.request_id]
        accepted: list[int] = []
        stop_match: Optional[str | int] = None
        for token_id in token_ids:
            request.output_token_ids.append(token_id)
            accepted.append(token_id)
            stop_string = detokenizer.add_token(token_id)
            reason, stop_match = self._check_stop(request, token_id, stop_string)
            if reason is not None:
                request.finish_reason = reason
                break
        final = request.finish_reason is not None
        return RequestOutput(token_ids=accepted, text=detokenizer.take_text(final=final),
                             finish_reason=request.finish_reason, stop_match=stop_match,
                             usage=request.usage() if final else None, index=request.index)

    def _check_stop(self, request: Request, token_id: int, stop_string: Optional[str]):
        stopping = request.stopping
        if stop_string is not None:
            return FinishReason.STOP, stop_string
        if token_id in stopping.stop_token_ids:
            return FinishReason.STOP, token_id
        if not stopping.ignore_eos and token_id in self._eos_token_ids:
            return FinishReason.EOS, None
        if (len(request.output_token_ids) >= stopping.max_new_tokens
                or request.num_tokens >= self._max_model_len):
            return FinishReason.LENGTH, None
        return None, None

    def finish(self, request: Request, reason: FinishReason) -> RequestOutput:
        """The last output of a request that ends for a reason outside its tokens (abort...)."""
        request.finish_reason = reason
        detokenizer = self._detokenizers.get(request.request_id)
        text = detokenizer.take_text(final=True) if detokenizer else ""
        return RequestOutput(token_ids=[], text=text, finish_reason=reason,
                             usage=request.usage(), index=request.index)

    def release(self, request: Request) -> None:
        self._detokenizers.pop(request.request_id, None)


def to_pb(request: Request, output: RequestOutput) -> generate_pb2.GenerateResponse:
    chunk = generate_pb2.GenerateResponse(
        request_id=request.public_id, token_ids=output.token_ids, text=output.text,
        index=output.index)
    if output.finish_reason is not None:
        chunk.finish_reason = int(output.finish_reason)
        usage = output.usage or request.usage()
        chunk.usage.CopyFrom(generate_pb2.Usage(
            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens, queue_time_us=usage.queue_time_us,
            time_to_first_token_us=usage.time_to_first_token_us))
        if isinstance(output.stop_match, str):
            chunk.stop_string = output.stop_match
        elif isinstance(output.stop_match, int):
            chunk.stop_token_id = output.stop_match
    return chunk
