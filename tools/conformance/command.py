"""`planserve conformance`: the argument parser and the entry points."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any, Optional

from tools.conformance import api_suite, engine_suite
from tools.conformance.connection import PLAINTEXT, Connection
from tools.conformance.report import Check, Outcome, format_report, passed, run_checks

SUITES: dict[str, tuple[Any, list[Check], str]] = {  # context class, checks, service
    "engine": (engine_suite.EngineContext, engine_suite.CHECKS, "EngineService"),
    "api": (api_suite.ApiContext, api_suite.CHECKS, "GenerationService"),
}


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "conformance",
        help="check that a server speaks planserve's engine contract or public API",
        description="Runs the engine-contract suite (--engine) or the public-API suite (--api) "
        "against a running server and prints one PASS/FAIL/SKIP line per check; the "
        "exit status is 1 when a check failed. Use a server nobody else is using.",
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--engine",
        metavar="HOST:PORT",
        type=host_port,
        help="an EngineService (a model service no scheduler is using)",
    )
    target.add_argument(
        "--api",
        metavar="HOST:PORT",
        type=host_port,
        help="a GenerationService (a scheduler nobody else is using)",
    )
    parser.add_argument(
        "--check",
        action="append",
        default=None,
        metavar="NAME",
        help="run only this check (or a group such as bad_plan); repeatable",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per check")
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=10.0,
        help="seconds to wait for the server to accept a connection",
    )
    parser.add_argument("--list", action="store_true", help="list the suite's checks and exit")
    secured = parser.add_argument_group("a secured server")
    secured.add_argument(
        "--tls-ca", default="", help="PEM CA that signed the server's certificate: TLS"
    )
    secured.add_argument(
        "--tls-cert", default="", help="PEM client certificate, for mutual TLS (with --tls-key)"
    )
    secured.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    secured.add_argument(
        "--tls-server-name",
        default="",
        help="the name to check the server's certificate against (default: the address's host)",
    )
    secured.add_argument(
        "--auth-token-file", default="", help="file holding the bearer token every call carries"
    )
    return parser


def host_port(value: str) -> str:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT")
    return value


async def run_suite(
    suite: str,
    address: str,
    timeout_s: float = 120.0,
    only: Optional[set[str]] = None,
    connect_timeout_s: float = 10.0,
    connection: Connection = PLAINTEXT,
) -> tuple[str, list[Outcome]]:
    """Runs one suite against address (reached as `connection` says: TLS, mTLS, a token);
    returns (report text, outcomes). A server that cannot be reached gives one FAIL line
    (`connect`) instead of one per check."""
    context_type, checks, service = SUITES[suite]
    context = context_type(address, connection)
    try:
        await asyncio.wait_for(context.channel.channel_ready(), connect_timeout_s)
    except asyncio.TimeoutError:
        outcomes = [
            Outcome(
                "connect",
                "FAIL",
                f"no gRPC server answered at {address} within {connect_timeout_s:g} s"
                + (" (over TLS)" if connection.tls_ca else ""),
                connect_timeout_s,
            )
        ]
        checks = [Check("connect", "reach the server", None)]
    else:
        outcomes = await run_checks(checks, context, timeout_s, only)
    finally:
        await context.close()
    title = f"planserve conformance --{suite} {address} ({service}, {len(outcomes)} checks)"
    return format_report(title, checks, outcomes), outcomes


def run_command(args: argparse.Namespace) -> int:
    suite = "engine" if args.engine else "api"
    if args.list:
        for item in SUITES[suite][1]:
            print(f"{item.name:<32} {item.description}")
        return 0
    only = set(args.check or ())
    names = {item.name for item in SUITES[suite][1]}
    groups = names | {name.split(".")[0] for name in names}
    unknown = sorted(only - groups)
    if unknown:
        print(
            f"planserve conformance: no check {', '.join(unknown)} in the {suite} suite; "
            f"see --list",
            flush=True,
        )
        return 2
    try:
        connection = Connection(
            args.tls_ca, args.tls_cert, args.tls_key, args.auth_token_file, args.tls_server_name
        ).validate()
    except ValueError as error:
        print(f"planserve conformance: {error}", flush=True)
        return 2
    report, outcomes = asyncio.run(
        run_suite(
            suite,
            args.engine or args.api,
            args.timeout,
            only or None,
            args.connect_timeout,
            connection,
        )
    )
    print(report, flush=True)
    return 0 if passed(outcomes) else 1
