"""--dtype auto on a CPU: bfloat16 for the dense parts where the CPU has bf16 instructions (x86
avx512_bf16 or amx_bf16, ARM bf16), float32 otherwise; the checkpoint's dtype on an accelerator."""
from __future__ import annotations

from pathlib import Path

import torch

from stages.gpu_runner.models.config import cpu_auto_dtype, cpu_flags, resolve_dtype

SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile\n"
SKYLAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\nbugs\t\t: spectre_v1\n"
NEOVERSE_V1 = "processor\t: 0\nFeatures\t: fp asimd sve asimddp bf16 i8mm\nCPU implementer\t: 0x41\n"
CORTEX_A72 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid\n"


def test_bf16_instructions_make_auto_bfloat16_and_their_absence_float32():
    assert cpu_auto_dtype(cpu_flags(SAPPHIRE_RAPIDS)) == torch.bfloat16
    assert cpu_auto_dtype(cpu_flags(NEOVERSE_V1)) == torch.bfloat16
    assert cpu_auto_dtype(cpu_flags(SKYLAKE)) == torch.float32
    assert cpu_auto_dtype(cpu_flags(CORTEX_A72)) == torch.float32
    assert cpu_auto_dtype(cpu_flags("")) == torch.float32  # no /proc/cpuinfo to read
    only_amx = "flags\t\t: fpu avx512f amx_bf16\n"
    assert cpu_auto_dtype(cpu_flags(only_amx)) == torch.bfloat16
    assert "bf16" not in cpu_flags(SKYLAKE + "model name\t: bf16 in a name is no flag\n")


class _Config:
    torch_dtype = torch.float16


def test_auto_on_an_accelerator_is_the_checkpoints_dtype_and_an_explicit_dtype_stays():
    assert resolve_dtype("auto", _Config(), torch.device("cuda")) == torch.float16
    assert resolve_dtype("float32", _Config(), torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", _Config(), torch.device("cpu")) == torch.bfloat16
    this_cpu = cpu_auto_dtype(cpu_flags(Path("/proc/cpuinfo").read_text()))
    assert resolve_dtype("auto", _Config(), torch.device("cpu")) == this_cpu
