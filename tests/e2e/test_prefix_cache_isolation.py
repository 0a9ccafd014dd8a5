"""Prefix caching on real servers: a hit needs the whole SHA-256 digest, salts and tenants apart.

Each test runs its own tiny model service (a scheduler takes over an engine's stream, so the
session's shared one is left alone) and schedulers on it one after another:

- collision: with the block index key cut to 1 bit (block_pool.set_key_bits_for_tests, test only)
  two prompts whose first blocks share a key, A and B, each get the tokens a cache-less server
  gives them; B reports no cached tokens, and A, sent again, still hits (cached_tokens > 0).
- scope: with --prefix-cache-scope tenant a second tenant's identical prompt is computed again
  (cached_tokens 0) while the same tenant hits; in the global scope the second tenant hits, and a
  different cache_salt does not.
"""
from __future__ import annotations

import pytest

from api import complete, greedy_ids_request, stub_for, wait_until_idle
from conftest import EngineProcess, start_scheduler
from cython_ext import block_pool
from tests.scheduler import block_pool_oracle as oracle

BLOCK_SIZE = 16  # the tiny model service's
KEY_BITS = 1


@pytest.fixture
def engine():
    process = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64")
    yield process.address
    process.stop()


def _prompt(first: int) -> list[int]:
    # Two full blocks and one more token (the last token is never matched).
    return [first + i for i in range(2 * BLOCK_SIZE + 1)]


def _colliding_prompts() -> tuple[list[int], list[int]]:
    a = _prompt(100)
    key = oracle.digest_key(oracle.block_hash(0, a[:BLOCK_SIZE]), KEY_BITS)
    for first in range(200, 2000):
        b = _prompt(first)
        if oracle.digest_key(oracle.block_hash(0, b[:BLOCK_SIZE]), KEY_BITS) == key:
            return a, b
    raise AssertionError("no colliding prompt found")


async def _run(server, prompt: list[int], **fields):
    reply = await complete(stub_for(server), greedy_ids_request(prompt, 8, **fields))
    await wait_until_idle(server)
    return reply.token_ids, reply.usage.cached_tokens


async def test_colliding_block_keys_never_share_kv(engine):
    a, b = _colliding_prompts()
    reference = await start_scheduler(engine, enable_prefix_caching=False)
    try:
        want_a, _ = await _run(reference, a)
        want_b, _ = await _run(reference, b)
    finally:
        await reference.stop(grace_s=1)
    assert want_a != want_b  # the test can tell the two apart

    block_pool.set_key_bits_for_tests(KEY_BITS)
    try:
        server = await start_scheduler(engine)  # its pool is built now, with the short key
    finally:
        block_pool.set_key_bits_for_tests(64)
    try:
        assert server.loop.scheduler.kv.pool.key_bits == KEY_BITS
        assert await _run(server, a) == (want_a, 0)
        assert await _run(server, b) == (want_b, 0)  # A's block has B's key: no hit
        tokens, cached = await _run(server, a)
        assert tokens == want_a and cached >= BLOCK_SIZE  # A still hits its own block
        assert await _run(server, b) == (want_b, 0)
    finally:
        await server.stop(grace_s=1)


async def test_tenant_scope_keeps_tenants_apart(engine):
    prompt = _prompt(500)
    cached_prefix = 2 * BLOCK_SIZE
    server = await start_scheduler(engine, prefix_cache_scope="tenant")
    try:
        want, cached = await _run(server, prompt, tenant="a")
        assert cached == 0
        assert await _run(server, prompt, tenant="a") == (want, cached_prefix)
        assert await _run(server, prompt, tenant="b") == (want, 0)
        assert await _run(server, prompt, tenant="b") == (want, cached_prefix)
        assert await _run(server, prompt, tenant="a", cache_salt="s") == (want, 0)
    finally:
        await server.stop(grace_s=1)

    server = await start_scheduler(engine)  # the global scope (default)
    try:
        assert await _run(server, prompt, tenant="a") == (want, 0)
        assert await _run(server, prompt, tenant="b") == (want, cached_prefix)  # shared
        assert await _run(server, prompt, tenant="b", cache_salt="s") == (want, 0)
        assert await _run(server, prompt, tenant="c", cache_salt="s") == (want, cached_prefix)
    finally:
        await server.stop(grace_s=1)
