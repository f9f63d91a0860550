"""The CPU operators: native kernels (attention.c, sample.c, elementwise.c, quant.c), C sources beside
this file, registered as torch operators by ops.cpp (torch.ops.pipeline.*: each checks its
arguments, so a bad index raises instead of reading out of bounds), built once per machine for its
own CPU and cached (build.py). Their callers: attention/cpu_attention.py (paged attention),
layers/kernels.py and layers/mlp.py (RMSNorm, rotary, SwiGLU), sampling/sampler.py (sampling),
layers/quantization/gguf.py (GGUF blocks, through quant.py). A wrapper called where they are not
built raises RuntimeError.

Where no compiler is found, the build fails, or PIPELINE_CPU_KERNELS=0, `library()` is None and
callers keep their plain-torch path (GGUF weights are then dequantized at load); `describe()` says
which, for the log and `pipeline status`.
"""
from __future__ import annotations

import functools
import logging
import os
import subprocess
from pathlib import Path

import torch

from stages.gpu_runner.cpu_ops import build

log = logging.getLogger(__name__)

ENABLE_VARIABLE = "PIPELINE_CPU_KERNELS"
CACHE_VARIABLE = build.CACHE_VARIABLE
_loaded: Path | None = None  # the library this process loaded (a library cannot be unloaded)
_failure = ""  # why the last library() found none


@functools.cache
def library() -> object | None:
    """torch.ops.pipeline once the operators are built and loaded, or None where they cannot be had
    (the reason is logged once and kept for describe())."""
    global _loaded, _failure
    if os.environ.get(ENABLE_VARIABLE, "1") == "0":
        _failure = f"switched off: {ENABLE_VARIABLE}=0"
        return None
    if _loaded is None:
        if build.compilers() is None:
            _failure = "no compiler"
            log.info("no C/C++ compiler: the CPU kernels stay in plain torch")
            return None
        try:
            _loaded = build.load()
            log.info("CPU kernels: built (torch ops, %s), loaded from %s", build.isa_label(), _loaded)
        except build.KernelCacheError as exc:
            _failure = str(exc)
            log.warning("CPU kernels not loaded: %s", exc)
            return None
        except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
            detail = str(getattr(exc, "stderr", "") or exc)
            _failure = f"the build failed: {_first_error(detail) or repr(exc)}"
            log.warning("CPU kernels not built (%s): the CPU kernels stay in plain torch", detail)
            return None
    return torch.ops.pipeline


def _first_error(output: str) -> str:
    """The compiler's first line that reports an error, else the output's last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "")


def library_path() -> Path | None:
    """The file the operators were loaded from, or None where they are not."""
    return _loaded if library() is not None else None


def describe() -> str:
    """What the CPU kernels are in this process, in a line: "built (torch ops, avx512+vnni)", or
    "plain torch (no compiler)" and the like."""
    if library() is None:
        return f"plain torch ({_failure})"
    return f"built (torch ops, {build.isa_label()})"


def operators():
    """`library()`, for a kernel's wrapper: a RuntimeError where it is not built."""
    ops = library()
    if ops is None:
        raise RuntimeError(f"the CPU kernels are not built ({_failure}; see cpu_ops.library)")
    return ops


SUPPORTED = (torch.float32, torch.bfloat16)


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether paged_attention takes this dtype and head size (a multiple of 16)."""
    return dtype in SUPPORTED and head_dim % 16 == 0


def paged_attention(query: torch.Tensor, flat_cache: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """query [rows, queries, heads, head_dim] over keys read in place: flat_cache
    [2, num_slots, kv_heads, head_dim] (keys, values), slots int64 [rows, num_keys], mask bool
    [rows, queries, num_keys] -> out like query. CPU tensors, the query and the cache each of a
    SUPPORTED dtype (a bfloat16 cache under a float32 query is widened as it is read); ValueError
    for anything else, IndexError for a slot some query sees that is outside the cache."""
    return operators().paged_attention(query, flat_cache, slots, mask, scale)


def sample_logits(logits: torch.Tensor, temperature: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """One token per row of float32 `logits` [rows, vocab], drawn with probability
    softmax(logits / temperature) by inverting the cumulative distribution at `points` (float64
    [rows], in [0, 1)); -inf logits are never drawn. int64 [rows]."""
    ops = operators()
    return ops.sample_logits(logits, temperature.to(torch.float32).reciprocal(), points)


def elementwise_ready(*tensors: torch.Tensor) -> bool:
    """Whether rms_norm, silu_and_mul and rotary take these tensors: CPU tensors of one
    SUPPORTED dtype, the kernels built."""
    dtype = tensors[0].dtype
    if dtype not in SUPPORTED:
        return False
    for tensor in tensors:  # a plain loop: every norm and rotary of a decode step asks
        if not tensor.is_cpu or tensor.dtype != dtype:
            return False
    return library() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(layers/norm.rms_norm of x, or of x + residual; that sum, or None): one pass over each row."""
    ops = operators()
    if residual is None:
        return ops.rms_norm(x, weight, eps, unit_offset), None
    return ops.add_rms_norm(x, residual, weight, eps, unit_offset)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate and up [tokens, width] views of one merged projection (the same row
    stride) or contiguous tensors. (GeGLU stays in torch: its tanh is not torch's to the last bit.)"""
    return operators().silu_and_mul(gate, up)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """layers/rotary.apply_rotary: x [tokens, heads, head_dim] (heads contiguous within a token),
    cos and sin [tokens, 1, head_dim]."""
    return operators().rotary(x, cos, sin)
