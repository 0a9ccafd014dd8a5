"""What loading a model gives the runner: the module, its architecture, what Describe reports."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from model_service.models.arch import LlamaArchConfig


@dataclasses.dataclass
class LoadedModel:
    model: nn.Module
    arch: LlamaArchConfig
    name: str
    tokenizer_json: str
    chat_template: str
    eos_token_ids: list[int]
    bos_token_id: Optional[int]
    special_tokens: dict[str, str]
    max_model_len: int
    tensor_parallel_size: int = 1
    """Ranks the layers are split across (model_service/models/parallel.py); this process holds one
    share."""
    weights: str = "checkpoint"
    """Where the weights came from, for Describe's compute map: "checkpoint", or dummy's seed."""
    num_kv_blocks: Optional[int] = None
    """KV blocks this model wants when the config sets none (the null model: a small fixed
    count)."""

    @property
    def num_kv_heads_per_rank(self) -> int:
        return self.arch.num_key_value_heads // self.tensor_parallel_size

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Weights in Hugging Face Llama naming (lm_head.weight shares the embedding when tied)."""
        hf_state_dict = getattr(
            self.model, "hf_state_dict", None
        )  # the null model has no fused layers
        return hf_state_dict() if hf_state_dict is not None else self.model.state_dict()
