"""A request as the scheduler sees it: plain dataclasses, no protobuf.

A sequence has no prefill or decode phase. It has `all_token_ids` (prompt, then generated tokens)
and `num_computed_tokens` (how many of them have their KV in the cache, on the model side);
each step schedules some of the difference. The model service samples a token whenever the
computed count reaches the known tokens, so a decode is simply "one token left to compute".

While a request holds a slot, its computed count and block table have one owner: the StepCore
(cython_ext/step_core.pyx), read through the slot's view the core binds to `slot_view`. Out of a
slot the request keeps its count itself (the one a resume starts from) and holds no block.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from typing import Any, Optional, Protocol


class FinishReason(enum.IntEnum):
    """Mirrors planserve.v1.FinishReason (same numbers), kept free of protobuf."""

    EOS = 1
    LENGTH = 2
    STOP = 3
    CANCELLED = 4
    DEADLINE = 5
    ERROR = 6


class OutputSink(Protocol):
    """Where a request's outputs go: its own queue (the default; a door reads it with `get`),
    a bounded StreamBuffer (api/overload.py), or a Session's shared queue (tagged)."""

    def put_nowait(self, output: "RequestOutput") -> None: ...


class SlotFacts(Protocol):
    """What a request reads of the slot it holds: a cython_ext.step_core.SlotView, bound by
    StepCore.admit/fork and unbound by release (the tests' pure-Python oracle binds its own)."""

    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def block_ids(self) -> list[int]: ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Sampling parameters with defaults filled in (the seed is always set)."""

    temperature: float
    top_k: int  # 0 = off
    top_p: float
    seed: int
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id


@dataclasses.dataclass(frozen=True)
class Stopping:
    """Stop conditions with defaults filled in."""

    max_new_tokens: int  # already lowered to what the model's length leaves
    stop_strings: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    min_new_tokens: int = 0  # eos and stop ids are masked until this many are generated


@dataclasses.dataclass
class RequestOutput:
    """What one step (or the end) produced for one request; the server turns it into a chunk."""

    token_ids: list[int]
    text: str
    finish_reason: Optional[FinishReason] = None
    stop_match: Optional[str | int] = None
    usage: Optional["Usage"] = None
    index: int = 0  # which of the request's n parallel samples
    # With Request.logprobs set: one entry per token of token_ids.
    logprobs: Optional[list["TokenLogprob"]] = None
    # With Request.prompt_logprobs set, on the first output only: one per prompt token after the
    # first.
    prompt_logprobs: Optional[list["TokenLogprob"]] = None


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and the top alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_time_us: int
    time_to_first_token_us: int


def _output_queue() -> asyncio.Queue[RequestOutput]:
    """A request's own outputs queue: its default sink, read by a door with `get`."""
    return asyncio.Queue()


