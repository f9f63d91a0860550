"""The device the engine, daemon, HTTP and recovery tests run their engines on: `pytest --device cpu|cuda`.

tests/conftest.py puts the choice into the environment once, when pytest starts, so that these
helpers and the processes the tests start (stage processes, test doubles) read the same one.
"""
from __future__ import annotations

import os

import pytest

DEVICE_ENV = "PIPELINE_TEST_DEVICE"
DEVICES = ("cpu", "cuda")


def engine_device(num_devices: int = 1) -> str:
    """The engines' device in this test run; the calling test (or fixture) is skipped when it is
    cuda and torch sees fewer than `num_devices` CUDA devices (a tensor-parallel engine puts a
    rank on each)."""
    device = os.environ.get(DEVICE_ENV, "cpu")
    if device not in DEVICES:
        raise ValueError(f"{DEVICE_ENV} must be one of {DEVICES}, got {device!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("--device cuda: torch sees no CUDA device here")
        if torch.cuda.device_count() < num_devices:
            pytest.skip(f"--device cuda: {num_devices} ranks need {num_devices} CUDA devices, "
                        f"torch sees {torch.cuda.device_count()}")
    return device


def engine_dtype(device: str) -> str:
    """The dtype of the engines a test compares token for token: float32 on the CPU, whose "auto" is
    bfloat16 where it has bf16 instructions (a row's rounding then depends on the rows beside it,
    which moves the tiny models' near-ties between runs of different batch shapes); "auto" on CUDA."""
    return "float32" if device == "cpu" else "auto"
