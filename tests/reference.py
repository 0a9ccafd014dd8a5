"""Hugging Face transformers as the reference for token parity (shared by model_service and e2e tests)."""

from __future__ import annotations

import torch


def hf_llama_from_loaded(loaded):
    """A float32 `transformers.LlamaForCausalLM` with our architecture and our weights copied in."""
    import transformers

    arch = loaded.arch
    config = transformers.LlamaConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta},
        rms_norm_eps=arch.rms_norm_eps,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        attention_bias=False,
        mlp_bias=False,
    )
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    state = {k: v.detach().to("cpu", torch.float32) for k, v in loaded.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(k == "lm_head.weight" for k in missing), missing
    return model.eval()


@torch.inference_mode()
def greedy_reference(hf_model, prompt_ids, max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation step by step with the HF KV cache; returns (token ids, top-2 logit gaps)."""
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    out = hf_model(input_ids=input_ids, use_cache=True)
    past = out.past_key_values
    tokens, gaps = [], []
    logits = out.logits[0, -1].float()
    for step in range(max_new_tokens):
        top2 = torch.topk(logits, 2)
        tokens.append(int(top2.indices[0]))
        gaps.append(float(top2.values[0] - top2.values[1]))
        if step == max_new_tokens - 1:
            break
        out = hf_model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
    return tokens, gaps


def compare_up_to_near_tie(ours, ref, gaps, tie: float = 1e-4) -> int:
    """Assert ours == ref up to (not including) the first step whose reference top-2 gap is < tie;
    a near-tie may legitimately flip under float reordering, and everything after it diverges.
    Returns how many tokens were compared."""
    limit = min(len(ours), len(ref))
    for i in range(limit):
        if gaps[i] < tie:
            limit = i
            break
    assert list(ours[:limit]) == list(ref[:limit]), f"first mismatch within {limit} compared: ours={list(ours[:limit])} ref={list(ref[:limit])}"
    return limit


@torch.inference_mode()
def reference_logprobs(hf_model, token_ids) -> torch.Tensor:
    """Log-softmax of the reference's logits over a whole sequence in one forward, float32:
    row i is the distribution of token i + 1."""
    out = hf_model(input_ids=torch.tensor([list(token_ids)], dtype=torch.long))
    return torch.log_softmax(out.logits[0].float(), dim=-1)
