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
import signal  # noqa: E402
import sys  # noqa: E402

import grpc  # noqa: E402
import structlog  # noqa: E402

from model_service.config import ModelServiceConfig, parse_bytes  # noqa: E402
from model_service.logs import configure_logging  # noqa: E402
from model_service.server import (  # noqa: E402
    PortTaken,
    check_port_free,
    serve,
    shutdown,
    tls_credentials,
)
from model_service.tp_worker import run_torchrun_worker, torchrun_rank  # noqa: E402

PORT_LINE = "PLANSERVE_ENGINE_PORT="


def parse_args(argv: list[str] | None = None) -> ModelServiceConfig:
    defaults = ModelServiceConfig()
    parser = argparse.ArgumentParser(
        prog="python -m model_service", description="planserve model service (torch)"
    )
    parser.add_argument(
        "--model",
        default=defaults.model,
        help='"smollm2", "tiny", "null", a path to a .gguf file or a Hugging Face Llama folder',
    )
    parser.add_argument(
        "--served-model-name",
        default=defaults.served_model_name,
        help="the model name Describe reports (default: the model's own)",
    )
    parser.add_argument(
        "--null-step-delay-ms",
        type=float,
        default=defaults.null_step_delay_ms,
        help="--model null: milliseconds each step sleeps (default 0)",
    )
    parser.add_argument(
        "--null-eos-at",
        type=int,
        default=defaults.null_eos_at,
        help="--model null: emit EOS from this position on (default never)",
    )
    parser.add_argument(
        "--dtype",
        default=defaults.dtype,
        choices=["auto", "float32", "bfloat16", "float16"],
        help='"auto" (default): bfloat16 on a GPU or a CPU with AMX/AVX512-BF16, else float32',
    )
    parser.add_argument(
        "--quantization",
        default=defaults.quantization,
        choices=["none", "int8"],
        help="int8: weight-only int8 in blocks of 32 input columns (~3x less memory than float32)",
    )
    parser.add_argument(
        "--device", default=defaults.device, help='"auto", "cpu", "cuda" or "cuda:N"'
    )
    parser.add_argument(
        "--host",
        default=defaults.host,
        help="interface to bind (loopback by default: the engine trusts its plans), "
        "or unix:/PATH for a Unix socket",
    )
    parser.add_argument(
        "--port", type=int, default=defaults.port, help="0 binds a free port and prints it"
    )
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument(
        "--num-kv-blocks",
        type=int,
        default=defaults.num_kv_blocks,
        help="default: from --kv-cache-memory-bytes",
    )
    parser.add_argument(
        "--kv-cache-memory",
        "--kv-cache-memory-bytes",
        dest="kv_cache_memory_bytes",
        type=parse_bytes,
        default=defaults.kv_cache_memory_bytes,
        help="KV cache budget in bytes (suffixes KiB/MiB/GiB; default 1GiB)",
    )
    parser.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=defaults.kv_cache_memory_fraction,
        help="KV cache budget as a fraction of the device's free memory after loading (wins over "
        "--kv-cache-memory; --num-kv-blocks wins over both)",
    )
    parser.add_argument(
        "--swap-space",
        dest="swap_space_bytes",
        type=parse_bytes,
        default=defaults.swap_space_bytes,
        help="host memory for swapped-out KV blocks, in bytes "
        "(suffixes KiB/MiB/GiB; default 0: none)",
    )
    parser.add_argument("--max-num-slots", type=int, default=defaults.max_num_slots)
    parser.add_argument(
        "--max-model-len", type=int, default=defaults.max_model_len, help="default: the model's"
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=defaults.tensor_parallel_size,
        help="ranks to split attention heads and MLP columns across (torch.distributed: nccl on "
        "CUDA, gloo on CPU); spawned here, or set by torchrun's WORLD_SIZE",
    )
    parser.add_argument(
        "--speculative-method",
        default=defaults.speculative_method,
        choices=["none", "ngram", "draft"],
        help="speculative decoding: ngram (prompt lookup, no extra model) or draft (--draft-model)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=defaults.num_speculative_tokens,
        help="draft tokens per decoding sequence and step (default 3)",
    )
    parser.add_argument(
        "--draft-model",
        default=defaults.draft_model,
        help="--speculative-method draft: the draft model (same forms as --model, same vocabulary)",
    )
    parser.add_argument(
        "--ngram-max",
        type=int,
        default=defaults.ngram_max,
        help="--speculative-method ngram: longest suffix looked up (default 3)",
    )
    add_tls_flags(parser)
    args = vars(parser.parse_args(argv))
    config = ModelServiceConfig(
        **{f.name: args[f.name] for f in dataclasses.fields(ModelServiceConfig)}
    )
    try:
        return config.validate()
    except ValueError as error:
        parser.error(str(error))


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tls-cert", default="", help="PEM certificate: serve over TLS (with --tls-key)"
    )
    parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-client-ca",
        default="",
        help="PEM CA: require client certificates it signed (mutual TLS)",
    )


def parse_tls_args(argv: list[str] | None = None) -> grpc.ServerCredentials | None:
    """The TLS flags (also listed by --help) as server credentials; None for plaintext."""
    parser = argparse.ArgumentParser(add_help=False)
    add_tls_flags(parser)
    args, _ = parser.parse_known_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_client_ca and not args.tls_cert):
        raise SystemExit("--tls-cert and --tls-key go together, and --tls-client-ca needs both")
    return (
        tls_credentials(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    )


async def _run(
    config: ModelServiceConfig, credentials: grpc.ServerCredentials | None = None
) -> None:
    server = await serve(config, credentials=credentials)
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
        asyncio.run(_run(config, parse_tls_args(argv)))
    except PortTaken as error:
        print(f"model service: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
