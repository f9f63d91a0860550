"""Fixtures: a FakeDaemon (test double) listening on a socket in a fresh private directory."""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_daemon import FakeDaemon


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # Not tmp_path: a Unix socket path must fit in 108 bytes, and tmp_path embeds the test name.
    directory = Path(tempfile.mkdtemp(prefix="pl-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def daemon(socket_dir: Path) -> Iterator[FakeDaemon]:
    fake = FakeDaemon(socket_dir / "pipeline.sock").start()
    yield fake
    fake.shutdown()
