"""/metrics on the HTTP serving port under vLLM's names, as the Gateway API Inference Extension
and llm-d's endpoint picker scrape it: every name, type and label, parsed by prometheus_client's
own parser, and the values right after a real workload on the tiny model."""

from __future__ import annotations

import asyncio
import time
import urllib.request

from api import complete, greedy_ids_request, stub_for, wait_until_idle
from prometheus_client.parser import text_string_to_metric_families

GAUGES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:lora_requests_info",
)
HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
)
COUNTERS = (
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:num_preemptions",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
)
REQUEST_HISTOGRAMS = [name for name in HISTOGRAMS if "inter_token" not in name]


def _scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        return response.read().decode()


async def scrape(server) -> tuple[dict, dict]:
    """(family name -> type, (sample name, sorted labels) -> value) of the HTTP port's /metrics."""
    text = await asyncio.to_thread(_scrape_text, server.http_port)
    families = list(text_string_to_metric_families(text))
    types = {family.name: family.type for family in families}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in families
        for s in family.samples
    }
    return types, samples


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0) - before.get(key, 0)


def labelled(samples: dict, name: str) -> list[tuple[dict, float]]:
    return [(dict(labels), value) for (sample, labels), value in samples.items() if sample == name]


async def test_every_vllm_name_has_its_type_and_labels(tiny_server):
    types, samples = await scrape(tiny_server)
    for name in GAUGES:
        assert types[name] == "gauge", name
    for name in HISTOGRAMS:
        assert types[name] == "histogram", name
        assert ("%s_bucket" % name, (("le", "+Inf"),)) in samples
    for name in COUNTERS:
        assert types[name] == "counter", name
    facts = tiny_server.loop.scheduler.facts
    assert labelled(samples, "vllm:cache_config_info") == [
        ({"block_size": str(facts.block_size), "num_gpu_blocks": str(facts.num_kv_blocks)}, 1.0)
    ]
    assert (facts.block_size, facts.num_kv_blocks) == (16, 64)  # tests/conftest.py's tiny engine
    [(lora_labels, stamp)] = labelled(samples, "vllm:lora_requests_info")
    assert lora_labels == {
        "max_lora": "0",
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
    assert time.time() - 24 * 3600 < stamp <= time.time()  # a unix time, as vLLM's
    reasons = {
        labels["finished_reason"] for labels, _ in labelled(samples, "vllm:request_success_total")
    }
    assert reasons == {"stop", "length", "abort", "error"}


async def test_token_counters_and_histograms_after_a_workload(tiny_server):
    stub = stub_for(tiny_server)
    _, before = await scrape(tiny_server)
    # 4 full blocks of 16, a prefix no other test on the shared server uses (else it is cached)
    prefix = list(range(3500, 3564))
    await complete(stub, greedy_ids_request(prefix + [1], 5))
    await asyncio.gather(
        *(complete(stub, greedy_ids_request(prefix + [i], 6)) for i in range(2, 8))
    )
    await wait_until_idle(tiny_server)
    _, after = await scrape(tiny_server)
    assert delta(after, before, "vllm:prompt_tokens_total") == 7 * 65
    assert delta(after, before, "vllm:prefix_cache_queries_total") == 7 * 65
    assert delta(after, before, "vllm:prefix_cache_hits_total") == 6 * 64
    assert delta(after, before, "vllm:generation_tokens_total") == 5 + 6 * 6
    assert delta(after, before, "vllm:request_success_total", finished_reason="length") == 7
    for name in REQUEST_HISTOGRAMS:
        assert delta(after, before, f"{name}_count") == 7, name
    # A sample's gaps: 4 for the first request's 5 tokens (one token per chunk), 5 for the others.
    assert delta(after, before, "vllm:inter_token_latency_seconds_count") == 4 + 6 * 5
    # Queue + prefill = TTFT, summed over the same requests (the same clock, the same stamps).
    queue = delta(after, before, "vllm:request_queue_time_seconds_sum")
    prefill = delta(after, before, "vllm:request_prefill_time_seconds_sum")
    ttft = delta(after, before, "vllm:time_to_first_token_seconds_sum")
    assert abs(queue + prefill - ttft) < 1e-6
    assert ttft < delta(after, before, "vllm:e2e_request_latency_seconds_sum")


async def test_queue_gauges_and_kv_fraction_follow_the_load(tiny_server):
    """24 requests against 16 sequences and 64 blocks: some wait and some get preempted; the
    gauges show it while they run, and come back to the scheduler's own numbers when idle."""
    stub = stub_for(tiny_server)
    _, before = await scrape(tiny_server)
    work = [
        asyncio.ensure_future(complete(stub, greedy_ids_request([5 + i] * 40, 60)))
        for i in range(24)
    ]
    seen_waiting = seen_running = 0.0
    while not all(task.done() for task in work):
        _, busy = await scrape(tiny_server)
        waiting = busy[("vllm:num_requests_waiting", ())]
        running = busy[("vllm:num_requests_running", ())]
        assert 0 <= running <= 16 and waiting + running <= 24
        assert 0 <= busy[("vllm:kv_cache_usage_perc", ())] <= 1
        seen_waiting, seen_running = max(seen_waiting, waiting), max(seen_running, running)
        await asyncio.sleep(0.02)
    await asyncio.gather(*work)
    await wait_until_idle(tiny_server)
    assert seen_waiting >= 1 and seen_running >= 2
    _, idle = await scrape(tiny_server)
    kv = tiny_server.loop.scheduler.kv
    assert idle[("vllm:num_requests_waiting", ())] == 0
    assert idle[("vllm:num_requests_running", ())] == 0
    assert idle[("vllm:kv_cache_usage_perc", ())] == (
        (kv.num_usable_blocks - kv.num_free_blocks) / kv.num_usable_blocks
    )
    assert delta(idle, before, "vllm:request_success_total", finished_reason="length") == 24
    assert delta(idle, before, "vllm:generation_tokens_total") == 24 * 60
    preempted = tiny_server.loop.scheduler.num_preemptions_total
    assert delta(idle, before, "vllm:num_preemptions_total") >= 1
    assert idle[("vllm:num_preemptions_total", ())] == preempted


async def test_a_cancelled_request_counts_as_abort(tiny_server):
    stub = stub_for(tiny_server)
    _, before = await scrape(tiny_server)
    call = stub.Generate(greedy_ids_request(list(range(1, 20)), 400))
    await call.read()
    call.cancel()
    await wait_until_idle(tiny_server)
    await asyncio.sleep(0.05)
    _, after = await scrape(tiny_server)
    assert delta(after, before, "vllm:request_success_total", finished_reason="abort") == 1
    assert delta(after, before, "vllm:request_success_total", finished_reason="length") == 0


def _parsed(text: str) -> list:
    return [
        (
            f.name,
            f.type,
            f.documentation,
            sorted((s.name, sorted(s.labels.items()), s.value) for s in f.samples),
        )
        for f in text_string_to_metric_families(text)
    ]


async def test_the_fast_text_reads_as_generate_latest(tiny_server):
    """The serving port's renderer (metrics_text.py) against prometheus_client's own, parsed by
    its parser: the live registry after the workloads above, and label values and help text that
    need escaping, counters, infinities and NaN."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    from scheduler_service.metrics_text import TextRenderer

    live = tiny_server.metrics.registry
    renderer = TextRenderer(live)
    for _ in range(2):  # the second render comes from the kept prefixes
        assert _parsed(renderer.render().decode()) == _parsed(generate_latest(live).decode())
    odd = CollectorRegistry()
    gauge = Gauge("odd_gauge", "help with \\ and\nnewline", ["label"], registry=odd)
    for i, value in enumerate(['quote " here', "back\\slash", "new\nline", ""]):
        gauge.labels(value).set(i - 1.5)
    Gauge("odd_big", "big", registry=odd).set(1e22)
    Gauge("odd_inf", "inf", registry=odd).set(float("-inf"))
    Counter("odd_requests", "a counter", ["a", "b"], registry=odd).labels("x", "y").inc(3)
    text = TextRenderer(odd).render().decode()
    assert _parsed(text) == _parsed(generate_latest(odd).decode())
    Gauge("odd_nan", "nan", registry=odd).set(float("nan"))
    assert "odd_nan NaN\n" in TextRenderer(odd).render().decode()
