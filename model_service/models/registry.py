"""The model-family registry: config.json's `architectures` to the facts our forward runs.

Every family we serve is Llama's decoder with a few switches (LlamaArchConfig's attention_bias,
qk_norm, sliding_window, head_dim, rope_scaling), so a family is not a module tree of its own but
a `Family`: its architecture name, the config keys it defaults differently from a plain Llama
config, and a parse that turns config.json into a LlamaArchConfig (models/families.py has the
built-ins). A config is resolved in this order:

  1. `architectures[0]` registered with `register` (or, for a config without `architectures`,
     its `model_type`);
  2. an entry point in the group `planserve.model_families` of that name (an installed plugin
     package declares `[project.entry-points."planserve.model_families"] MyForCausalLM =
     "pkg.module:FAMILY"`, a `Family`).

Anything else is refused at load, naming the architecture and listing those we serve.

Adding a family: write its parse (usually `llama_arch(config, ...)` with the family's switches and
the config keys it refuses), register it, and add a tiny-model parity test from its transformers
config class (tests/model_service/test_ms_families.py).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any, Callable

from model_service.models.arch import LlamaArchConfig

ENTRY_POINT_GROUP = "planserve.model_families"


@dataclasses.dataclass(frozen=True)
class Family:
    architecture: str
    """config.json's architectures[0], e.g. "Qwen2ForCausalLM"."""
    model_type: str
    """config.json's model_type, e.g. "qwen2"."""
    parse: Callable[[dict[str, Any]], LlamaArchConfig]
    """config.json (with the family's defaults filled in) -> the architecture facts; ValueError
    naming any config key and value our forward cannot honour."""
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Values transformers' config class assumes for keys an older config.json may leave out."""

    def arch_from_config(self, config: dict[str, Any]) -> LlamaArchConfig:
        return self.parse({**self.defaults, **config})  # a key present with null stays null


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    existing = _REGISTRY.get(family.architecture)
    if existing is not None and existing is not family:
        raise ValueError(f"model family {family.architecture!r} is already registered")
    _REGISTRY[family.architecture] = family
    return family


def available() -> list[str]:
    return sorted(
        set(_REGISTRY) | {e.name for e in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    )


def family_for_config(config: dict[str, Any]) -> Family:
    """The family a config.json names; ValueError naming it and the served ones otherwise (the
    built-ins are registered by importing models/families.py, which hf_folder.py does)."""
    names = config.get("architectures") or []
    if len(names) > 1:
        raise ValueError(f"model: config.json architectures {names} names more than one")
    if names:
        name = names[0]
        if name in _REGISTRY:
            return _REGISTRY[name]
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=name):
            family = entry_point.load()
            if not isinstance(family, Family):
                raise ValueError(
                    f"model: entry point {name!r} ({entry_point.value}) is not a Family"
                )
            return register(family)
        raise ValueError(
            f"model: config.json architectures {name!r} is not supported (one of {available()})"
        )
    model_type = config.get("model_type")
    for family in _REGISTRY.values():
        if family.model_type == model_type:
            return family
    raise ValueError(
        f"model: config.json has no architectures and model_type {model_type!r} is not supported "
        f"(one of {sorted(f.model_type for f in _REGISTRY.values())})"
    )
