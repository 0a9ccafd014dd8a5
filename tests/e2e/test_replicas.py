"""Two tiny model-service replicas (real processes on 127.0.0.1) behind one scheduler.

- requests spread across both, with the greedy tokens one engine gives, and status per replica;
- a shared-prefix workload lands on the replica that caches the prefix: its prefix-cache hit rate
  beats random routing's (router_weights "random=1") on the same workload;
- SIGKILL of one replica mid-generation loses no request: its requests are recomputed on the
  other replica and every client gets the undisturbed greedy output, no token twice.
"""
from __future__ import annotations

import asyncio
import signal

import pytest
import pytest_asyncio

from api import assert_no_leaked_blocks, complete, greedy_ids_request, stub_for, wait_until_idle
from planserve.v1 import generate_pb2
from scheduler_service.config import SchedulerConfig
from scheduler_service.server import SchedulerServer

ENGINE_ARGS = ("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "256")


class EngineProcess:
    """`python -m model_service --port 0 ...`, its address read from the port line. (Defined here,
    not imported from tests/conftest.py: `conftest` names another module when tests/model_service
    is collected first.)"""

    def __init__(self, *args: str):
        import os
        import subprocess
        import sys

        self.process = subprocess.Popen([sys.executable, "-m", "model_service", "--port", "0", *args],
                                        stdout=subprocess.PIPE, text=True,
                                        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PLANSERVE_LOG_JSON="1"))
        port = next((line.split("=", 1)[1].strip() for line in self.process.stdout
                     if line.startswith("PLANSERVE_ENGINE_PORT=")), None)
        if port is None:
            raise RuntimeError(f"model service exited with {self.process.wait()}")
        self.address = f"127.0.0.1:{port}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
            self.process.kill()


async def start_scheduler(engine_address: str, **overrides) -> SchedulerServer:
    server = SchedulerServer(SchedulerConfig(port=0, engine_address=engine_address, **overrides))
    await server.start()
    await server.connect_engine()
    return server


@pytest.fixture(scope="module")
def two_engines():
    engines = [EngineProcess(*ENGINE_ARGS) for _ in range(2)]
    yield [engine.address for engine in engines]
    for engine in engines:
        engine.stop()


@pytest_asyncio.fixture
async def replicated(two_engines):
    server = await start_scheduler(",".join(two_engines), max_num_batched_tokens=512, max_num_seqs=32)
    yield server
    await server.stop(grace_s=1)


def _routed(server) -> dict[str, float]:
    return {r.name: server.loop.series.routed.labels(r.name)._value.get() for r in server.loop.replicas}


async def test_requests_spread_across_both_replicas(replicated, tiny_server, two_engines):
    assert sorted(r.name for r in replicated.loop.replicas) == sorted(two_engines)
    stub = stub_for(replicated)
    prompts = [[100 + 37 * i + j for j in range(5 + i)] for i in range(12)]
    outputs = await asyncio.gather(*(complete(stub, greedy_ids_request(p, 16)) for p in prompts))
    routed = _routed(replicated)
    assert sum(routed.values()) == len(prompts)
    assert min(routed.values()) >= 3, routed  # both took a fair share
    # Same greedy tokens as the single-engine server (same tiny weights).
    reference = stub_for(tiny_server)
    for prompt, output in zip(prompts[:4], outputs[:4]):
        assert output.token_ids == (await complete(reference, greedy_ids_request(prompt, 16))).token_ids

    status = await stub.GetServerStatus(generate_pb2.GetServerStatusRequest())
    assert sorted(r.address for r in status.replicas) == sorted(two_engines)
    assert all(r.serving and r.num_kv_blocks == 255 for r in status.replicas)
    assert status.num_kv_blocks == 2 * 255
    from prometheus_client import generate_latest

    exported = generate_latest(replicated.metrics.registry).decode()
    for address in two_engines:
        assert f'planserve_replica_up{{replica="{address}"}} 1.0' in exported
        assert f'planserve_replica_routed_requests_total{{replica="{address}"}} {routed[address]}' in exported
    await wait_until_idle(replicated)
    assert_no_leaked_blocks(replicated)


PREFIX_LEN, SUFFIX_LEN, NUM_PREFIXES, PER_PREFIX = 96, 8, 4, 6


