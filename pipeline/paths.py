"""Where the daemon's Unix socket lives, and making its directory private to the user."""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from pipeline.errors import UnsafeSocketDirectory

SOCKET_NAME = "pipeline.sock"
SOCKET_DIR_MODE = 0o700


def default_socket_path() -> Path:
    """`$XDG_RUNTIME_DIR/pipeline/pipeline.sock`, else `<tempdir>/pipeline-<uid>/pipeline.sock`."""
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir:
        return Path(runtime_dir) / "pipeline" / SOCKET_NAME
    return Path(tempfile.gettempdir()) / f"pipeline-{os.getuid()}" / SOCKET_NAME


def ensure_socket_dir(socket_path: Path | str) -> Path:
    """Creates the socket's directory with mode 0700, or checks the one already there.

    Anyone who can write the directory can swap the socket for their own, and in a shared temp
    directory another user may have made it first: so an existing directory must be a real
    directory (not a symlink), owned by us, with no group or other permissions.
    Returns the directory.
    """
    directory = Path(socket_path).parent
    try:
        os.mkdir(directory, SOCKET_DIR_MODE)
        os.chmod(directory, SOCKET_DIR_MODE)  # mkdir's mode is narrowed by the umask, never widened
    except FileExistsError:
        pass
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeSocketDirectory(f"socket directory {directory} is not a directory (a symlink or a file)")
    if info.st_uid != os.getuid():
        raise UnsafeSocketDirectory(
            f"socket directory {directory} is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise UnsafeSocketDirectory(
            f"socket directory {directory} has mode {mode:04o}; it must allow only its owner (0700): "
            f"run `chmod 700 {directory}`"
        )
    return directory
