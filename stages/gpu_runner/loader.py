"""Load a local HF checkpoint (config.json, safetensors, single or sharded) into the model, or one
tensor-parallel rank's shard of it (each rank reads only the slices it holds)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from stages.gpu_runner.model_config import ModelConfig, ModelLoadError, load_model_config
from stages.gpu_runner.models.llama import LlamaFamilyModel
from stages.gpu_runner.parallel import TensorParallel, shard_tensor

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"


def _ignored(name: str) -> bool:
    # Older checkpoints store the rotary frequencies, which are recomputed from the config.
    return name.endswith("rotary_emb.inv_freq")


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


def tokenizer_path(model_dir: str | Path) -> Path:
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise ModelLoadError(f"missing file: {path}")
    return path


def load_model(
    model_dir: str | Path, *, device: torch.device, dtype: torch.dtype, max_positions: int,
    config: ModelConfig | None = None, tp: TensorParallel | None = None,
) -> LlamaFamilyModel:
    """Build the model (this rank's shard of it under `tp`) on `device` in `dtype` and fill it from
    the checkpoint, checking every tensor's shape."""
    root = Path(model_dir)
    config = config or load_model_config(root)
    files = weight_files(root)
    with torch.device("meta"):
        model = LlamaFamilyModel(config, max_positions, device, tp)
    model = model.to_empty(device=device).to(dtype)
    expected = model.expected_hf_tensors()
    present = {name for name in files if not _ignored(name)}
    missing = sorted(set(expected) - present)
    if missing:
        raise ModelLoadError(f"{root}: checkpoint is missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    # A tied model's checkpoint may still carry lm_head.weight; the embeddings are used instead.
    unexpected = sorted(present - set(expected) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    if unexpected:
        raise ModelLoadError(f"{root}: unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
                             f"for {config.architecture}")
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                tensor_slice = f.get_slice(name)
                shape = tuple(tensor_slice.get_shape())
                if shape != expected[name]:
                    raise ModelLoadError(f"{path.name}: tensor {name} has shape {list(shape)}, "
                                         f"config.json implies {list(expected[name])}")
                if tp is None:
                    model.load_hf_tensor(name, f.get_tensor(name))
                else:
                    model.load_hf_tensor(name, shard_tensor(name, tensor_slice.__getitem__, shape, config,
                                                            tp.rank, tp.size))
    return model.eval()
