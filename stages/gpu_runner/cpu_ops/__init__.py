"""The CPU operators: native kernels (attention.c, sample.c, elementwise.c, quant.c), C sources beside
this file, compiled on first use with the machine's C compiler for the machine's own CPU
(-march=native), cached, and called through ctypes; a wrapper called where they are not built raises
RuntimeError. Their callers: attention/cpu_attention.py (paged attention), layers/kernels.py and
layers/mlp.py (RMSNorm, rotary, SwiGLU), sampling/sampler.py (sampling), layers/quantization/gguf.py
(GGUF blocks, through quant.py).

Where no compiler is found, the build fails, or PIPELINE_CPU_KERNELS=0, `library()` is None and
callers keep their plain-torch path (GGUF weights are then dequantized at load). The cache is PIPELINE_KERNEL_CACHE, else
~/.cache/pipeline/kernels; a build is named by the hash of its source, flags, compiler and CPU,
written under a temporary name and renamed into place, so concurrent processes may build at once.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from stages.progress import Progress

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("attention.c", "sample.c", "elementwise.c", "quant.c",
                                                            "quant_gemm.c", "quant_encode.c"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("bf16.h", "exp.h"))
# No contraction of a * b + c into one rounding: elementwise.c rounds where torch's operators do.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
ENABLE_VARIABLE = "PIPELINE_CPU_KERNELS"
CACHE_VARIABLE = "PIPELINE_KERNEL_CACHE"


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


def _build(compiler: str) -> Path:
    source = b"\0".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(),
                                        _cpu_identity().encode()])).hexdigest()[:16]
    cache = Path(os.environ.get(CACHE_VARIABLE) or Path.home() / ".cache" / "pipeline" / "kernels")
    target = cache / f"cpu_kernels-{digest}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        built = Path(scratch) / target.name
        with Progress(f"compiling the CPU kernels into {target}"):
            subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", str(built), "-lm"], capture_output=True,
                           text=True, check=True)
        os.replace(built, target)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be had (the reason is logged once)."""
    if os.environ.get(ENABLE_VARIABLE, "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: CPU attention and sampling stay in plain torch")
        return None
    try:
        torch.get_num_threads()  # torch's OpenMP runtime is loaded before ours links to it
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("CPU kernels not built (%s): CPU attention and sampling stay in plain torch", detail)
        return None
    pointer, size, real, flag = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    signatures = {
        "paged_attention": [pointer] * 6 + [size] * 6 + [real, flag],
        "sample_logits": [pointer] * 4 + [size] * 2,
        "rms_norm": [pointer, size, pointer, pointer, pointer, pointer, size, size, real, flag, flag],
        "silu_and_mul": [pointer, pointer, size, pointer, size, size, flag],
        "rotary": [pointer, size, pointer, pointer, pointer, size, size, size, flag],
        "quant_dequantize_rows": [pointer, flag, size, size, pointer, size, size, pointer],
        "quant_matmul": [pointer, flag, size, size, size, pointer, size, pointer],
        "quant_matmul_tiled": [pointer, flag, size, size, size, pointer, size, pointer, size],
    }
    for name, argtypes in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = None, argtypes
    lib.quant_block_bytes.restype, lib.quant_block_bytes.argtypes = flag, [flag]
    lib.quant_quantize_rows.restype, lib.quant_quantize_rows.argtypes = flag, [pointer, flag, size, size, pointer]
    return lib


def _built(caller: str) -> ctypes.CDLL:
    """`library()`, for a kernel's wrapper: a RuntimeError naming `caller` where it is not built."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"{caller}: the CPU kernels are not built (see cpu_ops.library)")
    return lib


SUPPORTED = (torch.float32, torch.bfloat16)


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether paged_attention takes this dtype and head size (a multiple of 16)."""
    return dtype in SUPPORTED and head_dim % 16 == 0


