"""One line that says what each part of a loaded model runs in: its weights (quantized by block
type, dense by dtype), the dense compute dtype and the KV cache. The runner logs it at load and
publishes it on the status board, where `pipeline status` prints it."""
from __future__ import annotations

from collections import Counter

import torch
from gguf import GGMLQuantizationType
from torch import nn

from stages.gpu_runner.layers.quantization.base import QuantizedWeight

_MB = 1e6


def _held_weights(model: nn.Module) -> tuple[list[QuantizedWeight], list[torch.Tensor]]:
    """Every weight the model holds once (a tied head counted with its embedding): quantized, dense."""
    quantized: dict[int, QuantizedWeight] = {}
    dense: dict[int, torch.Tensor] = {}
    for tensor in model.parameters():
        dense[id(tensor)] = tensor
    for module in model.modules():
        weight = module.__dict__.get("weight")  # a held QuantizedWeight (or tuple) is a plain attribute
        for part in weight if isinstance(weight, tuple) else (weight,):
            if isinstance(part, QuantizedWeight):
                quantized[id(part.blocks)] = part
            elif isinstance(part, torch.Tensor):
                dense[id(part)] = part
    return list(quantized.values()), list(dense.values())


def describe_weights(model: nn.Module) -> str:
    """e.g. "90 Q4_1 + 1 Q8_0 quantized (98.4 MB; 91 of them with 8-bit activations), 61 float32
    dense (0.1 MB: norms and biases)"."""
    quantized, dense = _held_weights(model)
    parts = []
    if quantized:
        types = Counter(GGMLQuantizationType(weight.qtype).name for weight in quantized)
        counts = " + ".join(f"{count} {name}" for name, count in sorted(types.items()))
        int8 = sum(weight.int8_activations for weight in quantized)
        activations = f"; {int8} of them with 8-bit activations" if int8 else ""
        parts.append(f"{counts} quantized ({sum(w.nbytes for w in quantized) / _MB:.1f} MB{activations})")
    by_dtype: Counter[str] = Counter()
    bytes_by_dtype: Counter[str] = Counter()
    for tensor in dense:
        name = _name(tensor.dtype)
        by_dtype[name] += 1
        bytes_by_dtype[name] += tensor.numel() * tensor.element_size()
    only_vectors = all(tensor.dim() == 1 for tensor in dense)
    for name, count in sorted(by_dtype.items()):
        note = ": norms and biases" if only_vectors else ""
        parts.append(f"{count} {name} dense ({bytes_by_dtype[name] / _MB:.1f} MB{note})")
    return ", ".join(parts) or "none"


def describe_runs_in(model: nn.Module, quantization: str, dtype: torch.dtype, kv_dtype: torch.dtype,
                     kv_tokens: int) -> str:
    """The whole line: weights, the quantization choice and why, the dense dtype, the KV cache, and
    whether decode steps run every layer in one CPU operator (layers/decoder_stack.py)."""
    stacked = "; decode steps: every layer in one CPU operator" if getattr(model, "decoder_stack", None) else ""
    return (f"weights: {describe_weights(model)}; quantization {quantization}; dense dtype {_name(dtype)}; "
            f"KV cache {_name(kv_dtype)}, {kv_tokens} tokens{stacked}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
