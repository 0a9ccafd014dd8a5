"""lm-evaluation-harness's logged loglikelihoods from a planserve run against transformers.

Reads the samples file `lm_eval --log_samples` wrote for bench/eval/capitals.yaml and recomputes
each continuation's loglikelihood with transformers in float32 on the same weights (SmolLM2,
loaded by planserve's loader), split into context and continuation as lm-eval splits them. With
the server in float32 the two agree to float32's rounding; in bf16 they differ by bf16's, and the
choices they rank first should still agree.

  PYTHONPATH=.:protos .venv/bin/python bench/eval/check_logliks.py OUT/*/samples_*.jsonl
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from model_service.config import ModelServiceConfig  # noqa: E402
from model_service.loading.loader import load_model  # noqa: E402
from reference import hf_llama_from_loaded  # noqa: E402
from scheduler_service.text.tokenizer import Tokenizer  # noqa: E402


def _loglik(model, tokenizer: Tokenizer, context: str, continuation: str) -> float:
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    num_context = len(tokenizer.encode(context, add_special_tokens=False))
    with torch.no_grad():
        logprobs = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
    return sum(float(logprobs[i - 1, whole[i]]) for i in range(num_context, len(whole)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("samples", help="the samples_*.jsonl file lm_eval --log_samples wrote")
    args = parser.parse_args()
    loaded = load_model(ModelServiceConfig(model="smollm2", dtype="float32"))
    model, tokenizer = hf_llama_from_loaded(loaded), Tokenizer(loaded.tokenizer_json, "", {})
    differences, same_choice, num_docs = [], 0, 0
    for line in open(args.samples):
        doc = json.loads(line)
        served = [float(resp[0][0]) for resp in doc["resps"]]
        pairs = [(a["arg_0"], a["arg_1"]) for a in doc["arguments"].values()]
        reference = [_loglik(model, tokenizer, c, cont) for c, cont in pairs]
        differences += [abs(s - r) for s, r in zip(served, reference)]
        same_choice += served.index(max(served)) == reference.index(max(reference))
        num_docs += 1
    print(
        f"{num_docs} questions, {len(differences)} loglikelihoods: "
        f"|served - transformers float32| max {max(differences):.2e}, "
        f"mean {sum(differences) / len(differences):.2e}; "
        f"the same choice first in {same_choice}/{num_docs}"
    )


if __name__ == "__main__":
    main()
