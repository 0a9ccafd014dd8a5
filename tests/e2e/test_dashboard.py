"""docs/grafana/planserve-dashboard.json names only metrics a running server exports.

Every PromQL query of the dashboard is read for metric names (planserve_* and vllm:*); each must
be a sample name a real scheduler (the tiny model's own model service, /metrics on a free port)
serves over HTTP after one request, so that the labelled series exist too. A renamed or dropped
metric fails here instead of leaving an empty panel in production.
"""
from __future__ import annotations

import json
import pathlib
import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from api import complete, greedy_ids_request, stub_for
from conftest import EngineProcess, start_scheduler

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "docs" / "grafana" / "planserve-dashboard.json"
# A metric name in PromQL: planserve_... or vllm:... (label names and functions never start so).
METRIC_NAME = re.compile(r"\b(planserve_[a-zA-Z0-9_]+|vllm:[a-zA-Z0-9_:]+)")
# What a family of each type exports as samples (prometheus_client's text format).
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "summary": ("_sum", "_count", "_created", "")}


def _queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"]
              if isinstance(v.get("query"), dict)]
    return exprs


def _exported_names(text: str) -> set[str]:
    """Every sample name the families in `text` export (also those with no sample yet)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def test_dashboard_is_valid_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("first token", "inter-token", "throughput", "waiting", "kv cache", "preemptions",
                  "engine up", "rejections", "speculative"):
        assert topic in titles, f"no panel about {topic}"
    for panel in dashboard["panels"]:
        assert panel["targets"], f"panel {panel['title']!r} has no query"


async def test_every_metric_the_dashboard_queries_is_exported():
    dashboard = json.loads(DASHBOARD.read_text())
    wanted = {name for expr in _queries(dashboard) for name in METRIC_NAME.findall(expr)}
    assert len(wanted) >= 15  # the regex found the queries' metrics, not nothing
    # Its own model service: a second scheduler on the shared one would take over its stream.
    engine = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "32")
    server = await start_scheduler(engine.address, metrics_port=0)
    try:
        await complete(stub_for(server), greedy_ids_request([11, 12, 13, 14], 4))
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                    timeout=10) as reply:
            exported = _exported_names(reply.read().decode())
    finally:
        await server.stop(grace_s=1)
        engine.stop()
    missing = sorted(wanted - exported)
    assert not missing, f"the dashboard queries metrics the server does not export: {missing}"
