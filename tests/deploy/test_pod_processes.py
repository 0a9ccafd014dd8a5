"""The base pod's two containers as real processes on 127.0.0.1: started with the manifest's
args (only the model, the host and the ports changed: the tiny model, loopback, free ports),
every probe the manifest declares answers SERVING, the HTTP API and the metrics answer on the
ports the manifest declares as `http` and `metrics`, and SIGTERM drains within the grace
period."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from _deploy import env_of, expand, one, render, role


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _replace(args: list[str], flag: str, value: str) -> list[str]:
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


def _health(port: int, service: str, deadline_s: float) -> int:
    """Polls like the kubelet until SERVING or the deadline; returns the last status."""
    status = health_pb2.HealthCheckResponse.UNKNOWN
    end = time.monotonic() + deadline_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < end:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return status
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    return status


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tools", *args],
                            env={**os.environ, **env}, stdout=subprocess.DEVNULL)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(10)


def test_base_pod_processes_answer_their_probes_and_drain_in_the_grace_period():
    docs = render("base")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    containers = {role(c): c for c in pod["containers"]}
    engine_port, public_port = _free_port(), _free_port()
    ports = {"model-service": engine_port, "scheduler": public_port}

    engine_c = containers["model-service"]
    engine_args = expand(engine_c["args"], env_of(engine_c, docs))
    engine_args = _replace(_replace(_replace(engine_args, "--model", "tiny"), "--host", "127.0.0.1"),
                           "--port", str(engine_port))
    scheduler_c = containers["scheduler"]
    scheduler_args = expand(scheduler_c["args"], env_of(scheduler_c, docs))
    scheduler_args = _replace(_replace(scheduler_args, "--host", "127.0.0.1"), "--port", str(public_port))
    scheduler_args = _replace(scheduler_args, "--engine", f"127.0.0.1:{engine_port}")
    # The manifest's fixed HTTP and metrics ports, moved to free ones (by the container port's name).
    http_port, metrics_port = _free_port(), _free_port()
    named = {p["name"]: p["containerPort"] for p in scheduler_c["ports"]}
    for flag, name, port in (("--http-port", "http", http_port), ("--metrics-port", "metrics", metrics_port)):
        assert int(scheduler_args[scheduler_args.index(flag) + 1]) == named[name]
        scheduler_args = _replace(scheduler_args, flag, str(port))

    engine = _start(engine_args, env_of(engine_c, docs))
    scheduler = _start(scheduler_args, env_of(scheduler_c, docs))
    try:
        for name, container in containers.items():
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                service = container[kind]["grpc"].get("service", "")
                status = _health(ports[name], service, deadline_s=120)
                assert status == health_pb2.HealthCheckResponse.SERVING, (
                    f"{name} {kind} (service {service!r}) reads {status}")
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10) as reply:
            assert reply.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
            assert reply.status == 200 and b"# TYPE " in reply.read()

        # The kubelet: preStop first, then SIGTERM. Idle, each process exits within its drain.
        grace = pod["terminationGracePeriodSeconds"]
        started = time.monotonic()
        scheduler.send_signal(signal.SIGTERM)
        assert scheduler.wait(grace) == 0
        engine.send_signal(signal.SIGTERM)
        assert engine.wait(grace) == 0
        assert time.monotonic() - started < grace
    finally:
        _stop(scheduler)
        _stop(engine)
