"""What the public-API checks share: the channel, the reference request and the chunk
helpers (api_suite.py runs the checks, api_bad_input.py the bad input)."""

from __future__ import annotations

from typing import Optional

from grpc_health.v1 import health_pb2_grpc

from planserve.v1 import generate_pb2, generate_pb2_grpc
from tools.conformance.connection import PLAINTEXT, Connection
from tools.conformance.report import expect

SERVICE_NAME = "planserve.v1.GenerationService"
REFERENCE_TOKENS = 16
FinishReason = generate_pb2.FinishReason


class ApiContext:
    def __init__(self, address: str, connection: Connection = PLAINTEXT) -> None:
        self.address = address
        self.channel = connection.channel(address)
        self.stub = generate_pb2_grpc.GenerationServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self._info: Optional[generate_pb2.GetModelInfoResponse] = None
        self._reference: Optional[list[generate_pb2.GenerateResponse]] = None

    async def info(self) -> generate_pb2.GetModelInfoResponse:
        if self._info is None:
            self._info = await self.stub.GetModelInfo(
                generate_pb2.GetModelInfoRequest(), timeout=30
            )
        return self._info

    async def prompt(self, salt: int = 1, length: int = 6) -> list[int]:
        vocab = (await self.info()).vocab_size
        return [(salt * 7919 + 37 * i) % (vocab - 1) + 1 for i in range(length)]

    async def greedy(
        self, max_new_tokens: int, salt: int = 1, **fields
    ) -> generate_pb2.GenerateRequest:
        request = generate_pb2.GenerateRequest(**fields)
        request.token_ids.ids.extend(await self.prompt(salt))
        request.sampling.temperature = 0.0
        request.stopping.max_new_tokens = max_new_tokens
        request.stopping.ignore_eos = True
        return request

    async def long_request(self, **fields) -> generate_pb2.GenerateRequest:
        """A request that runs for many steps (until aborted)."""
        room = (await self.info()).max_model_len - len(await self.prompt()) - 1
        return await self.greedy(min(400, room), **fields)

    async def complete(
        self, request: generate_pb2.GenerateRequest
    ) -> list[generate_pb2.GenerateResponse]:
        return [chunk async for chunk in self.stub.Generate(request, timeout=120)]

    async def reference(self) -> list[generate_pb2.GenerateResponse]:
        if self._reference is None:
            self._reference = await self.complete(await self.greedy(REFERENCE_TOKENS))
        return self._reference

    async def close(self) -> None:
        await self.channel.close()


def tokens_of(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def text_of(chunks) -> str:
    return "".join(c.text for c in chunks)


def reason(value: int) -> str:
    return FinishReason.Name(value)


def expect_finished(chunks, want: int) -> None:
    expect(chunks, "the stream ended without a chunk")
    last = chunks[-1]
    expect(
        last.finish_reason == want,
        f"the last chunk's finish_reason is {reason(last.finish_reason)}, expected {reason(want)}",
    )
    early = [reason(c.finish_reason) for c in chunks[:-1] if c.finish_reason]
    expect(not early, f"chunks before the last carry a finish_reason: {early}")
