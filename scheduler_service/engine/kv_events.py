"""KV-cache events in vLLM's ZMQ + msgpack format, for routers that index the pods' prefix caches
(llm-d's precise prefix scorer, NVIDIA Dynamo, AIBrix): `--kv-events-config`, as vLLM's.

The block pool logs every change of its prefix cache as it happens (cython_ext/block_pool.pyx
"event log": STORED from the step core's `_cache_full_blocks`, REMOVED when `_take_head` evicts,
CLEARED on a prefix-cache reset). After each step the engine loop drains that log into one batch
(KVEventStream.on_step) and hands it to a publisher thread (KVEventPublisher), so the loop never
waits on the socket. Each message is three frames:

    topic   the configured topic (bytes)
    seq     the batch's sequence number, 8 bytes big-endian, from 0 without gaps
    payload msgpack [timestamp, [event, ...], data_parallel_rank]

and each event as vLLM's own event classes encode it (msgspec Structs with array_like=True,
tag=True, omit_defaults=True): an array whose first element is the class name, then the fields
in declaration order, the trailing ones left at their defaults omitted (lora_name, extra_keys):

    ["BlockStored", [h], p or None, [token ids...], block_size, None (lora_id), "GPU"]
    ["BlockStored", ..., block_size, lora_id, "GPU", lora_name]     (a LoRA adapter's block)
    ["BlockRemoved", [h], "GPU"]
    ["AllBlocksCleared"]

So a consumer that decodes with vLLM's classes (llm-d's, Dynamo's) takes every batch.

A hash is the low 64 bits of planserve's salted SHA-256 block digest, as an unsigned integer; the
salt itself is never published (it is inside the digest). A consumer keys blocks by the token ids
and the parent chain. AllBlocksCleared starts the stream, follows a model-service restart (a new
pool) and a prefix-cache reset; when a batch could not be queued (or logged), the next one is
AllBlocksCleared followed by a BlockStored for every cached block, so no consumer keeps a wrong
index. A ROUTER socket on the replay endpoint sends a subscriber the batches it missed (vLLM's
protocol; KVEventPublisher). The events reveal every tenant's prompt tokens: off by default, and
the sockets bind only the endpoints given (docs/gateway.md).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import queue
import threading
import time
from typing import Any, Optional

HASH_MASK = (1 << 64) - 1
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay sequence number
REPLAYS_PER_S = 10  # replay requests served per second; more get the end marker at once
MEDIUM = "GPU"  # vLLM's name for the model's own KV memory (the tier the router asks about)
STORED, REMOVED, CLEARED = 1, 2, 3  # the pool's event kinds (BlockPool.take_events)
CLEARED_EVENT = ["AllBlocksCleared"]


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig fields (`--kv-events-config` JSON)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" publishes; "null" (vLLM's default) does not
    endpoint: str = "tcp://127.0.0.1:5557"  # bound as given: a wildcard only if written here
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_config(text: str) -> Optional[KVEventsConfig]:
    """The config in `text` (JSON; empty: none); ValueError naming the field and the value."""
    if not text:
        return None
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"kv_events_config: not valid JSON ({error})") from None
    if not isinstance(fields, dict):
        raise ValueError("kv_events_config: must be a JSON object")
    known = {f.name: f for f in dataclasses.fields(KVEventsConfig)}
    for name in fields:
        if name not in known:
            raise ValueError(
                f"kv_events_config: unknown field {name!r} (fields: {', '.join(known)})"
            )
    config = KVEventsConfig(**fields)
    _check(config)
    return config


def _check(config: KVEventsConfig) -> None:
    def bad(field: str, rule: str, value: Any) -> ValueError:
        return ValueError(f"kv_events_config.{field}: {rule}, got {value!r}")

    if not isinstance(config.enable_kv_cache_events, bool):
        raise bad("enable_kv_cache_events", "must be true or false", config.enable_kv_cache_events)
    if config.publisher not in ("zmq", "null"):
        raise bad("publisher", "must be zmq or null", config.publisher)
    if not isinstance(config.endpoint, str) or not config.endpoint.startswith(
        ("tcp://", "ipc://", "inproc://")
    ):
        raise bad("endpoint", "must be a tcp://, ipc:// or inproc:// address", config.endpoint)
    addresses = ("tcp://", "ipc://", "inproc://")
    replay = config.replay_endpoint
    if replay is not None and not (isinstance(replay, str) and replay.startswith(addresses)):
        raise bad("replay_endpoint", "must be a tcp://, ipc:// or inproc:// address", replay)
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(name, "must be an integer >= 1", value)
    if not isinstance(config.topic, str):
        raise bad("topic", "must be a string", config.topic)


class KVEventPublisher:
    """A ZMQ PUB socket bound to the endpoint and the thread that sends on it; `publish` only
    queues (False when the queue is full: the batch is dropped and the caller resynchronizes).

    With a replay_endpoint, a ROUTER socket there answers a request [b"", start sequence (8 bytes
    big-endian)] with every kept batch from that number on ([b"", seq, payload] each), then
    [b"", -1, b""], as vLLM's: the last buffer_steps batches are kept, and at most
    REPLAYS_PER_S requests a second are served (more get the end marker alone)."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0, start: bool = True):
        import zmq

        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.set_hwm(config.hwm)
        self._replay = self._context.socket(zmq.ROUTER) if config.replay_endpoint else None
        try:
            self._socket.bind(config.endpoint)
            if self._replay is not None and config.replay_endpoint:
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as error:
            self._socket.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            self._context.term()
            raise OSError(f"kv_events_config: cannot bind ({error})") from None
        self._kept: collections.deque = collections.deque(maxlen=config.buffer_steps)
        self._replay_times: collections.deque = collections.deque(maxlen=REPLAYS_PER_S)
        self._topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self.num_published = 0  # batches sent; the next one's sequence number
        self._thread = threading.Thread(target=self._send_batches, name="kv-events", daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        self._thread.start()

    def publish(self, events: list[list], rank: Optional[int] = None) -> bool:
        """Queues one batch, tagged with `rank` (default: the publisher's data_parallel_rank)."""
        rank = self.data_parallel_rank if rank is None else rank
        try:
            self._queue.put_nowait((time.time(), events, rank))
        except queue.Full:
            return False
        return True

    def _send_batches(self) -> None:
        import msgpack

        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                # With a replay socket, come back to it at least every 50 ms.
                item = self._queue.get(timeout=0.05 if self._replay is not None else None)
            except queue.Empty:
                continue
            if item is None:
                self._queue.task_done()
                return
            timestamp, events, rank = item
            payload = msgpack.packb([timestamp, events, rank])
            sequence = self.num_published.to_bytes(8, "big")
            self._socket.send_multipart((self._topic, sequence, payload))
            if self._replay is not None:
                self._kept.append((sequence, payload))
            self.num_published += 1
            self._queue.task_done()

    def idle(self) -> bool:
        """No batch queued or being sent: num_published then counts every batch published so
        far (the sending thread publishes after publish() returns)."""
        return self._queue.unfinished_tasks == 0

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request
        client, _, start = frames
        now = time.monotonic()
        within_rate = len(self._replay_times) < REPLAYS_PER_S or now - self._replay_times[0] > 1
        if within_rate:
            self._replay_times.append(now)
            first = int.from_bytes(start, "big")
            for sequence, payload in list(self._kept):
                if int.from_bytes(sequence, "big") >= first:
                    self._replay.send_multipart((client, b"", sequence, payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))

    def close(self) -> None:
        """Sends what is queued (for up to a second), then closes the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=1.0)
        self._socket.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()


def _stored(event: tuple, block_size: int, lora: Optional[tuple[int, str]] = None) -> list:
    """BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium
    [, lora_name]): lora_id and lora_name for a block of a LoRA adapter's request."""
    _, digest, parent, token_ids = event
    parent_hash = None if parent is None else parent & HASH_MASK
    stored = ["BlockStored", [digest & HASH_MASK], parent_hash, token_ids, block_size, None, MEDIUM]
    if lora is not None:
        stored[5] = lora[0]
        stored.append(lora[1])
    return stored


