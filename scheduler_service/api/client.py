"""A small Python client of the public API, used by `planserve generate` and the examples."""

from __future__ import annotations

from typing import AsyncIterator, Optional

import grpc

from planserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc


def build_request(
    prompt: str,
    *,
    chat: bool = False,
    max_new_tokens: Optional[int] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    top_k: Optional[int] = None,
    seed: Optional[int] = None,
    stop: tuple[str, ...] = (),
    ignore_eos: bool = False,
    request_id: str = "",
) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(request_id=request_id)
    if chat:
        request.messages.messages.add(role="user", content=prompt)
    else:
        request.text = prompt
    sampling = common_pb2.SamplingParams()
    for name, value in (
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("seed", seed),
    ):
        if value is not None:
            setattr(sampling, name, value)
    request.sampling.CopyFrom(sampling)
    if max_new_tokens is not None:
        request.stopping.max_new_tokens = max_new_tokens
    request.stopping.stop.extend(stop)
    request.stopping.ignore_eos = ignore_eos
    return request


async def stream_generate(
    address: str,
    request: generate_pb2.GenerateRequest,
) -> AsyncIterator[generate_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        async for chunk in stub.Generate(request):
            yield chunk
