"""Stops and client-facing outputs: everything decided per generated token.

Stops are decided here, in the scheduler, never on the model side: eos (unless ignore_eos),
stop token ids, stop strings (on incrementally detokenized text), max_new_tokens and the
model's length. `to_pb` is the only place a public-API response chunk is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Collection, Optional

from cython_ext.step_outputs import take_plain_tokens
from planserve.v1 import common_pb2, generate_pb2
from scheduler_service.core.request import FinishReason, Request, RequestOutput, TokenLogprob
from scheduler_service.text.detokenizer import NO_TEXT, IncrementalDetokenizer, NoText
from scheduler_service.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from scheduler_service.text.guides import GuideState


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: frozenset[int], max_model_len: int):
        self._tokenizer = tokenizer
        self._eos_token_ids = eos_token_ids
        self._max_model_len = max_model_len
        self._detokenizers: dict[str, IncrementalDetokenizer | NoText] = {}
        # stream_interval: outputs held back until enough tokens are ready, by request id (their
        # text not taken yet).
        self._held: dict[str, RequestOutput] = {}

    def start(self, request: Request) -> None:
        self._detokenizers[request.request_id] = (
            IncrementalDetokenizer(
                self._tokenizer, request.prompt_token_ids, request.stopping.stop_strings
            )
            if request.detokenize
            else NO_TEXT
        )

    def take_tokens(
        self, request: Request, token_ids: list[int], logprobs: Optional[list[TokenLogprob]] = None
    ) -> tuple[list[int], Optional[RequestOutput]]:
        """Appends sampled tokens to the request (up to a stop) and says what the client gets:
        the tokens accepted, and the output to send now, or None while fewer than the request's
        stream_interval tokens are ready (the last output is never held).

        Sets request.finish_reason when a stop condition holds; tokens after the stop are
        dropped (they can only appear when a step returns several tokens). A held output grows
        in place and its text is taken once, when it is sent.
        """
        first = not request.output_token_ids
        accepted, stop_match = self._accept(request, token_ids)
        output = self._held.pop(request.request_id, None)
        if output is None:
            output = RequestOutput(token_ids=list(accepted), text="", index=request.index)
            if first and request.prompt_logprobs is not None and request.index == 0:
                output.prompt_logprobs = request.prompt_logprobs_out
        else:
            output.token_ids += accepted
        if logprobs is not None:
            entries = logprobs[: len(accepted)]
            output.logprobs = entries if output.logprobs is None else output.logprobs + entries
        final = request.finish_reason is not None
        if not final and len(output.token_ids) < request.stream_interval:
            self._held[request.request_id] = output
            return accepted, None
        output.text = self._detokenizers[request.request_id].take_text(final=final)
        output.finish_reason = request.finish_reason
        output.stop_match = stop_match
        output.usage = request.usage() if final else None
        return accepted, output

    def take_step(
        self,
        requests: list[Request],
        sampled: list[int],
        counts: list[int],
        live: Collection[int],
        placeholders: dict[int, Optional[int]],
        core: Any,
        now: float,
        slow: Callable[[int, int, int], Optional[RequestOutput]],
    ) -> list[tuple[Request, RequestOutput]]:
        """A committed step's tokens (overlap's reconcile): each plain entry (one token that
        stops nothing, no logprobs, grammar, stop strings or samples to fork) as take_tokens
        would take it, in C (cython_ext/step_outputs.pyx); every other entry by
        `slow(index, offset, count)`, which returns its output (None: none now). Outputs in
        entry order."""
        outputs: list[tuple[Request, RequestOutput]] = []
        take_plain_tokens(
            requests,
            sampled,
            counts,
            live,
            placeholders,
            core,
            self._held,
            self._detokenizers,
            NO_TEXT,
            RequestOutput,
            self._max_model_len,
            self._eos_token_ids,
            now,
            slow,
            outputs,
        )
        return outputs

    def _accept(
        self, request: Request, token_ids: list[int]
    ) -> tuple[list[int], Optional[str | int]]:
        """The tokens appended before a stop (all of them when none holds), and what matched."""
        detokenizer = self._detokenizers[request.request_id]
        accepted: list[int] = []
        stop_match: Optional[str | int] = None
        for token_id in token_ids:
            request.output_token_ids.append(token_id)
            accepted.append(token_id)
            stop_string = detokenizer.add_token(token_id)
            reason, stop_match = self._check_stop(request, token_id, stop_string)
            if reason is None and request.guide is not None:
                reason = self._check_grammar(request.guide, token_id)
            if reason is not None:
                request.finish_reason = reason
                break
        return accepted, stop_match

    def _check_stop(self, request: Request, token_id: int, stop_string: Optional[str]):
        stopping = request.stopping
        if stop_string is not None:
            return FinishReason.STOP, stop_string
        if token_id in stopping.stop_token_ids:
            return FinishReason.STOP, token_id
        if not stopping.ignore_eos and token_id in self._eos_token_ids:
            return FinishReason.EOS, None
        if (
            len(request.output_token_ids) >= stopping.max_new_tokens
            or request.num_tokens >= self._max_model_len
        ):
            return FinishReason.LENGTH, None
        return None, None

    def _check_grammar(self, guide: GuideState, token_id: int) -> Optional[FinishReason]:
        """Structured output: advances the request's guide by the token. An end-of-sequence
        token (allowed only once the grammar is complete) ends it even with ignore_eos; a token
        outside the grammar (the model service did not apply the mask) ends it with ERROR."""
        if token_id in self._eos_token_ids:
            return FinishReason.EOS
        if not guide.accept(token_id):
            return FinishReason.ERROR
        return None

    def finish(self, request: Request, reason: FinishReason) -> RequestOutput:
        """The last output of a request that ends for a reason outside its tokens (abort...)."""
        request.finish_reason = reason
        detokenizer = self._detokenizers.get(request.request_id)
        text = detokenizer.take_text(final=True) if detokenizer else ""
        output = RequestOutput(
            token_ids=[],
            text=text,
            finish_reason=reason,
            usage=request.usage(),
            index=request.index,
        )
        held = self._held.pop(request.request_id, None)
        return output if held is None else merge(held, output)

    def release(self, request: Request) -> None:
        self._detokenizers.pop(request.request_id, None)
        self._held.pop(request.request_id, None)


def merge(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request (one sample) as one: lists and text concatenated,
    the rest (finish reason, stop match, usage) from the later one where it has them. Field by
    field, written out: a reader that fell behind merges every output it missed, so this runs
    per token at worst (tests/scheduler/test_stream_merge.py checks that it covers every field)."""
    return RequestOutput(
        token_ids=first.token_ids + then.token_ids,
        text=first.text + then.text,
        finish_reason=_later(first.finish_reason, then.finish_reason),
        stop_match=_later(first.stop_match, then.stop_match),
        usage=_later(first.usage, then.usage),
        index=then.index,
        logprobs=_joined(first.logprobs, then.logprobs),
        prompt_logprobs=_joined(first.prompt_logprobs, then.prompt_logprobs),
    )


