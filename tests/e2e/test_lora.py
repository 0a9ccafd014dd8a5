"""LoRA adapters end to end (docs/lora.md): a real model service (the tiny model, --enable-lora)
behind a real scheduler with a bearer token, --lora-modules and run-time loading under an adapter
root; adapters are random PEFT folders made with peft on the tiny model's shapes.

The official openai client selects an adapter by model name and reads /v1/models' parent and
root; run-time load and unload (HTTP and gRPC) with each bad input refused; unload refused while a
request runs with the adapter; the metrics' labels. The null model (which checks folders and
holds no weights) serves the start-up errors and the closed door.
"""

from __future__ import annotations

import asyncio
import os

import grpc
import httpx
import openai
import pytest
import pytest_asyncio

from conftest import EngineProcess, start_scheduler
from planserve.v1 import generate_pb2, generate_pb2_grpc
from scheduler_service.ports import StartupError

TOKEN = "lora-test-token"
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _save_adapter(reference, folder: str, seed: int, rank: int = 4) -> str:
    import copy

    import peft
    import torch

    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=rank, lora_alpha=16, target_modules=ATTENTION, init_lora_weights=False, lora_dropout=0.0
    )
    peft.get_peft_model(copy.deepcopy(reference), config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory):
    """root/{a1,a2,a3} (adapters), outside/evil (an adapter outside the root), root/link (a
    symlink out of the root)."""
    from model_service.config import ModelServiceConfig
    from model_service.loading.loader import load_model
    from reference import hf_llama_from_loaded

    reference = hf_llama_from_loaded(load_model(ModelServiceConfig(model="tiny", dtype="float32")))
    base = tmp_path_factory.mktemp("lora")
    root, outside = base / "root", base / "outside"
    root.mkdir()
    outside.mkdir()
    for seed, name in enumerate(("a1", "a2", "a3")):
        _save_adapter(reference, str(root / name), seed=seed + 1)
    _save_adapter(reference, str(outside / "evil"), seed=9)
    os.symlink(outside / "evil", root / "link")
    return root, outside


async def one_place_server(root, dtype: str, **rule):
    """The tiny model in `dtype` with a1..a3 of `root` over one place (--max-loras 1) behind a
    scheduler with the rotation `rule` (a lora_*_after_steps setting): (engine, server)."""
    engine = EngineProcess(
        "--model", "tiny", "--dtype", dtype, "--num-kv-blocks", "64",
        "--enable-lora", "--max-loras", "1", "--max-cpu-loras", "3",
    )  # fmt: skip
    server = await start_scheduler(
        engine.address,
        http_port=0,
        max_num_seqs=8,
        lora_modules=tuple(f"{name}={root / name}" for name in ("a1", "a2", "a3")),
        **rule,
    )
    return engine, server


async def greedy_tokens(client, model: str) -> list[str]:
    """24 greedy tokens of "hello world" on `model` (an adapter's name or the base model's)."""
    reply = await client.completions.create(
        model=model, prompt="hello world", max_tokens=24, temperature=0, logprobs=1
    )
    return reply.choices[0].logprobs.tokens


@pytest.fixture(scope="module")
def lora_engine():
    engine = EngineProcess(
        "--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64",
        "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "3",
    )  # fmt: skip
    yield engine.address
    engine.stop()


@pytest_asyncio.fixture(scope="module")
async def lora_server(lora_engine, adapter_root, tmp_path_factory):
    root, _ = adapter_root
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN)
    server = await start_scheduler(
        lora_engine,
        http_port=0,
        max_num_seqs=8,
        auth_token_file=str(token_file),
        lora_modules=(f"a1={root / 'a1'}",),
        enable_runtime_lora=True,
        lora_root=str(root),
    )
    yield server
    await server.stop(grace_s=1)


def _http(server) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{server.http_port}",
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
    )


def _openai(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key=TOKEN)


def _base(server) -> str:
    return server.admission.serving.facts.model_name


async def _logprobs(client, model: str) -> list[float]:
    reply = await client.completions.create(
        model=model, prompt="hello world", max_tokens=6, temperature=0, logprobs=1
    )
    assert reply.model == model
    return reply.choices[0].logprobs.token_logprobs


async def test_the_openai_client_selects_an_adapter_by_model_name(lora_server, adapter_root):
    client = _openai(lora_server)
    base, adapted = await asyncio.gather(
        _logprobs(client, _base(lora_server)), _logprobs(client, "a1")
    )
    assert base != adapted  # the adapter changes the model's output
    assert await _logprobs(client, "a1") == adapted
    models = {m.id: m for m in (await client.models.list()).data}
    assert getattr(models["a1"], "parent") == _base(lora_server)
    assert getattr(models["a1"], "root") == str(adapter_root[0] / "a1")
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        await client.completions.create(model="nope", prompt="x", max_tokens=1)


