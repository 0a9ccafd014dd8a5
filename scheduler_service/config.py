"""The scheduler service's one configuration: frozen, validated once at start.

Run-time capacity (KV blocks, slots, model length) is not configured here: it comes back from
the model service's Describe reply and is held by the scheduler, never written into this object.
"""
from __future__ import annotations

import dataclasses

from scheduler_service.core import policies

CHUNKING_MODES = ("interleaved", "prefill-first", "decode-priority")
PREEMPTION_MODES = ("auto", "recompute", "swap")
PREFIX_CACHE_SCOPES = ("global", "tenant")


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
    """host:port of the model service's EngineService; several replicas as a comma list
    ("h1:p1,h2:p2"), or `dns:///name:port` (a headless Service: one replica per address,
    re-resolved every replica_check_interval_s); see scheduler_service/engine/replicas.py."""

    router_weights: str = "prefix_affinity=2,kv_usage=1,waiting_tokens=1"
    """With several replicas: the scorers that place a new request and their weights
    (scheduler_service/engine/scorers: kv_usage, waiting_tokens, prefix_affinity, random, or a plugin)."""

    replica_check_interval_s: float = 5.0
    """With several replicas: how often DNS is re-resolved, replicas that failed to connect are
    retried, and replicas down with requests are drained."""

    overlap: bool = True
    """Build and send step N+1 while the model service computes step N (at most two plans in
    flight; scheduler_service/engine/loop.py). Steps go one at a time while a request with a grammar
    is running or the engine speculates (a plan then depends on the previous step's tokens)."""

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
    """Reuse the KV of cached full blocks shared with earlier requests (same salt: see
    prefix_cache_scope)."""

    prefix_cache_scope: str = "global"
    """Which requests may share cached prefix blocks. `global`: those with the same cache_salt
    (no cache_salt: every such request); `tenant`: only those of the same tenant with the same
    cache_salt (the tenant joins the salt). A hit is faster than a miss, so requests sharing a
    cache can learn by timing whether others sent a prefix (docs/operations.md "Prefix cache")."""

    preemption_mode: str = "auto"
    """How a running sequence makes room when KV blocks run out: `swap` copies its computed KV
    to the model service's host swap space and resumes it from there; `recompute` frees it and
    recomputes its tokens on resume; `auto` (default) swaps when the model service has swap
    space (--swap-space). Swap falls back to recompute for a sequence that does not fit."""

    max_queue_len: int = 1024
    """Most requests waiting for admission; beyond it new requests get RESOURCE_EXHAUSTED."""

    engine_connect_timeout_s: float = 300.0
    """How long to wait for the model service to answer Describe at start (it loads weights)."""

    max_queue_tokens: int = 1 << 20
    """Most prompt tokens (still to compute) waiting for admission; beyond it new requests get
    RESOURCE_EXHAUSTED with a retry hint. A request arriving at an empty queue is always taken."""

    max_stream_buffer_chunks: int = 1024
    """Most chunks one stream holds that its client has not read yet (beyond gRPC's flow-control
    window); past it the stream's requests are aborted with RESOURCE_EXHAUSTED."""

    drain_grace_s: float = 30.0
    """On SIGTERM: how long running requests may take to finish (health NOT_SERVING and new
    requests UNAVAILABLE meanwhile) before the process exits anyway."""

    tls_cert: str = ""
    """PEM certificate chain of the public API (with tls_key): TLS instead of plaintext."""

    tls_key: str = ""
    """PEM private key of tls_cert."""

    tls_client_ca: str = ""
    """PEM CA bundle: when set (with TLS), clients must present a certificate it signed (mTLS)."""

    engine_tls_ca: str = ""
    """PEM CA bundle that signed the model service's certificate: TLS to the model service."""

    engine_tls_cert: str = ""
    """PEM client certificate for the model service (mutual TLS; with engine_tls_key)."""

    engine_tls_key: str = ""
    """PEM private key of engine_tls_cert."""

    engine_tls_server_name: str = ""
    """Name to check the model service's certificate against, when not the engine address host."""

    auth_token_file: str = ""
    """File holding the bearer token the public API requires (`authorization: Bearer <token>`);
    empty: no authentication. Health checks and reflection stay open."""

    max_concurrent_streams: int = 1024
    """Most concurrent RPCs per HTTP/2 connection of the public API."""

    max_message_bytes: int = 4 << 20
    """Largest request message the public API accepts (bigger ones get RESOURCE_EXHAUSTED)."""

    def validate(self) -> "SchedulerConfig":
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [-1, 65535], got {self.metrics_port}")
        if not -1 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [-1, 65535], got {self.http_port}")
        if any(":" not in part for part in self.engine_address.split(",")):
            raise ValueError(f"engine_address must be host:port (or a comma list of them, or "
                             f"dns:///name:port), got {self.engine_address!r}")
        if "," in self.engine_address or self.engine_address.startswith("dns:///"):
            from scheduler_service.engine import scorers
            scorers.parse_weights(self.router_weights)  # names the bad scorer or weight
        if self.replica_check_interval_s <= 0:
            raise ValueError(
                f"replica_check_interval_s must be > 0, got {self.replica_check_interval_s}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        # Fails with the valid names when the policy is unknown or does not import.
        policies.resolve(self.policy)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption_mode!r}")
        if self.chunking_mode not in CHUNKING_MODES:
            raise ValueError(f"chunking_mode must be one of {', '.join(CHUNKING_MODES)}, "
                             f"got {self.chunking_mode!r}")
        if self.prefix_cache_scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(f"prefix_cache_scope must be one of {', '.join(PREFIX_CACHE_SCOPES)}, "
                             f"got {self.prefix_cache_scope!r}")
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
        if self.max_queue_tokens < 1:
            raise ValueError(f"max_queue_tokens must be >= 1, got {self.max_queue_tokens}")
        if self.max_stream_buffer_chunks < 1:
            raise ValueError(
                f"max_stream_buffer_chunks must be >= 1, got {self.max_stream_buffer_chunks}")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: set both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca needs tls_cert and tls_key (mutual TLS is TLS)")
        if bool(self.engine_tls_cert) != bool(self.engine_tls_key):
            raise ValueError("engine_tls_cert and engine_tls_key go together: set both or neither")
        if self.engine_tls_cert and not self.engine_tls_ca:
            raise ValueError("engine_tls_cert needs engine_tls_ca (mutual TLS is TLS)")
        if self.max_concurrent_streams < 1:
            raise ValueError(
                f"max_concurrent_streams must be >= 1, got {self.max_concurrent_streams}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        return self
