"""Names, permissions and attachment: what a daemon and its stages see in /dev/shm."""
from __future__ import annotations

import os
import stat
import time

import pytest

from shm.naming import list_entries, new_instance_id, ring_name, unlink_instance
from shm.ring import RingWriter
from shm.ring_reader import RingReader
from shm.segment import RingSegment


def entries_of(name: str) -> set[str]:
    base = name.lstrip("/")
    return {e for e in list_entries() if e == base or e.startswith(f"sem.{base}.")}


@pytest.mark.timeout(10)
def test_names_are_private_and_disappear_once_every_end_attached(instance: str) -> None:
    segment = RingSegment.create(instance, "tok0-sched", 4096, num_readers=2)
    names = entries_of(segment.name)
    base = segment.name.lstrip("/")
    assert names == {base, f"sem.{base}.space", f"sem.{base}.data0", f"sem.{base}.data1"}
    for entry in names:
        assert stat.S_IMODE(os.stat(f"/dev/shm/{entry}").st_mode) == 0o600
    writer = RingWriter.attach(segment.name)
    reader0 = RingReader.attach(segment.name, 0)
    assert entries_of(segment.name) == names  # reader 1 still has to find it
    reader1 = RingReader.attach(segment.name, 1)
    assert entries_of(segment.name) == set()
    writer.write(3, b"still works after unlink")
    for reader in (reader0, reader1):
        record = reader.read(1.0)
        assert (record.kind, bytes(record.payload)) == (3, b"still works after unlink")
    for end in (writer, reader0, reader1):
        end.close()
    segment.close()


@pytest.mark.timeout(10)
def test_attaching_a_taken_end_or_a_missing_ring_fails_clearly(instance: str) -> None:
    segment = RingSegment.create(instance, "taken", 4096, num_readers=2)
    writer = RingWriter(segment)
    with pytest.raises(RuntimeError, match=f"already has a writer \\(pid {os.getpid()}\\)"):
        RingWriter.attach(segment.name)
    with pytest.raises(ValueError, match="reader index must be in \\[0, 2\\).* got 2"):
        RingReader.attach(segment.name, 2)
    with pytest.raises(FileNotFoundError, match="no ring segment"):
        RingReader.attach(ring_name(instance, "never-made"))
    with pytest.raises(FileExistsError):
        RingSegment.create(instance, "taken", 4096)
    writer.close()


@pytest.mark.timeout(10)
def test_names_are_validated_and_two_instances_never_collide() -> None:
    first, second = new_instance_id(), new_instance_id()
    assert first != second and first.startswith(f"{os.getpid()}_")
    assert ring_name(first, "sched-runner") == f"/pipeline-{first}-sched-runner"
    with pytest.raises(ValueError, match="link name .* got 'a/b'"):
        ring_name(first, "a/b")
    with pytest.raises(ValueError, match="instance id .* got 'daemon'"):
        ring_name("daemon", "x")


@pytest.mark.timeout(10)
def test_rings_refuse_to_run_without_x86_64_ordering(instance: str, monkeypatch) -> None:
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    with pytest.raises(RuntimeError, match="'aarch64'.*memory barrier"):
        RingSegment.create(instance, "arm", 4096)
    assert list_entries() & {ring_name(instance, "arm").lstrip("/")} == set()


@pytest.mark.timeout(10)
def test_an_idle_reader_sleeps_without_burning_cpu(instance: str) -> None:
    writer = RingWriter(RingSegment.create(instance, "idle", 4096))
    reader = RingReader.attach(writer.name)
    cpu_before, wall_before = time.process_time(), time.monotonic()
    assert reader.read(timeout=0.5) is None
    cpu_s, wall_s = time.process_time() - cpu_before, time.monotonic() - wall_before
    assert 0.5 <= wall_s < 1.5
    assert cpu_s < 0.05, f"an idle 0.5 s wait used {cpu_s * 1000:.0f} ms of CPU"
    writer.close()
    reader.close()


@pytest.mark.timeout(10)
def test_unlink_instance_removes_only_that_instance(instance: str) -> None:
    other = new_instance_id()
    mine = RingSegment.create(instance, "a", 4096)
    theirs = RingSegment.create(other, "a", 4096)
    mine_names, theirs_names = entries_of(mine.name), entries_of(theirs.name)
    assert len(mine_names) == len(theirs_names) == 3  # segment, space and data doorbells
    assert unlink_instance(instance) == sorted(mine_names)
    assert entries_of(mine.name) == set() and entries_of(theirs.name) == theirs_names
    assert unlink_instance(other) == sorted(theirs_names)
    mine.close()
    theirs.close()
