"""LoRA adapters of the base model (issue 35), by role:

    targets.py      the modules an adapter may adapt, as slices of the model's fused linears
    peft_folder.py  one PEFT folder read and checked, tensor by tensor, all or nothing
    store.py        the loaded adapters by lora_id (LoadAdapter / EvictAdapter), thread-safe
    grouping.py     a step's rows grouped by adapter, and the LoRA products added per group
    stacked.py      packed factors: every loaded adapter in one shrink a module, an expand a target
    triton_lora.py  the same products as grouped Triton kernels (CUDA)
    triton_stack.py the path's decider, the kernels' device stack of fixed slots, the layers' hook

The scheduler decides which adapters are loaded (engine.proto, LoadAdapter); the runner keeps each
slot's lora_id and builds the step's grouping (model_service/runner.py).
"""
