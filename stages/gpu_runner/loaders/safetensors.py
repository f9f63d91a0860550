"""Safetensors checkpoints (single or sharded): tensor names, shapes, and reads of whole tensors or slices."""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from stages.gpu_runner.models.config import ModelLoadError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index_path}: not a safetensors index with a 'weight_map': {exc}") from exc
        files = {name: model_dir / filename for name, filename in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise ModelLoadError(f"missing file: {path} (listed in {index_path})")
        return files
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        raise ModelLoadError(f"missing file: {single} (and no {INDEX_FILE})")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


class SafetensorsSource:
    """A checkpoint directory's tensors by their checkpoint names; files are opened once, on first read."""

    config_name = "config.json"  # where the expected shapes come from, for errors

    def __init__(self, model_dir: Path) -> None:
        self.root = model_dir
        self.files = weight_files(model_dir)
        self._stack = ExitStack()
        self._open: dict[Path, object] = {}

    def __enter__(self) -> SafetensorsSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        return list(self.files)

    def _slice(self, name: str):
        path = self.files[name]
        if path not in self._open:
            self._open[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        return self._open[path].get_slice(name)

    def where(self, name: str) -> str:
        return self.files[name].name

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, index: object = None) -> torch.Tensor:
        """The tensor, or the part of it at `index` (a slice or tuple of slices) read alone."""
        part = self._slice(name)
        return part[:] if index is None else part[index]