async def test_runtime_load_and_unload_with_every_bad_input_refused(lora_server, adapter_root):
    root, outside = adapter_root
    async with _http(lora_server) as http:
        refused = {
            ("", str(root / "a2")): (400, "lora_name"),
            ("x" * 65, str(root / "a2")): (400, "lora_name"),
            ("a/b", str(root / "a2")): (400, "lora_name"),
            (_base(lora_server), str(root / "a2")): (400, "lora_name"),
            ("evil", str(outside / "evil")): (400, "lora_path"),
            ("evil", str(root / "link")): (400, "lora_path"),
            ("evil", "../outside/evil"): (400, "lora_path"),
            ("a1", str(root / "a2")): (409, "lora_name"),
            ("missing", str(root / "none")): (404, "lora_path"),
        }
        for (name, path), (status, field) in refused.items():
            reply = await http.post(
                "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}
            )
            assert reply.status_code == status, (name, path, reply.text)
            assert reply.json()["error"]["param"] == field, reply.text
        reply = await http.post(
            "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(root / "a2")}
        )
        assert reply.status_code == 200, reply.text
        assert (
            await http.post("/v1/unload_lora_adapter", json={"lora_name": "zz"})
        ).status_code == 404
        no_token = await httpx.AsyncClient().post(
            f"http://127.0.0.1:{lora_server.http_port}/v1/load_lora_adapter",
            json={"lora_name": "a3", "lora_path": str(root / "a3")},
        )
        assert no_token.status_code == 401
    client = _openai(lora_server)
    assert len(await _logprobs(client, "a2")) == 6
    async with _http(lora_server) as http:
        reply = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert reply.status_code == 200, reply.text
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="a2", prompt="x", max_tokens=1)


async def test_unload_is_refused_while_a_request_uses_the_adapter(lora_server, adapter_root):
    root, _ = adapter_root
    client = _openai(lora_server)
    async with _http(lora_server) as http:
        reply = await http.post(
            "/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": str(root / "a3")}
        )
        assert reply.status_code == 200, reply.text
        stream = await client.completions.create(
            model="a3", prompt="count", max_tokens=40, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = aiter(stream)
        await anext(chunks)  # it runs
        busy = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
        assert busy.status_code == 409 and busy.json()["error"]["param"] == "lora_name"
        async for _ in chunks:
            pass
        reply = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
        assert reply.status_code == 200, reply.text


async def test_more_adapters_than_places_each_equal_to_itself_alone(lora_server, adapter_root):
    """Three adapters and the base model at once with --max-loras 2: the scheduler skips what
    has no place (the model service fails a plan with too many adapters) and every request
    gets exactly the tokens it gets alone."""
    root, _ = adapter_root
    async with _http(lora_server) as http:
        for name in ("c2", "c3"):
            body = {"lora_name": name, "lora_path": str(root / ("a" + name[1]))}
            assert (await http.post("/v1/load_lora_adapter", json=body)).status_code == 200
    client = _openai(lora_server)
    models = [_base(lora_server), "a1", "c2", "c3"]
    alone = {model: await _logprobs(client, model) for model in models}
    together = await asyncio.gather(*(_logprobs(client, m) for m in models * 3))
    assert together == [alone[m] for m in models * 3]
    async with _http(lora_server) as http:
        for name in ("c2", "c3"):
            reply = await http.post("/v1/unload_lora_adapter", json={"lora_name": name})
            assert reply.status_code == 200


async def test_grpc_selects_loads_and_lists_adapters(lora_server, adapter_root):
    root, _ = adapter_root
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{lora_server.port}") as channel:
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for _ in stub.Generate(
                generate_pb2.GenerateRequest(text="hi", lora_name="nope"), metadata=metadata
            ):
                pass
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        loaded = await stub.LoadLoraAdapter(
            generate_pb2.LoadLoraAdapterRequest(lora_name="g1", lora_path=str(root / "a2")),
            metadata=metadata,
        )
        assert loaded.adapter.rank == 4
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.LoadLoraAdapter(
                generate_pb2.LoadLoraAdapterRequest(lora_name="g1", lora_path=str(root / "a2")),
                metadata=metadata,
            )
        assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS
        tokens = []
        async for chunk in stub.Generate(
            generate_pb2.GenerateRequest(
                text="hi",
                lora_name="g1",
                stopping=generate_pb2.StoppingCriteria(max_new_tokens=3, ignore_eos=True),
            ),
            metadata=metadata,
        ):
            tokens.extend(chunk.token_ids)
        assert len(tokens) == 3
        info = await stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), metadata=metadata)
        assert {"a1", "g1"} <= {a.name for a in info.lora_adapters}
        await stub.UnloadLoraAdapter(
            generate_pb2.UnloadLoraAdapterRequest(lora_name="g1"), metadata=metadata
        )


