"""The adapter registry's checks (core/lora_registry.py), the LoRA flags' validation, and the
residency bookkeeping of an unloaded adapter (core/loras.py)."""

from __future__ import annotations

import os

import pytest

from scheduler_service.config import SchedulerConfig
from scheduler_service.core.lora_registry import (
    Adapter,
    LoraError,
    LoraRegistry,
    check_name,
    confined_path,
    parse_modules,
)
from scheduler_service.core.loras import LoraCapacity, LoraState


@pytest.mark.parametrize(
    "name, why",
    [
        ("", "empty"),
        ("x" * 65, "at most 64"),
        ("a b", "outside"),
        ("a/b", "outside"),
        ("base", "base"),
    ],
)
def test_a_bad_name_is_refused_naming_lora_name(name, why):
    with pytest.raises(LoraError, match=why) as error:
        check_name(name, "base")
    assert error.value.field == "lora_name" and error.value.kind == "invalid"


def test_paths_must_resolve_inside_the_root(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    os.symlink(outside, root / "link")
    assert confined_path(str(root), "a") == str(root / "a")
    assert confined_path(str(root), str(root / "a")) == str(root / "a")
    for path in ("", "../outside", str(outside), str(root / "link"), str(root / "link" / "x")):
        with pytest.raises(LoraError) as error:
            confined_path(str(root), path)
        assert error.value.field == "lora_path"
    # A root that is itself a symlink is resolved too.
    os.symlink(root, tmp_path / "root_link")
    assert confined_path(str(tmp_path / "root_link"), "a") == str(root / "a")


def test_ids_are_never_reused_and_names_conflict_while_loading():
    registry = LoraRegistry()
    first = registry.reserve("a")
    with pytest.raises(LoraError) as error:
        registry.reserve("a")  # being loaded
    assert error.value.kind == "conflict"
    registry.add(Adapter("a", first, "/x"))
    with pytest.raises(LoraError):
        registry.reserve("a")  # loaded
    registry.remove("a")
    assert registry.reserve("a") > first
    assert registry.resolve("", "base") is None and registry.resolve("base", "base") is None
    with pytest.raises(LoraError) as error:
        registry.resolve("nope", "base")
    assert error.value.kind == "not_found" and "does not exist" in error.value.message


def test_the_lora_flags_are_validated(tmp_path):
    assert parse_modules(["a=/x", "b=/y"]) == [("a", "/x"), ("b", "/y")]
    for modules, match in (
        ((["a"]), "name=path"),
        (["a=/x", "a=/y"], "twice"),
        (["a b=/x"], "outside"),
    ):
        with pytest.raises(ValueError, match=match):
            SchedulerConfig(lora_modules=tuple(modules)).validate()
    with pytest.raises(ValueError, match="lora_root"):
        SchedulerConfig(enable_runtime_lora=True).validate()
    with pytest.raises(ValueError, match="not a folder"):
        SchedulerConfig(lora_root=str(tmp_path / "none")).validate()
    SchedulerConfig(enable_runtime_lora=True, lora_root=str(tmp_path)).validate()


def test_an_unloaded_adapter_is_evicted_once_idle():
    loras = LoraState(LoraCapacity(max_loras=2, max_lora_rank=16, max_cpu_loras=2))
    loras.want("a", 1)
    [(name, lora_id, evicted)] = loras.start_loads()
    assert loras.loaded(name, lora_id, loras.epoch) and evicted is None
    loras.on_start("a", step_id=5)
    loras.on_stop("a", next_step_id=7)  # the plan of step 7 drops its slot
    loras.forget("a")
    loras.completed_step = 6
    assert loras.take_idle_forgotten() == []  # the model service may still hold the slot
    loras.completed_step = 7
    assert loras.take_idle_forgotten() == [("a", 1)] and not loras.resident
