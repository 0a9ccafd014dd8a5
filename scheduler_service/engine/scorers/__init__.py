"""The replica scorer registry: `--router-weights NAME=W,...` to weighted scorers.

A scorer rates every replica for one new request, each score in [0, 1] (1 = the best place for
it); the router adds the scores times their weights and sends the request to the top replica.
A name resolves, as a policy does (scheduler_service/core/policies), to:

  1. a scorer registered with `@register` (built-ins: kv_usage, waiting_tokens,
     prefix_affinity, random);
  2. an entry point of the group `planserve.scorers` (an installed plugin);
  3. a dotted path `package.module:Class`.
"""

from __future__ import annotations

import importlib
import importlib.metadata

from scheduler_service.engine.scorers.base import SCORERS, ReplicaScorer, register

__all__ = [
    "ENTRY_POINT_GROUP",
    "ReplicaScorer",
    "available",
    "parse_weights",
    "register",
    "resolve",
]

ENTRY_POINT_GROUP = SCORERS.entry_point_group


def available() -> list[str]:
    return SCORERS.available()


def resolve(spec: str) -> type[ReplicaScorer]:
    if spec in SCORERS.classes:
        cls = SCORERS.classes[spec]
    elif spec in SCORERS.entry_points():
        cls = SCORERS.entry_points()[spec].load()
    elif "." in spec or ":" in spec:
        module, _, name = spec.replace(":", ".").rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"router_weights: scorer {spec!r} does not import ({error})") from None
    else:
        raise ValueError(
            f"router_weights: unknown scorer {spec!r}; valid: {', '.join(available())}"
        )
    if not (isinstance(cls, type) and issubclass(cls, ReplicaScorer)):
        raise ValueError(f"router_weights: {spec!r} is not a ReplicaScorer subclass")
    return cls


def parse_weights(text: str) -> dict[str, float]:
    """ "prefix_affinity=2,kv_usage=1" -> {name: weight}; ValueError naming the bad entry."""
    weights: dict[str, float] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = entry.partition("=")
        try:
            weight = float(value) if sep else 1.0
        except ValueError:
            raise ValueError(f"router_weights: {entry!r} is not NAME=WEIGHT") from None
        if not weight >= 0:
            raise ValueError(f"router_weights: weight of {name!r} must be >= 0, got {value}")
        resolve(name.strip())
        weights[name.strip()] = weight
    if not weights or not any(weights.values()):
        raise ValueError(f"router_weights: {text!r} names no scorer with a weight above 0")
    return weights


# The built-ins register themselves on import.
from scheduler_service.engine.scorers import builtin  # noqa: E402,F401
