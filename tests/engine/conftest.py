"""A tiny random llama checkpoint, built once per session with the project's own tool."""
from __future__ import annotations

from pathlib import Path

import pytest
from device_choice import engine_device

from pipeline.models.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    engine_device()  # with --device cuda and no CUDA device, every engine test skips here
    return make_tiny_model(tmp_path_factory.mktemp("engine-tiny-llama"), "llama", seed=21)
