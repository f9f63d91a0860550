"""Fixtures for the stage-process tests: a tiny checkpoint and Backends that always clean up."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from backend_helpers import MakeBackend, assert_cleaned_up, start_backend
from device_choice import engine_device

from pipeline.engine.multiprocess import StageBackend
from pipeline.models.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def stage_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    engine_device()  # with --device cuda and no CUDA device, every test of a stage engine skips here
    return make_tiny_model(tmp_path_factory.mktemp("stages-tiny-llama"), "llama", seed=21)


@pytest.fixture
def make_backend(stage_model: Path) -> Iterator[MakeBackend]:
    started: list[StageBackend] = []

    def make(**options: object) -> StageBackend:
        backend = start_backend(stage_model, **options)
        started.append(backend)
        return backend

    yield make
    for backend in started:
        backend.close()
        assert_cleaned_up(backend)


@pytest.fixture(scope="module")
def shared_backend(stage_model: Path) -> Iterator[StageBackend]:
    """One async StageBackend for the tests that leave it healthy (they use distinct request ids)."""
    backend = start_backend(stage_model)
    yield backend
    backend.close()
    assert_cleaned_up(backend)
