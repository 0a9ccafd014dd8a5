"""KV-cache events in vLLM's wire format: a pyzmq subscriber decodes every batch strictly (three
frames, the sequence without gaps, each event with exactly the fields vLLM's classes require) and
rebuilds the set of cached blocks from the events alone; it must equal the scheduler's prefix
cache after a workload with prefix hits, evictions, two cache salts and an abort; a dropped batch
and a new pool (a model-service restart) are followed by AllBlocksCleared and the whole cache."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from typing import Optional, Union

import msgpack
import msgspec
import pytest
import pytest_asyncio
import zmq
from api import complete, greedy_ids_request, stub_for, wait_until_idle
from conftest import EngineProcess, start_scheduler

from cython_ext.block_pool import BlockPool
from scheduler_service.core.kv_blocks import KVBlockManager
from scheduler_service.engine.kv_events import (
    HASH_MASK,
    KVEventPublisher,
    KVEventStream,
    parse_config,
)


# vLLM's event classes (vllm/distributed/kv_events.py) for a strict decoder, encoded as vLLM
# encodes them (array_like, tagged by class name, defaults omitted): every field without a default
# is required, no unknown (extra) element is taken; the batch is [ts, events, rank].
class _Event(msgspec.Struct, array_like=True, tag=True, forbid_unknown_fields=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str] = None
    extra_keys: Optional[list] = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


STRICT = msgspec.msgpack.Decoder(KVEventBatch)

# The fields planserve sends, in vLLM's order after the tag: exactly the required ones.
REQUIRED = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def as_map(event: list) -> dict:
    """An array event as {"type": tag, field: value}; it must carry exactly REQUIRED's fields."""
    fields = REQUIRED[event[0]]
    assert len(event) == 1 + len(fields), event
    return {"type": event[0], **dict(zip(fields, event[1:]))}


