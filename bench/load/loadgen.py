"""The asyncio load generator: sends a workload at a request rate, times every streamed chunk.

Backends (one coroutine per request, all on one event loop):
  grpc      planserve's public API (GenerationService.Generate), token ids in, token ids out;
  openai    an OpenAI-compatible /v1/completions server streaming SSE (vLLM, llama.cpp's server,
            planserve's HTTP API): the prompt goes as a list of token ids, greedy, `ignore_eos`.

Per request it records the send time, the arrival time and token count of every chunk and the end
time; loadgen.RequestResult holds them and report.py turns them into TTFT / ITL / E2E statistics.
Arrivals: `rate` requests/s scales each request's unit-rate `arrival`; rate=inf sends all at t=0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from typing import Optional, Sequence

from bench.load.workloads import BenchRequest


@dataclasses.dataclass
class RequestResult:
    id: str
    prompt_tokens: int
    max_new_tokens: int
    sent_s: float = 0.0  # since the run's start
    chunk_times_s: list[float] = dataclasses.field(default_factory=list)  # since the run's start
    chunk_tokens: list[int] = dataclasses.field(default_factory=list)
    end_s: float = 0.0
    error: str = ""

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)


class GrpcBackend:
    name = "grpc"

    def __init__(
        self,
        address: str,
        stream_interval: int = 1,
        num_channels: int = 4,
        lora_names: Sequence[str] = (),
        temperature: float = 0.0,
        top_p: float = 1.0,
    ) -> None:
        self.address = address
        self.stream_interval = stream_interval
        # 0: greedy; above it each request draws with a seed of its own (its index in this
        # backend's run), so that a rerun draws the same tokens (common.proto's seed rule).
        self.temperature, self.top_p = temperature, top_p
        self.num_channels = num_channels
        self.lora_names = list(lora_names)  # request i names lora_names[i % len]; none: the base
        self.vocab_size: Optional[int] = None

    async def __aenter__(self) -> "GrpcBackend":
        import grpc

        from planserve.v1 import generate_pb2, generate_pb2_grpc

        self._pb = generate_pb2
        # A few channels: one HTTP/2 connection per channel, so hundreds of streams do not queue
        # behind one connection's flow control.
        self._channels = [grpc.aio.insecure_channel(self.address) for _ in range(self.num_channels)]
        self._stubs = [generate_pb2_grpc.GenerationServiceStub(c) for c in self._channels]
        info = await self._stubs[0].GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=30)
        self.vocab_size = int(info.vocab_size)
        self.model_name = info.model_name
        return self

    async def __aexit__(self, *exc) -> None:
        for channel in self._channels:
            await channel.close()

    async def send(
        self, request: BenchRequest, result: RequestResult, start: float, index: int
    ) -> None:
        pb = self._pb.GenerateRequest(request_id=f"{request.id}-{index}")
        ids = request.prompt_ids
        if self.vocab_size and max(ids) >= self.vocab_size:
            ids = [i % self.vocab_size for i in ids]  # a smaller vocabulary (the null model)
        pb.token_ids.ids.extend(ids)
        pb.sampling.temperature = self.temperature
        if self.temperature > 0:
            pb.sampling.top_p, pb.sampling.seed = self.top_p, index
        pb.stopping.max_new_tokens = request.max_new_tokens
        pb.stopping.ignore_eos = request.ignore_eos
        if self.stream_interval != 1:
            pb.stream_interval = self.stream_interval
        if self.lora_names:
            pb.lora_name = self.lora_names[index % len(self.lora_names)]
        stub = self._stubs[index % len(self._stubs)]
        result.sent_s = time.perf_counter() - start
        async for chunk in stub.Generate(pb):
            if chunk.token_ids:
                result.chunk_times_s.append(time.perf_counter() - start)
                result.chunk_tokens.append(len(chunk.token_ids))
        result.end_s = time.perf_counter() - start


class OpenAIBackend:
    """Streaming /v1/completions; the chunk's token count is 1 unless the server says otherwise."""

    name = "openai"

    def __init__(self, base_url: str, model: str, extra_body: Optional[dict] = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.extra_body = dict(extra_body or {})

    async def __aenter__(self) -> "OpenAIBackend":
        import httpx

        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
        self._client = httpx.AsyncClient(
            base_url=self.base_url, timeout=httpx.Timeout(3600.0), limits=limits
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self._client.aclose()

    async def send(
        self, request: BenchRequest, result: RequestResult, start: float, index: int
    ) -> None:
        body = {
            "model": self.model,
            "prompt": request.prompt_ids,
            "max_tokens": request.max_new_tokens,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": request.ignore_eos,
            "stream_options": {"include_usage": True},
            **self.extra_body,
        }
        result.sent_s = time.perf_counter() - start
        usage_tokens = None
        async with self._client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(
                    f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                )
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                choices = event.get("choices") or []
                if choices and (choices[0].get("text") or choices[0].get("tokens")):
                    result.chunk_times_s.append(time.perf_counter() - start)
                    result.chunk_tokens.append(1)
        result.end_s = time.perf_counter() - start
        # Servers may merge tokens into one event (or send empty-text tokens): trust their count.
        if (
            usage_tokens is not None
            and result.chunk_tokens
            and usage_tokens != result.output_tokens
        ):
            result.chunk_tokens[-1] += usage_tokens - result.output_tokens


async def run_workload(
    backend,
    requests: list[BenchRequest],
    rate: float = math.inf,
    progress: bool = True,
    max_concurrency: Optional[int] = None,
    label: str = "",
    request_timeout_s: Optional[float] = None,
) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time; returns the results and the run's wall time.
    A request still running after request_timeout_s is cancelled and recorded as failed
    ("timeout")."""
    results = [RequestResult(r.id, len(r.prompt_ids), r.max_new_tokens) for r in requests]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc=label or "requests", unit="req", leave=False)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(index: int) -> None:
        request = requests[index]
        delay = 0.0 if math.isinf(rate) else request.arrival / rate
        wait = start + delay - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        try:
            if limit is None:
                await asyncio.wait_for(
                    backend.send(request, results[index], start, index), request_timeout_s
                )
            else:
                async with limit:
                    await asyncio.wait_for(
                        backend.send(request, results[index], start, index), request_timeout_s
                    )
        except asyncio.TimeoutError:
            results[index].error = f"timeout after {request_timeout_s} s"
            results[index].end_s = time.perf_counter() - start
        except Exception as error:  # recorded, reported as a failed request
            results[index].error = repr(error)[:500]
            results[index].end_s = time.perf_counter() - start
        if bar is not None:
            bar.update(1)

    await asyncio.gather(*(one(i) for i in range(len(requests))))
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return results, elapsed
