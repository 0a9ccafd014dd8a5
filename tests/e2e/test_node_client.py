"""The Node.js client (tests/node, @grpc/grpc-js + @grpc/proto-loader) against the live servers:
Generate streaming, a Session with two interleaved requests and an abort, INVALID_ARGUMENT."""
from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from api import assert_no_leaked_blocks, wait_until_idle

NODE_DIR = Path(__file__).resolve().parents[1] / "node"


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"`{name}` is not on PATH: install Node.js >= 18 (e.g. apt-get install nodejs npm)")
    return found


async def _run(*argv: str, env: dict | None = None) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *argv, cwd=NODE_DIR, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    output, _ = await process.communicate()
    return process.returncode, output.decode()


async def test_node_client_against_the_live_scheduler(tiny_server):
    node = _tool("node")
    if not (NODE_DIR / "node_modules/@grpc/grpc-js").exists():  # `make install-test` runs it too
        code, output = await _run(_tool("npm"), "ci", "--no-audit", "--no-fund")
        assert code == 0, f"npm ci failed:\n{output}"
    env = dict(os.environ, PLANSERVE_ADDRESS=f"127.0.0.1:{tiny_server.port}")
    code, output = await _run(node, "--test", "--test-reporter=tap", "client.test.mjs", env=env)
    assert code == 0, f"node --test failed:\n{output}"
    # The four cases ran (a renamed or skipped case would still exit 0).
    assert "# pass 4" in output and "# fail 0" in output, output
    await wait_until_idle(tiny_server)
    assert_no_leaked_blocks(tiny_server)
