"""Benchmark statistics (JSON) and plots (PNG, matplotlib from the `bench` extra).

Definitions (per request, then percentiles over requests or over all gaps):
  TTFT  first token's arrival - send time
  ITL   gap between consecutive chunks, divided by the tokens of the later chunk (per token);
        percentiles over every gap of every request
  TPOT  (E2E - TTFT) / (output tokens - 1), per request
  E2E   last chunk - send time
Throughput: output tokens (and requests) completed / wall time from the first send to the last end.
"""

from __future__ import annotations

import json
import math
import os
import platform
from typing import Iterable, Optional

import numpy as np

from bench.load.loadgen import RequestResult

PERCENTILES = (50, 90, 99)


def _stats(values: Iterable[float], scale: float = 1000.0) -> dict:
    array = np.asarray(list(values), dtype=np.float64) * scale
    if array.size == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    out = {"mean": round(float(array.mean()), 3)}
    out.update({f"p{p}": round(float(np.percentile(array, p)), 3) for p in PERCENTILES})
    return out


def summarize(results: list[RequestResult], elapsed_s: float, **meta) -> dict:
    ok = [r for r in results if not r.error and r.chunk_tokens]
    ttft = [r.chunk_times_s[0] - r.sent_s for r in ok]
    e2e = [r.end_s - r.sent_s for r in ok]
    itl = [
        (r.chunk_times_s[i] - r.chunk_times_s[i - 1]) / r.chunk_tokens[i]
        for r in ok
        for i in range(1, len(r.chunk_times_s))
        for _ in range(r.chunk_tokens[i])  # weight each gap by its tokens: percentiles per token
    ]
    tpot = [
        (r.end_s - r.chunk_times_s[0]) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1
    ]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        **meta,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": round(elapsed_s, 3),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / elapsed_s, 2) if elapsed_s > 0 else None,
        "requests_per_s": round(len(ok) / elapsed_s, 3) if elapsed_s > 0 else None,
        "ttft_ms": _stats(ttft),
        "itl_ms": _stats(itl),
        "tpot_ms": _stats(tpot),
        "e2e_ms": _stats(e2e),
    }


def machine_note() -> dict:
    """What the numbers were measured on, including how busy the machine was at the start."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_1_5_15": [round(x, 2) for x in load],
    }


def write_json(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_run(results: list[RequestResult], path: str, title: str) -> None:
    """One run: TTFT and E2E per request (by send order) and the ITL distribution."""
    plt = _pyplot()
    ok = [r for r in results if not r.error and r.chunk_tokens]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([(r.chunk_times_s[0] - r.sent_s) * 1000 for r in ok], "o-", label="TTFT")
    left.plot([(r.end_s - r.sent_s) * 1000 for r in ok], "s-", label="E2E")
    left.set_xlabel("request (send order)")
    left.set_ylabel("ms")
    left.legend()
    gaps = [
        (r.chunk_times_s[i] - r.chunk_times_s[i - 1]) * 1000 / r.chunk_tokens[i]
        for r in ok
        for i in range(1, len(r.chunk_times_s))
    ]
    if gaps:
        right.hist(gaps, bins=50)
    right.set_xlabel("inter-token latency (ms)")
    right.set_ylabel("gaps")
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_rate_sweep(curves: dict[str, list[dict]], path: str, title: str) -> None:
    """Throughput vs latency: one line per engine, one point per request rate."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, runs in curves.items():
        runs = sorted(runs, key=lambda r: r["output_tokens_per_s"] or 0)
        x = [r["output_tokens_per_s"] for r in runs]
        for axis, key, label in (
            (axes[0], "itl_ms", "p99 inter-token latency (ms)"),
            (axes[1], "ttft_ms", "p99 time to first token (ms)"),
            (axes[2], "e2e_ms", "p50 end-to-end latency (ms)"),
        ):
            field = "p50" if key == "e2e_ms" else "p99"
            axis.plot(x, [r[key][field] for r in runs], "o-", label=name)
            axis.set_xlabel("output tokens/s")
            axis.set_ylabel(label)
            axis.set_yscale("log")  # engines differ by orders of magnitude under overload
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_bars(
    rows: list[dict],
    path: str,
    title: str,
    key: str = "output_tokens_per_s",
    label: str = "output tokens/s",
    goal: Optional[float] = None,
) -> None:
    plt = _pyplot()
    fig, axis = plt.subplots(figsize=(9, 4))
    names = [r["engine"] for r in rows]
    values = [r.get(key) or 0 for r in rows]
    bars = axis.barh(names, values)
    for bar, value in zip(bars, values):
        axis.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value:.0f}", va="center")
    if goal:
        axis.axvline(goal, linestyle="--", color="gray")
    axis.set_xlabel(label)
    axis.invert_yaxis()
    axis.set_title(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