class Subscriber(threading.Thread):
    """A SUB socket on the endpoint, keeping every (topic, seq, payload) it receives."""

    def __init__(self, endpoint: str, topic: str):
        super().__init__(daemon=True)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.connect(endpoint)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.socket.setsockopt(zmq.RCVTIMEO, 100)
        self.messages: list[list[bytes]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.messages.append(self.socket.recv_multipart())
            except zmq.Again:
                continue
        self.socket.close(linger=0)
        self.context.term()

    def wait_for(self, count: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.messages) < count:
            assert time.monotonic() < deadline, f"{len(self.messages)} of {count} batches came"
            time.sleep(0.01)


def decode(messages: list[list[bytes]], topic: str, ranks=(0,)) -> list[list[dict]]:
    """Every batch's events, checked strictly; the sequence numbers must run 0, 1, 2, ..."""
    batches = []
    for expected_seq, frames in enumerate(messages):
        assert len(frames) == 3
        frame_topic, seq, payload = frames
        assert frame_topic == topic.encode() and len(seq) == 8
        assert int.from_bytes(seq, "big") == expected_seq
        STRICT.decode(payload)  # raises on a missing, mistyped or unknown field
        timestamp, events, rank = msgpack.unpackb(payload)
        assert isinstance(timestamp, float) and abs(timestamp - time.time()) < 600
        assert rank in ranks and isinstance(events, list)
        events = [as_map(event) for event in events]
        for event in events:
            if event["type"] != "AllBlocksCleared":
                assert event["medium"] == "GPU"
                assert all(0 <= h <= HASH_MASK for h in event["block_hashes"])
            if event["type"] == "BlockStored":
                assert len(event["token_ids"]) == event["block_size"] * len(event["block_hashes"])
                assert event["lora_id"] is None
        batches.append(events)
    return batches


def rebuild(batches: list[list[dict]]) -> set[int]:
    cached: set[int] = set()
    for events in batches:
        for event in events:
            if event["type"] == "BlockStored":
                cached.update(event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                cached.difference_update(event["block_hashes"])
            else:
                cached.clear()
    return cached


def cached_hashes(pool) -> set[int]:
    events = pool.cached_block_events()
    assert len(events) == pool.num_cached  # every cached block's caching was logged
    return {digest & HASH_MASK for _, digest, _, _ in events}


@pytest.fixture(scope="module")
def engine():
    process = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64")
    yield process.address
    process.stop()


@pytest_asyncio.fixture
async def publishing(engine, tmp_path):
    endpoint = f"ipc://{tmp_path}/kv-events"
    config = (
        '{"enable_kv_cache_events": true, "publisher": "zmq", '
        f'"endpoint": "{endpoint}", "topic": "kv@planserve"}}'
    )
    server = await start_scheduler(
        engine, kv_events_config=config, max_num_seqs=16, max_num_batched_tokens=64
    )
    subscriber = Subscriber(endpoint, "kv@planserve")
    subscriber.start()
    await asyncio.sleep(0.5)  # the subscription reaches the PUB socket before the first batch
    yield server, subscriber
    subscriber.stopping.set()
    subscriber.join()
    await server.stop(grace_s=1)


async def test_subscriber_rebuilds_the_prefix_cache(publishing):
    server, subscriber = publishing
    stub = stub_for(server)
    prefix = list(range(3000, 3064))  # 4 full blocks
    await complete(stub, greedy_ids_request(prefix + [1], 4))
    await asyncio.gather(
        *(complete(stub, greedy_ids_request(prefix + [i], 4)) for i in range(2, 6))
    )
    salted = list(range(500, 540))
    for salt in ("tenant-a", "tenant-b"):
        await complete(stub, greedy_ids_request(salted, 2, cache_salt=salt))
    call = stub.Generate(greedy_ids_request(list(range(1, 30)), 300))
    await call.read()
    call.cancel()
    # More than 64 blocks' worth at once: preemptions, and cached blocks evicted for reuse.
    await asyncio.gather(*(complete(stub, greedy_ids_request([7 + i] * 40, 50)) for i in range(20)))
    await wait_until_idle(server)
    publisher = server.kv_publisher
    await _until(publisher.idle)
    await asyncio.to_thread(subscriber.wait_for, publisher.num_published)
    batches = decode(subscriber.messages, "kv@planserve")
    assert batches[0][0] == {"type": "AllBlocksCleared"}
    kinds = {event["type"] for events in batches for event in events}
    assert {"BlockStored", "BlockRemoved"} <= kinds  # the workload evicted cached blocks
    pool = server.loop.scheduler.kv.pool
    assert rebuild(batches) == cached_hashes(pool) and pool.num_cached > 0
    # The same first block under two salts: two different hashes, never one for both.
    first = [
        event["block_hashes"][0]
        for events in batches
        for event in events
        if event["type"] == "BlockStored"
        and event["parent_block_hash"] is None
        and event["token_ids"] == salted[:16]
    ]
    assert len(first) == 2 and first[0] != first[1]
    # A chain: each stored block of the prefix names the one before it.
    chain = [
        event
        for events in batches
        for event in events
        if event["type"] == "BlockStored" and event["token_ids"][0] in (3000, 3016, 3032)
    ]
    parents = {event["token_ids"][0]: event["parent_block_hash"] for event in chain}
    hashes = {event["token_ids"][0]: event["block_hashes"][0] for event in chain}
    assert parents[3000] is None and parents[3016] == hashes[3000]
    assert parents[3032] == hashes[3016]


def _cache(pool: BlockPool, tokens: list[int], block_size: int) -> list[int]:
    """Allocates and caches the blocks of `tokens` as the step core does; returns them."""
    hashes = pool.block_hashes(tokens, block_size)
    blocks = pool.allocate(len(hashes))
    for index, block in enumerate(blocks):
        parent = hashes[index - 1] if index else None
        pool.cache_block(
            block, hashes[index], parent, tokens[index * block_size : (index + 1) * block_size]
        )
    return blocks


def test_a_dropped_batch_and_a_new_pool_resynchronize(tmp_path):
    endpoint = f"ipc://{tmp_path}/kv-drop"
    config = parse_config(
        '{"enable_kv_cache_events": true, "publisher": "zmq", '
        f'"endpoint": "{endpoint}", "max_queue_size": 1}}'
    )
    publisher = KVEventPublisher(config, start=False)  # nothing leaves the queue yet
    subscriber = Subscriber(endpoint, "")
    subscriber.start()
    try:
        time.sleep(0.3)
        kv = KVBlockManager(16, block_size=2)
        kv.enable_events()
        stream = KVEventStream(publisher, block_size=2)
        _cache(kv.pool, [1, 2, 3, 4], 2)
        stream.on_step(kv.pool)  # queued: AllBlocksCleared (a new pool), two stores
        _cache(kv.pool, [5, 6, 7, 8], 2)
        stream.on_step(kv.pool)  # the queue is full: dropped
        _cache(kv.pool, [9, 10], 2)
        publisher.start()
        subscriber.wait_for(1)
        stream.on_step(kv.pool)  # resynchronized: cleared, then every cached block
        subscriber.wait_for(2)
        batches = decode(subscriber.messages, "")
        assert batches[1][0] == {"type": "AllBlocksCleared"}
        assert len(batches[1]) == 1 + 5
        assert rebuild(batches) == cached_hashes(kv.pool)
        # Parents before children in the resynchronized batch.
        seen: set[int] = set()
        for event in batches[1][1:]:
            assert event["parent_block_hash"] is None or event["parent_block_hash"] in seen
            seen.update(event["block_hashes"])
        # The model service restarted: a new, empty pool; the next batch clears everything.
        kv.replace_pool(16)
        held = _cache(kv.pool, [1, 2], 2)
        stream.on_step(kv.pool)
        subscriber.wait_for(3)
        batches = decode(subscriber.messages, "")
        assert batches[2][0] == {"type": "AllBlocksCleared"}
        assert rebuild(batches) == cached_hashes(kv.pool) and len(cached_hashes(kv.pool)) == 1
        kv.pool.free(held)
        assert kv.pool.reset_prefix_cache()
        stream.on_step(kv.pool)
        subscriber.wait_for(4)
        assert rebuild(decode(subscriber.messages, "")) == set()
    finally:
        subscriber.stopping.set()
        subscriber.join()
        publisher.close()


@pytest.mark.parametrize(
    "text, field",
    [
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
        ('{"endpoint": "http://x:1"}', "endpoint"),
        ('{"replay_endpoint": "http://127.0.0.1:5558"}', "replay_endpoint"),
        ('{"hwm": 0}', "hwm"),
        ('{"buffer_steps": "many"}', "buffer_steps"),
        ('{"colour": "blue"}', "colour"),
    ],
)
def test_bad_configs_name_the_field(text, field):
    with pytest.raises(ValueError, match=field):
        parse_config(text)


def test_events_are_off_by_default():
    from scheduler_service.config import SchedulerConfig

    assert SchedulerConfig().kv_events_config == ""
    assert parse_config("") is None
    assert not parse_config('{"enable_kv_cache_events": true}').publishes  # publisher "null"


def _replay(endpoint: str, first: int) -> list[list[bytes]]:
    """vLLM's replay request from a DEALER: every kept batch from `first` on, to the end marker."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", first.to_bytes(8, "big")))
        replies = []
        while True:
            _, sequence, payload = dealer.recv_multipart()
            if int.from_bytes(sequence, "big", signed=True) == -1:
                return replies
            replies.append([b"", sequence, payload])
    finally:
        dealer.close(linger=0)
        context.term()


def test_replay_returns_what_a_late_subscriber_missed(tmp_path):
    config = parse_config(
        '{"enable_kv_cache_events": true, "publisher": "zmq", '
        f'"endpoint": "ipc://{tmp_path}/kv", "replay_endpoint": "ipc://{tmp_path}/replay", '
        '"buffer_steps": 3}'
    )
    publisher = KVEventPublisher(config)  # nobody subscribes: every batch is missed
    try:
        kv = KVBlockManager(16, block_size=2)
        kv.enable_events()
        stream = KVEventStream(publisher, block_size=2)
        for first_token in (1, 3, 5, 7, 9):
            _cache(kv.pool, [first_token, first_token + 1], 2)
            stream.on_step(kv.pool)
        deadline = time.monotonic() + 5
        while publisher.num_published < 5:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        replayed = _replay(config.replay_endpoint, 1)
        # Kept: the last 3 batches (buffer_steps); asked from 1: sequences 2, 3, 4.
        assert [int.from_bytes(frames[1], "big") for frames in replayed] == [2, 3, 4]
        events = [[as_map(e) for e in msgpack.unpackb(frames[2])[1]] for frames in replayed]
        assert [[e["token_ids"] for e in batch] for batch in events] == [
            [[5, 6]],
            [[7, 8]],
            [[9, 10]],
        ]
        assert _replay(config.replay_endpoint, 5) == []  # nothing from 5 on: the end marker alone
    finally:
        publisher.close()


async def test_each_replica_publishes_under_its_own_rank(engine, tmp_path):
    """Two model services behind one scheduler: one socket, each replica's batches tagged with
    its rank, and each rank's rebuilt set equal to that replica's prefix cache."""
    second = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64")
    endpoint = f"ipc://{tmp_path}/kv-replicas"
    config = (
        '{"enable_kv_cache_events": true, "publisher": "zmq", '
        f'"endpoint": "{endpoint}", "topic": "kv"}}'
    )
    server = await start_scheduler(
        f"{engine},{second.address}",
        kv_events_config=config,
        max_num_seqs=16,
        max_num_batched_tokens=64,
    )
    subscriber = Subscriber(endpoint, "kv")
    subscriber.start()
    try:
        await asyncio.sleep(0.5)
        stub = stub_for(server)
        await asyncio.gather(
            *(complete(stub, greedy_ids_request([11 + i] * 40, 8)) for i in range(12))
        )
        await wait_until_idle(server)
        await _until(server.kv_publisher.idle)
        await asyncio.to_thread(subscriber.wait_for, server.kv_publisher.num_published)
        by_rank: dict[int, list[list[dict]]] = {0: [], 1: []}
        decode(subscriber.messages, "kv", ranks=(0, 1))
        for _, _, payload in subscriber.messages:
            _, events, rank = msgpack.unpackb(payload)
            by_rank[rank].append([as_map(event) for event in events])
        replicas = server.loop.replicas
        assert len(replicas) == 2
        for rank, replica in enumerate(replicas):
            pool = replica.scheduler.kv.pool
            assert pool.num_cached > 0  # the router sent work to both
            assert rebuild(by_rank[rank]) == cached_hashes(pool)
    finally:
        subscriber.stopping.set()
        subscriber.join()
        await server.stop(grace_s=1)
        second.stop()


async def _until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


async def test_a_model_service_restart_clears_the_consumers_index(tmp_path):
    """SIGKILL the model service after its blocks were announced, start it again on its port:
    the cached KV is gone, so the next batch starts with AllBlocksCleared, and the rebuilt set
    equals the new pool's cache (none of the old blocks)."""
    own = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64")
    endpoint = f"ipc://{tmp_path}/kv-restart"
    config = (
        '{"enable_kv_cache_events": true, "publisher": "zmq", '
        f'"endpoint": "{endpoint}", "topic": "kv"}}'
    )
    server = await start_scheduler(own.address, kv_events_config=config)
    subscriber = Subscriber(endpoint, "kv")
    subscriber.start()
    try:
        await asyncio.sleep(0.5)
        stub = stub_for(server)
        await complete(stub, greedy_ids_request(list(range(200, 250)), 4))
        await wait_until_idle(server)
        before = rebuild(decode(subscriber.messages, "kv"))
        assert len(before) == 3  # 50 prompt tokens: 3 full blocks announced
        own.process.send_signal(signal.SIGKILL)
        own.process.wait()
        await _until(lambda: not server.ready)
        port = server.config.engine_address.rsplit(":", 1)[1]
        own = EngineProcess(
            "--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64", "--port", port
        )
        await _until(lambda: server.ready)
        published_before = server.kv_publisher.num_published
        await complete(stub, greedy_ids_request(list(range(600, 640)), 4))
        await wait_until_idle(server)
        await _until(server.kv_publisher.idle)
        await asyncio.to_thread(subscriber.wait_for, server.kv_publisher.num_published)
        batches = decode(subscriber.messages, "kv")
        assert batches[published_before][0] == {"type": "AllBlocksCleared"}
        after = rebuild(batches)
        assert after == cached_hashes(server.loop.scheduler.kv.pool) and len(after) == 2
        assert not after & before
    finally:
        subscriber.stopping.set()
        subscriber.join()
        await server.stop(grace_s=1)
        own.stop()
