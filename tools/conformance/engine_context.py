"""What the engine-contract checks share: the channel, the Describe reply, the reference
sequences (engine_suite.py runs the lifecycle checks, engine_bad_plans.py the bad plans)."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator, Optional

from grpc_health.v1 import health_pb2_grpc

from planserve.v1 import engine_pb2, engine_pb2_grpc
from tools.conformance.connection import PLAINTEXT, Connection
from tools.conformance.engine_driver import ExecuteStream
from tools.conformance.report import expect

SERVICE_NAME = "planserve.v1.EngineService"


class EngineContext:
    """What the checks share: the channel, the Describe reply and the reference sequences."""

    def __init__(self, address: str, connection: Connection = PLAINTEXT) -> None:
        self.address = address
        self.channel = connection.channel(
            address,
            options=(("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)),
        )
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self._facts: Optional[engine_pb2.DescribeResponse] = None
        self._references: dict[tuple[int, ...], list[int]] = {}

    async def facts(self) -> engine_pb2.DescribeResponse:
        if self._facts is None:
            self._facts = await self.stub.Describe(engine_pb2.DescribeRequest(), timeout=30)
        return self._facts

    @contextlib.asynccontextmanager
    async def stream(self) -> AsyncIterator[ExecuteStream]:
        stream = ExecuteStream(self.stub, await self.facts())
        try:
            yield stream
        finally:
            await stream.close()

    def prompt(self, salt: int, length: Optional[int] = None) -> list[int]:
        """A deterministic prompt of `length` tokens (default: two blocks and three tokens), ids
        spread over the vocabulary."""
        facts = self._facts
        length = length or min(2 * facts.block_size + 3, facts.max_model_len // 2)
        return [(salt * 7919 + 31 * i) % (facts.vocab_size - 1) + 1 for i in range(length)]

    async def reference(self, prompt: list[int]) -> list[int]:
        """The greedy continuation of prompt (2 blocks' worth of tokens, crossing a block
        boundary): one-shot prefill on slot 0 of a fresh stream, then single-slot decodes."""
        key = tuple(prompt)
        if key not in self._references:
            async with self.stream() as s:
                await s.prefill(0, prompt)
                await s.decode([0], self.decode_steps())
                self._references[key] = s.slots[0].generated
        return self._references[key]

    def decode_steps(self) -> int:
        return min(2 * self._facts.block_size, self._facts.max_model_len // 4)

    async def close(self) -> None:
        await self.channel.close()


def same_as_reference(got: list[int], want: list[int], what: str) -> None:
    expect(
        got == want[: len(got)] and len(got) <= len(want),
        f"{what}: greedy tokens {got} differ from the reference {want[: len(got)]}",
    )
