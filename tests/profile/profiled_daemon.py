"""The profiler tests' live daemon (real stages, two tokenizer workers), one per module; conftest
registers the fixture. It puts tests/daemon on the path for `live_daemon`."""
from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "daemon"))

from live_daemon import LiveDaemon, short_dir, start_daemon  # noqa: E402

from pipeline.models.tiny_model import make_tiny_model  # noqa: E402

NUM_TOKENIZERS = 2


@pytest.fixture(scope="module")
def profiled_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveDaemon]:
    model = make_tiny_model(tmp_path_factory.mktemp("profile-tiny-llama"), "llama", seed=5)
    directory = short_dir()
    daemon = start_daemon(model, directory, ["--num-tokenizers", str(NUM_TOKENIZERS)])
    try:
        yield daemon
    finally:
        daemon.stop()
        shutil.rmtree(directory.parent, ignore_errors=True)
