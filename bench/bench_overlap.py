"""Overlap on vs off, end to end on the real model: the peer workload (16 prompts of 32..512
tokens, 128 greedy new tokens) through `planserve serve` with and without `--no-overlap`.

    PYTHONPATH=protos:. .venv/bin/python bench/bench_overlap.py --out bench/results/overlap.json

Thread layout: the model service runs torch with its defaults (2 intra-op threads on this 2-core
machine); the scheduler process (no torch) and the benchmark client share the same two cores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

PORT_LINE = "PLANSERVE_PORT="


def _serve(extra: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "tools", "serve", "--port", "0", "--http-port", "-1",
         "--metrics-port", "-1", *extra], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    for line in process.stdout:
        if line.startswith(PORT_LINE):
            process.port = int(line[len(PORT_LINE):])
            return process
    raise RuntimeError("planserve serve did not start")


def _bench(port: int, label: str) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "report.json")
        subprocess.run([sys.executable, "-m", "tools", "bench", "--workload", "peer", "--port", str(port),
                        "--label", label, "--out", out, "--no-progress"], check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    results = {}
    for label, extra in (("overlap", []), ("no-overlap", ["--no-overlap"])):
        server = _serve(extra)
        try:
            results[label] = _bench(server.port, label)
        finally:
            server.terminate()
            server.wait(timeout=60)
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
