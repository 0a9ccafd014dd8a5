"""The scheduler's side of the EngineService: Describe once, then one Execute stream.

Protobuf stops here for the engine contract: Describe becomes `EngineFacts`; plans go out via
`plan.to_pb` and results come back through `plan.result_from_pb`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from planserve.contract import CONTRACT_VERSION, CPU_STEP, REQUEST_BOUNDS, RequestBounds
from planserve.v1 import engine_pb2, engine_pb2_grpc
from scheduler_service.core import plan as plan_codec
from scheduler_service.core.loras import LoraCapacity
from scheduler_service.core.request import Sampling
from scheduler_service.engine.execute_stream import ExecuteStream, StreamEnded

_GREEDY = Sampling(temperature=0.0, top_k=0, top_p=1.0, seed=0)


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """The model's facts and capacity as the model service described them."""

    model_name: str
    architecture: str
    dtype: str
    device: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    max_num_slots: int
    eos_token_ids: frozenset[int]
    bos_token_id: Optional[int]
    tokenizer_json: str
    chat_template: str
    special_tokens: dict[str, str]
    num_swap_blocks: int = 0
    """Host blocks for swapped-out KV (0 unless the engine has features.swap)."""
    num_speculative_tokens: int = 0
    """Draft tokens the engine may propose per decoding sequence and step (0: no speculation)."""
    bounds: RequestBounds = REQUEST_BOUNDS
    """The sampling bounds the engine checks plans against; the doors check requests by them."""
    step_token_budget: int = CPU_STEP.token_budget
    """The most tokens of one step the engine chose for its device (and profiled): the
    scheduler's token budget unless --max-num-batched-tokens is given."""
    step_max_seqs: int = CPU_STEP.max_seqs
    """The most sequences of one step the engine chose: the scheduler's max_num_seqs unless
    --max-num-seqs is given (never above max_num_slots)."""
    lora: Optional[LoraCapacity] = None
    """The LoRA adapters the engine can hold (DescribeResponse.lora); None: it serves none."""

    @classmethod
    def from_pb(cls, reply: engine_pb2.DescribeResponse) -> "EngineFacts":
        if reply.contract_version != CONTRACT_VERSION:
            raise RuntimeError(
                f"model service speaks contract version {reply.contract_version}, "
                f"this scheduler speaks {CONTRACT_VERSION}"
            )
        return cls(
            model_name=reply.model_name,
            architecture=reply.architecture,
            dtype=reply.dtype,
            device=reply.device,
            vocab_size=reply.vocab_size,
            max_model_len=reply.max_model_len,
            block_size=reply.block_size,
            num_kv_blocks=reply.num_kv_blocks,
            max_num_slots=reply.max_num_slots,
            eos_token_ids=frozenset(reply.eos_token_ids),
            bos_token_id=reply.bos_token_id if reply.HasField("bos_token_id") else None,
            tokenizer_json=reply.tokenizer_json,
            chat_template=reply.chat_template,
            special_tokens=dict(reply.special_tokens),
            num_swap_blocks=reply.num_swap_blocks if reply.features.swap else 0,
            num_speculative_tokens=(
                reply.num_speculative_tokens if reply.features.speculation else 0
            ),
            bounds=_bounds(reply),
            # 0: an engine before these fields; the contract's CPU shape, as it always planned.
            step_token_budget=reply.step_token_budget or CPU_STEP.token_budget,
            step_max_seqs=reply.step_max_seqs or CPU_STEP.max_seqs,
            lora=_lora(reply),
        )


def _lora(reply: engine_pb2.DescribeResponse) -> Optional[LoraCapacity]:
    if not reply.HasField("lora"):
        return None
    lora = reply.lora
    return LoraCapacity(
        max_loras=lora.max_loras,
        max_lora_rank=lora.max_lora_rank,
        # Never fewer than max_loras: every adapter of a step is loaded.
        max_cpu_loras=max(lora.max_cpu_loras, lora.max_loras),
        target_modules=tuple(lora.target_modules),
    )


def _bounds(reply: engine_pb2.DescribeResponse) -> RequestBounds:
    """The engine's sampling bounds; the contract's where it reports none (an engine before
    DescribeResponse.request_bounds, or max_top_logprobs 0)."""
    bounds = dataclasses.replace(
        REQUEST_BOUNDS, max_top_logprobs=reply.max_top_logprobs or REQUEST_BOUNDS.max_top_logprobs
    )
    if not reply.HasField("request_bounds"):
        return bounds
    reported = reply.request_bounds
    return dataclasses.replace(
        bounds,
        max_logit_bias_entries=reported.max_logit_bias_entries,
        max_logit_bias=reported.max_logit_bias,
        max_repetition_penalty=reported.max_repetition_penalty,
        max_penalty=reported.max_penalty,
    )


class EngineUnavailable(ConnectionError):
    """The model service cannot be reached or its Execute stream broke: every sequence it held
    is lost, and it is worth reconnecting (a bad plan, INVALID_ARGUMENT, is not this)."""


# Reconnect quickly after a model service restart: gRPC's default backoff grows to 120 s.
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


async def says_serving(health: health_pb2_grpc.HealthStub, timeout_s: float) -> bool:
    """Whether a model service's health service answers SERVING within `timeout_s` (the
    scheduler's idle check, `planserve serve`'s liveness probe)."""
    try:
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


