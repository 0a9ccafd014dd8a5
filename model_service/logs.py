"""The model service's structured logs: key=value on a terminal, JSON with PLANSERVE_LOG_JSON=1.

Set up once per process: by `python -m model_service` and by each tensor-parallel rank it spawns.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging() -> None:
    json_logs = os.environ.get("PLANSERVE_LOG_JSON", "") not in ("", "0")
    renderer = (
        structlog.processors.JSONRenderer()
        if json_logs
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
