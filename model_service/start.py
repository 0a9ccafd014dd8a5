"""The model service's start-up order, in one place (a runner never builds itself):

    load      the checkpoint (or a tensor-parallel rank's share)   loading/loader.py
    draft     the draft model, before sizing: its weights leave
              the free memory, its cache counts in each block      speculative/draft_model.py
    profile   on CUDA, the largest step on a scratch cache: peak   step/profile_step.py
              (the step shape chosen for the device: step_shape.py)
    size      the KV cache's block count, the cache, swap space    step/kv_budget.py
              (beside the step's peak and the graphs' pool)
    capture   the steps' CUDA graphs over the sized cache          step/cuda_graphs.py

Each part receives what it reads; the runner receives the parts.
"""

from __future__ import annotations

from typing import Optional

import structlog
import torch

from model_service import threads
from model_service.attention import paged
from model_service.attention.kv_cache import KVCache
from model_service.config import ModelServiceConfig
from model_service.kernels import layer_ops
from model_service.kernels.gemm import PackedLinear
from model_service.loading.loaded import LoadedModel
from model_service.loading.loader import load_model
from model_service.lora import triton_stack
from model_service.lora.store import AdapterStore, new_store
from model_service.models import decoder_loop
from model_service.models.null import NullLM
from model_service.models.parallel import RankShare
from model_service.runner import ModelRunner
from model_service.speculative import draft_model
from model_service.speculative.stage import Drafter
from model_service.speculative.verify import NgramDrafter
from model_service.step import cuda_graphs, kv_budget, profile_step, sampler, step_shape
from model_service.step.slot_table import SlotTable

log = structlog.get_logger(__name__)


def start_runner(config: ModelServiceConfig, share: Optional[RankShare] = None) -> ModelRunner:
    """Load, then build: the whole start-up of one model service (or tensor-parallel rank)."""
    return build_runner(load_model(config, share), config)


