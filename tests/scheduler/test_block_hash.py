"""The prefix cache's block hash is SHA-256 and a hit needs the whole digest equal.

- The vendored SHA-256 (cython_ext/csrc/sha256.h) gives FIPS 180-4's example digests, and
  block_hash is SHA-256 of the tagged message block_pool.pyx documents (checked with hashlib),
  on every compression path this CPU runs: portable C and, where the CPU has them, the SHA
  instructions (csrc/sha256_shani.c); both give hashlib's digest for every length tried.
- StepCore.admit takes the pool's digests of the prefix hits rather than hashing them again: the
  slot's chain equals hashing the tokens (and does for a hit with no digest, hashed instead).
- With the index key truncated to a few bits (set_key_bits_for_tests, test only), prompts whose
  keys collide never share a block, on the Cython pool and on the oracle alike.
- Salts keep caches apart: kv_blocks.salt_of per cache_salt, and per tenant in the tenant scope.
"""
from __future__ import annotations

import hashlib
import random
import struct

import pytest

from cython_ext import block_pool as cy
from scheduler_service.core.kv_blocks import KVBlockManager, salt_of
from scheduler_service.core.request import Request
from tests.scheduler import block_pool_oracle as oracle
from tests.scheduler.factories import make_request

# FIPS 180-4 / NIST CSRC "SHA256.pdf" examples, and the empty message.
FIPS_VECTORS = [
    (b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
    (b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
     "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"),
    (b"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
    (b"a" * 1000, hashlib.sha256(b"a" * 1000).hexdigest()),  # many blocks, streamed
]


IMPLS = ["portable", "sha-ni"]


@pytest.fixture(params=IMPLS)
def sha256_impl(request):
    """Runs the test on one compression path (skipped where this build or CPU lacks it), then
    puts back the path the module chose at import."""
    if request.param not in cy.sha256_impls():
        pytest.skip(f"{request.param}: not on this build or CPU")
    before = cy.sha256_impl()
    assert cy.set_sha256_impl(request.param) == request.param
    yield request.param
    cy.set_sha256_impl(before)


@pytest.mark.parametrize("message,digest", FIPS_VECTORS)
def test_vendored_sha256_gives_the_standard_digests(sha256_impl, message, digest):
    assert cy.sha256_impl() == sha256_impl
    assert cy.sha256(message).hex() == digest


def test_sha256_equals_hashlib_for_every_length(sha256_impl):
    # Every length through 4 blocks (each padding case: the length field in the last block or in
    # one more), then longer random messages: many blocks in one call to the compression path.
    rng = random.Random(1901)
    for n in list(range(0, 300)) + [rng.randrange(300, 20_000) for _ in range(60)]:
        data = rng.randbytes(n)
        assert cy.sha256(data) == hashlib.sha256(data).digest(), n
    # Bytes that exercise every bit pattern of the message words (big-endian loads).
    for value in (0x00, 0xFF, 0x80, 0x7F):
        assert cy.sha256(bytes([value]) * 4096) == hashlib.sha256(bytes([value]) * 4096).digest()


def test_block_hash_equals_hashlib_on_each_path(sha256_impl):
    # One-shot (up to 108 tokens) and streamed (longer) messages, random salts and parents.
    rng = random.Random(sha256_impl == "portable")
    for n in list(range(0, 120)) + [128, 255, 1000]:
        tokens = [rng.randrange(2**32) for _ in range(n)]
        parent, salt = rng.randrange(2**256), rng.randrange(2**256)
        expected = int.from_bytes(hashlib.sha256(_message(parent, tokens, salt)).digest(), "big")
        assert cy.block_hash(parent, tokens, salt) == expected, n


def test_paths_agree_on_block_chains():
    # The digests a pool stores must not depend on the path: a chain hashed on one path, looked
    # up on the other (what a restart on another CPU, or PLANSERVE_SHA256, would do).
    before = cy.sha256_impl()
    rng = random.Random(7)
    prompt = [rng.randrange(32000) for _ in range(16 * 40)]
    chains = {}
    try:
        for impl in cy.sha256_impls():
            cy.set_sha256_impl(impl)
            chains[impl] = cy.BlockPool(4).block_hashes(prompt, 16, salt=12345)
    finally:
        cy.set_sha256_impl(before)
    expected, parent = [], 0
    for i in range(40):
        message = _message(parent, prompt[16 * i:16 * i + 16], 12345)
        parent = int.from_bytes(hashlib.sha256(message).digest(), "big")
        expected.append(parent)
    assert all(chain == expected for chain in chains.values())


def test_set_sha256_impl_names_the_choices():
    before = cy.sha256_impl()
    assert before in cy.sha256_impls() and cy.sha256_impls()[0] == "portable"
    with pytest.raises(ValueError, match=r"one of auto, portable, sha-ni; got 'md5'"):
        cy.set_sha256_impl("md5")
    assert cy.sha256_impl() == before
    try:
        assert cy.set_sha256_impl("portable") == "portable"
        # auto: the best this CPU runs, the last of sha256_impls()
        assert cy.set_sha256_impl("auto") == cy.sha256_impls()[-1]
    finally:
        cy.set_sha256_impl(before)


def _admit_with(pool, tokens, hits, salt, bs):
    from cython_ext.step_core import StepCore

    core = StepCore(pool, bs, 4)
    request = make_request(prompt_token_ids=tokens)
    core.admit(0, request, tokens, len(hits) * bs, hits, len(tokens) + 8, salt)
    return core


def test_admit_takes_the_pools_digests_of_its_hits(sha256_impl):
    bs, salt = 16, salt_of("s")
    rng = random.Random(5)
    tokens = [rng.randrange(32000) for _ in range(bs * 12 + 5)]
    pool = cy.BlockPool(64)
    hashes = pool.block_hashes(tokens, bs, salt)
    blocks = pool.allocate(10)
    assert all(pool.cache_block(b, h) for b, h in zip(blocks, hashes))
    pool.free(blocks)
    hits = pool.match_prefix(tokens[:-1], bs, salt)
    assert hits == blocks
    core = _admit_with(pool, tokens, hits, salt, bs)
    assert core.block_hashes(0) == hashes[:10]
    assert [pool.ref_count(b) for b in hits] == [1] * 10
    # Hits the caller holds but that carry no digest (not from match_prefix): hashed from the
    # tokens, the same chain.
    plain = cy.BlockPool(64)
    held = plain.allocate(3)
    core = _admit_with(plain, tokens, held, salt, bs)
    assert core.block_hashes(0) == hashes[:3]


def test_admit_refuses_more_hits_than_tokens():
    pool = cy.BlockPool(8)
    held = pool.allocate(2)
    with pytest.raises(ValueError, match="2 hit blocks of 16 tokens for 20 tokens"):
        _admit_with(pool, list(range(20)), held, 0, 16)
    assert [pool.ref_count(b) for b in held] == [1, 1]  # nothing increfed


def _message(parent: int, tokens: list[int], salt: int) -> bytes:
    return (b"S" + salt.to_bytes(32, "big") + b"P" + parent.to_bytes(32, "big") + b"T"
            + struct.pack("<I", len(tokens)) + struct.pack(f"<{len(tokens)}I", *tokens))


def test_block_hash_is_sha256_of_the_tagged_message():
    rng = random.Random(19)
    # Lengths around the 64-byte block and padding boundaries (71 + 4n bytes).
    for n in list(range(0, 40)) + [64, 128, 256]:
        tokens = [rng.randrange(2**32) for _ in range(n)]
        parent, salt = rng.randrange(2**256), rng.randrange(2**256)
        expected = int.from_bytes(hashlib.sha256(_message(parent, tokens, salt)).digest(), "big")
        assert cy.block_hash(parent, tokens, salt) == expected
    # A known value: the first block of [1, 2, 3], no salt.
    assert cy.block_hash(0, [1, 2, 3]) == 0xC1586F273B9773614BAC4D79635C33F80680A7EE64F24AC44D2ABE2814F79144


def test_a_digest_is_256_bits():
    digests = {cy.block_hash(0, [t]) for t in range(64)}
    assert len(digests) == 64
    assert max(d.bit_length() for d in digests) > 250  # not a 64-bit hash widened


def test_tags_keep_fields_apart():
    # Without tags and lengths, moving a token into the count or the salt could give one message.
    assert cy.block_hash(0, [1, 2]) != cy.block_hash(0, [1, 2, 0])
    assert cy.block_hash(0, [5], salt=0) != cy.block_hash(5, [0], salt=0)
    assert cy.block_hash(7, [1], salt=0) != cy.block_hash(0, [1], salt=7)


@pytest.fixture
def truncated_key():
    """Pools built inside use a 2-bit index key: 4 slots, so unrelated blocks collide."""
    cy.set_key_bits_for_tests(2)
    yield 2
    cy.set_key_bits_for_tests(64)


def _colliding_prompts(block_size: int, key_bits: int, salt: int = 0) -> tuple[list[int], list[int]]:
    """Two one-block prompts with different digests and the same index key."""
    a = list(range(100, 100 + block_size))
    key = oracle.digest_key(oracle.block_hash(0, a, salt), key_bits)
    for start in range(200, 10_000):
        b = list(range(start, start + block_size))
        if oracle.digest_key(oracle.block_hash(0, b, salt), key_bits) == key:
            return a, b
    raise AssertionError("no colliding prompt found")


@pytest.mark.parametrize("impl", ["cython", "oracle"])
def test_colliding_keys_never_share_a_block(truncated_key, impl):
    bs = 4
    pool = cy.BlockPool(16) if impl == "cython" else oracle.OracleBlockPool(16, key_bits=truncated_key)
    if impl == "cython":
        assert pool.key_bits == truncated_key
    a, b = _colliding_prompts(bs, truncated_key)
    (ha,), (hb,) = pool.block_hashes(a, bs), pool.block_hashes(b, bs)
    assert ha != hb and oracle.digest_key(ha, truncated_key) == oracle.digest_key(hb, truncated_key)
    (block_a,) = pool.allocate(1)
    assert pool.cache_block(block_a, ha)
    # b finds a's block by key, but the digests differ: a miss, not a's KV.
    assert pool.match_prefix(b + [0], bs) == []
    assert pool.lookup(hb) == -1
    (block_b,) = pool.allocate(1)
    assert pool.cache_block(block_b, hb) is False  # the key is a's: b stays uncached
    assert pool.match_prefix(b, bs) == []
    # a still hits (hits happen where they should), and only a.
    assert pool.match_prefix(a + [0], bs) == [block_a]
    pool.free([block_a])
    pool.allocate(pool.num_free)  # evicts a: the key is free again
    assert pool.match_prefix(a, bs) == [] and pool.num_cached == 0


def test_truncated_key_prompts_agree_with_the_oracle(truncated_key):
    # Many prompts into a 4-slot index: whatever each pool caches, every hit is a true prefix.
    rng = random.Random(3)
    bs = 2
    pools = [cy.BlockPool(64), oracle.OracleBlockPool(64, key_bits=truncated_key)]
    for _ in range(40):
        prompt = [rng.randrange(4) for _ in range(rng.randrange(1, 9))]
        results = []
        for pool in pools:
            hits = pool.match_prefix(prompt, bs)
            hashes = pool.block_hashes(prompt, bs)
            for block, h in zip(hits, hashes):
                assert pool.lookup(h) == block  # a hit is exactly this prefix's digest
            pool.incref(hits)
            new = pool.allocate(len(hashes) - len(hits))
            cached = [pool.cache_block(blk, h) for blk, h in zip(new, hashes[len(hits):])]
            pool.free(hits + new)
            results.append((hits, new, cached))
        assert results[0] == results[1]


def test_set_key_bits_names_the_bound():
    with pytest.raises(ValueError, match=r"key bits must be in \[1, 64\], got 0"):
        cy.set_key_bits_for_tests(0)
    assert cy.BlockPool(4).key_bits == 64


def _request(tenant: str, cache_salt: str = "") -> Request:
    return make_request(prompt_token_ids=list(range(1, 34)), tenant=tenant, cache_salt=cache_salt)


def test_salts_by_scope():
    assert salt_of("") == 0
    assert salt_of("x") != salt_of("y") and salt_of("x") != 0
    assert salt_of("ab", "c") != salt_of("a", "bc")  # length-prefixed, not concatenated
    assert salt_of("", "") != 0  # tenant scope never shares with the global cache
    global_kv = KVBlockManager(8, 16, prefix_cache_scope="global")
    tenant_kv = KVBlockManager(8, 16, prefix_cache_scope="tenant")
    assert global_kv.salt(_request("a")) == global_kv.salt(_request("b")) == 0
    assert tenant_kv.salt(_request("a")) != tenant_kv.salt(_request("b"))
    assert tenant_kv.salt(_request("a")) == tenant_kv.salt(_request("a"))
    assert tenant_kv.salt(_request("a", "s")) != tenant_kv.salt(_request("a"))


def test_tenant_scoped_cache_does_not_share_across_tenants():
    bs = 16
    kv = KVBlockManager(8, bs, prefix_cache_scope="tenant")
    owner = _request("a")
    hashes = kv.pool.block_hashes(owner.prompt_token_ids, bs, kv.salt(owner))
    blocks = kv.pool.allocate(len(hashes))
    assert all(kv.pool.cache_block(b, h) for b, h in zip(blocks, hashes))
    assert kv.find_cached_prefix(_request("a"))[0] == blocks          # same tenant: hits
    assert kv.find_cached_prefix(_request("b"))[0] == []              # another tenant: none
    assert kv.find_cached_prefix(_request("a", "other"))[0] == []     # another salt: none


def test_prefix_cache_scope_is_validated():
    from scheduler_service.config import SchedulerConfig

    assert SchedulerConfig().prefix_cache_scope == "global"
    assert SchedulerConfig(prefix_cache_scope="tenant").validate().prefix_cache_scope == "tenant"
    with pytest.raises(ValueError, match=r"prefix_cache_scope must be one of global, tenant, got 'team'"):
        SchedulerConfig(prefix_cache_scope="team").validate()


@pytest.mark.parametrize("impl", ["cython", "oracle"])
def test_match_prefix_within_num_tokens_and_num_unheld(impl):
    # What find_cached_prefix needs without copying a slice or asking ref_count per hit.
    bs = 4
    pool = cy.BlockPool(32) if impl == "cython" else oracle.OracleBlockPool(32)
    tokens = list(range(50, 50 + 4 * bs + 1))  # 4 full blocks and one token
    hashes = pool.block_hashes(tokens, bs)
    blocks = pool.allocate(4)
    assert all(pool.cache_block(b, h) for b, h in zip(blocks, hashes))
    pool.free(blocks[:3])  # three cached in the free queue, one still held
    for n in range(len(tokens) + 1):
        assert pool.match_prefix(tokens, bs, 0, n) == pool.match_prefix(tokens[:n], bs) == blocks[:n // bs]
    assert pool.match_prefix(tokens, bs, num_tokens=None) == blocks
    for bad in (-1, len(tokens) + 1):
        with pytest.raises(ValueError, match="num_tokens must be in"):
            pool.match_prefix(tokens, bs, 0, bad)
    assert pool.num_unheld(blocks) == 3 and pool.num_unheld(blocks[3:]) == 0
    assert pool.num_unheld([]) == 0
    with pytest.raises(ValueError):
        pool.num_unheld([0])  # the reserved block is never a hit


def test_packed_uint32_field_is_what_protobuf_parses():
    from planserve.v1 import engine_pb2

    from cython_ext.step_core import packed_uint32_field

    rng = random.Random(2)
    for n in (0, 1, 2, 127, 128, 4096):
        values = [rng.choice([0, 1, 127, 128, 16383, 16384, 2**21, 2**28, 2**32 - 1,
                              rng.randrange(2**32)]) for _ in range(n)]
        wire = packed_uint32_field(2, values)
        reference = engine_pb2.NewSequence(token_ids=values).SerializeToString()
        assert wire == reference  # byte for byte what protobuf writes (b"" for none)
        message = engine_pb2.NewSequence(slot=3)
        message.MergeFromString(wire)
        assert list(message.token_ids) == values and message.slot == 3
    assert packed_uint32_field(2, (5, 6)) == packed_uint32_field(2, [5, 6])  # not only lists
    with pytest.raises(OverflowError):
        packed_uint32_field(2, [2**32])
    with pytest.raises(OverflowError):
        packed_uint32_field(2, [-1])
    with pytest.raises(ValueError, match="field numbers"):
        packed_uint32_field(0, [1])