async def _shared_prefix_hit_rate(server, seed: int) -> float:
    """NUM_PREFIXES long prefixes, each first sent once (the replica that computes it caches
    it), then PER_PREFIX - 1 more requests per prefix all at once; returns the follow-ups'
    share of prompt tokens served from a prefix cache."""
    stub = stub_for(server)
    prefixes = [[1000 + seed * 5000 + 400 * k + i for i in range(PREFIX_LEN)] for k in range(NUM_PREFIXES)]

    def request(k: int, j: int):
        return greedy_ids_request(prefixes[k] + [30000 + 50 * j + i for i in range(SUFFIX_LEN)], 2)

    await asyncio.gather(*(complete(stub, request(k, 0)) for k in range(NUM_PREFIXES)))
    follow_ups = await asyncio.gather(*(complete(stub, request(k, j))
                                        for j in range(1, PER_PREFIX) for k in range(NUM_PREFIXES)))
    cached = sum(f.usage.cached_tokens for f in follow_ups)
    return cached / sum(f.usage.prompt_tokens for f in follow_ups)


async def test_shared_prefix_lands_on_the_caching_replica(two_engines):
    rates = {}
    for seed, weights in enumerate(("prefix_affinity=2,kv_usage=1,waiting_tokens=1", "random=1")):
        server = await start_scheduler(",".join(two_engines), max_num_batched_tokens=512, max_num_seqs=32,
                                       router_weights=weights)
        try:
            rates[weights] = await _shared_prefix_hit_rate(server, seed)
            await wait_until_idle(server)
            assert_no_leaked_blocks(server)
        finally:
            await server.stop(grace_s=1)
    affinity, random_rate = rates.values()
    print(f"\nprefix-cache hit rate of follow-ups: affinity {affinity:.3f}, random {random_rate:.3f}")
    # Every follow-up on the caching replica finds its 96-token prefix (6 full blocks) cached.
    assert affinity >= 0.9 * PREFIX_LEN / (PREFIX_LEN + SUFFIX_LEN), rates
    assert affinity > random_rate + 0.1, rates


async def _stream(stub, request, tokens: list[int]):
    chunks = []
    async for chunk in stub.Generate(request):
        chunks.append(chunk)
        tokens.extend(chunk.token_ids)
    return chunks


async def _chunks(stub, request, chunks: list):
    async for chunk in stub.Generate(request):
        chunks.append(chunk)
    return chunks


async def test_killing_a_replica_mid_run_loses_no_request():
    engines = [EngineProcess(*ENGINE_ARGS) for _ in range(2)]
    server = await start_scheduler(",".join(e.address for e in engines), max_num_batched_tokens=512,
                                   max_num_seqs=32)
    try:
        stub = stub_for(server)
        prompts = [[200 + 13 * i + j for j in range(6 + i)] for i in range(10)]
        requests = [greedy_ids_request(p, 120) for p in prompts]
        reference = [await complete(stub, r) for r in requests]  # undisturbed, one at a time

        # A request with two parallel samples (greedy: both equal the n=1 output); its samples
        # move together with their group.
        two_samples = greedy_ids_request(prompts[0], 120, n=2, request_id="two-samples")
        samples_reference = reference[0].token_ids
        streamed: list[list[int]] = [[] for _ in requests]
        tasks = [asyncio.ensure_future(_stream(stub, r, streamed[i])) for i, r in enumerate(requests)]
        sample_chunks: list = []
        samples = asyncio.ensure_future(_chunks(stub, two_samples, sample_chunks))
        while min(len(t) for t in streamed) < 5 or len(sample_chunks) < 10:
            await asyncio.sleep(0.005)
        # The replica holding the two samples (both forked and decoding by now) is the one killed.
        victim = next(r for r in server.loop.replicas if r.scheduler.find("two-samples") is not None)
        held = len(victim.scheduler.requests)
        engines[[e.address for e in engines].index(victim.name)].process.send_signal(signal.SIGKILL)
        assert held > 0 and not all(t.done() for t in tasks)

        results = await asyncio.gather(*tasks)
        for chunks, ref, tokens in zip(results, reference, streamed):
            assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
            assert tokens == ref.token_ids  # the undisturbed greedy output: nothing lost or repeated
            assert "".join(c.text for c in chunks) == ref.text
        by_sample = {0: [], 1: []}
        for chunk in await samples:
            by_sample[chunk.index].extend(chunk.token_ids)
        assert by_sample[0] == by_sample[1] == samples_reference  # both samples of the n=2 request
        assert server.loop.series.drained.labels(victim.name)._value.get() >= 1
        from prometheus_client import generate_latest
        exported = generate_latest(server.metrics.registry).decode()
        assert f'planserve_replica_up{{replica="{victim.name}"}} 0.0' in exported
        assert "\nplanserve_engine_up 1.0" in exported  # the set still serves
        status = await stub.GetServerStatus(generate_pb2.GetServerStatusRequest())
        assert {r.address: r.serving for r in status.replicas} == {
            r.name: r is not victim for r in server.loop.replicas}
        await wait_until_idle(server)
        survivor = next(r for r in server.loop.replicas if r is not victim)
        assert survivor.scheduler.kv.num_free_blocks == survivor.scheduler.kv.num_usable_blocks
    finally:
        await server.stop(grace_s=1)
        for engine in engines:
            engine.stop()


