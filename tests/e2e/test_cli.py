"""`planserve serve` as a user runs it: two processes, a printed port, a client, a clean stop."""
import os
import signal
import subprocess
import sys

import pytest

PORT_LINE = "PLANSERVE_PORT="


@pytest.fixture
def served_tiny():
    process = subprocess.Popen(
        [sys.executable, "-m", "tools", "serve", "--model", "tiny", "--dtype", "float32", "--port", "0",
         "--engine-port", "0", "--num-kv-blocks", "32", "--http-port", "0",
         "--metrics-port", "0"],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PLANSERVE_LOG_JSON="1"))
    port = None
    for line in process.stdout:
        if line.startswith(PORT_LINE):
            port = int(line[len(PORT_LINE):])
            break
    assert port, f"planserve serve exited with {process.poll()}"
    yield process, port
    if process.poll() is None:
        process.kill()


def test_serve_then_generate_then_sigterm_stops_both_processes(served_tiny):
    process, port = served_tiny
    result = subprocess.run(
        [sys.executable, "-m", "scheduler_service", "generate", "Hello there", "--port",
         str(port), "--max-new-tokens", "6", "--ignore-eos"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "FINISH_REASON_LENGTH" in result.stdout
    assert "completion 6 tokens" in result.stdout

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
