"""Offline batch generation in one process, without servers: `planserve.LLM`.

    from planserve import LLM, SamplingParams
    llm = LLM(model="tiny", dtype="float32")
    results = llm.generate(["Hello", "The capital of France is"],
                           SamplingParams(max_tokens=32, temperature=0))
    print(results[0].text, results[0].token_ids, results[0].finish_reason)

LoRA adapters: `LLM(..., enable_lora=True, max_loras=2)`, then
`llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))`
(tools/offline_lora.py).

The same code as the two services, minus the network: prompts become the same GenerateRequest a
gRPC client sends and pass the same validation (intake.py); the same Scheduler plans every step;
`InProcessEngine` hands each plan to the model service's own plan parsing and ModelRunner through
the same protobuf codec the Execute stream uses, and the result comes back the same way. So the
outputs equal a server's for the same requests (greedy, or seeded).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from typing import Optional, Sequence, Union

from planserve.v1 import common_pb2, engine_pb2, generate_pb2
from scheduler_service.api import intake
from scheduler_service.api.streams import Collected
from scheduler_service.config import SchedulerConfig
from scheduler_service.core import plan as plan_codec
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.client import EngineFacts
from scheduler_service.text import structured
from scheduler_service.text.outputs import OutputProcessor
from scheduler_service.text.tokenizer import Tokenizer
from tools.offline_lora import LoRARequest, LoraRequests, OfflineAdapters, rpc_error
from tools.offline_outputs import CompletionOutput, Logprob, RequestResult, result_of

__all__ = ["LLM", "LoRARequest", "SamplingParams", "CompletionOutput", "Logprob", "RequestResult"]


@dataclasses.dataclass
class SamplingParams:
    """What to generate per prompt (vLLM's names). Unset fields take the servers' defaults."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: Optional[int] = None
    n: int = 1
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[int, float]] = None
    # Structured output: at most one.
    json_schema: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[Sequence[str]] = None
    json_object: bool = False
    # Logprobs (vLLM's): per generated token, the chosen token's and this many alternatives';
    # per prompt token after the first, the same.
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None

    def fill(self, pb: generate_pb2.GenerateRequest) -> None:
        """Writes these parameters into a GenerateRequest (validated later by intake)."""
        sampling, stopping = pb.sampling, pb.stopping
        sampling.temperature = self.temperature
        sampling.top_p = self.top_p
        if self.top_k > 0:
            sampling.top_k = self.top_k
        if self.min_p:
            sampling.min_p = self.min_p
        if self.seed is not None:
            sampling.seed = self.seed % (1 << 64)
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            if getattr(self, name) is not None:
                setattr(sampling, name, getattr(self, name))
        for token_id, bias in (self.logit_bias or {}).items():
            sampling.logit_bias[int(token_id)] = bias
        stopping.max_new_tokens = self.max_tokens
        stopping.stop.extend([self.stop] if isinstance(self.stop, str) else self.stop)
        stopping.stop_token_ids.extend(self.stop_token_ids)
        stopping.ignore_eos = self.ignore_eos
        if self.min_tokens:
            stopping.min_new_tokens = self.min_tokens
        if self.n != 1:
            pb.n = self.n
        if self.logprobs is not None:
            pb.logprobs, pb.top_logprobs = True, self.logprobs
        if self.prompt_logprobs is not None:
            pb.prompt_logprobs = self.prompt_logprobs
        kinds = [
            name for name in ("json_schema", "regex", "choice") if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(kinds) > 1:
            raise ValueError(
                f"{kinds[1]}: only one of json_schema, regex, choice or json_object may be set"
            )
        if self.json_schema is not None:
            schema = self.json_schema
            pb.structured_output.json_schema = (
                schema if isinstance(schema, str) else json.dumps(schema)
            )
        elif self.regex is not None:
            pb.structured_output.regex = self.regex
        elif self.choice is not None:
            pb.structured_output.choice.CopyFrom(common_pb2.Choices(choices=list(self.choice)))
        elif self.json_object:
            pb.structured_output.json_object = True


class InProcessEngine:
    """The model service without gRPC: a plan goes through the Execute stream's codec
    (plan.to_pb -> model_service.batch.from_pb), the ModelRunner computes it, and the result
    comes back through result_to_pb -> plan.result_from_pb."""

    def __init__(self, runner):
        from model_service import batch

        self.runner = runner
        self._batch = batch

    def describe(self) -> EngineFacts:
        return EngineFacts.from_pb(self._batch.facts_to_pb(self.runner.describe_facts()))

    def execute(self, step: plan_codec.StepPlan) -> plan_codec.StepResult:
        received = time.perf_counter_ns()
        plan = self._batch.from_pb(plan_codec.to_pb(step), self.runner.limits)
        output = self.runner.execute(plan)
        result = plan_codec.result_from_pb(
            self._batch.result_to_pb(output, total_ns=time.perf_counter_ns() - received)
        )
        if result.step_id != step.step_id:
            raise RuntimeError(f"result for step {result.step_id}, expected {step.step_id}")
        return result

    async def load_adapter(
        self, lora_id: int, name: str, path: str, timeout_s: float = 600.0
    ) -> engine_pb2.LoadAdapterResponse:
        """LoadAdapter on the runner, on this thread (EngineClient's call, without the wait);
        a refusal raises the status the model service would send."""
        from model_service.lora.peft_folder import AdapterError

        try:
            adapter = self.runner.load_adapter(lora_id, name, path)
        except AdapterError as error:
            raise rpc_error(error.code, error.message) from None
        return engine_pb2.LoadAdapterResponse(
            rank=adapter.rank, target_modules=adapter.target_modules, num_bytes=adapter.num_bytes
        )

    async def evict_adapter(self, lora_id: int, timeout_s: float = 60.0) -> None:
        """EvictAdapter on the runner; an id it does not hold is not an error (EngineClient's)."""
        from model_service.lora.peft_folder import AdapterError

        try:
            self.runner.evict_adapter(lora_id)
        except AdapterError as error:
            if error.code != "NOT_FOUND":
                raise rpc_error(error.code, error.message) from None


Prompt = Union[str, Sequence[int], Sequence[dict]]


class LLM:
    """A model and a scheduler in this process. `model`: "tiny", "smollm2", a .gguf path or a
    Hugging Face folder (what `planserve model-service --model` takes); `engine_options` go to
    ModelServiceConfig (num_kv_blocks, max_model_len, kv_cache_memory_bytes, ...), and
    `scheduler_options` to SchedulerConfig (max_num_seqs, max_num_batched_tokens, policy, ...).
    LoRA: `enable_lora=True` and vLLM's `max_loras`, `max_lora_rank`, `max_cpu_loras` (engine
    options too); generate() and chat() then take `lora_request` (docs/lora.md, "Offline")."""

    def __init__(
        self,
        model: str = "smollm2",
        dtype: str = "auto",
        device: str = "auto",
        scheduler_options: Optional[dict] = None,
        **engine_options,
    ):
        from model_service.config import ModelServiceConfig, compute_env_defaults
        from model_service.server import warm_up
        from model_service.start import start_runner

        # The compute fields' environment aliases apply here as in `python -m model_service`.
        options = {**compute_env_defaults(os.environ), **engine_options}
        engine_config = ModelServiceConfig(
            model=model, dtype=dtype, device=device, **options
        ).validate()
        runner = start_runner(engine_config)
        warm_up(runner)  # one real step, as the model service does before serving
        self.engine = InProcessEngine(runner)
        self.facts = self.engine.describe()
        self.config = SchedulerConfig(**(scheduler_options or {})).validate()
        self.tokenizer = Tokenizer(
            self.facts.tokenizer_json, self.facts.chat_template, self.facts.special_tokens
        )
        self.scheduler = Scheduler(
            self.config,
            self.facts,
            OutputProcessor(self.tokenizer, self.facts.eos_token_ids, self.facts.max_model_len),
        )
        self.grammars = structured.GrammarCompiler(
            self.facts.tokenizer_json,
            self.facts.eos_token_ids,
            self.facts.vocab_size,
            engine=self.config.grammar_engine,
        )
        self.adapters = OfflineAdapters(self.scheduler, self.engine, self.facts.model_name)

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        lora_request: LoraRequests = None,
    ) -> list[RequestResult]:
        """Generates for every prompt (a string, a list of token ids, or chat messages as
        [{"role", "content"}, ...]), all batched together by the scheduler; results in the
        prompts' order. `lora_request`: one LoRARequest for every prompt, or a list with one
        per prompt (None: the base model). Bad input raises ValueError naming the field, before
        anything runs."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} for {len(prompts)} prompts")
        adapters = self.adapters.resolve(lora_request, len(prompts))
        requests = [self._request(prompt, p) for prompt, p in zip(prompts, params)]
        for request, adapter in zip(requests, adapters):
            if adapter is not None:  # as the served path's admission selects it
                request.lora_name, request.lora_id = adapter.name, adapter.lora_id
        return self._run(prompts, requests)

    def chat(
        self,
        conversations: Union[Sequence[dict], Sequence[Sequence[dict]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        lora_request: LoraRequests = None,
    ) -> list[RequestResult]:
        """generate() for chat conversations, rendered with the model's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate(list(conversations), sampling_params, lora_request)

    def _request(self, prompt: Prompt, params: SamplingParams) -> Request:
        pb = generate_pb2.GenerateRequest(request_id=uuid.uuid4().hex)
        if isinstance(prompt, str):
            pb.text = prompt
        elif prompt and isinstance(prompt[0], dict):
            pb.messages.SetInParent()
            for turn in prompt:
                pb.messages.messages.add(role=turn["role"], content=turn.get("content") or "")
        else:
            pb.token_ids.ids.extend(prompt)
            pb.token_ids.SetInParent()
        params.fill(pb)
        try:
            request = intake.to_request(
                pb, self.facts, self.tokenizer, self.scheduler.kv.capacity_tokens
            )
            if request.structured is not None:
                request.guide = self.grammars.compile(request.structured).new_guide()
        except (intake.InvalidRequest, structured.StructuredOutputError) as error:
            raise ValueError(str(error)) from None
        return request

    def _run(self, prompts: list, requests: list[Request]) -> list[RequestResult]:
        scheduler = self.scheduler
        collected = {request.request_id: Collected(request.n) for request in requests}
        for request in requests:
            scheduler.add_request(request)

        def collect(outputs) -> None:
            for request, output in outputs:
                collected[request.public_id].add(output)

        num_idle_steps = 0  # plans with nothing to compute, in a row
        while scheduler.has_work():
            step = scheduler.schedule()
            self.adapters.pump()  # the adapters this plan's waiting requests need, loaded now
            collect(scheduler.take_early_outputs())
            if step.is_empty:
                num_idle_steps += 1
                if num_idle_steps > 100:
                    raise RuntimeError(
                        "the scheduler cannot place a waiting request "
                        "(the KV cache is too small for it)"
                    )
                continue
            num_idle_steps = 0
            collect(scheduler.update(step, self.engine.execute(step)))
            self.adapters.pump()  # adapters idle since this result may be evicted now
        collect(scheduler.take_early_outputs())
        return [
            result_of(prompt, request, collected[request.request_id], self.tokenizer)
            for prompt, request in zip(prompts, requests)
        ]
