"""Where a checkpoint's tensors come from, one tensor (or one slice of it) at a time.

The loader never holds the whole checkpoint: it asks a `WeightSource` for one tensor by its Hugging
Face name, optionally only some rows and columns (a tensor-parallel rank's share), casts it to the
serving dtype, and drops it before asking for the next. Sources:

    SafetensorsWeights   a Hugging Face folder: one *.safetensors file, or shards listed by
                         model.safetensors.index.json (else every *.safetensors in the folder);
                         safe_open(...).get_slice reads only the requested rows/columns from the
                         memory-mapped file, in the file's dtype
    TensorDictWeights    tensors already in memory (the tiny test model)
    (gguf_file.GGUFWeights dequantizes one GGUF tensor at a time)
"""

from __future__ import annotations

import glob
import json
import os
from typing import Optional, Protocol

import torch

INDEX_FILE = "model.safetensors.index.json"
# Rotary inverse frequencies some checkpoints carry: our forward computes its own.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightSource(Protocol):
    def names(self) -> set[str]:
        """Every tensor name the checkpoint holds (Hugging Face naming)."""
        ...

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored tensor's shape, without reading it."""
        ...

    def read(
        self, name: str, rows: Optional[slice] = None, columns: Optional[slice] = None
    ) -> torch.Tensor:
        """The tensor (rows/columns of a 2-D one; rows of a 1-D one) on the CPU, in its stored
        dtype or float32; a KeyError naming it when absent."""
        ...


class TensorDictWeights:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def read(
        self, name: str, rows: Optional[slice] = None, columns: Optional[slice] = None
    ) -> torch.Tensor:
        return sliced(self._tensors[name], rows, columns)


def sliced(tensor, rows: Optional[slice], columns: Optional[slice]):
    """tensor[rows, columns] (either may be None: all)."""
    if columns is not None:
        return tensor[rows or slice(None), columns]
    return tensor if rows is None else tensor[rows]


class SafetensorsWeights:
    """The tensors of a folder's safetensors files, read lazily."""

    def __init__(self, folder: str) -> None:
        from safetensors import safe_open

        index = os.path.join(folder, INDEX_FILE)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map: dict[str, str] = json.load(f).get("weight_map") or {}
            if not weight_map:
                raise ValueError(f"model: {INDEX_FILE} in {folder!r} has no weight_map")
            files = sorted(set(weight_map.values()))
            missing = [name for name in files if not os.path.isfile(os.path.join(folder, name))]
            if missing:
                raise ValueError(
                    f"model: {INDEX_FILE} names shard(s) {missing} that are not in {folder!r}"
                )
        else:
            files = sorted(
                os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.safetensors"))
            )
            if not files:
                raise ValueError(f"model: no *.safetensors file in {folder!r}")
        self._handles = {
            name: safe_open(os.path.join(folder, name), framework="pt", device="cpu")
            for name in files
        }
        self._file_of: dict[str, str] = {}
        for name, handle in self._handles.items():
            for key in handle.keys():
                if key.endswith(_IGNORED_SUFFIXES):
                    continue
                if key in self._file_of:
                    raise ValueError(
                        f"model: tensor {key!r} appears in more than one safetensors file"
                    )
                self._file_of[key] = name

    def names(self) -> set[str]:
        return set(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._file_of[name]].get_slice(name).get_shape())

    def read(
        self, name: str, rows: Optional[slice] = None, columns: Optional[slice] = None
    ) -> torch.Tensor:
        handle = self._handles[self._file_of[name]]
        if rows is None and columns is None:
            return handle.get_tensor(name)
        part = handle.get_slice(name)
        if columns is not None:
            return part[rows or slice(None), columns]
        return part[rows]
