"""The Prometheus text format (0.0.4) of a registry, rendered for a scrape every 50 ms.

A gateway's endpoint picker scrapes /metrics every 50 ms, so the render is on the scheduler's
loop twenty times a second. prometheus_client's `generate_latest` formats and escapes every
sample's name and labels on every call; here each family's HELP/TYPE lines and each sample's
`name{labels} ` are made once and kept, and a scrape formats only the values. The text is the
same as generate_latest's but for how a float is spelled (Python's repr: 1000000.0 where
generate_latest writes 1e+06), which every parser reads alike.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, generate_latest

# OpenMetrics type -> (suffix of the HELP/TYPE name, the text format's type), as generate_latest.
_TYPES = {
    "counter": ("_total", "counter"),
    "info": ("_info", "gauge"),
    "stateset": ("", "gauge"),
    "gaugehistogram": ("", "histogram"),
    "unknown": ("", "untyped"),
}
# Samples generate_latest moves into families of their own (none with created series off).
_MOVED_SUFFIXES = ("_created", "_gsum", "_gcount")


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _value(value: float) -> str:
    if math.isfinite(value):
        return repr(float(value))
    if math.isnan(value):
        return "NaN"
    return "+Inf" if value > 0 else "-Inf"


class TextRenderer:
    """Renders one registry; keeps the static parts of what it rendered before."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self._headers: dict[tuple[str, str, str], str] = {}
        self._prefixes: dict[tuple, str] = {}

    def _header(self, name: str, documentation: str, type_: str) -> str:
        key = (name, documentation, type_)
        header = self._headers.get(key)
        if header is None:
            suffix, text_type = _TYPES.get(type_, ("", type_))
            name += suffix
            header = f"# HELP {name} {_escape_help(documentation)}\n# TYPE {name} {text_type}\n"
            self._headers[key] = header
        return header

    def _prefix(self, name: str, labels: dict[str, str]) -> str:
        key = (name, *labels.items())
        prefix = self._prefixes.get(key)
        if prefix is None:
            pairs = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sorted(labels.items()))
            prefix = f"{name}{{{pairs}}} " if labels else f"{name} "
            self._prefixes[key] = prefix
        return prefix

    def render(self) -> bytes:
        lines: list[str] = []
        for family in self.registry.collect():
            lines.append(self._header(family.name, family.documentation, family.type))
            for sample in family.samples:
                if sample.timestamp is not None or sample.name.endswith(_MOVED_SUFFIXES):
                    return generate_latest(self.registry)  # shapes this renderer leaves alone
                lines.append(self._prefix(sample.name, sample.labels) + _value(sample.value) + "\n")
        return "".join(lines).encode()
