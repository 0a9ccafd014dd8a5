"""The scheduler service's one configuration: frozen, validated once at start.

Run-time capacity (KV blocks, slots, model length) is not configured here: it comes back from
the model service's Describe reply and is held by the scheduler, never written into this object.

Each field is declared once (config_fields): its default, its bound and its flag in the `setting`,
its help in the docstring under it; the CLI's flags (cli.py) are made from them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from config_fields import check_bounds, setting
from scheduler_service.core import policies

CHUNKING_MODES = ("interleaved", "prefill-first", "decode-priority")
PREEMPTION_MODES = ("auto", "recompute", "swap")
PREFIX_CACHE_SCOPES = ("global", "tenant")
INT32 = (-(1 << 31), (1 << 31) - 1)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    host: str = "127.0.0.1"
    """Interface the public GenerationService listens on."""

    port: int = setting(50051, low=0, high=65535)
    """Port of the public API; 0 picks a free one (printed at start)."""

    metrics_port: int = setting(-1, low=-1, high=65535, cli_default=9400)
    """Port of the Prometheus /metrics endpoint (on `host`); 0 picks a free one, -1 (the
    library default) serves none. `planserve serve` and `planserve scheduler` default to 9400."""

    http_port: int = setting(-1, low=-1, high=65535, cli_default=8000)
    """Port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /health) on `host`; 0 picks a free one, -1 (the library default) serves none.
    `planserve serve` and `planserve scheduler` default to 8000."""

    frontend_processes: Optional[int] = setting(None, low=0, high=64)
    """Processes that serve the public doors (gRPC GenerationService, health, reflection, the
    OpenAI HTTP API) on `port` and `http_port`, sharing each port (SO_REUSEPORT), so that client
    I/O never runs on the scheduler loop's thread (scheduler_service/frontends). This process
    keeps the scheduler, the engine loop(s), /metrics and KV events. 0: the doors run in this
    process, beside the scheduler loop. Not given: 0, except that `planserve serve` starts one
    per 4 host cores, at most 4, when its model service runs on a GPU (frontends/count.py)."""

    engine_address: str = setting("127.0.0.1:50052", cli=False)  # --engine, or serve's own
    """host:port of the model service's EngineService; several replicas as a comma list
    ("h1:p1,h2:p2"), or `dns:///name:port` (a headless Service: one replica per address,
    re-resolved every replica_check_interval_s); see scheduler_service/engine/replicas.py."""

    router_weights: str = "prefix_affinity=2,kv_usage=1,waiting_tokens=1"
    """With several replicas: the scorers that place a new request and their weights
    (scheduler_service/engine/scorers: kv_usage, waiting_tokens, prefix_affinity, random, or a
    plugin)."""

    replica_check_interval_s: float = setting(5.0, above=0, flag="replica-check-interval")
    """With several replicas: how often DNS is re-resolved, replicas that failed to connect are
    retried, and replicas down with requests are drained."""

    overlap: bool = setting(True, flag="no-overlap")
    """Build and send step N+1 while the model service computes step N (at most two plans in
    flight; scheduler_service/engine/loop.py). Steps go one at a time while a request with a grammar
    is running or the engine speculates (a plan then depends on the previous step's tokens)."""

    max_num_seqs: Optional[int] = setting(None, low=1)
    """Most sequences scheduled in one step (running decodes plus prefill chunks). None: the
    model service's choice for its device (Describe's step_max_seqs: 64 on the CPU, its
    max_num_slots on CUDA); never above the slots it holds."""

    max_num_batched_tokens: Optional[int] = setting(None, low=1)
    """Token budget of one step, shared by decodes (1 token each) and prefill chunks. None: the
    model service's choice for its device (Describe's step_token_budget: 512 on the CPU, 8192 on
    CUDA), the step it profiled before sizing its KV cache. `planserve serve` passes a value
    given here to the model service as its profile_step_tokens."""

    policy: str = "fcfs"
    """Waiting order and preemption rule: a registered policy name (fcfs, priority, sjf, edf,
    fair, lpm), a dotted path `package.module:Class`, or an entry point of `planserve.policies`."""

    chunking_mode: str = setting("interleaved", choices=CHUNKING_MODES)
    """How prompt chunks and decodes share a step's budget:
    `interleaved`: running sequences in admission order (decodes and unfinished prompts
        alike), then waiting prompts, with every step a mixed batch;
    `prefill-first`: prompt chunks (running, then waiting) first, decodes get what is left:
        shorter time to first token, longer gaps between tokens while prompts arrive;
    `decode-priority`: every decode first, then at most one prompt chunk per step: the
        steadiest inter-token latency, slower admission."""

    max_prefill_chunk: int = setting(0, low=0)
    """Most prompt tokens one sequence computes in one step (0: up to the whole budget), so
    that a long prompt cannot take a step's budget from the others alone."""

    decode_reserve_tokens: int = setting(16, low=0, cli=False)
    """Tokens of growth kept free for every running sequence when admitting a new one, so
    that admission does not cause preemption a few steps later (SGLang's PrefillAdder rule)."""

    enable_prefix_caching: bool = setting(True, flag="no-prefix-caching")
    """Reuse the KV of cached full blocks shared with earlier requests (same salt: see
    prefix_cache_scope)."""

    prefix_cache_scope: str = setting("global", choices=PREFIX_CACHE_SCOPES)
    """Which requests may share cached prefix blocks. `global`: those with the same cache_salt
    (no cache_salt: every such request); `tenant`: only those of the same tenant with the same
    cache_salt (the tenant joins the salt). A hit is faster than a miss, so requests sharing a
    cache can learn by timing whether others sent a prefix (docs/operations.md "Prefix cache")."""

    preemption_mode: str = setting("auto", choices=PREEMPTION_MODES)
    """How a running sequence makes room when KV blocks run out: `swap` copies its computed KV
    to the model service's host swap space and resumes it from there; `recompute` frees it and
    recomputes its tokens on resume; `auto` (default) swaps when the model service has swap
    space (--swap-space). Swap falls back to recompute for a sequence that does not fit."""

    max_queue_len: int = setting(1024, low=1)
    """Most requests waiting for admission; beyond it new requests get RESOURCE_EXHAUSTED."""

    engine_connect_timeout_s: float = setting(300.0, above=0, cli=False)
    """How long to wait for the model service to answer Describe at start (it loads weights)."""

    max_queue_tokens: int = setting(1 << 20, low=1)
    """Most prompt tokens (still to compute) waiting for admission; beyond it new requests get
    RESOURCE_EXHAUSTED with a retry hint. A request arriving at an empty queue is always taken."""

    max_stream_buffer_chunks: int = setting(1024, low=1)
    """Most outputs of one request (one sample) a stream holds that its client has not read yet,
    beyond gRPC's flow-control window; they wait merged into one chunk. Past it the stream's
    requests are aborted with RESOURCE_EXHAUSTED."""

    drain_grace_s: float = setting(30.0, low=0, flag="drain-grace-seconds")
    """On SIGTERM: how long running requests may take to finish (health NOT_SERVING and new
    requests UNAVAILABLE meanwhile) before the process exits anyway."""

    tls_cert: str = ""
    """PEM certificate chain of the public API (with tls_key): TLS instead of plaintext, on the
    gRPC port and the OpenAI HTTP port (HTTPS) alike."""

    tls_key: str = ""
    """PEM private key of tls_cert."""

    tls_client_ca: str = ""
    """PEM CA bundle: when set (with TLS), clients must present a certificate it signed (mTLS)."""

    engine_keepalive_s: float = setting(10.0, above=0, flag="engine-keepalive-seconds")
    """How often the scheduler pings each model service it is connected to; a ping unanswered
    for as long closes the connection, and the scheduler reconnects (resolving the address
    again) instead of waiting for TCP to give up on a model service whose host was lost
    (planserve/contract.py keepalive_options)."""

    engine_step_timeout_s: float = setting(600.0, low=0, flag="engine-step-timeout-seconds")
    """A step whose result has not come back this long is given up on: the model service is
    treated as down and reconnected (scheduler_service/engine/step_timeout.py). Above the model
    service's own --step-timeout-seconds, which ends a hung step first where it can. 0: never."""

    engine_tls_ca: str = ""
    """PEM CA bundle that signed the model service's certificate: TLS to the model service."""

    engine_tls_cert: str = ""
    """PEM client certificate for the model service (mutual TLS; with engine_tls_key)."""

    engine_tls_key: str = ""
    """PEM private key of engine_tls_cert."""

    engine_tls_server_name: str = setting("", cli=False)
    """Name to check the model service's certificate against, when not the engine address host."""

    auth_token_file: str = ""
    """File holding the bearer token the public API requires (`authorization: Bearer <token>`);
    empty: no authentication. Health checks and reflection stay open."""

    trust_gateway_headers: bool = False
    """Read the Gateway API Inference Extension's request headers on the HTTP API:
    `x-gateway-inference-fairness-id` becomes the tenant (the fair policy's key and, with
    prefix_cache_scope tenant, the prefix cache's), `x-gateway-inference-objective` a priority
    (gateway_objective_priorities), `x-slo-ttft-ms` a first-token target that orders waiting
    requests within a priority (earliest due first; it never ends a request). Off by default:
    any client could claim another tenant, so turn it on only where the gateway is the only way
    in (docs/gateway.md)."""

    gateway_objective_priorities: str = ""
    """With trust_gateway_headers: InferenceObjective names and the priority each gets
    ("critical=10,standard=0,sheddable=-10"; higher is more urgent). A request naming an
    objective not listed gets 400."""

    no_sse_direct_writes: bool = False
    """Send every chunk of a streamed HTTP response through its response task, Starlette and
    uvicorn's send. By default the common chunk is written to the socket where its output
    arrives (api/sse_direct.py; measured in docs/benchmarks.md)."""

    enable_reset_prefix_cache: bool = False
    """Serve POST /reset_prefix_cache on the HTTP API (behind the bearer token): forgets every
    cached prefix block while no request holds blocks (409 otherwise), as vLLM's. Off: 404."""

    enable_tokenizer_info_endpoint: bool = False
    """Serve GET /tokenizer_info on the HTTP API (behind the bearer token), as vLLM's flag of the
    same name: the special tokens, the chat template and the model's length, which an evaluation
    harness's remote tokenizer reads (with /tokenize and /detokenize). Off: 404."""

    kv_events_config: str = ""
    """KV-cache events as vLLM publishes them, as vLLM's JSON: '{"enable_kv_cache_events": true,
    "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "topic": "kv"}' (also
    replay_endpoint, buffer_steps, hwm, max_queue_size). A ZMQ PUB socket bound to exactly the
    endpoint; one batch per step (scheduler_service/engine/kv_events.py). The events carry every
    tenant's prompt tokens: bind where only the router reaches. Empty: none."""

    max_concurrent_streams: int = setting(1024, low=1)
    """Most concurrent RPCs per HTTP/2 connection of the public API."""

    max_message_bytes: int = setting(4 << 20, low=1024)
    """Largest request message the public API accepts (bigger ones get RESOURCE_EXHAUSTED)."""

    max_grammar_compile_s: float = setting(30.0, above=0)
    """Longest a request waits for its structured-output grammar (a JSON schema, a tool's
    parameters) to compile before it gets INVALID_ARGUMENT naming the field. The compile goes on
    in the background and is cached, so the same grammar sent again may find it ready; other
    requests never wait for it (it runs off the event loop)."""

    grammar_engine: str = setting("llguidance", choices=("llguidance", "outlines"))
    """The structured-output engine (text/structured.py): llguidance (the default: compiles a
    tool's schema in about a millisecond, masks computed per step; needs a vocabulary that
    spells every byte, as byte-level BPE and byte-fallback SentencePiece ones do) or outlines-core
    (precomputes a DFA over the vocabulary: 0.05 s to seconds a schema, then cheap masks). Both
    give an object that declares `properties` only those, unless the schema sets
    `additionalProperties`."""

    enable_auto_tool_choice: bool = False
    """Let chat requests with tools use tool_choice "auto" (OpenAI's default when tools are
    sent): the model's text is read for calls by tool_call_parser. Without it "auto" gets a 400
    naming tool_choice; "none", "required" and a named function need neither flag."""

    tool_call_parser: str = ""
    """The served model family's tool-call format, read for tool_choice "auto": hermes
    (Qwen2.5/3, Hermes, planserve's default tool format), llama3_json, mistral, pythonic, an
    entry point of `planserve.tool_parsers`, or `package.module:Class` (docs/tools.md)."""

    reasoning_parser: str = setting("", choices=("", "qwen3", "deepseek_r1"))
    """A thinking model's think block to `reasoning_content` on chat completions, the rest to
    `content` (text/reasoning.py): qwen3 (the model writes <think>), deepseek_r1 (the chat
    template wrote it); empty: none."""

    lora_modules: tuple[str, ...] = setting((), nargs="+")
    """LoRA adapters loaded at start, as name=path (a PEFT folder: adapter_config.json and
    adapter_model.safetensors on the model service's host); requests select one by name (`model`
    on HTTP, `lora_name` on gRPC). The operator's paths: not confined to lora_root. Needs a model
    service started with --enable-lora (docs/lora.md)."""

    enable_runtime_lora: bool = False
    """Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (and the gRPC
    LoadLoraAdapter / UnloadLoraAdapter); off, they answer 404. vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING. Paths must lie under lora_root."""

    lora_root: str = ""
    """The folder runtime-loaded adapters must lie under (after resolving symlinks); required
    with enable_runtime_lora."""

    lora_max_skipped_steps: int = setting(32, low=1)
    """Steps a waiting request may be skipped for its adapter (max_loras adapters running)
    before one running adapter is drained to make room for it (docs/lora.md: no starvation)."""

    lora_rotate_after_steps: int = setting(8, low=0)
    """Steps a running adapter keeps admitting new requests while requests of adapters without a
    place wait that long; then it drains and gives its place (docs/lora.md: rotation), with
    parking off. 0: never."""

    lora_park_after_steps: int = setting(1, low=0)
    """Parking (docs/lora.md): adapters take turns of this many steps at the step's max_loras
    places while others wait for one; a running sequence whose adapter is out of turn sits the
    step out, keeping its slot and KV (nothing recomputed). Replaces draining rotation when
    set; preemptive rotation, when set, replaces it. 0: off."""

    lora_preempt_after_steps: int = setting(0, low=0)
    """Preemptive rotation (docs/lora.md): once requests waited this many steps for a place,
    the running adapter that has held its place longest (at least as long) is preempted, its
    sequences requeued ahead of fresh requests, and its place given to the adapter that waited
    longest. Replaces draining rotation when set. 0: off."""

    def validate(self) -> "SchedulerConfig":
        """Every field's declared bound (config_fields.check_bounds), then the rules that tie fields
        together or need a lookup; ValueError names the field. Returns self."""
        check_bounds(self)
        if any(":" not in part for part in self.engine_address.split(",")):
            raise ValueError(
                f"engine_address must be host:port (or a comma list of them, or "
                f"dns:///name:port), got {self.engine_address!r}"
            )
        if "," in self.engine_address or self.engine_address.startswith("dns:///"):
            from scheduler_service.engine import scorers

            scorers.parse_weights(self.router_weights)  # names the bad scorer or weight
        # Fails with the valid names when the policy is unknown or does not import.
        policies.resolve(self.policy)
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError(
                "enable_auto_tool_choice needs tool_call_parser (which format to read)"
            )
        if self.tool_call_parser:
            from scheduler_service.text import tool_parsers

            tool_parsers.resolve(self.tool_call_parser)  # names the valid parsers
        parse_objective_priorities(self.gateway_objective_priorities)  # names the bad entry
        from scheduler_service.engine import kv_events

        kv_events.parse_config(self.kv_events_config)  # names the bad field
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: set both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca needs tls_cert and tls_key (mutual TLS is TLS)")
        if bool(self.engine_tls_cert) != bool(self.engine_tls_key):
            raise ValueError("engine_tls_cert and engine_tls_key go together: set both or neither")
        if self.engine_tls_cert and not self.engine_tls_ca:
            raise ValueError("engine_tls_cert needs engine_tls_ca (mutual TLS is TLS)")
        from scheduler_service.core import lora_registry

        lora_registry.parse_modules(self.lora_modules)  # names the bad entry
        if self.enable_runtime_lora and not self.lora_root:
            raise ValueError("enable_runtime_lora needs lora_root (the folder adapters load from)")
        if self.lora_root and not os.path.isdir(self.lora_root):
            raise ValueError(f"lora_root: {self.lora_root!r} is not a folder")
        if self.frontend_processes and self.host.startswith("unix:"):
            raise ValueError("frontend_processes > 0 needs a TCP host (ports are shared)")
        return self


def parse_objective_priorities(text: str) -> dict[str, int]:
    """ "name=priority,..." -> {name: priority}; ValueError naming the field and the entry."""
    priorities: dict[str, int] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = entry.partition("=")
        try:
            priority = int(value)
        except ValueError:
            priority = None
        if not name.strip() or priority is None or not INT32[0] <= priority <= INT32[1]:
            raise ValueError(
                f"gateway_objective_priorities: {entry!r} must be name=integer (an int32)"
            )
        priorities[name.strip()] = priority
    return priorities
