"""Socket location and the private socket directory."""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from pipeline.errors import UnsafeSocketDirectory
from pipeline.paths import default_socket_path, ensure_socket_dir

pytestmark = pytest.mark.timeout(10)


def test_default_socket_path_prefers_xdg_runtime_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_socket_path() == tmp_path / "pipeline" / "pipeline.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "")
    assert default_socket_path() == Path(tempfile.gettempdir()) / f"pipeline-{os.getuid()}" / "pipeline.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_socket_path().parent.name == f"pipeline-{os.getuid()}"


def test_socket_dir_is_created_private_whatever_the_umask(tmp_path: Path) -> None:
    old_umask = os.umask(0)
    try:
        directory = ensure_socket_dir(tmp_path / "run" / "pipeline.sock")
    finally:
        os.umask(old_umask)
    assert directory == tmp_path / "run"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert ensure_socket_dir(tmp_path / "run" / "pipeline.sock") == directory  # existing and fine


@pytest.mark.parametrize("mode", [0o755, 0o710, 0o701, 0o777])
def test_socket_dir_with_wider_permissions_is_refused(tmp_path: Path, mode: int) -> None:
    directory = tmp_path / "run"
    directory.mkdir()
    directory.chmod(mode)
    with pytest.raises(UnsafeSocketDirectory, match=f"{directory}.*mode {mode:04o}"):
        ensure_socket_dir(directory / "pipeline.sock")


def test_socket_dir_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "run").symlink_to(target)
    with pytest.raises(UnsafeSocketDirectory, match="not a directory"):
        ensure_socket_dir(tmp_path / "run" / "pipeline.sock")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory owned by another user")
def test_socket_dir_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)
    with pytest.raises(UnsafeSocketDirectory, match="owned by uid 65534"):
        ensure_socket_dir(directory / "pipeline.sock")
