"""Loads the @triton.jit kernel modules once per mode: compiled for CUDA tensors, interpreted for CPU tensors.

Triton decides at decoration time whether `@triton.jit` builds a compiled kernel or a Python
interpreted one, by reading TRITON_INTERPRET while the decorator runs. So the kernel sources
(the `*_jit.py` files beside this one) are not imported as ordinary modules: each is executed
here into a fresh module per mode, with TRITON_INTERPRET set for just that execution. The
interpreted kernels avoid Triton's own @jit library functions (see common_jit.py), which are
decorated in the mode of the process's first `import triton`; so the CPU kernels work whether
or not something imported triton first, as when a whole test suite shares one process.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType

import torch

_JIT_MODULES = ("common", "attention", "norm", "rotary", "moe")
# Triton 3.6's interpreter hands a scalar load back as a one-element array, which the kernels'
# loop bounds (ranges over loaded lengths) refuse; from 3.7 it is a scalar. Compiled kernels run on 3.6.
INTERPRETER_MIN_VERSION = (3, 7)


def check_interpreter(version: str) -> None:
    """Raises, naming the way out, when Triton `version`'s interpreter cannot run the kernels."""
    major, minor = (int(part) for part in re.match(r"(\d+)\.(\d+)", version).groups())
    if (major, minor) < INTERPRETER_MIN_VERSION:
        need = ".".join(map(str, INTERPRETER_MIN_VERSION))
        raise RuntimeError(f"the Triton kernels on the CPU run in Triton's interpreter, which needs triton>={need} "
                           f"(this is {version}); use attention_backend 'torch' on the CPU or upgrade triton")


def interpreted(device: torch.device) -> bool:
    """True for CPU (the Triton interpreter), False for CUDA (compiled kernels)."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return False
    raise ValueError(f"Triton kernels run on cuda (compiled) or cpu (interpreted), not on device {device}")


@functools.cache
def jit_module(name: str, interpret: bool) -> ModuleType:
    """The kernels of `<name>_jit.py`, decorated in the given mode (loaded once per mode)."""
    if name not in _JIT_MODULES:
        raise ValueError(f"unknown kernel module {name!r}; expected one of {_JIT_MODULES}")
    try:
        import triton  # imported here so the package imports without it
    except ImportError as error:
        raise RuntimeError("the Triton kernels need the `triton` package (`pip install triton`)") from error
    if not interpret and type(triton.language.standard._sum_combine).__name__ == "InterpretedFunction":
        raise RuntimeError("triton was imported with TRITON_INTERPRET=1, so its library cannot compile; "
                           "run the CUDA kernels in a process without it")
    if interpret:
        check_interpreter(triton.__version__)
    path = Path(__file__).with_name(f"{name}_jit.py")
    module_name = f"{__package__}.{name}_jit_{'interpreted' if interpret else 'compiled'}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    # A mode forced through triton.knobs (not the environment) would override ours: say so.
    kinds = {type(value).__name__ for value in vars(module).values()} & {"InterpretedFunction", "JITFunction"}
    if kinds != {"InterpretedFunction" if interpret else "JITFunction"}:
        raise RuntimeError(f"Triton built the {name} kernels {'compiled' if interpret else 'interpreted'}, "
                           f"not {'interpreted' if interpret else 'compiled'}; is triton.knobs.runtime.interpret set?")
    return module


def jit_module_in_loading_mode(name: str) -> ModuleType:
    """For a jit module that uses another one's helpers: that module in the mode being loaded now."""
    return jit_module(name, os.environ.get("TRITON_INTERPRET") == "1")


def kernels_for(name: str, tensor: torch.Tensor) -> ModuleType:
    """The jit module `name` in the mode of the tensor's device."""
    return jit_module(name, interpreted(tensor.device))


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