async def test_metrics_carry_the_adapters(lora_server):
    await _logprobs(_openai(lora_server), "a1")
    async with _http(lora_server) as http:
        text = (await http.get("/metrics")).text
    info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0], info
    assert 'running_lora_adapters="' in info[0] and 'waiting_lora_adapters="' in info[0]
    assert 'planserve_lora_requests_total{lora_name="a1"}' in text


@pytest.mark.slow(reason="three model services start, one per start-up case")
async def test_start_up_errors_and_the_closed_door(adapter_root):
    root, _ = adapter_root
    plain = EngineProcess("--model", "null")
    try:
        with pytest.raises(StartupError, match="--lora-modules: the model service serves no LoRA"):
            await start_scheduler(plain.address, lora_modules=(f"a1={root / 'a1'}",))
    finally:
        plain.stop()
    engine = EngineProcess("--model", "null", "--enable-lora")
    try:
        with pytest.raises(StartupError, match="--lora-modules bad="):
            await start_scheduler(engine.address, lora_modules=(f"bad={root / 'none'}",))
        server = await start_scheduler(engine.address, http_port=0)  # runtime loading off
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as http:
                body = {"lora_name": "a2", "lora_path": str(root / "a2")}
                assert (await http.post("/v1/load_lora_adapter", json=body)).status_code == 404
                unload = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
                assert unload.status_code == 404
        finally:
            await server.stop(grace_s=1)
    finally:
        engine.stop()


@pytest.mark.slow(
    reason="a model service killed mid-generation and started again (the tiny model loads twice)"
)
async def test_a_restarted_model_service_loads_the_adapter_again(adapter_root):
    """SIGKILL of the model service mid-generation: the request on an adapter resumes on the
    restarted process (the scheduler loads the adapter again) with the undisturbed tokens."""
    import signal

    from api import complete, greedy_ids_request, stub_for

    root, _ = adapter_root
    args = ("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64", "--enable-lora")
    engine = EngineProcess(*args)
    server = await start_scheduler(engine.address, lora_modules=(f"a1={root / 'a1'}",))
    try:
        stub = stub_for(server)
        request = greedy_ids_request([17, 400, 120, 88, 9], 200)
        request.lora_name = "a1"
        reference = await complete(stub, request)
        base = greedy_ids_request([17, 400, 120, 88, 9], 200)
        assert (await complete(stub, base)).token_ids != reference.token_ids
        tokens: list[int] = []

        async def stream():
            async for chunk in stub.Generate(request):
                tokens.extend(chunk.token_ids)

        task = asyncio.ensure_future(stream())
        while len(tokens) < 10:
            await asyncio.sleep(0.005)
        engine.process.send_signal(signal.SIGKILL)
        engine.process.wait()
        assert len(tokens) < 200, "the request finished before the kill: nothing was tested"
        port = server.config.engine_address.rsplit(":", 1)[1]
        engine = EngineProcess(*args, "--port", port)
        await task
        assert tokens == list(reference.token_ids)
        assert server.loop.num_engine_recoveries == 1
    finally:
        await server.stop(grace_s=1)
        engine.stop()


async def test_every_replica_loads_the_modules_and_serves_them(adapter_root):
    from api import complete, greedy_ids_request, stub_for

    root, _ = adapter_root
    args = ("--model", "null", "--enable-lora", "--max-loras", "1", "--max-cpu-loras", "2")
    engines = [EngineProcess(*args), EngineProcess(*args)]
    server = await start_scheduler(
        ",".join(e.address for e in engines),
        metrics_port=0,
        lora_modules=(f"a1={root / 'a1'}", f"a2={root / 'a2'}"),
    )
    try:
        replicas = server.loop.replicas
        assert len(replicas) == 2
        for replica in replicas:
            assert set(replica.scheduler.loras.resident) == {"a1", "a2"}
        stub = stub_for(server)
        requests = []
        for index in range(8):
            request = greedy_ids_request([5 + index, 6, 7], 8)
            request.lora_name = ("a1", "a2")[index % 2]
            requests.append(request)
        replies = await asyncio.gather(*(complete(stub, r) for r in requests))
        assert all(len(reply.token_ids) == 8 for reply in replies)
        registry = server.metrics.registry
        assert registry.get_sample_value("planserve_lora_requests_total", {"lora_name": "a2"}) == 4
        infos = [
            s.labels
            for metric in registry.collect()
            if metric.name == "vllm:lora_requests_info"
            for s in metric.samples
        ]
        assert len(infos) == 1 and infos[0]["max_lora"] == "1"
    finally:
        await server.stop(grace_s=1)
        for engine in engines:
            engine.stop()
