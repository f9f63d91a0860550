"""Tiny random checkpoints, built once per session with the project's own tool."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pipeline.models.tiny_model import ARCHITECTURES, make_tiny_model

ARCHS = tuple(ARCHITECTURES)
# A distinct seed per architecture, so two archs never share weights and outputs.
ARCH_SEEDS = {"llama": 11, "mistral": 12, "qwen2": 13, "qwen3": 14, "gemma3": 15, "mixtral": 16, "qwen2_moe": 17,
              "qwen3_moe": 18, "gpt_oss": 19}


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models spend their time in op overhead; a second intra-op thread only adds
    contention, and on a busy 2-core machine it can make a test ten times slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_checkpoint(arch, **options) -> directory; the same options give the same directory.

    Llama checkpoints get llama3 rope scaling unless rope_scaling_llama3=False is passed.
    """
    built: dict[tuple, Path] = {}

    def make(arch: str, **options: object) -> Path:
        if arch == "llama":
            options.setdefault("rope_scaling_llama3", True)
        key = (arch, tuple(sorted(options.items())))
        if key not in built:
            outdir = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[key] = make_tiny_model(outdir, arch, seed=ARCH_SEEDS[arch], **options)
        return built[key]

    return make
