"""What the model service says of itself in Describe, as plain values: the runner fills it
(model_service/runner.py describe_facts), model_service/server.py writes the reply."""

from __future__ import annotations

import dataclasses

from model_service.lora.store import AdapterStore


@dataclasses.dataclass(frozen=True)
class DescribedFacts:
    """What this model service describes about itself in Describe, as plain values (the
    scheduler's reading of the reply is scheduler_service/engine/client.py EngineFacts)."""

    model_name: str
    architecture: str
    dtype: str
    device: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    max_num_slots: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    tokenizer_json: str
    chat_template: str
    special_tokens: dict[str, str]
    chunked_prefill: bool = True
    block_copy: bool = True
    num_swap_blocks: int = 0
    num_speculative_tokens: int = 0  # > 0: speculation on, this many drafts per decode at most
    # The step shape chosen for the device (step/step_shape.py); 0: not reported.
    step_token_budget: int = 0
    step_max_seqs: int = 0
    # threads and kernel paths (threads.py)
    compute: dict[str, str] = dataclasses.field(default_factory=dict)
    lora: AdapterStore | None = None  # --enable-lora: its capacity (DescribeResponse.lora)
