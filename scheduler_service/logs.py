"""Structured logs: key=value in a terminal, JSON lines otherwise (or with PLANSERVE_LOG_JSON=1).

Prompts and generated text are the users' data: no event logs them at info level or above (events
carry request ids and counts), and `redact_content` masks the fields that would hold them if an
event ever did; at debug level they pass, for a developer's own machine.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog
from structlog.typing import EventDict, WrappedLogger

# Event fields that would carry a user's prompt or output.
CONTENT_KEYS = frozenset(
    {
        "prompt",
        "text",
        "token_ids",
        "prompt_token_ids",
        "output_token_ids",
        "messages",
        "content",
        "stop",
        "completion",
    }
)


def redact_content(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    """Replaces content fields by their size, except in debug events."""
    if method_name != "debug":
        for key in CONTENT_KEYS.intersection(event_dict):
            value = event_dict[key]
            size = len(value) if hasattr(value, "__len__") else 1
            event_dict[key] = f"<redacted: {size}>"
    return event_dict


# The level configure() was last called with (frontend processes start with the same).
configured_level = "info"


def configure(level: str = "info") -> None:
    global configured_level
    configured_level = level
    json_logs = os.environ.get("PLANSERVE_LOG_JSON") == "1" or not sys.stderr.isatty()
    renderer = (
        structlog.processors.JSONRenderer()
        if json_logs
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            redact_content,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
