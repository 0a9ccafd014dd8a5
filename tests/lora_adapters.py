"""Random LoRA adapters made with peft for a transformers reference model (the tests' source of
PEFT folders), and peft's own models over them: the unmerged PeftModel and the merged one."""

from __future__ import annotations

import copy
import json
import os

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = ATTENTION + ["gate_proj", "up_proj", "down_proj"]


def save_adapter(reference, folder: str, rank: int, targets: list[str], seed: int, alpha: float = 16.0,
                 use_rslora: bool = False, scale_b: float = 1.0):
    """Saves a random adapter of `reference` (B not zero: init_lora_weights=False) into `folder`
    as PEFT writes it; returns the unmerged PeftModel over a copy of the reference. scale_b
    multiplies B before saving (peft's random B can swamp a tiny model)."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                             use_rslora=use_rslora, lora_dropout=0.0)
    model = peft.get_peft_model(copy.deepcopy(reference), config)
    if scale_b != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(scale_b)
    model.save_pretrained(folder)
    return model.eval()


def merged(peft_model):
    """peft's merged model (the adapter folded into the base weights) of a copy."""
    return copy.deepcopy(peft_model).merge_and_unload().eval()


def edit_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)
