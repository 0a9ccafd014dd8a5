"""The `planserve` command. Never imports torch: the model service runs as a child process.

  planserve serve            model service + scheduler on one host, two processes
  planserve model-service    the model service alone
  planserve scheduler        the scheduler alone, against --engine HOST:PORT
  planserve generate PROMPT  stream a completion from a running server
  planserve bench            load generator: a stored workload against a server (JSON + plots)
  planserve conformance      check a server against the engine contract or the public API

It sits outside both services because it runs both: the scheduler's flags come from
SchedulerConfig (scheduler_service/cli.py), the model service's from ModelServiceConfig's field
declarations (config_fields; model_service/config.py imports neither torch nor anything heavy),
the same ones `python -m model_service` makes its flags from; so `serve` and `model-service` have
every model flag, and pass on only the ones given.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from typing import Optional

from bench.load import cli as bench_cli
from config_fields import add_flags, flag_of, parsed
from model_service.config import ModelServiceConfig
from scheduler_service import cli as scheduler_cli
from scheduler_service import logs
from scheduler_service.config import SchedulerConfig
from scheduler_service.frontends import count as frontend_count
from scheduler_service.ports import StartupError, check_port_free
from scheduler_service.server import SchedulerServer, check_ports
from tools import conformance
from tools.supervisor import ModelServiceSupervisor

# Where and how the model service listens: `serve` places it itself (loopback, --engine-port,
# plaintext); `planserve model-service` has these flags with their own defaults.
_MODEL_LISTENER_FIELDS = ("host", "port", "tls_cert", "tls_key", "tls_client_ca")


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The model service's flags, passed on as given (byte sizes as "2GiB")."""
    add_flags(parser, ModelServiceConfig, skip=_MODEL_LISTENER_FIELDS, pass_on=True)


def _model_fields_given(args: argparse.Namespace) -> dict:
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(ModelServiceConfig)
        if f.name not in _MODEL_LISTENER_FIELDS and getattr(args, f.name, None) is not None
    }


def check_model_flags(args: argparse.Namespace) -> None:
    """The model service's own validation of the flags given, before it is started."""
    ModelServiceConfig(**parsed(ModelServiceConfig, _model_fields_given(args))).validate()


def _model_service_argv(args: argparse.Namespace, host: str, port: int) -> list[str]:
    argv = [sys.executable, "-m", "model_service", "--host", host, "--port", str(port)]
    for name, value in _model_fields_given(args).items():
        argv += [flag_of(ModelServiceConfig, name), str(value)]
    return argv


def profiling_the_token_budget(
    args: argparse.Namespace, config: SchedulerConfig
) -> argparse.Namespace:
    """`serve`'s model flags with the largest step the model service profiles set to the
    scheduler's token budget when --max-num-batched-tokens was given (and --profile-step-tokens
    was not). Otherwise the model service chooses the step for its device and the scheduler
    adopts it from Describe."""
    if args.profile_step_tokens is not None or config.max_num_batched_tokens is None:
        return args
    return argparse.Namespace(
        **{**vars(args), "profile_step_tokens": config.max_num_batched_tokens}
    )


async def _serve(args: argparse.Namespace) -> None:
    # Every port is tried before anything starts: a taken one ends here, with nothing running.
    check_port_free("--engine-port", "127.0.0.1", args.engine_port)
    config = scheduler_cli.scheduler_config(args, f"127.0.0.1:{args.engine_port}")
    check_ports(config)
    model_args = profiling_the_token_budget(args, config)
    supervisor = ModelServiceSupervisor(
        lambda port: _model_service_argv(model_args, "127.0.0.1", port),
        args.engine_port,
        args.model_service_liveness_seconds,
    )
    try:
        engine_port = await supervisor.start()
    except RuntimeError as error:  # the child said why on stderr
        raise StartupError(str(error)) from None
    try:
        config = dataclasses.replace(config, engine_address=f"127.0.0.1:{engine_port}")
        if config.frontend_processes is None:  # the model service's device decides
            chosen = await frontend_count.for_engine(config)
            config = dataclasses.replace(config, frontend_processes=chosen)
        server = SchedulerServer(config)
        await server.start()
        await server.connect_engine()
        scheduler_cli.announce(server)
        await scheduler_cli.run_until_signal(server, args.sample)
    finally:
        await supervisor.stop()


def _add_serve(commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="model service + scheduler, two processes",
        formatter_class=argparse.RawTextHelpFormatter,
    )
    _add_model_flags(serve)
    scheduler_cli.add_scheduler_flags(serve)
    serve.add_argument(
        "--engine-port",
        type=int,
        default=50052,
        help="model service port (0 picks a free one) (default: 50052)",
    )
    serve.add_argument(
        "--model-service-liveness-seconds",
        type=float,
        default=20.0,
        help="the model service child's liveness probe: a health check this often, each given\n"
        "half as long; after 3 failed in a row the child is killed and restarted, as the\n"
        "deployment's livenessProbe does (0: no probe) (default: 20)",
    )
    serve.add_argument(
        "--sample",
        default=None,
        help="once serving, stream a completion of this chat prompt (default: none)",
    )


def _add_model_service(commands) -> None:
    model = commands.add_parser("model-service", help="the model service alone")
    _add_model_flags(model)
    add_flags(model, ModelServiceConfig, only=_MODEL_LISTENER_FIELDS)  # its own defaults


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="planserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--log-level", default="info")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_serve(commands)
    _add_model_service(commands)
    scheduler_cli.add_commands(commands)
    conformance.add_parser(commands)
    bench_cli.add_parser(commands)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logs.configure(args.log_level)
    if args.command in ("serve", "model-service"):
        try:
            check_model_flags(args)
        except ValueError as error:
            parser.error(str(error))
    liveness_s = getattr(args, "model_service_liveness_seconds", 0.0)
    if liveness_s < 0:
        parser.error(f"--model-service-liveness-seconds must be >= 0, got {liveness_s}")
    if args.command == "bench":
        bench_cli.main(args)
        return 0
    if args.command == "model-service":
        # Replace this process: the model service is its own program (and imports torch).
        tls = [
            f"{flag_of(ModelServiceConfig, name)}={getattr(args, name)}"
            for name in ("tls_cert", "tls_key", "tls_client_ca")
            if getattr(args, name)
        ]
        os.execv(sys.executable, _model_service_argv(args, args.host, args.port) + tls)
    if args.command == "conformance":
        return conformance.run_command(args)  # exit status 1 when a check failed
    if args.command == "serve":
        try:
            asyncio.run(_serve(args))
        except KeyboardInterrupt:
            pass
        except StartupError as error:
            print(f"planserve: {error}", file=sys.stderr, flush=True)
            return 2
        return 0
    return scheduler_cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
