"""Prometheus metrics of the scheduler, served over HTTP at /metrics.

Gauges are refreshed after every step; counters and histograms are fed as requests produce
tokens and finish. A figure vLLM also exports (the queue, the running batch, the KV fraction,
token and prefix-cache counters, preemptions, the request latency histograms) is exported once,
under vLLM's name (metrics_vllm.py), so that routers that read them (the Gateway API Inference
Extension, llm-d), vLLM's dashboards and planserve's own read the same series. What vLLM has no
name for (steps, finish reasons in planserve's finer terms, speculation, the model service's
forward time, faults and overload) keeps a planserve_* name here.

Each server owns its registry, so several servers in one process (tests) do not collide.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)

from cython_ext.step_outputs import note_token_times
from scheduler_service.core.loras import LoraState
from scheduler_service.core.request import FinishReason, Request, RequestOutput
from scheduler_service.metrics_vllm import VllmMetrics

# No `_created` series beside each counter and histogram (as vLLM): a scrape every 50 ms renders
# a third fewer lines, and no router reads them.
disable_created_metrics()

# Seconds: from a few milliseconds (a tiny model's step) to minutes (a long queue).
_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
# A step's forward: 2.5-5 ms apart where decode steps fall, so a median read from them is within
# a few percent.
_FORWARD_BUCKETS = (
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.0125,
    0.015,
    0.0175,
    0.02,
    0.0225,
    0.025,
    0.0275,
    0.03,
    0.035,
    0.04,
    0.045,
    0.05,
    0.06,
    0.07,
    0.08,
    0.09,
    0.1,
    0.125,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._add_counters(self.registry)
        self._add_forward_histogram(self.registry)
        self._add_fault_metrics(self.registry)
        self.vllm = VllmMetrics(self.registry, _LATENCY_BUCKETS)
        self._last_token_time: dict[int, float] = {}  # by id(request)
        self._http: Optional[Any] = None  # the /metrics server, once serving

    def _add_counters(self, registry: CollectorRegistry) -> None:
        self.steps = Counter(
            "planserve_steps", "Steps executed by the model service.", registry=registry
        )
        self.finished = Counter(
            "planserve_requests_finished",
            "Samples finished, by reason.",
            ["reason"],
            registry=registry,
        )
        # Speculative decoding: acceptance rate = accepted / draft (rate() of both).
        self.draft_tokens = Counter(
            "planserve_spec_decode_draft_tokens",
            "Draft tokens proposed by speculative decoding.",
            registry=registry,
        )
        self.accepted_tokens = Counter(
            "planserve_spec_decode_accepted_tokens",
            "Draft tokens accepted by verification.",
            registry=registry,
        )
        self.lora_requests = Counter(
            "planserve_lora_requests",
            "Requests admitted per LoRA adapter (docs/lora.md).",
            ["lora_name"],
            registry=registry,
        )

    def _add_forward_histogram(self, registry: CollectorRegistry) -> None:
        # The model service's own time per step, to set beside the inter-token latency clients see.
        self.forward = Histogram(
            "planserve_model_forward_seconds",
            "Model service forward time per step (StepResult.forward_ns).",
            buckets=_FORWARD_BUCKETS,
            registry=registry,
        )

    def _add_fault_metrics(self, registry: CollectorRegistry) -> None:
        # Faults and overload (docs/operations.md).
        # 0 until the model service has computed a step (the readiness probe, a one-token step):
        # a scheduler still waiting for its model service at start is not up.
        self.engine_up = Gauge(
            "planserve_engine_up",
            "1 while the model service computes, 0 "
            "before its first step and while it is down and the scheduler "
            "reconnects.",
            registry=registry,
        )
        self.engine_up.set(0)
        self.engine_recoveries = Counter(
            "planserve_engine_recoveries",
            "Times the model service came back and every sequence in flight was recomputed.",
            registry=registry,
        )
        self.rejected = Counter(
            "planserve_requests_rejected",
            "Requests refused or cut for overload, by reason.",
            ["reason"],
            registry=registry,
        )

    def on_engine_facts(self, block_size: int, num_kv_blocks: int) -> None:
        """The model service described its KV cache (vllm:cache_config_info)."""
        self.vllm.on_capacity(block_size, num_kv_blocks)

    def on_engine_ready(self) -> None:
        """The model service computed its first step (the readiness probe)."""
        self.engine_up.set(1)

    def on_engine_up(self, up: bool) -> None:
        """The engine loop lost the model service (False) or got it back after a step (True)."""
        self.engine_up.set(1 if up else 0)
        if up:
            self.engine_recoveries.inc()

    def on_rejected(self, reason: str) -> None:
        """reason: queue_full, stream_buffer_full or draining."""
        self.rejected.labels(reason).inc()

    def on_lora_request(self, name: str) -> None:
        """A request for adapter `name` was admitted (planserve_lora_requests_total)."""
        self.lora_requests.labels(name).inc()

    def on_lora(self, loras: LoraState) -> None:
        """The adapters running and waiting after a step (vllm:lora_requests_info)."""
        self.vllm.on_lora(loras.max_loras, loras.running_names(), loras.waiting_names())

    def serve(self, host: str, port: int) -> int:
        """Serves /metrics; returns the bound port (port 0 picks a free one)."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def on_step(
        self, num_waiting: int, num_running: int, kv_usage: float, num_preemptions: int
    ) -> None:
        self.steps.inc()
        self.vllm.on_step(num_waiting, num_running, kv_usage, num_preemptions)

    def on_forward(self, forward_ns: int) -> None:
        self.forward.observe(forward_ns / 1e9)

    def on_speculation(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.draft_tokens.inc(num_draft_tokens)
        self.accepted_tokens.inc(num_accepted_tokens)

    def on_outputs(self, outputs: Sequence[tuple[Request, RequestOutput]]) -> None:
        """A step's outputs, counted at once: the tokens, each chunk's gap since its request's
        previous chunk, and each finished sample."""
        now = time.monotonic()
        gaps: list[float] = []
        num_tokens, finished = note_token_times(
            outputs if isinstance(outputs, list) else list(outputs),
            self._last_token_time,
            now,
            gaps,
        )
        for request, output in finished:
            self.vllm.on_finished(request, output, now)
            self.finished.labels(FinishReason(output.finish_reason).name.lower()).inc()
        self.vllm.on_tokens(num_tokens, gaps)