def _wire(event: tuple, block_size: int, lora: Optional[tuple[int, str]] = None) -> list:
    kind = event[0]
    if kind == STORED:
        return _stored(event, block_size, lora)
    if kind == REMOVED:
        return ["BlockRemoved", [event[1] & HASH_MASK], MEDIUM]  # (block_hashes, medium)
    return CLEARED_EVENT


def parents_first(events: list[tuple]) -> list[tuple]:
    """STORED events ordered so that a block's parent, when cached, comes before it."""
    by_digest = {event[1]: event for event in events}
    done: set[int] = set()
    ordered: list[tuple] = []
    for first in events:
        chain = []
        event: Optional[tuple] = first
        while event is not None and event[1] not in done:
            chain.append(event)
            done.add(event[1])
            event = by_digest.get(event[2])
        ordered.extend(reversed(chain))
    return ordered


class KVEventStream:
    """One scheduler's events: its pool's log drained after each step into one batch, tagged
    with its rank (with several model services, each replica's scheduler has its own)."""

    def __init__(self, publisher: KVEventPublisher, block_size: int, rank: int = 0):
        self.publisher = publisher
        self.block_size = block_size
        self.rank = rank
        self._pool: Any = None
        self._resync = False
        # LoRA: the first-block digests of adapter requests (KVBlockManager.lora_roots, set by
        # the engine loop) and the adapter of each cached block of theirs (a chain's blocks
        # inherit their first block's adapter).
        self.lora_roots: dict[int, tuple[int, str]] = {}
        self._lora_of: dict[int, tuple[int, str]] = {}

    def clear(self) -> None:
        """The model service is gone (a replica removed): its rank's blocks are all gone."""
        self._resync = not self.publisher.publish([CLEARED_EVENT], self.rank)

    def _lora(self, event: tuple) -> Optional[tuple[int, str]]:
        """The adapter of a STORED block (None: the base model), kept while it is cached."""
        if not (self.lora_roots or self._lora_of):
            return None
        kind, digest, parent, _ = event
        if kind == STORED:
            lora = self.lora_roots.get(digest) if parent is None else self._lora_of.get(parent)
            if lora is not None:
                self._lora_of[digest] = lora
            return lora
        if kind == REMOVED:
            self._lora_of.pop(digest, None)
        elif kind == CLEARED:
            self._lora_of.clear()
        return None

    def on_step(self, pool) -> None:
        """Publishes what the pool logged since the last step (nothing: no batch)."""
        logged, lost = pool.take_events()
        if pool is not self._pool:  # the first step, or a new pool after a model-service restart
            self._pool = pool
            self._lora_of.clear()
            batch = [CLEARED_EVENT] + [_wire(e, self.block_size, self._lora(e)) for e in logged]
        elif self._resync or lost:
            cached = parents_first(pool.cached_block_events())
            lora_of = self._lora_of
            batch = [CLEARED_EVENT] + [
                _stored(e, self.block_size, lora_of.get(e[1])) for e in cached
            ]
        elif logged:
            batch = [_wire(e, self.block_size, self._lora(e)) for e in logged]
        else:
            return
        self._resync = not self.publisher.publish(batch, self.rank)
