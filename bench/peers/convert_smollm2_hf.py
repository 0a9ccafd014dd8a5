"""SmolLM2's GGUF as a Hugging Face folder, for peers that only read HF checkpoints (vLLM).

    .venv/bin/python bench/peers/convert_smollm2_hf.py bench/peers/.work/smollm2-hf

The config and tokenizer come from transformers' own GGUF loading; the weights are the very tensors
planserve serves (model_service.loading.gguf_file: Q4_1 dequantized to float32, Q/K rows back in HF
order), copied into a plain LlamaForCausalLM and saved with save_pretrained. So every engine of the
benchmark multiplies the same numbers. A greedy check against our loader runs at the end.
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

from model_service.loading.gguf_file import load_gguf
from model_service.loading.loader import SMOLLM2_FILE, smollm2_path


def convert(out: str) -> None:
    gguf = smollm2_path()
    folder = os.path.dirname(gguf)
    config = AutoConfig.from_pretrained(folder, gguf_file=SMOLLM2_FILE)
    config.tie_word_embeddings = True
    config.torch_dtype = torch.float32
    model = LlamaForCausalLM(config)
    weights = load_gguf(gguf).weights  # read tensor by tensor (model_service/loading/gguf_file.py)
    state = {name: weights.read(name) for name in weights.names()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_FILE)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # Greedy check: the saved folder, reloaded, continues a prompt as the GGUF weights do.
    reloaded = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        a = reloaded.generate(ids, max_new_tokens=8, do_sample=False)
        b = model.eval().generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b), (a, b)
    print(
        f"{out}: {sum(p.numel() for p in model.parameters())} parameters; greedy: "
        f"{tokenizer.decode(a[0])!r}"
    )


if __name__ == "__main__":
    convert(
        sys.argv[1]
        if len(sys.argv) > 1
        else os.path.join(os.path.dirname(__file__), ".work", "smollm2-hf")
    )
