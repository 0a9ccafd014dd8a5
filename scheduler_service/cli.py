"""The `planserve` command. Never imports torch: the model service runs as a child process.

  planserve serve            model service + scheduler on one host, two processes
  planserve model-service    the model service alone
  planserve scheduler        the scheduler alone, against --engine HOST:PORT
  planserve generate PROMPT  stream a completion from a running server
  planserve bench            load generator: a stored workload against a server (JSON + plots)
  planserve conformance      check a server against the engine contract or the public API
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
from typing import Optional

import structlog

from planserve.v1 import generate_pb2
from bench.load import cli as bench_cli
from scheduler_service import logs
from scheduler_service.core import policies
from tools import conformance
from scheduler_service.api.client import build_request, stream_generate
from scheduler_service.config import (CHUNKING_MODES, PREEMPTION_MODES, PREFIX_CACHE_SCOPES,
                                      SchedulerConfig)
from scheduler_service.server import SchedulerServer

log = structlog.get_logger("planserve.cli")

ENGINE_PORT_LINE = "PLANSERVE_ENGINE_PORT="
PORT_LINE = "PLANSERVE_PORT="
HTTP_PORT_LINE = "PLANSERVE_HTTP_PORT="


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help="a GGUF file path, 'smollm2' (default), 'tiny' (random, for tests) or "
                             "'null' (deterministic tokens, no compute: orchestration benchmarks)")
    parser.add_argument("--null-step-delay-ms", type=float, default=0.0,
                        help="--model null: milliseconds each step sleeps")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="'auto': bfloat16 on a GPU or a CPU with AMX/AVX512-BF16, else float32")
    parser.add_argument("--device", default="auto", help="'auto' (CUDA when available), cpu, cuda")
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV blocks to allocate (default: from a 1 GiB budget)")
    parser.add_argument("--quantization", default="none", choices=["none", "int8"],
                        help="'int8': weight-only int8 (about 3.8x less weight memory)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="split attention heads and MLP columns across N ranks "
                             "(torch.distributed: nccl on CUDA, gloo on CPU)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest sequence in tokens (default: the model's; only shortens it)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name served (GetModelInfo, OpenAI /v1/models and `model`)")
    parser.add_argument("--kv-cache-memory", default=None,
                        help="KV cache budget in bytes, e.g. 2GiB (default 1GiB)")
    parser.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                        help="KV cache budget as a fraction of the device's free memory after loading")
    parser.add_argument("--swap-space", default=None,
                        help="host memory for swapped-out KV blocks, e.g. 4GiB (default none)")
    parser.add_argument("--speculative-method", default=None, choices=["none", "ngram", "draft"],
                        help="speculative decoding: 'ngram' (prompt lookup) or 'draft' (--draft-model)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="draft tokens per decoding sequence and step (default 3)")
    parser.add_argument("--draft-model", default=None,
                        help="the draft model of --speculative-method draft (same vocabulary)")


def _add_scheduler_flags(parser: argparse.ArgumentParser) -> None:
    defaults = SchedulerConfig()
    parser.add_argument("--host", default=defaults.host)
    parser.add_argument("--port", type=int, default=defaults.port,
                        help="public API port (0 picks a free one and prints it)")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=defaults.max_num_batched_tokens)
    parser.add_argument("--max-queue-len", type=int, default=defaults.max_queue_len)
    parser.add_argument("--metrics-port", type=int, default=9400,
                        help="Prometheus /metrics port (0 picks a free one, -1 serves none)")
    parser.add_argument("--http-port", type=int, default=8000,
                        help="OpenAI-compatible HTTP API port (/v1/completions, "
                             "/v1/chat/completions, /v1/models); 0 picks a free one, -1 serves none")
    parser.add_argument("--policy", default=defaults.policy,
                        help="waiting order and preemption rule; one of:\n"
                             + policies.describe()
                             + "\nor a dotted path package.module:Class, or an entry point "
                               "of the group planserve.policies")
    parser.add_argument("--chunking-mode", default=defaults.chunking_mode,
                        choices=CHUNKING_MODES,
                        help="how prompt chunks and decodes share a step (default interleaved)")
    parser.add_argument("--max-prefill-chunk", type=int, default=defaults.max_prefill_chunk,
                        help="most prompt tokens of one sequence per step (0: the budget)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="turn automatic prefix caching off")
    parser.add_argument("--prefix-cache-scope", default=defaults.prefix_cache_scope,
                        choices=PREFIX_CACHE_SCOPES,
                        help="who shares cached prefixes: 'global' (default): requests with the "
                             "same cache_salt; 'tenant': also the same tenant (docs/operations.md)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="one step at a time: plan step N+1 only after step N's result "
                             "(default: plan and send it while the model computes step N)")
    parser.add_argument("--preemption-mode", default=defaults.preemption_mode,
                        choices=PREEMPTION_MODES,
                        help="'swap': preempted KV goes to the model service's --swap-space; "
                             "'recompute': it is recomputed; 'auto' (default): swap when there "
                             "is swap space")
    _add_hardening_flags(parser, defaults)


def _add_hardening_flags(parser: argparse.ArgumentParser, defaults: SchedulerConfig) -> None:
    """Overload, drain and security flags of the scheduler (see docs/operations.md)."""
    parser.add_argument("--max-queue-tokens", type=int, default=defaults.max_queue_tokens,
                        help="most prompt tokens waiting; beyond: RESOURCE_EXHAUSTED + retry hint")
    parser.add_argument("--max-stream-buffer-chunks", type=int,
                        default=defaults.max_stream_buffer_chunks,
                        help="unread chunks one stream may hold before it is aborted")
    parser.add_argument("--drain-grace-seconds", type=float, default=defaults.drain_grace_s,
                        help="on SIGTERM, how long running requests may take to finish")
    parser.add_argument("--tls-cert", default="", help="PEM certificate: serve the API over TLS")
    parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-client-ca", default="",
                        help="PEM CA: require client certificates signed by it (mutual TLS)")
    parser.add_argument("--engine-tls-ca", default="",
                        help="PEM CA of the model service's certificate: TLS to the engine")
    parser.add_argument("--engine-tls-cert", default="",
                        help="PEM client certificate for the model service (mutual TLS)")
    parser.add_argument("--engine-tls-key", default="", help="PEM key of --engine-tls-cert")
    parser.add_argument("--auth-token-file", default="",
                        help="file with the bearer token the API requires (none: no auth)")
    parser.add_argument("--max-concurrent-streams", type=int,
                        default=defaults.max_concurrent_streams,
                        help="most concurrent RPCs per connection")
    parser.add_argument("--max-message-bytes", type=int, default=defaults.max_message_bytes,
                        help="largest request message accepted")


def _scheduler_config(args: argparse.Namespace, engine_address: str) -> SchedulerConfig:
    return SchedulerConfig(
        host=args.host, port=args.port, engine_address=engine_address,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_queue_len=args.max_queue_len, metrics_port=args.metrics_port,
        http_port=args.http_port, policy=args.policy,
        chunking_mode=args.chunking_mode, max_prefill_chunk=args.max_prefill_chunk,
        enable_prefix_caching=not args.no_prefix_caching,
        prefix_cache_scope=args.prefix_cache_scope,
        max_queue_tokens=args.max_queue_tokens,
        max_stream_buffer_chunks=args.max_stream_buffer_chunks,
        drain_grace_s=args.drain_grace_seconds, tls_cert=args.tls_cert, tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca, engine_tls_ca=args.engine_tls_ca,
        engine_tls_cert=args.engine_tls_cert, engine_tls_key=args.engine_tls_key,
        auth_token_file=args.auth_token_file, max_concurrent_streams=args.max_concurrent_streams,
        max_message_bytes=args.max_message_bytes,
        preemption_mode=args.preemption_mode, overlap=not args.no_overlap).validate()


def _model_service_argv(args: argparse.Namespace, host: str, port: int) -> list[str]:
    argv = [sys.executable, "-m", "model_service", "--model", args.model, "--dtype", args.dtype,
            "--device", args.device, "--quantization", args.quantization, "--host", host,
            "--port", str(port)]
    if args.num_kv_blocks is not None:
        argv += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.tensor_parallel_size != 1:
        argv += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.null_step_delay_ms:
        argv += ["--null-step-delay-ms", str(args.null_step_delay_ms)]
    for flag in ("max_model_len", "served_model_name", "kv_cache_memory", "kv_cache_memory_fraction",
                 "swap_space", "speculative_method", "num_speculative_tokens", "draft_model"):
        if getattr(args, flag) is not None:
            argv += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    return argv


async def _start_model_service(argv: list[str]) -> tuple[asyncio.subprocess.Process, int]:
    """Starts the model service and waits for the line that tells its port."""
    child = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    while True:
        line = await child.stdout.readline()
        if not line:
            await child.wait()
            raise RuntimeError(f"model service exited with status {child.returncode} "
                               "before it started serving")
        text = line.decode().strip()
        if text.startswith(ENGINE_PORT_LINE):
            return child, int(text[len(ENGINE_PORT_LINE):])


async def _run_until_signal(server: SchedulerServer, sample_prompt: Optional[str]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    address = f"{server.config.host}:{server.port}"
    if sample_prompt:
        print(f"\n>>> planserve generate --chat {sample_prompt!r}", flush=True)
        await _print_stream(address, build_request(sample_prompt, chat=True, temperature=0.0,
                                                   max_new_tokens=64))
        print(f"\nplanserve is serving on {address}; Ctrl-C stops it.", flush=True)
    await stop.wait()
    log.info("stopping")
    # Drain: NOT_SERVING and UNAVAILABLE for new requests, running ones finish within the
    # grace period (keep k8s terminationGracePeriodSeconds above it); then exit 0.
    # A second signal during the drain stops at once.
    stop.clear()
    drain = asyncio.ensure_future(server.drain(server.config.drain_grace_s))
    again = asyncio.ensure_future(stop.wait())
    await asyncio.wait({drain, again}, return_when=asyncio.FIRST_COMPLETED)
    drained = drain.done() and drain.result()
    if not drain.done():
        log.info("second_signal_stopping_now")
        drain.cancel()
    again.cancel()
    # Past the grace period the streams still open are cut (UNAVAILABLE/CANCELLED) at once.
    await server.stop(grace_s=5.0 if drained else 0.0)


def _announce(server: SchedulerServer) -> None:
    """Tells a parent process (or a person) the bound port, once requests can be served."""
    print(f"{PORT_LINE}{server.port}", flush=True)
    if server.http_port is not None:
        print(f"{HTTP_PORT_LINE}{server.http_port}", flush=True)


class _ModelServiceSupervisor:
    """`planserve serve`'s model service child, restarted on the same port whenever it dies (the
    scheduler notices, reconnects and recomputes what was in flight). The delay before a restart
    doubles, up to MAX_DELAY_S, while the child keeps dying within HEALTHY_S of its start."""

    FIRST_DELAY_S = 0.5
    MAX_DELAY_S = 30.0
    HEALTHY_S = 60.0

    def __init__(self, args: argparse.Namespace):
        self._args = args
        self.child: Optional[asyncio.subprocess.Process] = None
        self.port = args.engine_port
        self.num_restarts = 0
        self._watch: Optional[asyncio.Task] = None

    async def start(self) -> int:
        self.child, self.port = await _start_model_service(
            _model_service_argv(self._args, "127.0.0.1", self.port))
        self._watch = asyncio.get_running_loop().create_task(self._restart_when_dead())
        return self.port

    async def _restart_when_dead(self) -> None:
        delay_s = self.FIRST_DELAY_S
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            status = await self.child.wait()
            delay_s = self.FIRST_DELAY_S if loop.time() - started > self.HEALTHY_S else delay_s
            log.warning("model_service_died", status=status, restart_in_s=delay_s)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, self.MAX_DELAY_S)
            try:
                self.child, _ = await _start_model_service(
                    _model_service_argv(self._args, "127.0.0.1", self.port))
            except RuntimeError as error:  # died while starting: wait() returns at once
                log.warning("model_service_restart_failed", error=str(error))
                continue
            self.num_restarts += 1
            log.warning("model_service_restarted", port=self.port, restarts=self.num_restarts)

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        child = self.child
        if child is not None and child.returncode is None:
            child.terminate()
            with contextlib.suppress(ProcessLookupError, asyncio.TimeoutError):
                await asyncio.wait_for(child.wait(), 10)


async def _serve(args: argparse.Namespace) -> None:
    supervisor = _ModelServiceSupervisor(args)
    engine_port = await supervisor.start()
    try:
        server = SchedulerServer(_scheduler_config(args, f"127.0.0.1:{engine_port}"))
        await server.start()
        await server.connect_engine()
        _announce(server)
        await _run_until_signal(server, args.sample)
    finally:
        await supervisor.stop()


async def _scheduler(args: argparse.Namespace) -> None:
    # Several --engine (or a comma list, or dns:///name:port): replicas behind one router.
    config = dataclasses.replace(
        _scheduler_config(args, ",".join(args.engine or ["127.0.0.1:50052"])),
        router_weights=args.router_weights,
        replica_check_interval_s=args.replica_check_interval).validate()
    server = SchedulerServer(config)
    await server.start()
    await server.connect_engine()
    _announce(server)
    await _run_until_signal(server, None)


async def _print_stream(address: str, request: generate_pb2.GenerateRequest) -> None:
    final = None
    async for chunk in stream_generate(address, request):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        if chunk.finish_reason:
            final = chunk
    if final is not None:
        reason = generate_pb2.FinishReason.Name(final.finish_reason)
        print(f"\n[{reason}; prompt {final.usage.prompt_tokens} tokens, "
              f"completion {final.usage.completion_tokens} tokens, "
              f"TTFT {final.usage.time_to_first_token_us / 1000:.0f} ms]", flush=True)


async def _generate(args: argparse.Namespace) -> None:
    request = build_request(
        args.prompt, chat=args.chat, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    await _print_stream(f"{args.host}:{args.port}", request)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="planserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="info")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="model service + scheduler, two processes",
                                formatter_class=argparse.RawTextHelpFormatter)
    _add_model_flags(serve)
    _add_scheduler_flags(serve)
    serve.add_argument("--engine-port", type=int, default=50052,
                       help="model service port (0 picks a free one)")
    serve.add_argument("--sample", default=None,
                       help="once serving, stream a completion of this chat prompt")

    model = commands.add_parser("model-service", help="the model service alone")
    _add_model_flags(model)
    model.add_argument("--host", default="127.0.0.1",
                       help="interface to bind: loopback by default (the engine trusts its "
                            "plans), or unix:/PATH for a Unix socket")
    model.add_argument("--port", type=int, default=50052)
    model.add_argument("--tls-cert", default="", help="PEM certificate: serve over TLS")
    model.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    model.add_argument("--tls-client-ca", default="",
                       help="PEM CA: require client certificates it signed (mutual TLS)")

    scheduler = commands.add_parser("scheduler", help="the scheduler alone",
                                    formatter_class=argparse.RawTextHelpFormatter)
    _add_scheduler_flags(scheduler)
    scheduler.add_argument("--engine", action="append", default=None,
                           help="model service HOST:PORT (default 127.0.0.1:50052); repeat it or "
                                "give a comma list for replicas, or dns:///NAME:PORT (a headless "
                                "Service, one replica per address, re-resolved)")
    scheduler.add_argument("--router-weights", default=SchedulerConfig.router_weights,
                           help="with replicas: scorers placing new requests, NAME=WEIGHT,... "
                                "(kv_usage, waiting_tokens, prefix_affinity, random)")
    scheduler.add_argument("--replica-check-interval", type=float,
                           default=SchedulerConfig.replica_check_interval_s,
                           help="with replicas: seconds between DNS re-resolves and retries")

    generate = commands.add_parser("generate", help="stream a completion to the terminal")
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true",
                          help="send the prompt as one user message (chat template)")
    generate.add_argument("--host", default="127.0.0.1")
    generate.add_argument("--port", type=int, default=50051)
    generate.add_argument("--max-new-tokens", type=int, default=None)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=None)
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", default=[])
    generate.add_argument("--ignore-eos", action="store_true")

    conformance.add_parser(commands)
    bench_cli.add_parser(commands)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level)
    if args.command == "bench":
        bench_cli.main(args)
        return 0
    if args.command == "model-service":
        # Replace this process: the model service is its own program (and imports torch).
        tls = [f"--{flag.replace('_', '-')}={getattr(args, flag)}"
               for flag in ("tls_cert", "tls_key", "tls_client_ca") if getattr(args, flag)]
        os.execv(sys.executable, _model_service_argv(args, args.host, args.port) + tls)
    if args.command == "conformance":
        return conformance.run_command(args)  # exit status 1 when a check failed
    runners = {"serve": _serve, "scheduler": _scheduler, "generate": _generate}
    try:
        asyncio.run(runners[args.command](args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
