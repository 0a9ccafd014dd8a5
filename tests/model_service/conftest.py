"""Fixtures for the model service tests: the tiny model is loaded once per session."""
from __future__ import annotations

import pytest

from model_service.config import ModelServiceConfig
from model_service.loading.loader import load_model
from model_service.start import build_runner


def tiny_config(**overrides) -> ModelServiceConfig:
    values = dict(model="tiny", dtype="float32", num_kv_blocks=512, max_num_slots=16)
    values.update(overrides)
    return ModelServiceConfig(**values)


@pytest.fixture(scope="session")
def tiny_loaded():
    return load_model(tiny_config())


@pytest.fixture
def tiny_runner(tiny_loaded):
    return build_runner(tiny_loaded, tiny_config())


@pytest.fixture(scope="session")
def tiny_hf(tiny_loaded):
    from reference import hf_llama_from_loaded

    return hf_llama_from_loaded(tiny_loaded)
