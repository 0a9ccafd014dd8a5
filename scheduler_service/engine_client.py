"""The scheduler's side of the EngineService: Describe once, then one Execute stream.

Protobuf stops here for the engine contract: Describe becomes `EngineFacts`; plans go out via
`plan.to_pb` and results come back through `plan.result_from_pb`.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Optional

import grpc

from planserve.v1 import engine_pb2, engine_pb2_grpc
from scheduler_service import plan as plan_codec

CONTRACT_VERSION = 1


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

    @classmethod
    def from_pb(cls, reply: engine_pb2.DescribeResponse) -> "EngineFacts":
        if reply.contract_version != CONTRACT_VERSION:
            raise RuntimeError(
                f"model service speaks contract version {reply.contract_version}, "
                f"this scheduler speaks {CONTRACT_VERSION}")
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
        )


class EngineClient:
    def __init__(self, address: str):
        self._channel = grpc.aio.insecure_channel(
            address,
            options=[("grpc.max_send_message_length", -1),
                     ("grpc.max_receive_message_length", -1)])
        self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        self._stream: Optional[grpc.aio.StreamStreamCall] = None

    async def describe(self, timeout_s: float) -> EngineFacts:
        """Waits (up to timeout_s) for the model service to come up, then describes it."""
        await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        reply = await self._stub.Describe(engine_pb2.DescribeRequest(), wait_for_ready=True,
                                          timeout=timeout_s)
        return EngineFacts.from_pb(reply)

    async def execute(self, step: "plan_codec.StepPlan") -> "plan_codec.StepResult":
        """Sends one plan and waits for its result (one in flight)."""
        if self._stream is None:
            self._stream = self._stub.Execute()
        await self._stream.write(plan_codec.to_pb(step))
        response = await self._stream.read()
        if response is grpc.aio.EOF:
            raise ConnectionError("model service closed the Execute stream")
        result = plan_codec.result_from_pb(response)
        if result.step_id != step.step_id:
            raise RuntimeError(f"result for step {result.step_id}, expected {step.step_id}")
        return result

    async def close(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None
        await self._channel.close()
