"""Seeded benchmark workloads, stored in the repo as JSON lines (bench/workloads/NAME.jsonl).

One line per request:

    {"id": "peer-000", "arrival": 0.0, "prompt_ids": [...], "max_new_tokens": 128,
     "ignore_eos": true}

`arrival` is in units of the mean inter-arrival gap: the load generator divides it by the request
rate (requests/s), so one online file serves every rate. Offline workloads have every arrival at 0.
Prompts are token ids of SmolLM2's tokenizer (so every engine sees exactly the same tokens; a model
with a smaller vocabulary, such as `--model null`, folds them modulo its vocabulary size).

The files are regenerated, byte for byte, by

    python -m bench.load.workloads --out bench/workloads

which needs the model extra (it tokenizes a seeded text with SmolLM2's GGUF tokenizer).

Workloads:
  peer           the issue's peer workload: 16 prompts of 32, 64, ..., 512 tokens, 128 greedy new
                 tokens each, EOS ignored, all at t=0
  offline        64 prompts of 64..512 tokens, 32..256 new tokens, all at t=0
  online         200 requests, Poisson arrivals (unit rate), prompts 64..512, 32..256 new tokens
  shared_prefix  64 requests: one of 4 system prompts of 384 tokens + a 32..96-token question,
                 Poisson arrivals
  long_prompt    48 requests: 3 in 4 short (64..256 tokens), 1 in 4 long (1024..3072), 64..128 new
  big            the GPU benchmark's (bench/bench_gpu_serve.py): 512 requests at t=0, prompts of
                 32..512 uniformly random token ids of SmolLM2's vocabulary (no text: every shape
                 sees the same ids), 256 new tokens each, EOS ignored
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
from typing import Iterable

WORKLOADS = ("peer", "offline", "online", "shared_prefix", "long_prompt", "big")
SMOLLM2_VOCAB = 49152
DEFAULT_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "workloads")

_WORDS = (
    "the a of and to in is was for on that with as by at from it his her their an be this which or "
    "had are but not have one all were when we there can been has more if will who would so no "
    "out up "
    "into them some could time these two may then do first any my now such like our over man "
    "me even "
    "most made after also did many before must through back years where much your way well "
    "down should "
    "because each just those people how too little state good very make world still own see "
    "men work "
    "long get here between both life being under never day same another know while last might "
    "us great "
    "old year off come since against go came right used take three river mountain garden "
    "library train "
    "city night autumn moon bread rain coffee bridge star lighthouse snow sea letter story "
    "music engine "
    "kernel memory cache scheduler token batch stream latency throughput request model server queue"
).split()


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    id: str
    arrival: float
    prompt_ids: list[int]
    max_new_tokens: int
    ignore_eos: bool = True

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))


def path_of(name: str, directory: str = DEFAULT_DIR) -> str:
    return os.path.normpath(os.path.join(directory, f"{name}.jsonl"))


def load(name_or_path: str, directory: str = DEFAULT_DIR) -> list[BenchRequest]:
    """A workload by name (bench/workloads/NAME.jsonl) or by path to a .jsonl file."""
    path = name_or_path if name_or_path.endswith(".jsonl") else path_of(name_or_path, directory)
    if not os.path.isfile(path):
        raise ValueError(f"workload: {path!r} does not exist (names: {', '.join(WORKLOADS)})")
    with open(path) as f:
        return [BenchRequest(**json.loads(line)) for line in f if line.strip()]


def save(requests: Iterable[BenchRequest], path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        for request in requests:
            f.write(request.to_json() + "\n")


class _TokenSource:
    """Seeded text tokenized once: prompts are windows of its ids, so they look like text."""

    def __init__(self, encode, seed: int, num_words: int = 120_000) -> None:
        rng = random.Random(seed)
        words = [rng.choice(_WORDS) for _ in range(num_words)]
        self.ids = encode(" ".join(words))
        self.rng = random.Random(seed + 1)

    def take(self, length: int) -> list[int]:
        start = self.rng.randrange(0, len(self.ids) - length)
        return list(self.ids[start : start + length])


def _poisson_arrivals(rng: random.Random, count: int) -> list[float]:
    now, out = 0.0, []
    for _ in range(count):
        now += rng.expovariate(1.0)
        out.append(round(now, 6))
    return out


def random_ids(
    name: str,
    count: int,
    prompt_lengths: tuple[int, int],
    max_new_tokens: int,
    seed: int = 0,
    vocab_size: int = SMOLLM2_VOCAB,
) -> list[BenchRequest]:
    """`count` requests at t=0 whose prompts are seeded uniformly random ids, of lengths uniform
    in prompt_lengths (inclusive)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        length = rng.randint(*prompt_lengths)
        ids = [rng.randrange(vocab_size) for _ in range(length)]
        out.append(BenchRequest(f"{name}-{i:03d}", 0.0, ids, max_new_tokens))
    return out


def generate(name: str, encode, seed: int = 0) -> list[BenchRequest]:
    """The workload `name`, a pure function of the seed and the tokenizer."""
    if name == "big":
        return random_ids("big", 512, (32, 512), 256, seed)
    source = _TokenSource(encode, seed)
    rng = random.Random(seed + 2)
    if name == "peer":
        return [
            BenchRequest(f"peer-{i:03d}", 0.0, source.take(32 * (i + 1)), 128) for i in range(16)
        ]
    if name == "offline":
        return [
            BenchRequest(
                f"offline-{i:03d}", 0.0, source.take(rng.randint(64, 512)), rng.randint(32, 256)
            )
            for i in range(64)
        ]
    if name == "online":
        arrivals = _poisson_arrivals(rng, 200)
        return [
            BenchRequest(
                f"online-{i:03d}", a, source.take(rng.randint(64, 512)), rng.randint(32, 256)
            )
            for i, a in enumerate(arrivals)
        ]
    if name == "shared_prefix":
        systems = [source.take(384) for _ in range(4)]
        arrivals = _poisson_arrivals(rng, 64)
        return [
            BenchRequest(
                f"shared-{i:03d}",
                a,
                systems[rng.randrange(4)] + source.take(rng.randint(32, 96)),
                rng.randint(32, 128),
            )
            for i, a in enumerate(arrivals)
        ]
    if name == "long_prompt":
        arrivals = _poisson_arrivals(rng, 48)
        out = []
        for i, a in enumerate(arrivals):
            length = rng.randint(1024, 3072) if rng.random() < 0.25 else rng.randint(64, 256)
            out.append(BenchRequest(f"long-{i:03d}", a, source.take(length), rng.randint(64, 128)))
        return out
    raise ValueError(f"workload: {name!r} is not one of {WORKLOADS}")


def smollm2_encode():
    """SmolLM2's tokenizer (needs the model extra: gguf)."""
    from tokenizers import Tokenizer

    from model_service.loading.gguf_file import load_gguf_tokenizer
    from model_service.loading.loader import smollm2_path

    tokenizer = Tokenizer.from_str(load_gguf_tokenizer(smollm2_path()).tokenizer_json)
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="write the seeded workloads as JSON lines")
    parser.add_argument("--out", default=DEFAULT_DIR)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    encode = smollm2_encode()
    for name in WORKLOADS:
        requests = generate(name, encode, args.seed)
        save(requests, path_of(name, args.out))
        print(
            f"{path_of(name, args.out)}: {len(requests)} requests, "
            f"{sum(len(r.prompt_ids) for r in requests)} prompt tokens"
        )


if __name__ == "__main__":
    main()
