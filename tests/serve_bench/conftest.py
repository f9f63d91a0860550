"""Fixtures: a PacedDaemon on a socket in a fresh private directory."""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from paced_daemon import PacedDaemon


@pytest.fixture
def daemon() -> Iterator[PacedDaemon]:
    # Not tmp_path: a Unix socket path must fit in 108 bytes, and tmp_path embeds the test name.
    directory = Path(tempfile.mkdtemp(prefix="pl-bench-"))
    fake = PacedDaemon(directory / "pipeline.sock").start()
    yield fake
    fake.shutdown()
    shutil.rmtree(directory, ignore_errors=True)