def build_runner(
    loaded: LoadedModel, config: ModelServiceConfig, runner_class: type[ModelRunner] = ModelRunner
) -> ModelRunner:
    """Everything after the load, in order: kernel paths, draft, profile, size, allocate,
    capture. `runner_class`: a ModelRunner subclass to build instead (the conformance kit's
    engines that bend one rule of the contract on purpose)."""
    config.validate()
    select_compute(loaded, config)
    device, dtype = _device(loaded), next(loaded.model.parameters()).dtype
    # LoRA before sizing: on the Triton path the store's device stack is allocated now, so the
    # KV budget counts it like the weights (lora/triton_stack.py).
    kernel, kernel_why = (
        triton_stack.kernel_path(device, config.lora_kernel)
        if config.enable_lora
        else ("torch", "")
    )
    adapters = new_store(loaded, config, kernel)
    draft = draft_model.load_draft(config, loaded)
    step_peak_bytes = profile_largest_step(loaded, config) if profiles(device, loaded) else None
    draft_bytes = draft_model.draft_block_bytes(draft, config.block_size)
    graphs_bytes = kv_budget.graphs_reserve_bytes(
        step_peak_bytes, step_peak_bytes is not None and graphs_captured(loaded, config)
    )
    sizing = kv_budget.size_kv_cache(
        config, loaded, dtype, device, step_peak_bytes, draft_bytes, graphs_bytes
    )
    num_blocks = sizing.num_blocks
    log.info("kv_cache_sized", num_kv_blocks=num_blocks, basis=sizing.basis())
    kv_cache = new_kv_cache(loaded, config, num_blocks)
    kv_cache.allocate_swap(config.swap_space_bytes // kv_cache.block_bytes)
    table = SlotTable(config.max_num_slots, loaded.max_model_len, config.block_size)
    drafter = _drafter(config, draft, table, kv_cache, device)
    step = step_shape.for_device(config, device)  # Describe's step_token_budget, step_max_seqs
    graphs, graphs_path = cuda_graphs.capture(
        config.cuda_graphs,
        loaded,
        kv_cache,
        step.token_budget,
        config.max_num_slots,
        table.max_blocks_per_seq,
        adapters.triton if adapters is not None else None,
    )
    compute = {
        **compute_paths(loaded, kv_cache),
        "cuda_graphs": graphs_path,
        "kv_budget": sizing.basis(),
    }
    if adapters is not None:
        native = compute["decoder_loop"] == "native"
        compute["lora"] = lora_path(device, adapters, native, kernel_why)
    log.info(
        "runner_ready",
        model=loaded.name,
        device=str(device),
        dtype=config.resolved_dtype(),
        num_kv_blocks=num_blocks,
        step=step,
        **compute,
    )
    return runner_class(loaded, config, kv_cache, table, drafter, graphs, compute, adapters)


def select_compute(loaded: LoadedModel, config: ModelServiceConfig) -> None:
    """The config's compute fields into force: the attention and layer-op paths (process-wide,
    as the native kernels are), then the decoder loop the model runs with them. The GEMM path
    was applied when the loader packed the linears; the graphs are the capture's."""
    paged.PATH.select(config.attention_isa)
    layer_ops.PATH.select(config.layer_ops_isa)
    if hasattr(loaded.model, "decoder_loop_reason"):  # the null model has no decoder layers
        decoder_loop.decide(loaded.model, config.decoder_loop)
    if isinstance(loaded.model, NullLM):
        # The null model stands in for a device whose work costs the host nothing, but its
        # one-hot logits and their argmax are big enough tensors for torch to start a parallel
        # region, whose wake-up of the OpenMP pool cost more host CPU than the rest of a step.
        torch.set_num_threads(1)


def _device(loaded: LoadedModel) -> torch.device:
    return next(loaded.model.parameters()).device


def new_kv_cache(loaded: LoadedModel, config: ModelServiceConfig, num_blocks: int) -> KVCache:
    """A KV cache of num_blocks blocks; under tensor parallelism a rank caches its KV heads."""
    arch = loaded.arch
    return KVCache(
        arch.num_hidden_layers,
        num_blocks,
        config.block_size,
        loaded.num_kv_heads_per_rank,
        arch.head_dim,
        next(loaded.model.parameters()).dtype,
        _device(loaded),
    )


def profiles(device: torch.device, loaded: LoadedModel) -> bool:
    """The largest step is profiled on CUDA, for a model that computes (kv_budget.py)."""
    return device.type == "cuda" and loaded.num_kv_blocks is None


def profile_largest_step(loaded: LoadedModel, config: ModelServiceConfig) -> int:
    """Runs the largest steps (profile_step.py) on a scratch runner and cache; returns their
    peak bytes. Both are released before the real cache is sized."""
    shape = step_shape.for_device(config, _device(loaded))
    lengths = profile_step.sequence_lengths(
        shape.token_budget, shape.max_seqs, loaded.max_model_len
    )
    cache = new_kv_cache(loaded, config, profile_step.blocks_needed(lengths, config.block_size))
    table = SlotTable(config.max_num_slots, loaded.max_model_len, config.block_size)
    scratch = ModelRunner(loaded, config, cache, table)
    device = _device(loaded)
    peak = profile_step.peak_step_bytes(
        scratch, lengths, config.block_size, loaded.arch.vocab_size, device
    )
    del scratch, cache
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the scratch cache's and the steps' blocks, for the real cache
    log.info(
        "largest_step_profiled", tokens=shape.token_budget, seqs=shape.max_seqs, peak_bytes=peak
    )
    return peak


def graphs_captured(loaded: LoadedModel, config: ModelServiceConfig) -> bool:
    """Whether the capture after sizing will record graphs (cuda_graphs.records, asked of a
    two-block cache of the real one's layout), so the budget leaves their pool free."""
    probe = new_kv_cache(loaded, config, 2)
    return cuda_graphs.records(
        config.cuda_graphs, probe.k.device, probe, loaded.tensor_parallel_size
    )


def _drafter(
    config: ModelServiceConfig,
    draft: LoadedModel | None,
    table: SlotTable,
    kv_cache: KVCache,
    device: torch.device,
) -> Drafter | None:
    """Speculative decoding's drafter: the n-gram lookup, a draft model, or none."""
    if config.speculative_method == "ngram":
        return NgramDrafter(max_n=config.ngram_max)
    if draft is not None:
        return draft_model.DraftModelDrafter(
            draft, table, kv_cache.num_blocks, config.block_size, device
        )
    return None


def lora_path(device: torch.device, store: AdapterStore, native_loop: bool, why: str) -> str:
    """How a step with adapter rows runs (Describe's compute["lora"]). The Triton kernels
    (lora/triton_stack.py; `why`: the decider's reason), in the captured steps too. Stacked
    (packed factors: a bf16 model on the CPU): the native decoder loop, where the model runs it,
    runs each row against its own adapter's blocks of the stack (csrc/lora_rows.h); the Python
    layers run every loaded adapter in one shrink and one expand per module (lora/stacked.py).
    Otherwise the Python layers run such a step eagerly, with torch GEMMs grouped by adapter."""
    if store.triton is not None:
        slots = f"{store.triton.slots} slots of rank {store.triton.rank}"
        return f"triton grouped kernels ({why}), the adapters in a device stack of {slots}"
    if store.stacked and native_loop:
        products = "each row against its own adapter's blocks of the stacked factors"
        return f"native decoder loop for steps with adapter rows, {products}"
    if store.stacked:
        products = "the loaded adapters stacked in one packed GEMM pair per module"
        return f"python layers for steps with adapter rows, {products}"
    graphs = "; CUDA graphs skipped" if device.type == "cuda" else ""
    return (
        f"python layers for steps with adapter rows, torch GEMMs grouped by adapter ({why}){graphs}"
    )


def compute_paths(loaded: LoadedModel, kv_cache: KVCache) -> dict[str, str]:
    """Threads and the path each op runs, as the compute fields resolved (Describe's
    `compute`)."""
    model = loaded.model
    on_cpu = _device(loaded).type == "cpu"
    return {
        **threads.settings(),
        "attention": paged.PATH.current if on_cpu else paged.cuda_path(kv_cache.k),
        "layer_ops": layer_ops.PATH.current if on_cpu else layer_ops.device_path(kv_cache.k),
        "gemm": next((m.isa for m in model.modules() if isinstance(m, PackedLinear)), "torch"),
        "decoder_loop": decoder_loop.describe(model),
        "sampler": sampler.device_path(_device(loaded)),
        "weights": loaded.weights,
    }
