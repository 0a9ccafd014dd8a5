"""Loading the null model (`--model null`, model_service/models/null.py): no checkpoint, a
LoadedModel with the null model's tokenizer, chat template and a fixed small KV cache."""

from __future__ import annotations

import torch

from model_service.loading.loaded import LoadedModel
from model_service.models.null import (
    EOS_ID,
    EOS_TOKEN,
    NULL_ARCH,
    NULL_CHAT_TEMPLATE,
    NULL_MAX_MODEL_LEN,
    NULL_NUM_KV_BLOCKS,
    NullLM,
    null_tokenizer_json,
)


def load_null_model(config):
    """The LoadedModel of `--model null` (loader.load_model calls this)."""
    max_model_len = NULL_MAX_MODEL_LEN
    if config.max_model_len is not None:
        if config.max_model_len > max_model_len:
            raise ValueError(
                f"max_model_len: {config.max_model_len} exceeds the model's {max_model_len}"
            )
        max_model_len = config.max_model_len
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.resolved_dtype()]
    model = NullLM(config.null_step_delay_ms, config.null_eos_at).to(config.resolved_device())
    model.anchor.data = model.anchor.data.to(dtype)  # the runner's KV dtype; logits stay float32
    return LoadedModel(
        model=model.eval(),
        arch=NULL_ARCH,
        name="null",
        tokenizer_json=null_tokenizer_json(),
        chat_template=NULL_CHAT_TEMPLATE,
        eos_token_ids=[EOS_ID],
        bos_token_id=None,
        special_tokens={"eos_token": EOS_TOKEN},
        max_model_len=max_model_len,
        num_kv_blocks=NULL_NUM_KV_BLOCKS,
    )
