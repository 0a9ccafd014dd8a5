"""Prometheus metrics: load gauges (also under vLLM's names), counters, histograms, /metrics."""
import asyncio
import urllib.request

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from api import complete, greedy_ids_request, stub_for, wait_until_idle
from scheduler_service.metrics import Metrics


def _samples(text: str) -> dict:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _read(server) -> dict:
    return _samples(generate_latest(server.metrics.registry).decode())


def _delta(after: dict, before: dict, name: str, labels=()) -> float:
    key = (name, labels)
    return after.get(key, 0) - before.get(key, 0)


async def test_metrics_follow_the_load(tiny_server):
    stub = stub_for(tiny_server)
    before = _read(tiny_server)
    prefix = list(range(3000, 3064))  # 4 full blocks
    await complete(stub, greedy_ids_request(prefix + [1], 5))
    call = stub.Generate(greedy_ids_request(list(range(1, 50)), 400))
    await call.read()
    await asyncio.gather(*(complete(stub, greedy_ids_request(prefix + [i], 6))
                           for i in range(2, 8)))
    busy = _read(tiny_server)
    assert busy[("vllm:num_requests_running", ())] >= 1
    assert busy[("vllm:kv_cache_usage_perc", ())] > 0
    assert busy[("planserve_num_requests_running", ())] == busy[("vllm:num_requests_running", ())]
    assert _delta(busy, before, "planserve_requests_finished_total", (("reason", "length"),)) == 7
    assert _delta(busy, before, "planserve_generation_tokens_total") >= 5 + 6 * 6 + 1
    assert _delta(busy, before, "planserve_prefix_cache_hit_tokens_total") == 6 * 64
    assert _delta(busy, before, "planserve_time_to_first_token_seconds_count") == 7
    assert _delta(busy, before, "planserve_inter_token_latency_seconds_count") >= 7 * 4
    # One forward time per step, each under the model's own step (a few ms for the tiny model).
    steps = _delta(busy, before, "planserve_steps_total")
    assert steps > 0 and _delta(busy, before, "planserve_model_forward_seconds_count") == steps
    assert 0 < _delta(busy, before, "planserve_model_forward_seconds_sum") < steps * 1.0
    call.cancel()
    await wait_until_idle(tiny_server)
    await asyncio.sleep(0.05)
    idle = _read(tiny_server)
    assert _delta(idle, before, "planserve_requests_finished_total",
                  (("reason", "cancelled"),)) == 1


def test_metrics_endpoint_serves_the_registry():
    metrics = Metrics()
    port = metrics.serve("127.0.0.1", 0)
    try:
        metrics.on_step(num_waiting=3, num_running=2, kv_usage=0.25, num_preemptions=1)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        samples = _samples(text.decode())
        assert samples[("vllm:num_requests_waiting", ())] == 3
        assert samples[("vllm:kv_cache_usage_perc", ())] == 0.25
        assert samples[("planserve_preemptions_total", ())] == 1
    finally:
        metrics.close()
