"""Shared-memory names of one daemon instance, peer liveness, and sweeping what dead instances left.

Every segment is `/pipeline-<instance>-<link>` and its doorbells are `<segment name>.<suffix>`
(they appear in /dev/shm as `pipeline-...` and `sem.pipeline-...`; a named-pipe doorbell as
`pipeline-...` too, removed as a segment's name is). The instance id starts with
the creator's pid, so the names of a dead instance can be swept even when the segment that
would have told its creator's pid is already gone.
"""
from __future__ import annotations

import os
import re
import secrets

import posix_ipc

PREFIX = "pipeline-"
SHM_DIR = "/dev/shm"
_SEM_FILE_PREFIX = "sem."
_INSTANCE_RE = re.compile(r"^([1-9][0-9]*)_([0-9a-f]{1,16})$")
_LINK_RE = re.compile(r"^[A-Za-z0-9_]+(-[A-Za-z0-9_]+)*$")
MAX_LINK_CHARS = 64


def new_instance_id() -> str:
    """A fresh instance id `<pid>_<6 hex>`: the pid for sweeping, the hex so two daemons that
    reuse a pid (or one daemon started twice) never share a name."""
    return f"{os.getpid()}_{secrets.token_hex(3)}"


def check_instance_id(instance: str) -> int:
    """Return the creator pid encoded in `instance`; raise ValueError naming a malformed id."""
    match = _INSTANCE_RE.match(instance) if isinstance(instance, str) else None
    if match is None:
        raise ValueError(f"instance id must look like '<pid>_<hex>' (see new_instance_id), got {instance!r}")
    return int(match.group(1))


def ring_name(instance: str, link: str) -> str:
    """The POSIX name `/pipeline-<instance>-<link>` of one link of one instance."""
    check_instance_id(instance)
    if not isinstance(link, str) or len(link) > MAX_LINK_CHARS or not _LINK_RE.match(link):
        raise ValueError(
            f"link name must be 1-{MAX_LINK_CHARS} characters of [A-Za-z0-9_] joined by single '-', got {link!r}"
        )
    return f"/{PREFIX}{instance}-{link}"


def instance_of(entry: str) -> str | None:
    """The instance id of a /dev/shm entry name (segment or `sem.` doorbell), or None if the
    entry is not one of the project's."""
    if entry.startswith(_SEM_FILE_PREFIX):
        entry = entry[len(_SEM_FILE_PREFIX):]
    if not entry.startswith(PREFIX):
        return None
    instance = entry[len(PREFIX):].split("-", 1)[0]
    return instance if _INSTANCE_RE.match(instance) else None


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs. A zombie (killed, not yet reaped) counts as dead: it will never write
    again, and its parent may not reap it before our peer check matters."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            stat = stat_file.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True  # no /proc to look in: trust os.kill
    # The command name (field 2) may hold spaces and parentheses; the state follows the last ')'.
    state = stat[stat.rfind(b")") + 2: stat.rfind(b")") + 3]
    return state not in (b"Z", b"X", b"x")


def list_entries(shm_dir: str = SHM_DIR) -> set[str]:
    """Names of the project's entries (segments and `sem.` doorbells) present in `shm_dir`."""
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return set()
    return {name for name in names if instance_of(name) is not None}


def _unlink_entry(entry: str) -> bool:
    try:
        if entry.startswith(_SEM_FILE_PREFIX):
            posix_ipc.unlink_semaphore("/" + entry[len(_SEM_FILE_PREFIX):])
        else:
            posix_ipc.unlink_shared_memory("/" + entry)
    except posix_ipc.ExistentialError:
        return False  # someone else unlinked it first
    except posix_ipc.PermissionsError:
        return False  # not ours to remove
    return True


def _owned_by_me(entry: str, shm_dir: str) -> bool:
    try:
        return os.stat(os.path.join(shm_dir, entry)).st_uid == os.geteuid()
    except FileNotFoundError:
        return False  # someone else unlinked it first


def unlink_instance(instance: str, shm_dir: str = SHM_DIR) -> list[str]:
    """Remove every entry of `instance`, live or not (a daemon's shutdown, a test's cleanup).
    Returns the entry names removed."""
    check_instance_id(instance)
    return sorted(e for e in list_entries(shm_dir) if instance_of(e) == instance and _unlink_entry(e))


def sweep_stale(shm_dir: str = SHM_DIR, creator_pid: int | None = None) -> list[str]:
    """Remove this user's entries of every instance whose creator process is dead (or a zombie),
    or only of the instances `creator_pid` created. Returns the entry names removed. Live
    instances, this one's included, and other users' entries are left alone."""
    removed = []
    alive: dict[str, bool] = {}
    for entry in sorted(list_entries(shm_dir)):
        instance = instance_of(entry)
        pid = check_instance_id(instance)
        if creator_pid is not None and pid != creator_pid:
            continue
        if instance not in alive:
            alive[instance] = pid_alive(pid)
        if not alive[instance] and _owned_by_me(entry, shm_dir) and _unlink_entry(entry):
            removed.append(entry)
    return removed
