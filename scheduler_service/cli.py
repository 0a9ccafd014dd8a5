"""The scheduler's commands. Never imports torch nor the model service.

  python -m scheduler_service scheduler            the scheduler alone, against --engine HOST:PORT
  python -m scheduler_service generate PROMPT      stream a completion from a running server

The `planserve` command (tools/cli.py) has these and the ones that run the model service too
(serve, model-service) and the tools (bench, conformance). The scheduler's flags are made from
SchedulerConfig's fields (config_fields): one declaration per field gives the default, the bound,
the flag and its help.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Optional

import structlog

from config_fields import add_flags, from_args
from planserve.v1 import generate_pb2
from scheduler_service import heap, logs
from scheduler_service.api.client import build_request, stream_generate
from scheduler_service.config import SchedulerConfig
from scheduler_service.core import policies
from scheduler_service.ports import StartupError
from scheduler_service.server import SchedulerServer

log = structlog.get_logger("planserve.cli")

PORT_LINE = "PLANSERVE_PORT="
HTTP_PORT_LINE = "PLANSERVE_HTTP_PORT="
# Fields only `planserve scheduler` has a flag for (with replicas); `serve` runs one engine.
REPLICA_FIELDS = ("router_weights", "replica_check_interval_s")


def add_scheduler_flags(parser: argparse.ArgumentParser, replicas: bool = False) -> None:
    """SchedulerConfig's flags; `replicas`: also the ones of several engines."""
    policy_help = (
        "; one of:\n" + policies.describe() + "\nor a dotted path package.module:Class, or an "
        "entry point of the group planserve.policies"
    )
    add_flags(
        parser,
        SchedulerConfig,
        skip=() if replicas else REPLICA_FIELDS,
        helps={"policy": policy_help},
    )


def scheduler_config(args: argparse.Namespace, engine_address: str) -> SchedulerConfig:
    return from_args(SchedulerConfig, args, engine_address=engine_address).validate()


async def run_until_signal(server: SchedulerServer, sample_prompt: Optional[str]) -> None:
    log.info("startup_heap_frozen", process="scheduler", objects=heap.freeze_startup_heap())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    address = f"{server.config.host}:{server.port}"
    if sample_prompt:
        print(f"\n>>> planserve generate --chat {sample_prompt!r}", flush=True)
        await print_stream(
            address, build_request(sample_prompt, chat=True, temperature=0.0, max_new_tokens=64)
        )
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


def announce(server: SchedulerServer) -> None:
    """Tells a parent process (or a person) the bound port, once requests can be served."""
    print(f"{PORT_LINE}{server.port}", flush=True)
    if server.http_port is not None:
        print(f"{HTTP_PORT_LINE}{server.http_port}", flush=True)


async def _scheduler(args: argparse.Namespace) -> None:
    # Several --engine (or a comma list, or dns:///name:port): replicas behind one router.
    config = scheduler_config(args, ",".join(args.engine or ["127.0.0.1:50052"]))
    server = SchedulerServer(config)
    await server.start()
    await server.connect_engine()
    announce(server)
    await run_until_signal(server, None)


async def print_stream(address: str, request: generate_pb2.GenerateRequest) -> None:
    final = None
    async for chunk in stream_generate(address, request):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        if chunk.finish_reason:
            final = chunk
    if final is not None:
        reason = generate_pb2.FinishReason.Name(final.finish_reason)
        print(
            f"\n[{reason}; prompt {final.usage.prompt_tokens} tokens, "
            f"completion {final.usage.completion_tokens} tokens, "
            f"TTFT {final.usage.time_to_first_token_us / 1000:.0f} ms]",
            flush=True,
        )


async def _generate(args: argparse.Namespace) -> None:
    request = build_request(
        args.prompt,
        chat=args.chat,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    await print_stream(f"{args.host}:{args.port}", request)


def add_commands(commands) -> None:
    """The `scheduler` and `generate` subcommands."""
    scheduler = commands.add_parser(
        "scheduler", help="the scheduler alone", formatter_class=argparse.RawTextHelpFormatter
    )
    add_scheduler_flags(scheduler, replicas=True)
    scheduler.add_argument(
        "--engine",
        action="append",
        default=None,
        help="model service HOST:PORT (default 127.0.0.1:50052); repeat it or give a comma list "
        "for replicas, or dns:///NAME:PORT (a headless Service, one replica per address, "
        "re-resolved)",
    )
    generate = commands.add_parser("generate", help="stream a completion to the terminal")
    generate.add_argument("prompt")
    generate.add_argument(
        "--chat", action="store_true", help="send the prompt as one user message (chat template)"
    )
    generate.add_argument("--host", default="127.0.0.1")
    generate.add_argument("--port", type=int, default=50051)
    generate.add_argument("--max-new-tokens", type=int, default=None)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=None)
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", default=[])
    generate.add_argument("--ignore-eos", action="store_true")


RUNNERS = {"scheduler": _scheduler, "generate": _generate}


def run(args: argparse.Namespace) -> int:
    """Runs a command of add_commands until it ends (or Ctrl-C); a start-up problem is one line
    on stderr and exit status 2."""
    try:
        asyncio.run(RUNNERS[args.command](args))
    except KeyboardInterrupt:
        pass
    except StartupError as error:
        print(f"planserve: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scheduler_service",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log-level", default="info")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    logs.configure(args.log_level)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