def test_scheduler_cli_takes_repeated_engines(two_engines):
    """`planserve scheduler --engine A --engine B`: both replicas serve, GetServerStatus lists them."""
    import os
    import subprocess
    import sys

    import grpc

    from planserve.v1 import generate_pb2_grpc

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    process = subprocess.Popen(
        [sys.executable, "-m", "scheduler_service", "scheduler", "--engine", two_engines[0], "--engine", two_engines[1],
         "--port", "0", "--http-port", "-1", "--metrics-port", "0", "--router-weights", "kv_usage=1,random=0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        port = next(int(line.split("=", 1)[1]) for line in process.stdout if line.startswith("PLANSERVE_PORT="))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            status = generate_pb2_grpc.GenerationServiceStub(channel).GetServerStatus(
                generate_pb2.GetServerStatusRequest(), timeout=10)
        assert sorted(r.address for r in status.replicas) == sorted(two_engines)
        assert all(r.serving for r in status.replicas)
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_router_weights_are_checked_and_ties_take_turns():
    from scheduler_service.engine import scorers
    from scheduler_service.engine.router import Router

    assert scorers.parse_weights("prefix_affinity=2, kv_usage=1") == {"prefix_affinity": 2.0, "kv_usage": 1.0}
    for bad, why in (("nope=1", "unknown scorer 'nope'"), ("kv_usage=-1", "must be >= 0"),
                     ("kv_usage=0", "no scorer with a weight above 0"), ("kv_usage=x", "is not NAME=WEIGHT")):
        with pytest.raises(ValueError, match=why):
            scorers.parse_weights(bad)

    class Idle:  # two replicas with nothing on them: equal scores, turns alternate
        def __init__(self, name):
            self.name = name
            self.scheduler = type("S", (), {"requests": {}})()

    router = Router({"random": 0.0, "waiting_tokens": 1.0})
    replicas = [Idle("a"), Idle("b")]
    assert [router.choose(None, replicas) for _ in range(4)] == [0, 1, 0, 1]


async def test_dns_name_resolves_to_replicas(two_engines):
    """engine_address dns:///localhost:PORT (as a headless Service name would be) resolves to the
    engine's address, which then serves as a replica."""
    from scheduler_service.engine.replicas import resolve_dns

    port = two_engines[0].rsplit(":", 1)[1]
    assert f"127.0.0.1:{port}" in await resolve_dns(f"dns:///localhost:{port}")
    assert await resolve_dns("dns:///no-such-host.invalid:50052") == []
    server = await start_scheduler(f"dns:///localhost:{port}", replica_check_interval_s=0.5)
    try:
        assert f"127.0.0.1:{port}" in [r.name for r in server.loop.replicas if r.up]
        output = await complete(stub_for(server), greedy_ids_request([5, 6, 7], 4))
        assert len(output.token_ids) == 4
    finally:
        await server.stop(grace_s=1)


async def test_replica_gone_from_dns_is_drained_mid_run(two_engines, monkeypatch):
    """A replica whose address leaves the name's answer (its pod was deleted) is stopped mid-step
    and its requests finish on the other one with the undisturbed greedy tokens. The name's
    answer is set by the test (the resolver is the environment here, not the part under test)."""
    from scheduler_service.engine import replicas as replicas_module

    answer = list(two_engines)

    async def resolve(target):
        return list(answer)

    monkeypatch.setattr(replicas_module, "resolve_dns", resolve)
    server = await start_scheduler("dns:///planserve-engine:50052", max_num_batched_tokens=512, max_num_seqs=32,
                                   replica_check_interval_s=0.2)
    try:
        assert sorted(r.name for r in server.loop.replicas) == sorted(two_engines)
        stub = stub_for(server)
        requests = [greedy_ids_request([300 + 11 * i + j for j in range(5 + i)], 100) for i in range(8)]
        reference = [await complete(stub, r) for r in requests]
        streamed: list[list[int]] = [[] for _ in requests]
        tasks = [asyncio.ensure_future(_stream(stub, r, streamed[i])) for i, r in enumerate(requests)]
        while min(len(t) for t in streamed) < 5:
            await asyncio.sleep(0.005)
        leaving = next(r for r in server.loop.replicas if r.scheduler.running)
        answer.remove(leaving.name)
        results = await asyncio.gather(*tasks)
        for chunks, ref, tokens in zip(results, reference, streamed):
            assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
            assert tokens == ref.token_ids
        assert [r.name for r in server.loop.replicas] == answer
        assert server.loop.series.drained.labels(leaving.name)._value.get() >= 1
        await wait_until_idle(server)
        assert_no_leaked_blocks(server)
    finally:
        await server.stop(grace_s=1)