def paged_attention(query: torch.Tensor, flat_cache: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """query [rows, queries, heads, head_dim] over keys read in place: flat_cache
    [2, num_slots, kv_heads, head_dim] (keys, values), slots int64 [rows, num_keys], mask bool
    [rows, queries, num_keys] -> out like query. CPU tensors of one SUPPORTED dtype.""" 
    lib = _built("paged_attention")
    rows, queries, heads, head_dim = query.shape
    kv_heads = flat_cache.shape[2]
    if flat_cache.dtype != query.dtype or not supports(query.dtype, head_dim) or heads % kv_heads:
        raise ValueError(f"paged_attention: {query.dtype} queries with {heads} heads over a {flat_cache.dtype} "
                         f"cache with {kv_heads} KV heads")
    if not flat_cache.is_contiguous() or slots.dtype != torch.int64 or mask.dtype != torch.bool:
        raise ValueError(f"paged_attention: a contiguous cache, int64 slots and a bool mask, not "
                         f"{flat_cache.stride()} strides, {slots.dtype} slots, a {mask.dtype} mask")
    query, slots, mask = query.contiguous(), slots.contiguous(), mask.contiguous()
    out = torch.empty_like(query)
    lib.paged_attention(query.data_ptr(), flat_cache[0].data_ptr(), flat_cache[1].data_ptr(), slots.data_ptr(),
                        mask.data_ptr(), out.data_ptr(), rows, queries, slots.shape[1], heads, kv_heads, head_dim,
                        scale, int(query.dtype == torch.bfloat16))
    return out


def sample_logits(logits: torch.Tensor, temperature: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """One token per row of float32 `logits` [rows, vocab], drawn with probability
    softmax(logits / temperature) by inverting the cumulative distribution at `points` (float64
    [rows], in [0, 1)); -inf logits are never drawn. int64 [rows]."""
    lib = _built("sample_logits")
    if logits.dim() != 2 or logits.dtype != torch.float32 or points.dtype != torch.float64:
        raise ValueError(f"sample_logits: float32 [rows, vocab] logits and float64 points, not {logits.dtype} "
                         f"{tuple(logits.shape)} and {points.dtype}")
    logits = logits.contiguous()
    inverse = temperature.to(torch.float32).reciprocal().contiguous()
    points = points.contiguous()
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.sample_logits(logits.data_ptr(), inverse.data_ptr(), points.data_ptr(), tokens.data_ptr(), logits.shape[0],
                      logits.shape[1])
    return tokens


def elementwise_ready(*tensors: torch.Tensor) -> bool:
    """Whether rms_norm, silu_and_mul and rotary take these tensors: CPU tensors of one
    SUPPORTED dtype, the kernels built."""
    dtype = tensors[0].dtype
    return (dtype in SUPPORTED and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
            and library() is not None)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last] with its last dimension contiguous (a view where one exists)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(layers/norm.rms_norm of x, or of x + residual; that sum, or None): one pass over each row."""
    rows = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype)
    residual_in = None if residual is None else residual.contiguous()
    residual_out = None if residual is None else torch.empty_like(out)
    lib = _built("rms_norm")
    lib.rms_norm(rows.data_ptr(), rows.stride(0), None if residual_in is None else residual_in.data_ptr(),
                 None if residual_out is None else residual_out.data_ptr(), weight.contiguous().data_ptr(),
                 out.data_ptr(), rows.shape[0], rows.shape[1], eps, int(unit_offset), int(x.dtype == torch.bfloat16))
    return out, residual_out


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate and up [tokens, width] views of one merged projection (the same row
    stride) or contiguous tensors. (GeGLU stays in torch: its tanh is not torch's to the last bit.)"""
    if gate.stride() != up.stride() or gate.stride(-1) != 1:
        gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty(gate.shape, dtype=gate.dtype)
    lib = _built("silu_and_mul")
    lib.silu_and_mul(gate.data_ptr(), up.data_ptr(), gate.stride(0), out.data_ptr(), gate.shape[0], gate.shape[1],
                     int(gate.dtype == torch.bfloat16))
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """layers/rotary.apply_rotary: x [tokens, heads, head_dim] (heads contiguous within a token),
    cos and sin [tokens, 1, head_dim]."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    lib = _built("rotary")
    lib.rotary(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
               x.shape[2], int(x.dtype == torch.bfloat16))
    return out
