"""Structured logs: key=value in a terminal, JSON lines otherwise (or with PLANSERVE_LOG_JSON=1)."""
from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(level: str = "info") -> None:
    json_logs = os.environ.get("PLANSERVE_LOG_JSON") == "1" or not sys.stderr.isatty()
    renderer = (structlog.processors.JSONRenderer() if json_logs
                else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