@dataclasses.dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    stopping: Stopping
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    priority: int = 0  # higher is more urgent
    deadline: Optional[float] = None  # absolute, on the time.monotonic() clock
    # When the first token is wanted (arrival + ttft_target_ms; time.monotonic() clock): orders
    # the waiting queue among requests the policy ranks equal (policies/_heap.waiting_order),
    # never ends the request.
    first_token_due: Optional[float] = None
    tenant: str = ""
    cache_salt: str = ""
    # The LoRA adapter it runs with ("" and 0: the base model); lora_id is the id the scheduler
    # gave the name (core/lora_registry.py), what NewSequence.lora_id carries.
    lora_name: str = ""
    lora_id: int = 0
    # Steps this request was skipped for its adapter while waiting (core/lora_admission.py).
    lora_skips: int = 0
    # The last step it sat out while running, its adapter out of turn (core/lora_parking.py).
    lora_parked_step: int = -1
    # Times this request was preempted; a preempted request goes ahead of fresh ones.
    num_preemptions: int = 0
    # Model-service failures it was running through (each one recomputes it from the start).
    num_engine_failures: int = 0
    # Parallel samples: sample 0 is this request; once its prompt is computed, samples
    # 1 .. n-1 fork from it (`fork_sample`), sharing its prompt blocks.
    n: int = 1
    index: int = 0
    group_id: str = ""  # the public request id of every sample ("" for sample 0: request_id)
    forked: bool = False  # samples 1 .. n-1 exist
    # Logprobs: None = off; k = the sampled token's logprob and k alternatives per token.
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    # Prompt logprob entries received so far (positions 1 .. len), kept across a recompute;
    # handed to the client once complete.
    prompt_logprobs_out: list[TokenLogprob] = dataclasses.field(default_factory=list)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_cached_tokens: int = 0
    slot: Optional[int] = None
    # The StepCore's view of `slot` while the request holds it (None out of a slot).
    slot_view: Optional[SlotFacts] = dataclasses.field(default=None, init=False, repr=False)
    # Out of a slot: the count a resume starts from (0, or what a swap-out kept), or the one the
    # core left at release.
    _num_computed_tokens: int = dataclasses.field(default=0, init=False, repr=False)
    finish_reason: Optional[FinishReason] = None

    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None

    # Where this request's outputs go (the engine loop puts them; a door may set its own sink).
    outputs: OutputSink = dataclasses.field(default_factory=_output_queue, repr=False)
    # Tokens per chunk the client gets (GenerateRequest.stream_interval); 1 = every step.
    stream_interval: int = 1
    # False: the text of its outputs is made where they go (a frontend process,
    # scheduler_service/frontends/text.py); this process sends token ids and leaves text empty.
    detokenize: bool = True
    # Structured output: the grammar (a structured.StructuredSpec, set by intake) and this
    # sequence's walk through it (a guides.GuideState, set once compiled, before admission).
    structured: Optional[Any] = dataclasses.field(default=None, repr=False)
    guide: Optional[Any] = dataclasses.field(default=None, repr=False)

    # In transit from a frontend process only: the guide's reasoning markers, from which the
    # engine core makes the guide again (frontends/hub.py takes them).
    guide_markers: Optional[tuple] = dataclasses.field(default=None, init=False, repr=False)
    # The step's plain path keeps here what it checks each token against (cython_ext/
    # step_outputs.pyx, _plain_facts): the logprobs, guide, stopping, prompt, index, chunk size
    # and id, all set before the request is first scheduled and never changed after (a parallel
    # sample is a new Request; a recompute keeps the prompt as it is).
    plain_facts: Optional[tuple] = dataclasses.field(default=None, init=False, repr=False)

    # Slots, not an instance dict: the engine core reads a dozen of these per sequence per step,
    # and a dict of this many names is a table of its own in every request (shared-key dicts
    # stop at 30 names), missed in the cache at each read.

    def __getstate__(self) -> dict:
        """What a frontend process sends the engine core (scheduler_service/frontends): the
        request without its outputs sink, guide and slot view (this process's objects); the
        guide's reasoning markers travel instead, and the core makes the guide again from
        `structured` (admission.compile_grammar)."""
        state = {name: getattr(self, name) for name in _SENT_FIELDS}
        state["guide_markers"] = self.guide.markers if self.guide is not None else None
        return state

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self.guide = None
        self.slot_view = None
        self.plain_facts = None
        self.outputs = _output_queue()

    @property
    def num_computed_tokens(self) -> int:
        """Tokens with their KV computed: the StepCore's count while the request holds a slot."""
        view = self.slot_view
        return self._num_computed_tokens if view is None else view.num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        if self.slot_view is not None:
            raise AttributeError(
                f"request {self.request_id!r} holds slot {self.slot}: its computed count is the "
                "StepCore's"
            )
        self._num_computed_tokens = value

    @property
    def running_slot(self) -> int:
        """The slot of a request that holds one (ValueError when it holds none)."""
        slot = self.slot
        if slot is None:
            raise ValueError(f"request {self.request_id!r} holds no slot")
        return slot

    @property
    def block_ids(self) -> list[int]:
        """The block table (a new list): the StepCore's while the request holds a slot, else
        empty."""
        view = self.slot_view
        return [] if view is None else view.block_ids

    @property
    def public_id(self) -> str:
        return self.group_id or self.request_id

    def fork_sample(self, index: int) -> "Request":
        """Parallel sample `index` of this request: same prompt, stops, rank and outputs queue;
        its own seed (the request's seed + index) and its own state."""
        return Request(
            request_id=f"{self.request_id}/{index}",
            prompt_token_ids=self.prompt_token_ids,
            sampling=dataclasses.replace(
                self.sampling, seed=(self.sampling.seed + index) % (1 << 64)
            ),
            stopping=self.stopping,
            arrival_time=self.arrival_time,
            priority=self.priority,
            deadline=self.deadline,
            first_token_due=self.first_token_due,
            tenant=self.tenant,
            cache_salt=self.cache_salt,
            lora_name=self.lora_name,
            lora_id=self.lora_id,
            index=index,
            group_id=self.request_id,
            outputs=self.outputs,
            logprobs=self.logprobs,
            stream_interval=self.stream_interval,
            detokenize=self.detokenize,
            structured=self.structured,
            guide=self.guide.fork() if self.guide is not None else None,
        )

    def unforked_finals(self, reason: FinishReason) -> list[RequestOutput]:
        """Last outputs of samples 1 .. n-1 when this request ends before they forked (so
        that the client's stream still gets one last chunk per sample)."""
        if self.forked:
            return []
        usage = Usage(
            prompt_tokens=len(self.prompt_token_ids),
            completion_tokens=0,
            cached_tokens=0,
            queue_time_us=0,
            time_to_first_token_us=0,
        )
        return [
            RequestOutput(token_ids=[], text="", finish_reason=reason, usage=usage, index=index)
            for index in range(1, self.n)
        ]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def usage(self) -> Usage:
        def micros(t: Optional[float]) -> int:
            return 0 if t is None else int((t - self.arrival_time) * 1e6)

        return Usage(
            prompt_tokens=len(self.prompt_token_ids),
            completion_tokens=len(self.output_token_ids),
            cached_tokens=self.num_cached_tokens,
            queue_time_us=micros(self.first_scheduled_time),
            time_to_first_token_us=micros(self.first_token_time),
        )


# What Request.__getstate__ sends: every field but this process's own objects.
_SENT_FIELDS = tuple(
    field.name
    for field in dataclasses.fields(Request)
    if field.name not in ("outputs", "guide", "slot_view", "guide_markers", "plain_facts")
)
