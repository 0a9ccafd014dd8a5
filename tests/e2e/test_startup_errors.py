"""Start-up problems a person can act on: every port `planserve serve` opens (public gRPC, the
model service's, the OpenAI HTTP API, /metrics), when another process holds it, ends the start
with one line on stderr naming the flag and the port, exit status 2, and nothing left running
(the model service child included); a config the model service refuses while loading or sizing
ends it the same way, with that refusal's line. And `--help` shows every flag's default."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

ALL_FREE = {"--port": "0", "--engine-port": "0", "--http-port": "0", "--metrics-port": "0"}


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    """Runs planserve in its own session, so that anything it left running can be found."""
    process = subprocess.Popen([sys.executable, "-m", "tools", *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=120)
    finally:
        leftovers = _alive(process.pid)
        if leftovers:
            os.killpg(process.pid, signal.SIGKILL)
    assert not leftovers, "a process of the failed start is still running"
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


def _alive(session: int) -> bool:
    try:
        os.killpg(session, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("flag", ["--port", "--engine-port", "--http-port", "--metrics-port"])
def test_a_taken_port_is_one_line_naming_its_flag_and_exit_2(held_port, flag):
    ports = {**ALL_FREE, flag: str(held_port)}
    result = _run(["serve", "--model", "tiny", "--num-kv-blocks", "32",
                   *[a for pair in ports.items() for a in pair]])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert re.fullmatch(rf"planserve: {flag} {held_port}: cannot listen on 127\.0\.0\.1:{held_port} "
                        r"\(Address already in use\); stop what holds it or choose another port "
                        r"\(0 picks a free one\)", lines[0]), lines[0]


def test_the_model_service_alone_fails_before_loading(held_port):
    result = _run(["model-service", "--model", "tiny", "--port", str(held_port)])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"model service: --port {held_port}: cannot listen on 127.0.0.1:{held_port} (Address already in "
        "use); stop what holds it or choose another port (0 picks a free one)"]


def test_a_config_the_model_service_refuses_at_start_is_one_line_naming_its_field():
    """Sizing the KV cache refuses a budget that holds no two blocks: the model service's one
    line naming the field (no traceback), then serve's own, exit status 2, nothing left running."""
    result = _run(["serve", "--model", "tiny", "--kv-cache-memory", "100",
                   *[a for pair in ALL_FREE.items() for a in pair]])
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert re.fullmatch(r"model service: kv_cache_memory_bytes: a budget of 100 bytes holds 0 "
                        r"blocks of \d+ bytes; need >= 2", lines[-2]), result.stderr
    assert lines[-1] == "planserve: model service exited with status 2 before it started serving"


def test_the_scheduler_alone_names_its_flag(held_port):
    result = _run(["scheduler", "--port", "0", "--http-port", str(held_port), "--metrics-port", "0"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"planserve: --http-port {held_port}: ")


@pytest.mark.parametrize("command", ["serve", "scheduler", "model-service"])
def test_help_shows_every_default(command):
    out = subprocess.run([sys.executable, "-m", "tools", command, "--help"], capture_output=True,
                         text=True, check=True, env=dict(os.environ, COLUMNS="400")).stdout
    # One block per option: its "  --flag VALUE" line and the help lines under it.
    blocks = re.split(r"\n(?=  -)", out.split("options:", 1)[1])
    options = [(b.split()[0], b) for b in blocks if re.match(r"  --[a-z0-9-]+ [A-Z_]+", b)]
    assert len(options) > 5, out
    missing = [flag for flag, text in options if "default" not in text]
    assert not missing, f"no default shown for {missing}"
