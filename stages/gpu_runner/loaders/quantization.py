"""What --quantization means for one checkpoint on one device, and quantizing float weights at load.

`choose_quantization` resolves the setting: whether a GGUF file's blocks are kept (multiplied in
place by layers/quantization/gguf.py) and whether float 2-D weights (a safetensors checkpoint's,
or a GGUF file's float tensors) are quantized at load to ggml blocks (q8_0, q4_0), which the same
GGUF linear method multiplies. Where a setting cannot be had (a GPU, no CPU kernels built), the
weights load dense and the choice's reason says why; where it is refused (tensor parallelism), a
ModelLoadError names the problem.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from stages.contracts.config import QUANTIZATIONS
from stages.gpu_runner.cpu_ops import quant
from stages.gpu_runner.layers.quantization.base import QuantizedWeight
from stages.gpu_runner.layers.quantization.gguf import int8_activations_for
from stages.gpu_runner.models.config import ModelConfig, ModelLoadError

log = logging.getLogger(__name__)

# The types float weights are quantized to at load, by --quantization name.
AT_LOAD = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
BLOCK_VALUES = 32  # values per block of both AT_LOAD types: a quantized row's columns are a multiple
# "auto" on a GGUF file on the CPU with the kernels built: keep its blocks (True) or dequantize (False).
AUTO_KEEPS_GGUF_BLOCKS = True


@dataclass(frozen=True, slots=True)
class LoadQuantization:
    """How one load treats the checkpoint's weights."""

    keep_blocks: bool  # a GGUF file's block-quantized weights kept as their blocks
    qtype: int | None  # float 2-D weights quantized at load to this ggml type; None: kept dense
    reason: str  # the choice and why, for the log and the status

    @property
    def name(self) -> str:
        if self.qtype is not None:
            return GGMLQuantizationType(self.qtype).name.lower()
        return "gguf" if self.keep_blocks else "none"


def _dense(reason: str) -> LoadQuantization:
    return LoadQuantization(False, None, reason)


def choose_quantization(quantization: str, config: ModelConfig, device: torch.device,
                        tensor_parallel: bool) -> LoadQuantization:
    """What `quantization` comes to for this checkpoint on `device`; the reason says which and why."""
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    is_gguf = config.gguf_file is not None
    if quantization == "none":
        return _dense("none: every weight dequantized to the dense dtype at load")
    if quantization == "auto":
        return _choose_auto(is_gguf, device, tensor_parallel)
    if tensor_parallel:
        raise ModelLoadError(f"quantization {quantization} holds whole weights: it does not run under tensor "
                             "parallelism; use quantization none")
    if device.type != "cpu":
        return _dense(f"{quantization} asked, but on {device.type} the weights are dense (the block kernels are "
                      "CPU-only)")
    if not _kernels_built():
        return _dense(f"{quantization} asked, but the CPU kernels are not built (no compiler?): weights dense")
    if quantization == "gguf":
        if not is_gguf:
            return _dense("gguf asked, but the checkpoint is not a GGUF file: its weights load as stored")
        return LoadQuantization(True, None, "gguf: the GGUF file's blocks kept and multiplied in place")
    what = "the GGUF file's blocks kept, its float weights" if is_gguf else "float weights"
    return LoadQuantization(is_gguf, int(AT_LOAD[quantization]), f"{quantization}: {what} quantized at load")


def _choose_auto(is_gguf: bool, device: torch.device, tensor_parallel: bool) -> LoadQuantization:
    if not is_gguf:
        return _dense("auto: not a GGUF file, so weights load dense as stored")
    if not AUTO_KEEPS_GGUF_BLOCKS:
        return _dense("auto: GGUF blocks dequantized at load (the default for GGUF files)")
    if tensor_parallel:
        return _dense("auto: GGUF blocks dequantized at load, as tensor parallelism splits dense weights")
    if device.type != "cpu":
        return _dense(f"auto: GGUF blocks dequantized at load, as the block kernels are CPU-only (device "
                      f"{device.type})")
    if not _kernels_built():
        return _dense("auto: GGUF blocks dequantized at load, as the CPU kernels are not built (no compiler?)")
    return LoadQuantization(True, None, "auto: the GGUF file's blocks kept and multiplied in place on the CPU")


def _kernels_built() -> bool:
    return quant.block_bytes(int(GGMLQuantizationType.Q8_0)) > 0


def quantize_rows(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """uint8 [rows, row_bytes]: each row of a float [rows, cols] weight as ggml blocks of `qtype`,
    laid out as a GGUF file stores them (cpu_ops/quant_encode.c, bit for bit the gguf package's
    reference quantizer)."""
    return quant.quantize_rows(weight.detach().to(torch.float32), int(qtype))


def with_activations(tensor: torch.Tensor | QuantizedWeight, mode: str) -> torch.Tensor | QuantizedWeight:
    """`tensor`, a quantized weight marked to take 8-bit activations where --quantized-activations
    `mode` gives them to its block type on this CPU (layers/quantization/gguf.py)."""
    if isinstance(tensor, QuantizedWeight) and int8_activations_for(mode, tensor.qtype):
        return dataclasses.replace(tensor, int8_activations=True)
    return tensor


def quantize_at_load(tensor: torch.Tensor | QuantizedWeight, qtype: int | None) -> torch.Tensor | QuantizedWeight:
    """`tensor` as blocks of `qtype` where it is a float 2-D weight whose rows fill whole blocks;
    anything else (1-D norms and biases, blocks already, no qtype) as it is."""
    if qtype is None or not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 \
            or not tensor.is_floating_point() or tensor.shape[1] % BLOCK_VALUES:
        return tensor
    return QuantizedWeight(qtype, quantize_rows(tensor, qtype), tuple(tensor.shape))
