"""The gateway's headers and vLLM's request extras on the HTTP API: the fairness id becomes the
tenant (seen by the prefix cache scoped per tenant), the objective a priority and x-slo-ttft-ms
a first-token target (both seen in the order a one-sequence server serves waiting requests),
body `priority` and `cache_salt`, X-Request-Id echoed; none of the headers is read without
--trust-gateway-headers; bad values are 400 naming the header or field."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
import pytest_asyncio
from api import greedy_ids_request, stub_for
from conftest import EngineProcess, start_scheduler

PREFIX = " ".join(f"w{i}" for i in range(60))  # well over 2 blocks of 16 tokens


@pytest.fixture(scope="module")
def engine():
    process = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "128")
    yield process.address
    process.stop()


def _scheduler(engine, trusted: bool):
    return start_scheduler(
        engine,
        http_port=0,
        policy="priority",
        max_num_seqs=1,  # one sequence at a time: the waiting order is the finishing order
        prefix_cache_scope="tenant",
        trust_gateway_headers=trusted,
        gateway_objective_priorities="critical=10,sheddable=-10",
    )


@pytest_asyncio.fixture(scope="module")
async def trusting(engine):
    server = await _scheduler(engine, trusted=True)
    yield server
    await server.stop(grace_s=1)


def _post(port: int, body: dict, headers: dict) -> tuple[int, dict, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), dict(error.headers)


async def post(server, headers=None, **body) -> tuple[int, dict, dict]:
    body = {"model": server.servicer.serving.facts.model_name, "max_tokens": 2, **body}
    return await asyncio.to_thread(_post, server.http_port, body, headers or {})


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_fairness_id_is_the_tenant_of_the_prefix_cache(trusting):
    fair = "x-gateway-inference-fairness-id"
    prompt = PREFIX + " tenants"
    _, first, _ = await post(trusting, {fair: "team-a"}, prompt=prompt)
    _, same, _ = await post(trusting, {fair: "team-a"}, prompt=prompt)
    _, other, _ = await post(trusting, {fair: "team-b"}, prompt=prompt)
    assert cached(first) == 0 and cached(same) >= 32 and cached(other) == 0


async def test_cache_salt_in_the_body_separates_prefix_caches(trusting):
    prompt = PREFIX + " salts"
    await post(trusting, prompt=prompt, cache_salt="s1")
    _, again, _ = await post(trusting, prompt=prompt, cache_salt="s1")
    _, salted, _ = await post(trusting, prompt=prompt, cache_salt="s2")
    assert cached(again) >= 32 and cached(salted) == 0


async def _in_flight(server, count: int) -> None:
    """Waits until the scheduler holds `count` requests (running or waiting)."""
    for _ in range(1000):
        if len(server.loop.scheduler.requests) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{count} requests never reached the scheduler")


async def _finishing_order(server, second: dict, third: dict) -> list[str]:
    """A long request holds the one sequence while two more arrive, one after the other; then it
    is cancelled, and the two run one at a time: which finishes first. The blocker outranks
    both, so neither preempts it (a preempting request could finish before the other arrives)."""
    request = greedy_ids_request(list(range(2, 30)), 400)
    request.priority = 1_000_000  # above every objective's and body's priority
    blocker = stub_for(server).Generate(request)
    await blocker.read()  # it runs
    order: list[str] = []

    async def run(name: str, kwargs: dict) -> None:
        status, reply, _ = await post(server, **kwargs)
        assert status == 200, reply
        order.append(name)

    low = asyncio.ensure_future(run("second", second))
    await _in_flight(server, 2)  # queued first
    high = asyncio.ensure_future(run("third", third))
    await _in_flight(server, 3)
    blocker.cancel()
    await asyncio.gather(low, high)
    return order


async def test_objective_header_sets_the_priority(trusting):
    objective = "x-gateway-inference-objective"
    order = await _finishing_order(
        trusting,
        {"prompt": "a", "headers": {objective: "sheddable"}},
        {"prompt": "b", "headers": {objective: "critical"}},
    )
    assert order == ["third", "second"]


async def test_body_priority_is_vllms_lower_first(trusting):
    order = await _finishing_order(
        trusting, {"prompt": "a", "priority": 5}, {"prompt": "b", "priority": -5}
    )
    assert order == ["third", "second"]
    order = await _finishing_order(
        trusting, {"prompt": "a", "priority": -5}, {"prompt": "b", "priority": 5}
    )
    assert order == ["second", "third"]


TTFT = "x-slo-ttft-ms"


async def test_ttft_target_header_admits_the_earliest_due_first(trusting):
    # The second arrived first but may wait a minute; the third is due in 50 ms.
    order = await _finishing_order(
        trusting,
        {"prompt": "a", "headers": {TTFT: "60000"}},
        {"prompt": "b", "headers": {TTFT: "50"}},
    )
    assert order == ["third", "second"]
    # A request without a target waits behind one with a target (a decimal, as llm-d sends it).
    order = await _finishing_order(
        trusting, {"prompt": "a"}, {"prompt": "b", "headers": {TTFT: "2500.5"}}
    )
    assert order == ["third", "second"]


async def test_ttft_target_orders_within_a_priority_not_across(trusting):
    objective = "x-gateway-inference-objective"
    order = await _finishing_order(
        trusting,
        {"prompt": "a", "headers": {objective: "critical", TTFT: "60000"}},
        {"prompt": "b", "headers": {objective: "sheddable", TTFT: "1"}},
    )
    assert order == ["second", "third"]


async def test_request_id_is_echoed_and_used(trusting):
    status, reply, headers = await post(trusting, {"X-Request-Id": "trace-42"}, prompt="hi")
    assert status == 200 and headers["x-request-id"] == "trace-42"
    assert reply["id"] == "cmpl-trace-42"


@pytest.mark.parametrize(
    "headers, body, param",
    [
        ({"x-gateway-inference-objective": "gold"}, {}, "x-gateway-inference-objective"),
        ({"x-gateway-inference-fairness-id": ""}, {}, "x-gateway-inference-fairness-id"),
        ({"x-gateway-inference-fairness-id": "t" * 129}, {}, "tenant"),
        ({}, {"priority": 1 << 40}, "priority"),
        ({}, {"priority": "high"}, "priority"),
        ({}, {"cache_salt": "s" * 257}, "cache_salt"),
        ({"X-Request-Id": "r" * 257}, {}, "request_id"),
        ({TTFT: "0"}, {}, TTFT),
        ({TTFT: "-20"}, {}, TTFT),
        ({TTFT: "soon"}, {}, TTFT),
        ({TTFT: "nan"}, {}, TTFT),
        ({TTFT: "inf"}, {}, TTFT),
        ({TTFT: "4294967296"}, {}, TTFT),
    ],
)
async def test_bad_values_are_400_naming_the_field(trusting, headers, body, param):
    status, reply, _ = await post(trusting, headers, prompt="x", **body)
    assert status == 400, reply
    assert reply["error"]["param"] == param
    assert reply["error"]["message"].startswith(param) or param in reply["error"]["message"]
    if param == TTFT:  # the bound is named
        assert "(0, 4294967295]" in reply["error"]["message"]


async def test_no_header_is_read_without_trust(engine, trusting):
    await trusting.stop(grace_s=1)  # one scheduler per engine at a time
    server = await _scheduler(engine, trusted=False)
    try:
        fair, objective = "x-gateway-inference-fairness-id", "x-gateway-inference-objective"
        prompt = PREFIX + " untrusted"
        await post(server, {fair: "team-a"}, prompt=prompt)
        _, other, _ = await post(server, {fair: "team-b"}, prompt=prompt)
        assert cached(other) >= 32  # the header is not the tenant: one cache
        status, _, _ = await post(server, {objective: "gold"}, prompt="x")
        assert status == 200  # an unknown objective is not even looked at
        order = await _finishing_order(
            server,
            {"prompt": "a", "headers": {objective: "sheddable"}},
            {"prompt": "b", "headers": {objective: "critical"}},
        )
        assert order == ["second", "third"]  # arrival order: the header changed nothing
        status, _, _ = await post(server, {TTFT: "soon"}, prompt="x")
        assert status == 200  # not read, so not refused
        order = await _finishing_order(
            server,
            {"prompt": "a", "headers": {TTFT: "60000"}},
            {"prompt": "b", "headers": {TTFT: "1"}},
        )
        assert order == ["second", "third"]  # the target is not read either
    finally:
        await server.stop(grace_s=1)
