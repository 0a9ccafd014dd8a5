"""planserve.LLM: the offline API runs the same scheduler and model code in one process, so its
outputs equal the gRPC server's for the same requests."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest

from api import complete, stub_for
from planserve.v1 import generate_pb2

PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3,"]
PROMPT_IDS = [1, 17, 300, 4000, 22, 9]


@pytest.fixture(scope="module")
def llm():
    from planserve import LLM
    # The tiny_engine fixture's model service, in this process.
    return LLM(model="tiny", dtype="float32", num_kv_blocks=64,
               scheduler_options={"max_num_batched_tokens": 64, "max_num_seqs": 16})


def test_importing_planserve_does_not_load_torch():
    code = ("import sys, planserve, planserve.v1.generate_pb2; "
            "print('torch' in sys.modules, 'tools.offline' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": "protos:."})
    assert out.stdout.split() == ["False", "False"]


async def test_greedy_outputs_equal_the_grpc_servers(llm, tiny_server):
    from planserve import SamplingParams
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    results = llm.generate(PROMPTS + [PROMPT_IDS], params)
    stub = stub_for(tiny_server)
    assert [r.prompt for r in results] == PROMPTS + [PROMPT_IDS]
    for prompt, result in zip(PROMPTS + [PROMPT_IDS], results):
        request = generate_pb2.GenerateRequest()
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        request.sampling.temperature = 0
        request.stopping.max_new_tokens = 14
        request.stopping.ignore_eos = True
        served = await complete(stub, request)
        assert result.token_ids == served.token_ids
        assert result.text == served.text
        assert result.finish_reason == "length"
        assert result.prompt_token_ids == (list(prompt) if not isinstance(prompt, str)
                                           else result.prompt_token_ids)
        assert len(result.prompt_token_ids) == served.usage.prompt_tokens


async def test_seeded_samples_and_chat_equal_the_grpc_servers(llm, tiny_server):
    from planserve import SamplingParams
    messages = [{"role": "user", "content": "Name a colour."}]
    [result] = llm.chat(messages, SamplingParams(max_tokens=10, temperature=0.8, seed=42, n=3,
                                                 ignore_eos=True))
    request = generate_pb2.GenerateRequest(n=3)
    request.messages.messages.add(role="user", content="Name a colour.")
    request.sampling.temperature = 0.8
    request.sampling.seed = 42
    request.stopping.max_new_tokens = 10
    request.stopping.ignore_eos = True
    by_index: dict[int, list[int]] = {}
    async for chunk in stub_for(tiny_server).Generate(request):
        by_index.setdefault(chunk.index, []).extend(chunk.token_ids)
    assert [o.index for o in result.outputs] == [0, 1, 2]
    assert [o.token_ids for o in result.outputs] == [by_index[i] for i in range(3)]


def test_structured_output_and_stops(llm):
    from planserve import SamplingParams
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    results = llm.generate(["a", "b", "c"], [
        SamplingParams(max_tokens=30, seed=1, regex=r"[0-9]{3}-[0-9]{4}"),
        SamplingParams(max_tokens=30, seed=2, json_schema=schema),
        SamplingParams(max_tokens=30, seed=3, choice=["yes", "no"]),
    ])
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", results[0].text)
    jsonschema.validate(json.loads(results[1].text), schema)
    assert results[2].text in ("yes", "no")
    assert [r.finish_reason for r in results] == ["stop"] * 3


def test_bad_input_raises_naming_the_field(llm):
    from planserve import SamplingParams
    with pytest.raises(ValueError, match=r"^sampling\.top_p: must be in \(0, 1\]"):
        llm.generate("x", SamplingParams(top_p=0))
    with pytest.raises(ValueError, match=r"^structured_output\.regex: cannot be compiled"):
        llm.generate("x", SamplingParams(regex="(unclosed"))
    with pytest.raises(ValueError, match=r"^sampling_params: 1 for 2 prompts"):
        llm.generate(["x", "y"], [SamplingParams()])
    # Nothing was left behind by the rejected calls.
    assert not llm.scheduler.requests and not llm.scheduler.has_work()


async def test_logprobs_and_prompt_logprobs_equal_the_grpc_servers(llm, tiny_server):
    """vLLM's shapes: per position a dict of token id -> Logprob, the chosen token's and k
    alternatives' ranked 1 .. k; prompt logprobs lead with None for the first token."""
    from planserve import SamplingParams
    [result] = llm.generate([PROMPT_IDS], SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1))
    request = generate_pb2.GenerateRequest(logprobs=True, top_logprobs=2, prompt_logprobs=1)
    request.token_ids.ids.extend(PROMPT_IDS)
    request.sampling.temperature = 0
    request.stopping.max_new_tokens = 6
    request.stopping.ignore_eos = True
    chunks = [chunk async for chunk in stub_for(tiny_server).Generate(request)]
    served = [entry for chunk in chunks for entry in chunk.logprobs]
    [output] = result.outputs
    assert len(output.logprobs) == len(served) == 6
    for token_id, position, entry in zip(output.token_ids, output.logprobs, served):
        assert position[token_id].logprob == pytest.approx(entry.logprob, abs=1e-6)
        assert position[token_id].rank == 1  # greedy: the most likely token
        ranked = sorted((p.rank, t) for t, p in position.items() if p.rank is not None)
        assert [t for _, t in ranked] == [alt.token_id for alt in entry.top]
        assert position[token_id].decoded_token == llm.tokenizer.decode(
            [token_id], skip_special_tokens=False)
    prompt_served = list(chunks[0].prompt_logprobs)
    assert result.prompt_logprobs[0] is None
    assert len(result.prompt_logprobs) == len(PROMPT_IDS)
    for token_id, position, entry in zip(PROMPT_IDS[1:], result.prompt_logprobs[1:],
                                         prompt_served):
        assert position[token_id].logprob == pytest.approx(entry.logprob, abs=1e-6)
