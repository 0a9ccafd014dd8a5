"""The LoRA adapters this server serves: public names, the ids the scheduler gives them, their
folders; and the checks on what an operator or a client may name.

One registry per scheduler process, shared by every door and every replica: an adapter's id is
the same on every model service (NewSequence.lora_id, LoadAdapter.lora_id). Ids start at 1 (0 is
the base model) and are never reused, so an adapter loaded again under an old name is a new
adapter everywhere, prefix cache included (kv_blocks.lora_key).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Iterable, Optional

MAX_NAME_CHARS = 64
_NAME = re.compile(r"[A-Za-z0-9._-]+")


@dataclasses.dataclass(frozen=True)
class Adapter:
    name: str
    lora_id: int
    path: str
    rank: int = 0


class LoraError(Exception):
    """A refused adapter operation. `kind`: "invalid" (400 / INVALID_ARGUMENT), "not_found"
    (404 / NOT_FOUND), "conflict" (409 / ALREADY_EXISTS or FAILED_PRECONDITION), "unavailable"
    (503 / UNAVAILABLE); `field`: the request field at fault."""

    def __init__(self, kind: str, field: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.field = field
        self.message = message

    def __reduce__(self):
        """Pickled whole: the engine core answers a frontend process's load with it."""
        return LoraError, (self.kind, self.field, self.message)


def check_name(name: str, base_model: str) -> None:
    """LoraError naming lora_name unless 1 to 64 characters of [A-Za-z0-9._-], not the base
    model's name."""
    if not name:
        raise LoraError("invalid", "lora_name", "lora_name: must not be empty")
    if len(name) > MAX_NAME_CHARS:
        raise LoraError(
            "invalid",
            "lora_name",
            f"lora_name: at most {MAX_NAME_CHARS} characters, got {len(name)}",
        )
    if not _NAME.fullmatch(name):
        raise LoraError(
            "invalid", "lora_name", f"lora_name: {name!r} has characters outside [A-Za-z0-9._-]"
        )
    if name == base_model:
        raise LoraError("invalid", "lora_name", f"lora_name: {name!r} is the base model's name")


def confined_path(root: str, path: str) -> str:
    """`path` (relative ones under `root`) resolved, symlinks followed; LoraError naming
    lora_path when it is empty or resolves outside `root`."""
    if not path:
        raise LoraError("invalid", "lora_path", "lora_path: must not be empty")
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, path))
    if os.path.commonpath([real_root, real]) != real_root:
        raise LoraError(
            "invalid",
            "lora_path",
            f"lora_path: {path!r} resolves outside the adapter root (--lora-root)",
        )
    return real


def parse_modules(entries: Iterable[str]) -> list[tuple[str, str]]:
    """--lora-modules entries name=path as (name, path); ValueError naming the bad entry."""
    modules: list[tuple[str, str]] = []
    seen: set[str] = set()
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not path:
            raise ValueError(f"lora_modules: {entry!r} must be name=path")
        try:
            check_name(name, "")
        except LoraError as error:
            raise ValueError(f"lora_modules: {entry!r}: {error.message}") from None
        if name in seen:
            raise ValueError(f"lora_modules: {name!r} is given twice")
        seen.add(name)
        modules.append((name, path))
    return modules


class LoraRegistry:
    """Name -> Adapter, and the names being loaded right now (reserved)."""

    def __init__(self) -> None:
        self.adapters: dict[str, Adapter] = {}
        self._reserved: set[str] = set()
        self._next_id = 1

    def resolve(self, name: str, base_model: str) -> Optional[Adapter]:
        """The adapter a request names; None for the base model ("" or its name); LoraError
        (not_found) for an unknown name."""
        if not name or name == base_model:
            return None
        adapter = self.adapters.get(name)
        if adapter is None:
            raise LoraError("not_found", "lora_name", f"The model `{name}` does not exist.")
        return adapter

    def reserve(self, name: str) -> int:
        """A new id for `name`, held until `add` or `release`; LoraError (conflict) when the
        name is served or being loaded."""
        if name in self.adapters or name in self._reserved:
            raise LoraError(
                "conflict", "lora_name", f"lora_name: the adapter {name!r} is already loaded"
            )
        self._reserved.add(name)
        lora_id = self._next_id
        self._next_id += 1
        return lora_id

    def add(self, adapter: Adapter) -> None:
        self._reserved.discard(adapter.name)
        self.adapters[adapter.name] = adapter

    def release(self, name: str) -> None:
        """A reserved name whose load failed."""
        self._reserved.discard(name)

    def remove(self, name: str) -> Adapter:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoraError("not_found", "lora_name", f"The model `{name}` does not exist.")
        return adapter

    def by_id(self, lora_id: int) -> Optional[Adapter]:
        for adapter in self.adapters.values():
            if adapter.lora_id == lora_id:
                return adapter
        return None
