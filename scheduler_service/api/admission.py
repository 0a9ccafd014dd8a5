"""One admission path for every door: gRPC Generate and Session, and the OpenAI HTTP API.

A public request (a `GenerateRequest`, whatever door it came through) is checked once, here:
draining, every field's bound (intake.py), a duplicate id, room in the waiting queue, and its
grammar compiled off the event loop. What is refused raises `Rejected`, which carries the
status, and for a bad field the field's path in the public request and the bound it broke as
separate values, so that each door words the refusal its own way (the HTTP API names OpenAI's
parameter) without reading it back out of a message. Tokenize and Detokenize are checked here
too, as Generate would check the same prompt.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Optional

import grpc

from planserve.v1 import generate_pb2
from scheduler_service.api import intake, overload
from scheduler_service.config import SchedulerConfig
from scheduler_service.core.lora_registry import LoraError
from scheduler_service.core.request import Request
from scheduler_service.engine.client import EngineFacts
from scheduler_service.engine.frontend import EngineFrontend
from scheduler_service.engine.lora_admin import LoraAdmin
from scheduler_service.text import reasoning, structured
from scheduler_service.text.guides import Grammar
from scheduler_service.text.tokenizer import Tokenizer

# Enough of a prompt's end to hold a think block its template closed (Qwen3's empty one).
_PROMPT_TAIL_TOKENS = 32


def _compiled(
    grammars: structured.GrammarCompiler, spec: structured.StructuredSpec, opens: bytes
) -> Grammar:
    """The grammar, with its opening marker's masks built (once per marker, over the whole
    vocabulary): both off the event loop."""
    grammar = grammars.compile(spec)
    if opens:
        grammar.openings.rows(opens)
    return grammar


def compile_grammar(
    grammars: structured.GrammarCompiler, spec: structured.StructuredSpec, opens: bytes
) -> asyncio.Future:
    """A future of the request's grammar compiled off the event loop (cached by the compiler):
    admission waits for it within its bound; the engine core (scheduler_service/frontends)
    makes a frontend's request's guide again from it, with the markers the frontend sent."""
    compiling = asyncio.get_running_loop().run_in_executor(None, _compiled, grammars, spec, opens)
    # Whoever waited, the outcome is read, so that a late failure is not reported unread.
    compiling.add_done_callback(lambda done: done.cancelled() or done.exception())
    return compiling


class Rejected(Exception):
    """A request that is not accepted, with the status it gets. A bad field (INVALID_ARGUMENT)
    also carries `field`, its path in the public request ("sampling.top_p",
    "stopping.stop[2]"), and `detail`, the bound it broke ("must be in (0, 1], got 2.0"):
    `message` is "field: detail", the wording every gRPC client sees."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        retry_after_ms: Optional[int] = None,
        field: Optional[str] = None,
        detail: Optional[str] = None,
    ):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms  # sent as trailing metadata retry-after-ms
        self.field = field
        self.detail = detail

    def __reduce__(self):
        """Pickled whole: the engine core sends a frontend process the refusal of an add."""
        return Rejected, (self.code, self.message, self.retry_after_ms, self.field, self.detail)

    @classmethod
    def invalid(cls, field: str, detail: str) -> "Rejected":
        return cls(
            grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {detail}", field=field, detail=detail
        )

    @property
    def trailing_metadata(self) -> tuple:
        if self.retry_after_ms is None:
            return ()
        return overload.retry_trailing_metadata(self.code, self.message, self.retry_after_ms)


@dataclasses.dataclass(frozen=True)
class Serving:
    """What the doors need once the model service has described itself."""

    facts: EngineFacts
    tokenizer: Tokenizer
    frontend: EngineFrontend
    # Structured output's grammars over the served vocabulary (compiled on demand, cached).
    grammars: Optional[structured.GrammarCompiler] = None

    @classmethod
    def of(
        cls, facts: EngineFacts, tokenizer: Tokenizer, frontend: EngineFrontend, grammar_engine: str
    ) -> "Serving":
        """The doors' state over a described model, with grammars over its vocabulary compiled
        by `grammar_engine` (the scheduler process's doors and a frontend process's alike)."""
        return cls(
            facts=facts,
            tokenizer=tokenizer,
            frontend=frontend,
            grammars=structured.GrammarCompiler(
                facts.tokenizer_json, facts.eos_token_ids, facts.vocab_size, engine=grammar_engine
            ),
        )