def _later(first, then):
    return first if then is None else then


def _joined(first: Optional[list], then: Optional[list]) -> Optional[list]:
    if first is None or then is None:
        return then if first is None else first
    return first + then


def to_pb(request: Request, output: RequestOutput) -> generate_pb2.GenerateResponse:
    chunk = generate_pb2.GenerateResponse(
        request_id=request.public_id,
        token_ids=output.token_ids,
        text=output.text,
        index=output.index,
    )
    if output.logprobs:
        chunk.logprobs.extend(_logprobs_to_pb(output.logprobs))
    if output.prompt_logprobs:
        chunk.prompt_logprobs.extend(_logprobs_to_pb(output.prompt_logprobs))
    if output.finish_reason is not None:
        chunk.finish_reason = int(output.finish_reason)
        usage = output.usage or request.usage()
        chunk.usage.CopyFrom(
            generate_pb2.Usage(
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                cached_tokens=usage.cached_tokens,
                queue_time_us=usage.queue_time_us,
                time_to_first_token_us=usage.time_to_first_token_us,
            )
        )
        if isinstance(output.stop_match, str):
            chunk.stop_string = output.stop_match
        elif isinstance(output.stop_match, int):
            chunk.stop_token_id = output.stop_match
    return chunk


def _logprobs_to_pb(entries: list[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    return [
        common_pb2.TokenLogprob(
            token_id=e.token_id,
            logprob=e.logprob,
            top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in e.top],
        )
        for e in entries
    ]
