"""Frontend processes (`--frontend-processes 2`) of a scheduler core in this process, against
real model services: structured output and parallel samples (the core makes the guide again),
replicas behind the core, the bearer token and TLS applied by the frontends (the core's config)."""
from __future__ import annotations

import asyncio
import re
import ssl
import urllib.request

import grpc
import pytest

from api import assert_no_leaked_blocks, complete, greedy_ids_request, stub_for, wait_until_idle
from conftest import EngineProcess, start_scheduler
from model_service.models.null import null_continuation
from planserve.v1 import generate_pb2, generate_pb2_grpc
from test_security import Pki


@pytest.fixture(scope="module")
def own_tiny_engine():
    """A tiny model service of this file's own: the session's is held by the session's scheduler
    (a model service takes one Execute stream at a time)."""
    engine = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64")
    yield engine.address
    engine.stop()


async def test_structured_output_and_parallel_samples_through_frontends(own_tiny_engine):
    """The grammar is compiled in the frontend (admission's bound) and again in the core, which
    makes the guide from the request's spec; parallel samples fork in the core and come back
    on one frontend's stream."""
    server = await start_scheduler(own_tiny_engine, frontend_processes=2)
    try:
        stub = stub_for(server)
        email = r"[a-z]{3,8}@example\.(com|org)"
        for seed in range(2):
            request = greedy_ids_request([1, 17, 300, 4000, 22, 9], 64)
            request.sampling.temperature, request.sampling.seed = 1.0, seed
            request.structured_output.regex = email
            out = await complete(stub, request)
            assert re.fullmatch(email, out.text), out.text
            assert out.finish_reason == generate_pb2.FINISH_REASON_EOS
        choices = ["red", "green", "blue", "no colour at all"]
        request = greedy_ids_request([1, 17, 300], 16)
        request.n, request.sampling.temperature, request.sampling.seed = 4, 1.0, 11
        request.structured_output.choice.choices.extend(choices)
        texts: dict[int, str] = {}
        async for chunk in stub.Generate(request):
            texts[chunk.index] = texts.get(chunk.index, "") + chunk.text
        assert sorted(texts) == [0, 1, 2, 3] and set(texts.values()) <= set(choices), texts
        await wait_until_idle(server)
        assert_no_leaked_blocks(server)
    finally:
        await server.stop(grace_s=1)

async def test_replicas_behind_the_frontends():
    """The core's engine side may be a ReplicaSet: the frontends do not care."""
    engines = [EngineProcess("--model", "null"), EngineProcess("--model", "null")]
    try:
        server = await start_scheduler(",".join(e.address for e in engines),
                                       frontend_processes=2)
        try:
            stub = stub_for(server)
            prompts = [[5 + i, 6, 7] for i in range(32)]
            outs = await asyncio.gather(*(complete(stub, greedy_ids_request(p, 20))
                                          for p in prompts))
            for prompt, out in zip(prompts, outs):
                assert out.token_ids == null_continuation(prompt, 20)
            status = await stub.GetServerStatus(generate_pb2.GetServerStatusRequest())
            assert len(status.replicas) == 2
        finally:
            await server.stop(grace_s=1)
    finally:
        for engine in engines:
            engine.stop()

async def test_the_bearer_token_is_checked_by_the_frontends(tmp_path):
    """The config (auth, TLS, tenants) is the core's, sent to the frontends at start."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    engine = EngineProcess("--model", "null")
    try:
        server = await start_scheduler(engine.address, frontend_processes=2,
                                       auth_token_file=str(token_file))
        try:
            stub = stub_for(server)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await complete(stub, greedy_ids_request([1, 2, 3], 5))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ids = []
            async for chunk in stub.Generate(greedy_ids_request([1, 2, 3], 5),
                                             metadata=(("authorization", "Bearer s3cret"),)):
                ids.extend(chunk.token_ids)
            assert ids == null_continuation([1, 2, 3], 5)
        finally:
            await server.stop(grace_s=1)
    finally:
        engine.stop()


async def test_tls_doors_in_the_frontends(tmp_path):
    """TLS on both doors of the frontends (the core's certificate files, read there)."""
    pki = Pki(str(tmp_path), "planserve")
    engine = EngineProcess("--model", "null")
    try:
        server = await start_scheduler(engine.address, frontend_processes=2, http_port=0,
                                       tls_cert=pki.server_cert, tls_key=pki.server_key)
        try:
            credentials = grpc.ssl_channel_credentials(root_certificates=pki.read("ca"))
            async with grpc.aio.secure_channel(f"127.0.0.1:{server.port}", credentials) as channel:
                out = await complete(generate_pb2_grpc.GenerationServiceStub(channel),
                                     greedy_ids_request([4, 5, 6], 7))
            assert out.token_ids == null_continuation([4, 5, 6], 7)
            context = ssl.create_default_context(cafile=pki.ca)
            url = f"https://127.0.0.1:{server.http_port}/v1/models"
            body = await asyncio.get_running_loop().run_in_executor(
                None, lambda: urllib.request.urlopen(url, context=context, timeout=10).read())
            assert b'"null"' in body
        finally:
            await server.stop(grace_s=1)
    finally:
        engine.stop()