class Admission:
    """Checks and prepares requests for every door; the server sets `serving` once the engine
    answered Describe, and `draining` on SIGTERM."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.serving: Optional[Serving] = None
        self.loras = LoraAdmin(config)  # the LoRA adapters served (engine/lora_admin.py)
        self.draining = False  # SIGTERM: new requests get UNAVAILABLE, running ones finish

    def _ready(self) -> Serving:
        """The serving state; the doors answer UNAVAILABLE before it is set, never come here."""
        if self.serving is None:
            raise RuntimeError("admission before the model service answered Describe")
        return self.serving

    def count_rejection(self, reason: str) -> None:
        metrics = self.serving.frontend.metrics if self.serving is not None else None
        if metrics is not None:
            metrics.on_rejected(reason)

    async def admit(self, pb: generate_pb2.GenerateRequest, reasoning_parser: str = "") -> Request:
        """A checked request, its grammar compiled, ready to be added to the frontend.
        `reasoning_parser`: the door's, when it splits this request's output (a chat): its
        grammar then applies after the thinking."""
        request = self.check(pb)
        await self._compile_grammar(request, reasoning_parser)
        return request

    def check(self, pb: generate_pb2.GenerateRequest) -> Request:
        """Validates a request against every bound and the queue's room; `Rejected` says which
        status it gets instead."""
        serving = self._ready()
        if self.draining:
            self.count_rejection("draining")
            raise Rejected(
                grpc.StatusCode.UNAVAILABLE,
                "the server is draining (shutting down): send the request elsewhere",
            )
        scheduler = serving.frontend.scheduler
        try:
            request = intake.to_request(
                pb, serving.facts, serving.tokenizer, scheduler.kv.capacity_tokens
            )
        except intake.InvalidRequest as error:
            raise Rejected.invalid(error.field, error.detail) from None
        if pb.lora_name:
            self._select_adapter(request, pb.lora_name, serving)
        # A frontend process's engine (frontends/remote.py) knows its own requests but only a
        # snapshot of the queue: the engine core checks the room on each add instead.
        self.check_room(request, queue=not getattr(serving.frontend, "checks_room_on_add", False))
        metrics = serving.frontend.metrics
        if request.lora_name and metrics is not None and hasattr(metrics, "on_lora_request"):
            metrics.on_lora_request(request.lora_name)
        return request

    def check_room(self, request: Request, queue: bool = True) -> None:
        """The checks against the engine's live state: an id already in flight (ALREADY_EXISTS)
        and, with `queue`, room in the waiting queue. check() runs them; behind frontend
        processes the engine core runs them again on each add (frontends/hub.py), its queue
        being the one the bounds are about, and the frontend's door gets the same Rejected."""
        scheduler = self._ready().frontend.scheduler
        if scheduler.find(request.request_id) is not None:
            raise Rejected(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id: {request.request_id!r} is already in flight",
                field="request_id",
            )
        if queue and scheduler.num_waiting:
            self._check_queue_room(request.num_tokens_to_compute)

    def _select_adapter(self, request: Request, name: str, serving: Serving) -> None:
        """The request's LoRA adapter by name (the base model's name or "": none); NOT_FOUND
        for a name not served."""
        try:
            adapter = self.loras.registry.resolve(name, serving.facts.model_name)
        except LoraError as error:
            raise Rejected(grpc.StatusCode.NOT_FOUND, error.message, field="lora_name") from None
        if adapter is not None:
            request.lora_name, request.lora_id = adapter.name, adapter.lora_id

    def render(self, pb: generate_pb2.GenerateRequest) -> Request:
        """The request Generate would make of `pb` (the same intake: prompt ids with the chat
        template, every bound), neither queued nor counted: the render endpoints' answer."""
        serving = self._ready()
        try:
            return intake.to_request(
                pb, serving.facts, serving.tokenizer, serving.frontend.scheduler.kv.capacity_tokens
            )
        except intake.InvalidRequest as error:
            raise Rejected.invalid(error.field, error.detail) from None

    def check_room_for_all(self, requests: list[Request]) -> None:
        """Room in the waiting queue for several requests queued at once (a completion's
        prompts), by requests and by tokens, as check() finds it for one; behind frontend
        processes the engine core checks each add instead."""
        frontend = self._ready().frontend
        if getattr(frontend, "checks_room_on_add", False) or not frontend.scheduler.num_waiting:
            return
        num_tokens = sum(request.num_tokens_to_compute for request in requests)
        self._check_queue_room(num_tokens, len(requests))

    def _check_queue_room(self, num_tokens: int, num_requests: int = 1) -> None:
        """RESOURCE_EXHAUSTED with a retry hint when the waiting queue is full, by requests or by
        tokens, for `num_requests` more of `num_tokens` prompt tokens in all (callers let one
        arriving at an empty queue in)."""
        frontend, config = self._ready().frontend, self.config
        scheduler = frontend.scheduler
        waiting_tokens = scheduler.num_waiting_tokens
        arriving = "" if num_requests == 1 else f" + {num_requests} arriving"
        if scheduler.num_waiting + num_requests > config.max_queue_len:
            why = (
                f"queue full: {scheduler.num_waiting} requests waiting{arriving} "
                f"(max_queue_len {config.max_queue_len})"
            )
        elif waiting_tokens + num_tokens > config.max_queue_tokens:
            why = (
                f"queue full: {waiting_tokens} prompt tokens waiting + "
                f"{num_tokens} exceed max_queue_tokens "
                f"{config.max_queue_tokens}"
            )
        else:
            return
        retry_after_ms = overload.retry_after_ms(waiting_tokens, frontend.tokens_per_s)
        self.count_rejection("queue_full")
        raise Rejected(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{why}; retry after {retry_after_ms} ms",
            retry_after_ms,
        )

    async def _compile_grammar(self, request: Request, reasoning_parser: str) -> None:
        """Structured output: compiles the request's grammar off the event loop (outlines-core
        releases the GIL; repeats hit the cache) and gives the request its guide, before it is
        queued. Rejected (INVALID_ARGUMENT naming the field) when it does not compile, or not
        within max_grammar_compile_s (the compile goes on and is cached)."""
        spec = request.structured
        if spec is None:
            return
        grammars = self._ready().grammars
        assert grammars is not None  # set with the serving state
        after, opens = self._think_markers(request, reasoning_parser)
        compiling = compile_grammar(grammars, spec, opens)
        bound = self.config.max_grammar_compile_s
        try:
            grammar = await asyncio.wait_for(asyncio.shield(compiling), bound)
        except structured.StructuredOutputError as error:
            raise Rejected.invalid(error.field, error.message) from None
        except asyncio.TimeoutError:
            field = f"structured_output.{spec.kind}"
            raise Rejected.invalid(
                field,
                f"took over {bound:g} s to compile (max_grammar_compile_s); it is still "
                "compiling and is kept when done, so the same grammar may be sent again",
            ) from None
        request.guide = grammar.new_guide(after, opens)

    def _think_markers(self, request: Request, reasoning_parser: str) -> tuple[bytes, bytes]:
        """(after, opens) for the request's guide: the prompt's tail says whether the output may
        think first (reasoning.grammar_after)."""
        if not reasoning_parser:
            return b"", b""
        ids = request.prompt_token_ids[-_PROMPT_TAIL_TOKENS:]
        tail = self._ready().tokenizer.decode(ids, skip_special_tokens=False)
        return reasoning.grammar_after(reasoning_parser, tail)

    def tokenize(self, pb: generate_pb2.TokenizeRequest) -> generate_pb2.TokenizeResponse:
        """Text or chat turns to ids, exactly as Generate would turn them into its prompt
        (chat turns checked the same way); Rejected names the field."""
        serving = self._ready()
        if pb.WhichOneof("input") == "messages":
            as_prompt = generate_pb2.GenerateRequest(messages=pb.messages)
            try:
                ids = intake.prompt_token_ids(as_prompt, serving.facts, serving.tokenizer)
            except intake.InvalidRequest as error:
                raise Rejected.invalid(error.field, error.detail) from None
        elif pb.WhichOneof("input") == "text":
            ids = serving.tokenizer.encode(pb.text, add_special_tokens=pb.add_special_tokens)
        else:
            raise Rejected.invalid("input", "one of text or messages must be set")
        return generate_pb2.TokenizeResponse(
            token_ids=ids, max_model_len=serving.facts.max_model_len
        )

    def detokenize(self, pb: generate_pb2.DetokenizeRequest) -> generate_pb2.DetokenizeResponse:
        serving = self._ready()
        facts = serving.facts
        if len(pb.token_ids) > facts.max_model_len:
            raise Rejected.invalid(
                "token_ids",
                f"at most {facts.max_model_len} ids (the model's max length), got "
                f"{len(pb.token_ids)}",
            )
        for index, token_id in enumerate(pb.token_ids):
            if token_id >= facts.vocab_size:
                raise Rejected.invalid(
                    f"token_ids[{index}]",
                    f"{token_id} is outside the vocabulary [0, {facts.vocab_size})",
                )
        text = serving.tokenizer.decode(pb.token_ids, skip_special_tokens=pb.skip_special_tokens)
        return generate_pb2.DetokenizeResponse(text=text)
