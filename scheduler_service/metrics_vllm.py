"""The scheduler's figures under vLLM's metric names, for the fleet's routers and dashboards.

The Gateway API Inference Extension's endpoint picker (and llm-d's) scrapes /metrics on a pod's
serving port and reads vLLM's names: the queue (`vllm:num_requests_waiting`), the running batch,
the KV fraction, the block geometry (`vllm:cache_config_info`) and the adapters
(`vllm:lora_requests_info`). vLLM's request histograms and token counters follow so that a
vLLM dashboard works unchanged. planserve's own names (metrics.py) stay beside them.

Where planserve's vocabulary differs from vLLM's it is translated here, once:
finish reasons eos and stop are vLLM's `stop`, cancelled and deadline its `abort`.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from scheduler_service.core.request import FinishReason, Request, RequestOutput
from scheduler_service.metrics_batch import StepHistogram

# vLLM's `finished_reason` label values.
VLLM_FINISH_REASON = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",
    FinishReason.DEADLINE: "abort",
    FinishReason.ERROR: "error",
}

# Request-level latency histograms: (vLLM name, help). Seconds, observed once per finished sample.
_REQUEST_HISTOGRAMS = (
    ("time_to_first_token", "vllm:time_to_first_token_seconds", "Arrival to first token."),
    ("e2e", "vllm:e2e_request_latency_seconds", "Arrival to finish."),
    ("queue", "vllm:request_queue_time_seconds", "Arrival to first scheduled step."),
    ("prefill", "vllm:request_prefill_time_seconds", "First scheduled step to first token."),
    ("decode", "vllm:request_decode_time_seconds", "First token to finish."),
)


class VllmMetrics:
    """vLLM's gauges, counters and histograms in `registry`, fed by metrics.Metrics."""

    def __init__(self, registry: CollectorRegistry, buckets: tuple[float, ...]):
        self._add_gauges(registry)
        self._add_counters(registry)
        self.histograms = {
            key: Histogram(name, text, buckets=buckets, registry=registry)
            for key, name, text in _REQUEST_HISTOGRAMS
        }
        self.inter_token = StepHistogram(
            "vllm:inter_token_latency_seconds",
            "Time between a request's consecutive token chunks.",
            buckets,
            registry,
        )

    def _add_gauges(self, registry: CollectorRegistry) -> None:
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting for admission.", registry=registry
        )
        self.running = Gauge(
            "vllm:num_requests_running",
            "Sequences running (parallel samples count one each).",
            registry=registry,
        )
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction (0-1, as vLLM's) of the usable KV blocks held by sequences.",
            registry=registry,
        )
        self.cache_config = Gauge(
            "vllm:cache_config_info",
            "The KV cache's geometry in the labels (value 1), as vLLM's.",
            ["block_size", "num_gpu_blocks"],
            registry=registry,
        )
        # vLLM sets the value to the unix time of the update; the lists are comma-joined adapter
        # names (empty lists and max_lora 0 without adapters); one label set at a time.
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running and waiting LoRA adapters in the labels; the value is the unix time.",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=registry,
        )
        self._lora_labels = ("0", "", "")
        self.lora_info.labels(*self._lora_labels).set(time.time())

    def _add_counters(self, registry: CollectorRegistry) -> None:
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of finished samples.", registry=registry
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated.", registry=registry
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Finished samples by vLLM's finish reason (stop, length, abort, error).",
            ["finished_reason"],
            registry=registry,
        )
        for reason in sorted(set(VLLM_FINISH_REASON.values())):
            self.request_success.labels(reason)  # every reason present from the start, at 0
        self.preemptions = Counter(
            "vllm:num_preemptions", "Sequences preempted.", registry=registry
        )
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (counted when a sample finishes).",
            registry=registry,
        )
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache (counted when a sample finishes).",
            registry=registry,
        )

    def on_capacity(self, block_size: int, num_gpu_blocks: int) -> None:
        """The model service's Describe: the KV geometry (one label set; a new one replaces it
        after a model-service restart with other numbers)."""
        self.cache_config.clear()
        self.cache_config.labels(str(block_size), str(num_gpu_blocks)).set(1)

    def on_lora(self, max_lora: int, running: list[str], waiting: list[str]) -> None:
        """The adapters running and waiting after a step (vllm:lora_requests_info)."""
        labels = (str(max_lora), ",".join(running), ",".join(waiting))
        if labels != self._lora_labels:
            self.lora_info.clear()
            self._lora_labels = labels
        self.lora_info.labels(*labels).set(time.time())

    def on_step(
        self, num_waiting: int, num_running: int, kv_usage: float, num_preemptions: int
    ) -> None:
        self.waiting.set(num_waiting)
        self.running.set(num_running)
        self.kv_usage.set(kv_usage)
        if num_preemptions:
            self.preemptions.inc(num_preemptions)

    def on_tokens(self, num_tokens: int, gaps_s: Sequence[float]) -> None:
        """A step's output tokens, and the time since each chunk's previous one."""
        if num_tokens:
            self.generation_tokens.inc(num_tokens)
        self.inter_token.observe_many(gaps_s)

    def on_finished(self, request: Request, output: RequestOutput, now: float) -> None:
        """A sample finished: its reason, its tokens and its request-level times."""
        assert output.finish_reason is not None
        self.request_success.labels(VLLM_FINISH_REASON[output.finish_reason]).inc()
        if output.usage is not None:
            self.prompt_tokens.inc(output.usage.prompt_tokens)
            self.prefix_cache_queries.inc(output.usage.prompt_tokens)
            self.prefix_cache_hits.inc(output.usage.cached_tokens)
        scheduled, first_token = request.first_scheduled_time, request.first_token_time
        spans: dict[str, tuple[Optional[float], Optional[float]]] = {
            "e2e": (request.arrival_time, now),
            "queue": (request.arrival_time, scheduled),
        }
        if first_token is not None:
            spans["time_to_first_token"] = (request.arrival_time, first_token)
            spans["prefill"] = (scheduled, first_token)
            spans["decode"] = (first_token, now)
        for key, (start, end) in spans.items():
            if start is not None and end is not None:
                self.histograms[key].observe(max(end - start, 0.0))
