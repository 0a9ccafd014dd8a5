"""The scheduler service's one configuration: frozen, validated once at start.

Run-time capacity (KV blocks, slots, model length) is not configured here: it comes back from
the model service's Describe reply and is held by the scheduler, never written into this object.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    host: str = "127.0.0.1"
    """Interface the public GenerationService listens on."""

    port: int = 50051
    """Port of the public API; 0 picks a free one (printed at start)."""

    engine_address: str = "127.0.0.1:50052"
    """host:port of the model service's EngineService."""

    max_num_seqs: int = 64
    """Most sequences scheduled in one step (running decodes plus prefill chunks)."""

    max_num_batched_tokens: int = 512
    """Token budget of one step, shared by decodes (1 token each) and prefill chunks."""

    max_queue_len: int = 1024
    """Most requests waiting for admission; beyond it new requests get RESOURCE_EXHAUSTED."""

    engine_connect_timeout_s: float = 300.0
    """How long to wait for the model service to answer Describe at start (it loads weights)."""

    def validate(self) -> "SchedulerConfig":
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if ":" not in self.engine_address:
            raise ValueError(f"engine_address must be host:port, got {self.engine_address!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_queue_len < 1:
            raise ValueError(f"max_queue_len must be >= 1, got {self.max_queue_len}")
        if self.engine_connect_timeout_s <= 0:
            raise ValueError(
                f"engine_connect_timeout_s must be > 0, got {self.engine_connect_timeout_s}")
        return self
