"""Build the model for a checkpoint and fill it, strictly: every tensor the model needs, none it does
not know, each of the shape the config implies. The tensors come from a loader (loaders/): a
safetensors directory, or the GGUF file its config names; under tensor parallelism each rank
reads only the slices it holds. What --quantization comes to is loaders/quantization.py's choice: a
GGUF file's block-quantized weights kept as their blocks on the CPU (layers/quantization/gguf.py),
float weights quantized to q8_0/q4_0 blocks at load, or every weight dense."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from stages.gpu_runner.layers.quantization.gguf import check_int8_activations
from stages.gpu_runner.loaders.quantization import choose_quantization, quantize_at_load, with_activations
from stages.gpu_runner.models.config import ModelConfig, ModelLoadError, load_model_config
from stages.gpu_runner.models.base import CausalLM
from stages.gpu_runner.models.registry import model_class
from stages.gpu_runner.parallel.group import TensorParallel
from stages.gpu_runner.parallel.sharding import shard_tensor
from stages.progress import Progress

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
# A multimodal checkpoint's parts that the text model does not use, and where its text model's
# tensors sit (transformers 4 and 5 name them differently).
_SKIPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
_RENAMED_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head."))


def _model_name(name: str) -> str | None:
    """A checkpoint tensor's name as the model knows it; None for tensors it does not use."""
    # Older checkpoints store the rotary frequencies, which are recomputed from the config.
    if name.endswith("rotary_emb.inv_freq") or name.startswith(_SKIPPED_PREFIXES):
        return None
    for old, new in _RENAMED_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def tokenizer_path(model_dir: str | Path) -> Path:
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise ModelLoadError(f"missing file: {path}")
    return path


def open_source(root: Path, config: ModelConfig, keep_blocks: bool = False):
    """The tensor source of a checkpoint: its GGUF file when its config names one (its quantized
    weights kept as blocks with `keep_blocks`), else its safetensors."""
    if config.gguf_file is not None:
        from stages.gpu_runner.loaders.gguf import GGUFSource
        return GGUFSource(Path(config.gguf_file), config, keep_blocks)
    from stages.gpu_runner.loaders.safetensors import SafetensorsSource
    return SafetensorsSource(root)


def load_model(
    model_dir: str | Path, *, device: torch.device, dtype: torch.dtype, max_positions: int,
    config: ModelConfig | None = None, tp: TensorParallel | None = None, quantization: str = "none",
    expert_parallel: bool = False, quantized_activations: str = "float32",
) -> CausalLM:
    """Build the model (this rank's shard of it under `tp`) on `device` in `dtype` and fill it from
    the checkpoint, checking every tensor's shape. `quantization` (one of QUANTIZATIONS):
    "gguf" keeps a GGUF file's quantized weights as blocks where the model runs on the CPU, whole
    (so not under `tp`); "q8_0"/"q4_0" also quantize float weights at load; "auto" keeps a GGUF
    file's blocks where it can. The choice and its reason are logged. `expert_parallel`: a
    mixture's ranks hold whole experts, num_experts / tp.size each. `quantized_activations` (float32,
    int8): whether quantized weights multiply a decode step's few rows as float32 or as 8-bit
    activations (where the CPU's kernels take their type)."""
    root = Path(model_dir)
    config = config or load_model_config(root)
    if expert_parallel and tp is not None and config.num_experts:
        if config.num_experts % tp.size:
            raise ModelLoadError(f"expert parallelism over {tp.size} ranks does not divide the model's "
                                 f"{config.num_experts} experts")
        config = dataclasses.replace(config, expert_parallel=True)
    chosen = choose_quantization(quantization, config, device, tp is not None)
    if chosen.keep_blocks or chosen.qtype is not None:
        check_int8_activations(quantized_activations)
    log.info("quantization %s", chosen.reason)
    keep_blocks = chosen.keep_blocks
    with torch.device("meta"):
        model = model_class(config)(config, max_positions, device, tp)
    model = model.to_empty(device=device).to(dtype)
    expected = model.expected_hf_tensors()
    with open_source(root, config, keep_blocks) as source:
        names = {model_name: name for name in source.names() if (model_name := _model_name(name)) is not None}
        missing = sorted(set(expected) - set(names))
        if missing:
            raise ModelLoadError(f"{root}: checkpoint is missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        # A tied model's checkpoint may still carry lm_head.weight; the embeddings are used instead.
        unexpected = sorted(set(names) - set(expected) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
        if unexpected:
            raise ModelLoadError(f"{root}: unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
                                 f"for {config.architecture}")
        progress = Progress(f"loading the weights of {root.name}", total=len(expected)).start()
        for model_name, shape_wanted in expected.items():
            progress.advance()
            name = names[model_name]
            shape = source.shape(name)
            if shape != shape_wanted:
                raise ModelLoadError(f"{source.where(name)}: tensor {name} has shape {list(shape)}, "
                                     f"{source.config_name} implies {list(shape_wanted)}")
            if tp is None:
                tensor = quantize_at_load(source.read(name), chosen.qtype)
                model.load_hf_tensor(model_name, with_activations(tensor, quantized_activations))
            else:
                model.load_hf_tensor(model_name, shard_tensor(model_name, lambda index: source.read(name, index),
                                                              shape, config, tp.rank, tp.size))
        progress.finish()
    model.quantization = chosen
    return model.eval()

