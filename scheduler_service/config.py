"""The scheduler service's one configuration: frozen, validated once at start.

Run-time capacity (KV blocks, slots, model length) is not configured here: it comes back from
the model service's Describe reply and is held by the scheduler, never written into this object.
"""
from __future__ import annotations

import dataclasses

from scheduler_service import policies

CHUNKING_MODES = ("interleaved", "prefill-first", "decode-priority")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    host: str = "127.0.0.1"
    """Interface the public GenerationService listens on."""

    port: int = 50051
    """Port of the public API; 0 picks a free one (printed at start)."""

    metrics_port: int = -1
    """Port of the Prometheus /metrics endpoint (on `host`); 0 picks a free one, -1 (the
    library default) serves none. `planserve serve` and `planserve scheduler` default to 9400."""

    http_port: int = -1
    """Port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /health) on `host`; 0 picks a free one, -1 (the library default) serves none.
    `planserve serve` and `planserve scheduler` default to 8000."""

    engine_address: str = "127.0.0.1:50052"
    """host:port of the model service's EngineService."""

    max_num_seqs: int = 64
    """Most sequences scheduled in one step (running decodes plus prefill chunks)."""

    max_num_batched_tokens: int = 512
    """Token budget of one step, shared by decodes (1 token each) and prefill chunks."""

    policy: str = "fcfs"
    """Waiting order and preemption rule: a registered policy name (fcfs, priority, sjf, edf,
    fair, lpm), a dotted path `package.module:Class`, or an entry point of `planserve.policies`."""

    chunking_mode: str = "interleaved"
    """How prompt chunks and decodes share a step's budget:
    `interleaved`: running sequences in admission order (decodes and unfinished prompts
        alike), then waiting prompts, with every step a mixed batch;
    `prefill-first`: prompt chunks (running, then waiting) first, decodes get what is left:
        shorter time to first token, longer gaps between tokens while prompts arrive;
    `decode-priority`: every decode first, then at most one prompt chunk per step: the
        steadiest inter-token latency, slower admission."""

    max_prefill_chunk: int = 0
    """Most prompt tokens one sequence computes in one step (0: up to the whole budget), so
    that a long prompt cannot take a step's budget from the others alone."""

    decode_reserve_tokens: int = 16
    """Tokens of growth kept free for every running sequence when admitting a new one, so
    that admission does not cause preemption a few steps later (SGLang's PrefillAdder rule)."""

    enable_prefix_caching: bool = True
    """Reuse the KV of cached full blocks shared with earlier requests (same cache_salt)."""

    max_queue_len: int = 1024
    """Most requests waiting for admission; beyond it new requests get RESOURCE_EXHAUSTED."""

    engine_connect_timeout_s: float = 300.0
    """How long to wait for the model service to answer Describe at start (it loads weights)."""

    def validate(self) -> "SchedulerConfig":
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [-1, 65535], got {self.metrics_port}")
        if not -1 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [-1, 65535], got {self.http_port}")
        if ":" not in self.engine_address:
            raise ValueError(f"engine_address must be host:port, got {self.engine_address!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        # Fails with the valid names when the policy is unknown or does not import.
        policies.resolve(self.policy)
        if self.chunking_mode not in CHUNKING_MODES:
            raise ValueError(f"chunking_mode must be one of {', '.join(CHUNKING_MODES)}, "
                             f"got {self.chunking_mode!r}")
        if self.max_prefill_chunk < 0:
            raise ValueError(f"max_prefill_chunk must be >= 0, got {self.max_prefill_chunk}")
        if self.decode_reserve_tokens < 0:
            raise ValueError(
                f"decode_reserve_tokens must be >= 0, got {self.decode_reserve_tokens}")
        if self.max_queue_len < 1:
            raise ValueError(f"max_queue_len must be >= 1, got {self.max_queue_len}")
        if self.engine_connect_timeout_s <= 0:
            raise ValueError(
                f"engine_connect_timeout_s must be > 0, got {self.engine_connect_timeout_s}")
        return self
