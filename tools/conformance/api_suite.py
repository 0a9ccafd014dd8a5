"""The public-API suite: does a server speak `planserve.v1.GenerationService` as clients expect
(protos/planserve/v1/generate.proto)? `planserve conformance --api HOST:PORT`.

Requests are greedy with ignore_eos, so their outcome is exact for any model: a first run is the
reference that stops, aborts and sessions are compared with. The `cancel` check reads the
server's load, so run the suite against a server nobody else is using.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Optional

import grpc
from grpc_health.v1 import health_pb2

from planserve.v1 import generate_pb2
from tools.conformance.api_bad_input import BAD_INPUT_CHECKS
from tools.conformance.api_context import (
    REFERENCE_TOKENS,
    SERVICE_NAME,
    ApiContext,
    FinishReason,
    expect_finished,
    reason,
    text_of,
    tokens_of,
)
from tools.conformance.report import Check, CheckFailed, Skipped, check, expect

CHECKS: list[Check] = []


@check(CHECKS, "health", 'grpc.health.v1 reports SERVING for "" and planserve.v1.GenerationService')
async def check_health(ctx: ApiContext) -> None:
    for service in ("", SERVICE_NAME):
        reply = await ctx.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        expect(
            reply.status == health_pb2.HealthCheckResponse.SERVING,
            f"health of {service!r} is "
            f"{health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}",
        )


@check(CHECKS, "model_info", "GetModelInfo names the model and its vocabulary and length")
async def check_model_info(ctx: ApiContext) -> str:
    info = await ctx.info()
    expect(info.model_name != "", "model_name is empty")
    expect(info.vocab_size >= 2, f"vocab_size is {info.vocab_size}")
    expect(
        info.max_model_len > REFERENCE_TOKENS + 8,
        f"max_model_len {info.max_model_len} is too short",
    )
    return (
        f"{info.model_name}, {info.dtype}, vocab {info.vocab_size}, max length {info.max_model_len}"
    )


@check(CHECKS, "server_status", "GetServerStatus: KV blocks and a usage in [0, 1]")
async def check_server_status(ctx: ApiContext) -> str:
    status = await ctx.stub.GetServerStatus(generate_pb2.GetServerStatusRequest(), timeout=10)
    expect(status.num_kv_blocks >= 1, f"num_kv_blocks is {status.num_kv_blocks}")
    expect(
        status.num_free_kv_blocks <= status.num_kv_blocks,
        f"{status.num_free_kv_blocks} free of {status.num_kv_blocks} KV blocks",
    )
    expect(0.0 <= status.kv_cache_usage <= 1.0, f"kv_cache_usage is {status.kv_cache_usage}")
    return (
        f"{status.num_running} running, {status.num_waiting} waiting, "
        f"{status.num_kv_blocks} KV blocks"
    )


@check(
    CHECKS,
    "generate",
    "Generate streams chunks under one request id; the last one carries LENGTH and the usage",
)
async def check_generate(ctx: ApiContext) -> str:
    chunks = await ctx.reference()
    expect_finished(chunks, FinishReason.FINISH_REASON_LENGTH)
    ids = {c.request_id for c in chunks}
    expect(len(ids) == 1 and "" not in ids, f"request ids on the chunks: {sorted(ids)}")
    tokens = tokens_of(chunks)
    expect(
        len(tokens) == REFERENCE_TOKENS,
        f"{len(tokens)} tokens for max_new_tokens {REFERENCE_TOKENS}",
    )
    vocab = (await ctx.info()).vocab_size
    expect(all(t < vocab for t in tokens), f"token ids outside the vocabulary: {tokens}")
    usage = chunks[-1].usage
    prompt = await ctx.prompt()
    expect(
        (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), REFERENCE_TOKENS),
        f"usage says {usage.prompt_tokens} prompt and {usage.completion_tokens} completion tokens, "
        f"expected {len(prompt)} and {REFERENCE_TOKENS}",
    )
    return f"{len(chunks)} chunks"


@check(
    CHECKS,
    "greedy_repeatable",
    "the same greedy request with a caller-chosen id gives the same tokens, the id on every chunk",
)
async def check_greedy_repeatable(ctx: ApiContext) -> None:
    request_id = f"conformance-{uuid.uuid4().hex[:8]}"
    chunks = await ctx.complete(await ctx.greedy(REFERENCE_TOKENS, request_id=request_id))
    expect(
        {c.request_id for c in chunks} == {request_id},
        f"chunks carry {sorted({c.request_id for c in chunks})}, the request set {request_id!r}",
    )
    expect(
        tokens_of(chunks) == tokens_of(await ctx.reference()),
        f"{tokens_of(chunks)} differ from the first run's {tokens_of(await ctx.reference())}",
    )


@check(CHECKS, "text_prompt", "a text prompt is tokenized by the server and completed")
async def check_text_prompt(ctx: ApiContext) -> None:
    request = generate_pb2.GenerateRequest(text="The capital of France is")
    request.sampling.temperature = 0.0
    request.stopping.max_new_tokens = 4
    request.stopping.ignore_eos = True
    chunks = await ctx.complete(request)
    expect_finished(chunks, FinishReason.FINISH_REASON_LENGTH)
    expect(len(tokens_of(chunks)) == 4, f"{len(tokens_of(chunks))} tokens for max_new_tokens 4")
    expect(chunks[-1].usage.prompt_tokens >= 1, "usage.prompt_tokens is 0 for a text prompt")


@check(CHECKS, "max_new_tokens", "max_new_tokens 1 gives exactly one token")
async def check_max_new_tokens(ctx: ApiContext) -> None:
    chunks = await ctx.complete(await ctx.greedy(1))
    expect_finished(chunks, FinishReason.FINISH_REASON_LENGTH)
    expect(
        tokens_of(chunks) == tokens_of(await ctx.reference())[:1],
        f"tokens {tokens_of(chunks)}, expected the reference's first",
    )


@check(CHECKS, "stop_token_ids", "a stop token id ends the request with STOP, the token included")
async def check_stop_token_ids(ctx: ApiContext) -> str:
    reference = tokens_of(await ctx.reference())
    stop = reference[3]
    cut = reference.index(stop) + 1
    request = await ctx.greedy(REFERENCE_TOKENS)
    request.stopping.stop_token_ids.append(stop)
    chunks = await ctx.complete(request)
    expect_finished(chunks, FinishReason.FINISH_REASON_STOP)
    expect(
        tokens_of(chunks) == reference[:cut],
        f"tokens {tokens_of(chunks)}, expected {reference[:cut]}",
    )
    expect(
        chunks[-1].WhichOneof("stop_match") == "stop_token_id" and chunks[-1].stop_token_id == stop,
        f"the last chunk's stop_match is {chunks[-1].WhichOneof('stop_match')}, expected "
        f"stop_token_id {stop}",
    )
    return f"stop token {stop} after {cut} tokens"


def _stop_string(text: str) -> Optional[str]:
    """Two printable characters from the middle of the reference text."""
    for start in range(len(text) // 3, len(text) - 1):
        candidate = text[start : start + 2]
        if candidate.strip() and candidate.isprintable():
            return candidate
    return None


@check(
    CHECKS,
    "stop_string",
    "a stop string ends the request with STOP; the text before it is returned, the match is not",
)
async def check_stop_string(ctx: ApiContext) -> str:
    text = text_of(await ctx.reference())
    stop = _stop_string(text)
    if stop is None:
        raise Skipped(f"the reference text {text!r} has no printable stretch to stop on")
    request = await ctx.greedy(REFERENCE_TOKENS)
    request.stopping.stop.append(stop)
    chunks = await ctx.complete(request)
    expect_finished(chunks, FinishReason.FINISH_REASON_STOP)
    expected = text[: text.index(stop)]
    expect(
        text_of(chunks) == expected,
        f"text {text_of(chunks)!r}, expected {expected!r} (stop {stop!r})",
    )
    expect(
        chunks[-1].stop_string == stop,
        f"stop_string is {chunks[-1].stop_string!r}, expected {stop!r}",
    )
    return f"stop {stop!r}"


@check(
    CHECKS,
    "parallel_samples",
    "n = 2: chunks carry their sample's index, each sample ends with its own last chunk",
)
async def check_parallel_samples(ctx: ApiContext) -> None:
    reference = tokens_of(await ctx.reference())
    chunks = await ctx.complete(await ctx.greedy(8, n=2))
    by_index: dict[int, list] = {}
    for chunk in chunks:
        by_index.setdefault(chunk.index, []).append(chunk)
    expect(sorted(by_index) == [0, 1], f"sample indices {sorted(by_index)}, expected [0, 1]")
    for index, own in by_index.items():
        expect_finished(own, FinishReason.FINISH_REASON_LENGTH)
        # Greedy: every sample is the reference.
        expect(
            tokens_of(own) == reference[:8],
            f"sample {index}: {tokens_of(own)}, expected {reference[:8]}",
        )


@check(
    CHECKS,
    "abort",
    "Abort ends an in-flight request with CANCELLED; unknown or finished ids are NOT_FOUND",
)
async def check_abort(ctx: ApiContext) -> None:
    request_id = f"conformance-abort-{uuid.uuid4().hex[:8]}"
    request = await ctx.long_request(request_id=request_id)
    call = ctx.stub.Generate(request, timeout=120)
    chunks = [await call.read()]
    reply = ctx.stub.Abort(generate_pb2.AbortRequest(request_id=request_id), timeout=10)
    await reply
    while (chunk := await call.read()) is not grpc.aio.EOF:
        chunks.append(chunk)
    expect_finished(chunks, FinishReason.FINISH_REASON_CANCELLED)
    expect(
        len(tokens_of(chunks)) < request.stopping.max_new_tokens,
        "the aborted request generated all its tokens",
    )
    for unknown in (request_id, "conformance-no-such-request"):
        try:
            await ctx.stub.Abort(generate_pb2.AbortRequest(request_id=unknown), timeout=10)
        except grpc.aio.AioRpcError as error:
            expect(
                error.code() == grpc.StatusCode.NOT_FOUND,
                f"Abort of {unknown!r} ended with {error.code().name}, expected NOT_FOUND",
            )
        else:
            raise CheckFailed(
                f"Abort of {unknown!r} (finished or unknown) succeeded, expected NOT_FOUND"
            )


async def _until_idle(
    ctx: ApiContext, timeout_s: float = 10.0
) -> generate_pb2.GetServerStatusResponse:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        status = await ctx.stub.GetServerStatus(generate_pb2.GetServerStatusRequest(), timeout=10)
        if status.num_running == status.num_waiting == 0:
            return status
        if asyncio.get_running_loop().time() > deadline:
            raise CheckFailed(
                f"{timeout_s:g} s after the cancel: {status.num_running} running, "
                f"{status.num_waiting} waiting"
            )
        await asyncio.sleep(0.05)


@check(
    CHECKS, "cancel", "a client that cancels its call frees its request (GetServerStatus goes idle)"
)
async def check_cancel(ctx: ApiContext) -> None:
    call = ctx.stub.Generate(await ctx.long_request(), timeout=120)
    await call.read()
    call.cancel()
    status = await _until_idle(ctx)
    expect(
        status.num_free_kv_blocks == status.num_kv_blocks or status.kv_cache_usage == 0.0,
        f"idle, yet {status.num_kv_blocks - status.num_free_kv_blocks} KV blocks are in use",
    )


@check(
    CHECKS, "duplicate_request_id", "a second in-flight request with the same id is ALREADY_EXISTS"
)
async def check_duplicate_request_id(ctx: ApiContext) -> None:
    request_id = f"conformance-dup-{uuid.uuid4().hex[:8]}"
    first = ctx.stub.Generate(await ctx.long_request(request_id=request_id), timeout=120)
    await first.read()
    try:
        await ctx.complete(await ctx.greedy(2, request_id=request_id))
    except grpc.aio.AioRpcError as error:
        expect(
            error.code() == grpc.StatusCode.ALREADY_EXISTS,
            f"the duplicate ended with {error.code().name}: {error.details()}",
        )
    else:
        raise CheckFailed("the duplicate request id was served")
    finally:
        first.cancel()


async def _drained(outbox: asyncio.Queue):
    """A request stream of what is put in `outbox`, until None."""
    while (message := await outbox.get()) is not None:
        yield message


@check(
    CHECKS,
    "session",
    "Session multiplexes two requests, aborts one, reports a bad request "
    "and an unknown abort as errors on the stream, which goes on",
)
async def check_session(ctx: ApiContext) -> None:
    outbox: asyncio.Queue = asyncio.Queue()

    reference = tokens_of(await ctx.reference())
    call = ctx.stub.Session(_drained(outbox), timeout=120)
    bad = await ctx.greedy(1, request_id="bad")
    bad.stopping.max_new_tokens = 0
    for message in (
        generate_pb2.SessionRequest(generate=await ctx.greedy(6, request_id="short")),
        generate_pb2.SessionRequest(generate=await ctx.long_request(request_id="long")),
        generate_pb2.SessionRequest(generate=bad),
    ):
        outbox.put_nowait(message)
    tokens: dict[str, list[int]] = {"short": [], "long": []}
    finals, errors, aborted = {}, {}, False
    async for response in call:
        if response.HasField("error"):
            errors[response.error.request_id] = response.error
            continue
        chunk = response.chunk
        expect(chunk.request_id in tokens, f"a chunk for request {chunk.request_id!r}")
        tokens[chunk.request_id] += chunk.token_ids
        if chunk.request_id == "long" and len(tokens["long"]) >= 2 and not aborted:
            aborted = True
            outbox.put_nowait(
                generate_pb2.SessionRequest(abort=generate_pb2.AbortRequest(request_id="long"))
            )
            outbox.put_nowait(
                generate_pb2.SessionRequest(abort=generate_pb2.AbortRequest(request_id="nobody"))
            )
        if chunk.finish_reason:
            finals[chunk.request_id] = reason(chunk.finish_reason)
            if len(finals) == 2:
                outbox.put_nowait(None)
    expect(
        finals == {"short": "FINISH_REASON_LENGTH", "long": "FINISH_REASON_CANCELLED"},
        f"finish reasons {finals}",
    )
    expect(tokens["short"] == reference[:6], f"short: {tokens['short']}, expected {reference[:6]}")
    got = {
        rid: (
            grpc.StatusCode.INVALID_ARGUMENT.value[0]
            if rid == "bad"
            else grpc.StatusCode.NOT_FOUND.value[0],
            e.code,
        )
        for rid, e in errors.items()
    }
    expect(
        set(errors) == {"bad", "nobody"} and all(want == have for want, have in got.values()),
        f"session errors {[(rid, e.code, e.message) for rid, e in errors.items()]}, expected "
        "bad: 3 (INVALID_ARGUMENT) and nobody: 5 (NOT_FOUND)",
    )
    expect(
        "max_new_tokens" in errors["bad"].message,
        f"the bad request's error {errors['bad'].message!r} does not name stopping.max_new_tokens",
    )


CHECKS.extend(BAD_INPUT_CHECKS)
