from planserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineFeatures(_message.Message):
    __slots__ = ("chunked_prefill", "block_copy", "swap", "speculation")
    CHUNKED_PREFILL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COPY_FIELD_NUMBER: _ClassVar[int]
    SWAP_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    chunked_prefill: bool
    block_copy: bool
    swap: bool
    speculation: bool
    def __init__(self, chunked_prefill: _Optional[bool] = ..., block_copy: _Optional[bool] = ..., swap: _Optional[bool] = ..., speculation: _Optional[bool] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("contract_version", "model_name", "architecture", "dtype", "device", "vocab_size", "max_model_len", "block_size", "num_kv_blocks", "max_num_slots", "eos_token_ids", "bos_token_id", "tokenizer_json", "chat_template", "special_tokens", "features", "num_swap_blocks", "num_speculative_tokens", "max_top_logprobs", "compute", "request_bounds", "step_token_budget", "step_max_seqs", "lora")
    class SpecialTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class ComputeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CONTRACT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    STEP_MAX_SEQS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    contract_version: int
    model_name: str
    architecture: str
    dtype: str
    device: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    max_num_slots: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    tokenizer_json: str
    chat_template: str
    special_tokens: _containers.ScalarMap[str, str]
    features: EngineFeatures
    num_swap_blocks: int
    num_speculative_tokens: int
    max_top_logprobs: int
    compute: _containers.ScalarMap[str, str]
    request_bounds: RequestBounds
    step_token_budget: int
    step_max_seqs: int
    lora: LoraCapacity
    def __init__(self, contract_version: _Optional[int] = ..., model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., max_num_slots: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., tokenizer_json: _Optional[str] = ..., chat_template: _Optional[str] = ..., special_tokens: _Optional[_Mapping[str, str]] = ..., features: _Optional[_Union[EngineFeatures, _Mapping]] = ..., num_swap_blocks: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., max_top_logprobs: _Optional[int] = ..., compute: _Optional[_Mapping[str, str]] = ..., request_bounds: _Optional[_Union[RequestBounds, _Mapping]] = ..., step_token_budget: _Optional[int] = ..., step_max_seqs: _Optional[int] = ..., lora: _Optional[_Union[LoraCapacity, _Mapping]] = ...) -> None: ...

class LoraCapacity(_message.Message):
    __slots__ = ("max_loras", "max_lora_rank", "max_cpu_loras", "target_modules")
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., max_cpu_loras: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("lora_id", "lora_name", "lora_path")
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_id: int
    lora_name: str
    lora_path: str
    def __init__(self, lora_id: _Optional[int] = ..., lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("rank", "target_modules", "num_bytes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    num_bytes: int
    def __init__(self, rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class EvictAdapterRequest(_message.Message):
    __slots__ = ("lora_id",)
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    lora_id: int
    def __init__(self, lora_id: _Optional[int] = ...) -> None: ...

class EvictAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RequestBounds(_message.Message):
    __slots__ = ("max_logit_bias_entries", "max_logit_bias", "max_repetition_penalty", "max_penalty")
    MAX_LOGIT_BIAS_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MAX_REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_PENALTY_FIELD_NUMBER: _ClassVar[int]
    max_logit_bias_entries: int
    max_logit_bias: float
    max_repetition_penalty: float
    max_penalty: float
    def __init__(self, max_logit_bias_entries: _Optional[int] = ..., max_logit_bias: _Optional[float] = ..., max_repetition_penalty: _Optional[float] = ..., max_penalty: _Optional[float] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("slot", "token_ids", "sampling", "num_computed_tokens", "num_prompt_tokens", "min_new_tokens", "min_tokens_suppressed_ids", "num_logprobs", "num_prompt_logprobs", "speculate", "lora_id")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_SUPPRESSED_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    slot: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    num_computed_tokens: int
    num_prompt_tokens: int
    min_new_tokens: int
    min_tokens_suppressed_ids: _containers.RepeatedScalarFieldContainer[int]
    num_logprobs: int
    num_prompt_logprobs: int
    speculate: bool
    lora_id: int
    def __init__(self, slot: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., num_computed_tokens: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., min_tokens_suppressed_ids: _Optional[_Iterable[int]] = ..., num_logprobs: _Optional[int] = ..., num_prompt_logprobs: _Optional[int] = ..., speculate: _Optional[bool] = ..., lora_id: _Optional[int] = ...) -> None: ...

class BatchPlan(_message.Message):
    __slots__ = ("step_id", "new_sequences", "slots", "num_scheduled_tokens", "num_new_blocks", "new_block_ids", "finished_slots", "preempted_slots", "aborted_slots", "copy_src", "copy_dst", "swap_out_src", "swap_out_dst", "swap_in_src", "extension", "swap_in_dst", "masked_slots", "allowed_token_bitmask")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    COPY_SRC_FIELD_NUMBER: _ClassVar[int]
    COPY_DST_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_SRC_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_DST_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_SRC_FIELD_NUMBER: _ClassVar[int]
    EXTENSION_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_DST_FIELD_NUMBER: _ClassVar[int]
    MASKED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_BITMASK_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_sequences: _containers.RepeatedCompositeFieldContainer[NewSequence]
    slots: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    finished_slots: _containers.RepeatedScalarFieldContainer[int]
    preempted_slots: _containers.RepeatedScalarFieldContainer[int]
    aborted_slots: _containers.RepeatedScalarFieldContainer[int]
    copy_src: _containers.RepeatedScalarFieldContainer[int]
    copy_dst: _containers.RepeatedScalarFieldContainer[int]
    swap_out_src: _containers.RepeatedScalarFieldContainer[int]
    swap_out_dst: _containers.RepeatedScalarFieldContainer[int]
    swap_in_src: _containers.RepeatedScalarFieldContainer[int]
    extension: bytes
    swap_in_dst: _containers.RepeatedScalarFieldContainer[int]
    masked_slots: _containers.RepeatedScalarFieldContainer[int]
    allowed_token_bitmask: bytes
    def __init__(self, step_id: _Optional[int] = ..., new_sequences: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., slots: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., num_new_blocks: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., finished_slots: _Optional[_Iterable[int]] = ..., preempted_slots: _Optional[_Iterable[int]] = ..., aborted_slots: _Optional[_Iterable[int]] = ..., copy_src: _Optional[_Iterable[int]] = ..., copy_dst: _Optional[_Iterable[int]] = ..., swap_out_src: _Optional[_Iterable[int]] = ..., swap_out_dst: _Optional[_Iterable[int]] = ..., swap_in_src: _Optional[_Iterable[int]] = ..., extension: _Optional[bytes] = ..., swap_in_dst: _Optional[_Iterable[int]] = ..., masked_slots: _Optional[_Iterable[int]] = ..., allowed_token_bitmask: _Optional[bytes] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("plan",)
    PLAN_FIELD_NUMBER: _ClassVar[int]
    plan: BatchPlan
    def __init__(self, plan: _Optional[_Union[BatchPlan, _Mapping]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "num_sampled_tokens", "sampled_token_ids", "logprobs", "logprob_token_ids", "forward_ns", "sample_ns", "total_ns", "prompt_logprobs", "prompt_logprob_token_ids", "num_draft_tokens", "num_accepted_draft_tokens")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    num_sampled_tokens: _containers.RepeatedScalarFieldContainer[int]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    logprob_token_ids: _containers.RepeatedScalarFieldContainer[int]
    forward_ns: int
    sample_ns: int
    total_ns: int
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_logprob_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    def __init__(self, step_id: _Optional[int] = ..., num_sampled_tokens: _Optional[_Iterable[int]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., logprob_token_ids: _Optional[_Iterable[int]] = ..., forward_ns: _Optional[int] = ..., sample_ns: _Optional[int] = ..., total_ns: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_logprob_token_ids: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_draft_tokens: _Optional[int] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: StepResult
    def __init__(self, result: _Optional[_Union[StepResult, _Mapping]] = ...) -> None: ...
