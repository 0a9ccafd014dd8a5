"""`python -m model_service`: run the model service.

With `--port 0` a free port is bound and, once serving, one line `PLANSERVE_ENGINE_PORT=<port>` is
printed to stdout (flushed): the scheduler CLI and the tests read the port from it. Everything else
(structured logs) goes to stderr; PLANSERVE_LOG_JSON=1 switches logs to JSON lines.
"""

from __future__ import annotations

from model_service import threads

threads.configure()  # first: libgomp reads its environment when torch loads it

import argparse  # noqa: E402
import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import grpc  # noqa: E402
import structlog  # noqa: E402

from config_fields import add_flags, from_args  # noqa: E402
from model_service.config import ModelServiceConfig, compute_env_defaults  # noqa: E402
from model_service.logs import configure_logging  # noqa: E402
from model_service.server import (  # noqa: E402
    PortTaken,
    StartRefused,
    check_port_free,
    serve,
    shutdown,
    tls_credentials,
)
from model_service.tp_worker import run_torchrun_worker, torchrun_rank  # noqa: E402

PORT_LINE = "PLANSERVE_ENGINE_PORT="


def build_parser() -> argparse.ArgumentParser:
    """One flag per ModelServiceConfig field, made from its declaration (config_fields)."""
    parser = argparse.ArgumentParser(
        prog="python -m model_service", description="planserve model service (torch)"
    )
    add_flags(parser, ModelServiceConfig)
    parser.set_defaults(**compute_env_defaults(os.environ))  # the compute fields' aliases
    return parser


def parse_args(argv: list[str] | None = None) -> ModelServiceConfig:
    parser = build_parser()
    config = from_args(ModelServiceConfig, parser.parse_args(argv))
    try:
        return config.validate()
    except ValueError as error:
        parser.error(str(error))


def server_credentials(config: ModelServiceConfig) -> grpc.ServerCredentials | None:
    """The TLS fields as server credentials; None for plaintext."""
    if not config.tls_cert:
        return None
    return tls_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)


async def _run(
    config: ModelServiceConfig, credentials: grpc.ServerCredentials | None = None
) -> None:
    server = await serve(config, credentials=credentials)
    # What start-up made (torch's modules, the model, the handlers) lives as long as the process:
    # frozen, a full collection walks only what serving made since, not the whole heap (the
    # scheduler's processes do the same: scheduler_service/heap.py). The young generation keeps
    # its threshold here: a tensor in a reference cycle frees its memory only when collected.
    gc.collect()
    gc.freeze()
    structlog.get_logger(__name__).info(
        "startup_heap_frozen", process="model_service", objects=gc.get_freeze_count()
    )
    print(f"{PORT_LINE}{server.bound_port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    structlog.get_logger(__name__).info("shutting_down")
    await shutdown(server, grace_s=5.0)


def main(argv: list[str] | None = None) -> None:
    configure_logging()
    config = parse_args(argv)
    launched = torchrun_rank()
    if launched is not None:
        config = dataclasses.replace(config, tensor_parallel_size=launched[1])
        if launched[0] != 0:  # torchrun started this rank: it follows rank 0 and serves nothing
            run_torchrun_worker(config)
            return
    try:
        check_port_free(config.host, config.port)  # before the model loads
        asyncio.run(_run(config, server_credentials(config)))
    except (PortTaken, StartRefused) as error:
        print(f"model service: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
