"""Prometheus metrics: load gauges, counters and histograms (each figure once: vLLM's name where
vLLM has one), /metrics."""
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
    assert _delta(busy, before, "planserve_requests_finished_total", (("reason", "length"),)) == 7
    assert _delta(busy, before, "vllm:generation_tokens_total") >= 5 + 6 * 6 + 1
    assert _delta(busy, before, "vllm:prefix_cache_hits_total") == 6 * 64
    assert _delta(busy, before, "vllm:time_to_first_token_seconds_count") == 7
    assert _delta(busy, before, "vllm:inter_token_latency_seconds_count") >= 7 * 4
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
        assert samples[("vllm:num_preemptions_total", ())] == 1
    finally:
        metrics.close()


def test_a_figure_vllm_names_is_exported_once_under_vllms_name():
    """One owner per figure: the copies planserve once kept beside vLLM's names are gone (a
    scrape every 50 ms renders each line), and vLLM's names are there."""
    names = {family.name for family in Metrics().registry.collect()}
    for dropped in ("planserve_num_requests_waiting", "planserve_num_requests_running",
                    "planserve_kv_cache_usage_ratio", "planserve_preemptions",
                    "planserve_prompt_tokens", "planserve_prefix_cache_hit_tokens",
                    "planserve_generation_tokens", "planserve_queue_time_seconds",
                    "planserve_time_to_first_token_seconds",
                    "planserve_inter_token_latency_seconds",
                    "planserve_e2e_request_latency_seconds"):
        assert dropped not in names
    for kept in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_preemptions",
                 "vllm:prompt_tokens", "vllm:prefix_cache_hits", "vllm:generation_tokens",
                 "vllm:request_queue_time_seconds", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
                 "planserve_steps", "planserve_requests_finished",
                 "planserve_model_forward_seconds"):
        assert kept in names
