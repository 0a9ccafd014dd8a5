"""The null model (`--model null`): deterministic tokens, no compute, for measuring orchestration.

Everything around the forward stays real (plan checks, slot state, the input builder, the sampler,
gRPC), so a scheduler over the null model pays every host-side cost of a real step and none of the
model's. The "forward" writes one-hot logits over a 259-token byte-level vocabulary:

    next token after token t at position p  =  NULL_ALPHABET[(p + 1 + t) % 26]   ("a".."z")

so a sequence's tokens depend on its own prompt (through its last token and its length) as well
as on the position, and a test can tell one stream's tokens from another's (26 x 26 distinct
continuations, by length and last token modulo 26); whatever slot, batch or sampling parameters
it gets, it continues the same way (one-hot logits make every sampler pick the same id), so
recompute, restarts and batching reproduce it. EOS comes only when asked: with `eos_at` set, the
token at position >= eos_at is EOS.
`step_delay_ms` stands in for a model of that speed: the forward sleeps (the GIL is released) until
the step is done. With launch-ahead (model_service/step/launch_ahead.py) the delay runs the way a
GPU's steps do instead: a launched step is queued behind the one before and the forward returns at
once; `device_free_ns` says when the queued steps are done, and the host waits for that only where
a GPU's host would (the launched step's ids; a step run at once).

The tokenizer is byte-level with no merges: id b < 256 is byte b, then the specials below, so the
scheduler's tokenizer, chat template and detokenizer work unchanged and text prompts cost one token
per byte.
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch
from torch import nn

from model_service.models.arch import LlamaArchConfig

NULL_ALPHABET = b"abcdefghijklmnopqrstuvwxyz"
NULL_ALPHABET_IDS = tuple(NULL_ALPHABET)
EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
EOS_ID, IM_START_ID, IM_END_ID = 256, 257, 258
NULL_VOCAB_SIZE = 259
NULL_MAX_MODEL_LEN = 8192
# The KV cache is never read, so keep it small: a 1-layer, 1-head, head_dim 8 shape and a fixed
# count of blocks (1M tokens at block size 16) instead of the 1 GiB budget a real model gets.
NULL_NUM_KV_BLOCKS = 1 << 16
NULL_ARCH = LlamaArchConfig(
    vocab_size=NULL_VOCAB_SIZE,
    hidden_size=8,
    intermediate_size=8,
    num_hidden_layers=1,
    num_attention_heads=1,
    num_key_value_heads=1,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=NULL_MAX_MODEL_LEN,
    tie_word_embeddings=True,
)
NULL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def null_next_token(position: int, token_id: int) -> int:
    """The token the null model puts after `token_id` at `position` (EOS aside)."""
    return NULL_ALPHABET[(position + 1 + token_id) % len(NULL_ALPHABET)]


def null_continuation(prompt_token_ids: list[int], num_tokens: int) -> list[int]:
    """The ids a prompt continues with (what tests compare against)."""
    ids = list(prompt_token_ids)
    for _ in range(num_tokens):
        ids.append(null_next_token(len(ids) - 1, ids[-1]))
    return ids[len(prompt_token_ids) :]


def null_tokenizer_json() -> str:
    """A byte-level tokenizer without merges: id b is byte b, ids 256.. the special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    # ByteLevel's alphabet lists the 256 byte spellings unordered; order them by byte value the way
    # GPT-2 assigns them (printable bytes map to themselves, the rest to chr(256 + n)).
    spelling = _gpt2_byte_spelling()
    assert set(spelling) == set(alphabet)
    vocab = {s: b for b, s in enumerate(spelling)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t in (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
        ]
    )
    text = tokenizer.to_str()
    ids = json.loads(text)["added_tokens"]
    assert [t["id"] for t in ids] == [EOS_ID, IM_START_ID, IM_END_ID], ids
    return text


def _gpt2_byte_spelling() -> list[str]:
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    spelling, extra = [], 0
    for b in range(256):
        if b in printable:
            spelling.append(chr(b))
        else:
            spelling.append(chr(256 + extra))
            extra += 1
    return spelling


class NullLM(nn.Module):
    """Same call signature as LlamaForCausalLM; returns one-hot float32 logits [R, V]."""

    alphabet: torch.Tensor  # a buffer, declared for the type checker

    def __init__(self, step_delay_ms: float = 0.0, eos_at: int | None = None) -> None:
        super().__init__()
        # One parameter so the runner can read the device and dtype off the module.
        self.anchor = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.step_delay_s = step_delay_ms / 1000.0
        self.eos_at = eos_at
        self.queue_steps = False  # set by launch-ahead around a launched step's forward
        self.device_free_ns = 0  # when the last step queued is done
        self.register_buffer(
            "alphabet", torch.tensor(list(NULL_ALPHABET), dtype=torch.int64), persistent=False
        )

    def forward(
        self, input_ids, positions, meta, kv_cache, logits_indices, lora=None
    ) -> torch.Tensor:
        """`lora` (rows grouped by adapter) changes nothing: the null model continues the same
        way whatever adapter a sequence names."""
        if self.step_delay_s > 0:
            start = max(time.perf_counter_ns(), self.device_free_ns)
            self.device_free_ns = start + int(self.step_delay_s * 1e9)
            if not self.queue_steps:
                wait_until(self.device_free_ns)
        if input_ids.device.type == "cpu":
            return torch.from_numpy(
                self._host_logits(input_ids.numpy(), positions.numpy(), logits_indices.numpy())
            )
        last = positions[logits_indices]
        tokens = input_ids[logits_indices].to(torch.int64)
        next_ids = self.alphabet[(last + 1 + tokens) % self.alphabet.numel()]
        if self.eos_at is not None:
            next_ids = torch.where(last + 1 >= self.eos_at, EOS_ID, next_ids)
        logits = torch.full(
            (last.numel(), NULL_VOCAB_SIZE), -1e4, dtype=torch.float32, device=input_ids.device
        )
        logits.scatter_(1, next_ids[:, None], 0.0)
        return logits

    def _host_logits(
        self, input_ids: np.ndarray, positions: np.ndarray, logits_indices: np.ndarray
    ) -> np.ndarray:
        """The same logits in numpy: on the CPU a handful of torch ops on these small tensors
        cost more host time than the step they stand in for."""
        last = positions[logits_indices]
        next_ids = np.asarray(NULL_ALPHABET_IDS)[
            (last + 1 + input_ids[logits_indices]) % len(NULL_ALPHABET)
        ]
        if self.eos_at is not None:
            next_ids = np.where(last + 1 >= self.eos_at, EOS_ID, next_ids)
        logits = np.full((last.size, NULL_VOCAB_SIZE), -1e4, dtype=np.float32)
        logits[np.arange(last.size), next_ids] = 0.0
        return logits


def wait_until(deadline_ns: int) -> None:
    """Sleeps until time.perf_counter_ns() reaches `deadline_ns`."""
    left_s = (deadline_ns - time.perf_counter_ns()) / 1e9
    if left_s > 0:
        time.sleep(left_s)
