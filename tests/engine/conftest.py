"""A tiny random llama checkpoint, built once per session with the project's own tool."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.models.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("engine-tiny-llama"), "llama", seed=21)
