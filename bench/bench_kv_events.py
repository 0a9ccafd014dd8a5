"""What publishing KV-cache events costs the scheduler's loop per step (--kv-events-config).

A block pool of 4,096 blocks of 16 tokens logs a step's changes (`--stored` blocks cached, as
many evicted), then KVEventStream.on_step drains the log, builds the batch and queues it for the
publisher thread (a real ZMQ PUB socket on ipc://). The loop's share is timed with the thread's
CPU clock; the thread's own msgpack and send run beside it.

    PYTHONPATH=$PWD:protos .venv/bin/python bench/bench_kv_events.py --stored 32
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from cython_ext.block_pool import BlockPool
from scheduler_service.engine.kv_events import KVEventPublisher, KVEventStream, parse_config

BLOCK_SIZE = 16


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stored", type=int, default=32, help="blocks cached per step")
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        config = parse_config(
            json.dumps(
                {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"ipc://{folder}/kv",
                }
            )
        )
        assert config is not None
        publisher = KVEventPublisher(config)
        pool = BlockPool(4096)
        pool.enable_events(BLOCK_SIZE)
        stream = KVEventStream(publisher, BLOCK_SIZE)
        loop_cpu = 0.0
        for step in range(args.steps):
            tokens = [(step * 7919 + i) % 32000 for i in range(args.stored * BLOCK_SIZE)]
            hashes = pool.block_hashes(tokens, BLOCK_SIZE)
            blocks = pool.allocate(len(hashes))  # evicts cached blocks once the pool has cycled
            for i, (block, digest) in enumerate(zip(blocks, hashes)):
                pool.cache_block(
                    block,
                    digest,
                    hashes[i - 1] if i else None,
                    tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE],
                )
            pool.free(blocks)
            started = time.thread_time()
            stream.on_step(pool)
            loop_cpu += time.thread_time() - started
        publisher.close()
    print(
        json.dumps(
            {
                "stored_per_step": args.stored,
                "steps": args.steps,
                "loop_us_per_step": round(1e6 * loop_cpu / args.steps, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