class EngineClient:
    def __init__(
        self,
        address: str,
        credentials: Optional[grpc.ChannelCredentials] = None,
        options: tuple = (),
    ):
        channel_options = _CHANNEL_OPTIONS + list(options)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(address, options=channel_options)
        else:
            self._channel = grpc.aio.secure_channel(address, credentials, options=channel_options)
        self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        # The Execute stream runs on a synchronous channel of its own: its I/O stays off the
        # event loop (engine/execute_stream.py says why).
        if credentials is None:
            self._execute_channel = grpc.insecure_channel(address, options=channel_options)
        else:
            self._execute_channel = grpc.secure_channel(
                address, credentials, options=channel_options
            )
        self._execute_stub = engine_pb2_grpc.EngineServiceStub(self._execute_channel)
        self._stream: Optional[ExecuteStream] = None

    async def describe(self, timeout_s: float) -> EngineFacts:
        """Waits (up to timeout_s) for the model service to come up, then describes it."""
        await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        reply = await self._stub.Describe(
            engine_pb2.DescribeRequest(), wait_for_ready=True, timeout=timeout_s
        )
        return EngineFacts.from_pb(reply)

    async def execute(self, step: "plan_codec.StepPlan") -> "plan_codec.StepResult":
        """Sends one plan and waits for its result (one in flight). EngineUnavailable when the
        stream broke; the next call opens a new stream (on which the model service holds no
        sequence)."""
        await self.send(step)
        return await self.receive(step)

    async def send(self, step: "plan_codec.StepPlan") -> None:
        """Sends a plan without waiting for its result (overlap keeps up to two in flight;
        results come back in order, receive() takes them). Never suspends: the plan goes to
        the stream's own thread (engine/execute_stream.py); a broken stream shows on receive."""
        if self._stream is None:
            self._stream = ExecuteStream(self._execute_stub)
        self._stream.send(plan_codec.to_pb(step))

    async def receive(self, step: "plan_codec.StepPlan") -> "plan_codec.StepResult":
        """The result of the oldest plan sent, which must be `step`."""
        if self._stream is None:
            raise EngineUnavailable("no Execute stream: the plan was never sent")
        try:
            response = await self._stream.receive()
        except StreamEnded as ended:
            self.drop_stream()
            error = ended.error
            if error is None:
                raise EngineUnavailable("model service closed the Execute stream") from None
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise error from None  # a plan the model service refused: a bug, not an outage
            raise EngineUnavailable(
                f"Execute stream ended: {error.code().name} {error.details()}"
            ) from error
        result = plan_codec.result_from_pb(response)
        if result.step_id != step.step_id:
            raise RuntimeError(f"result for step {result.step_id}, expected {step.step_id}")
        return result

    async def probe(self, first_step_id: int, facts: EngineFacts) -> None:
        """Readiness: one real one-token step on the model (a process that is up but cannot
        compute fails here), then the probe's slot is dropped. Two plans, step ids
        first_step_id and first_step_id + 1; meant for a model service holding no sequence
        (a new stream), using slot 0 and block 1."""
        token = facts.bos_token_id if facts.bos_token_id is not None else 0
        computed = plan_codec.StepPlan(
            step_id=first_step_id,
            new_sequences=[
                plan_codec.NewSequence(
                    slot=0, token_ids=[token], sampling=_GREEDY, num_computed_tokens=0
                )
            ],
            slots=[0],
            num_scheduled_tokens=[1],
            num_new_blocks=[1],
            new_block_ids=[1],
        )
        result = await self.execute(computed)
        if (
            result.num_sampled_tokens != [1]
            or not 0 <= result.sampled_token_ids[0] < facts.vocab_size
        ):
            raise EngineUnavailable(
                f"probe step sampled {result.sampled_token_ids}, "
                "expected one token in the vocabulary"
            )
        await self.execute(plan_codec.StepPlan(step_id=first_step_id + 1, aborted_slots=[0]))

    async def load_adapter(
        self, lora_id: int, name: str, path: str, timeout_s: float = 600.0
    ) -> engine_pb2.LoadAdapterResponse:
        """LoadAdapter: the model service reads the PEFT folder and keeps it under lora_id
        (grpc.aio.AioRpcError on refusal, engine/lora_loader.py maps it)."""
        request = engine_pb2.LoadAdapterRequest(lora_id=lora_id, lora_name=name, lora_path=path)
        return await self._stub.LoadAdapter(request, timeout=timeout_s)

    async def evict_adapter(self, lora_id: int, timeout_s: float = 60.0) -> None:
        """EvictAdapter; an id the model service does not hold (it restarted) is not an error."""
        try:
            await self._stub.EvictAdapter(
                engine_pb2.EvictAdapterRequest(lora_id=lora_id), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                raise

    async def is_alive(self, timeout_s: float) -> bool:
        """A cheap liveness check while idle: the model service's own health service."""
        return await says_serving(self._health, timeout_s)

    def drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None

    async def close(self) -> None:
        self.drop_stream()
        self._execute_channel.close()
        await self._channel.close()


def incompatibility(old: EngineFacts, new: EngineFacts) -> Optional[str]:
    """Why a restarted model service cannot take over the requests admitted against `old`
    (None when it can: same model, vocabulary, tokenizer and block size; capacity may differ)."""
    for field in (
        "model_name",
        "vocab_size",
        "block_size",
        "max_model_len",
        "tokenizer_json",
        "eos_token_ids",
    ):
        if getattr(old, field) != getattr(new, field):
            return f"{field} changed"
    if new.num_kv_blocks < 2 or new.max_num_slots < 1:
        return f"num_kv_blocks {new.num_kv_blocks}, max_num_slots {new.max_num_slots}: too small"
    return None
