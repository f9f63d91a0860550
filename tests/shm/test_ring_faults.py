"""Dead peers and dead instances: a ring end whose peer dies gets PeerDied within a second instead
of hanging, and the shared-memory names of a killed instance are swept (this user's only, and
only those of one dead creator when asked)."""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import shm_procs

from shm.naming import check_instance_id, instance_of, list_entries, pid_alive, sweep_stale, unlink_instance
from shm.ring import RingTimeout, RingWriter
from shm.ring_reader import RingReader
from shm.segment import PeerDied, RingSegment

PEER_DIED_WITHIN_S = 1.0


def wait_until_attached(name: str, timeout_s: float = 20.0) -> None:
    """A ring's names leave /dev/shm once every end has attached."""
    deadline = time.monotonic() + timeout_s
    while name.lstrip("/") in list_entries():
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} was not attached within {timeout_s} s")
        time.sleep(0.01)


@pytest.mark.timeout(30)
def test_reader_gets_peer_died_within_a_second_of_the_writer_being_killed(instance: str, start_child) -> None:
    segment = RingSegment.create(instance, "wkill", 4096)
    reader = RingReader(segment)
    producer = start_child(shm_procs.produce_forever, segment.name)
    expected = 0
    for _ in range(20_000):  # mid-stream: the producer is busy writing
        record = reader.read(10.0)
        assert int.from_bytes(record.payload, "little") == expected
        expected += 1
    producer.kill()  # not reaped yet: a zombie until join()
    killed_at = time.monotonic()
    with pytest.raises(PeerDied, match=f"writer \\(pid {producer.pid}\\) died"):
        while True:  # what it published before dying still arrives, in order
            record = reader.read(5.0)
            assert record is not None and int.from_bytes(record.payload, "little") == expected
            expected += 1
    assert time.monotonic() - killed_at < PEER_DIED_WITHIN_S
    reader.close()


def fill(writer: RingWriter) -> None:
    try:
        while True:
            writer.write(0, bytes(56), timeout=0.2)
    except RingTimeout:
        pass


@pytest.mark.timeout(30)
def test_writer_on_a_full_ring_gets_peer_died_within_a_second_of_the_reader_being_killed(
        instance: str, start_child) -> None:
    segment = RingSegment.create(instance, "rkill", 4096)
    writer = RingWriter(segment)
    consumer = start_child(shm_procs.read_some_then_hang, segment.name, 0, 10)
    wait_until_attached(segment.name)
    fill(writer)
    consumer.kill()
    killed_at = time.monotonic()
    with pytest.raises(PeerDied, match=f"reader 0 \\(pid {consumer.pid}\\) died"):
        writer.write(0, bytes(56), timeout=5.0)
    assert time.monotonic() - killed_at < PEER_DIED_WITHIN_S
    writer.close()


@pytest.mark.timeout(30)
def test_broadcast_writer_names_the_dead_reader(instance: str, start_child) -> None:
    segment = RingSegment.create(instance, "bkill", 4096, num_readers=3)
    writer = RingWriter(segment)
    live = [RingReader.attach(segment.name, 0), RingReader.attach(segment.name, 2)]
    consumer = start_child(shm_procs.read_some_then_hang, segment.name, 1, 0)
    wait_until_attached(segment.name)
    fill(writer)
    for reader in live:  # the live readers keep up; only the dead one holds the writer back
        while reader.try_read() is not None:
            pass
    consumer.kill()
    with pytest.raises(PeerDied, match="reader 1 "):
        writer.write(0, bytes(56), timeout=5.0)
    writer.close()
    for reader in live:
        reader.close()


@pytest.mark.timeout(30)
def test_a_writer_that_never_attaches_is_dead_once_its_creator_is(instance: str, start_child) -> None:
    creator = start_child(shm_procs.create_rings_then_hang, "orphan")
    deadline = time.monotonic() + 20
    name = f"/pipeline-{creator.pid}_"
    while not any(entry.startswith(name[1:]) and entry.endswith("-orphan") for entry in list_entries()):
        assert time.monotonic() < deadline, "the child never created its ring"
        time.sleep(0.01)
    ring = next(entry for entry in list_entries() if entry.startswith(name[1:]) and entry.endswith("-orphan"))
    reader = RingReader.attach("/" + ring)
    creator.kill()
    creator.join()
    with pytest.raises(PeerDied, match="never attached"):
        reader.read(5.0)
    reader.close()
    sweep_stale()


@pytest.mark.timeout(30)
def test_sweep_removes_a_killed_instance_and_keeps_live_ones(instance: str, start_child) -> None:
    live = RingSegment.create(instance, "live", 4096)
    creator = start_child(shm_procs.create_rings_then_hang, "stale")
    prefix = f"pipeline-{creator.pid}_"
    deadline = time.monotonic() + 20
    # Two rings: 1 reader (segment + 2 doorbells) and 2 readers (segment + 3 doorbells).
    while len([e for e in list_entries() if prefix in e]) < 7:
        assert time.monotonic() < deadline, "the child never created its rings"
        time.sleep(0.01)
    stale = sorted(e for e in list_entries() if prefix in e)
    assert len([e for e in stale if e.startswith("sem.")]) == 5
    assert sweep_stale() == []  # its creator still lives: nothing is stale
    creator.kill()
    creator.join()
    assert sorted(set(sweep_stale()) & set(stale)) == stale
    remaining = list_entries()
    assert not remaining & set(stale)
    assert live.name.lstrip("/") in remaining
    live.close()


@pytest.mark.timeout(30)
def test_a_killed_unreaped_child_counts_as_dead() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert pid_alive(child.pid)
        child.kill()
        deadline = time.monotonic() + 10
        while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(child.pid, 0)  # the zombie still answers signal 0...
        assert not pid_alive(child.pid)  # ...but counts as dead
    finally:
        child.kill()
        child.wait()
    assert not pid_alive(child.pid)


@pytest.fixture
def dead_instances() -> Iterator[list[str]]:
    """Two instances of two dead creators (pids above pid_max, which no process has), each with a
    ring (a segment and two doorbells)."""
    with open("/proc/sys/kernel/pid_max") as pid_max:
        first = int(pid_max.read()) + 1
    instances = [f"{pid}_{secrets.token_hex(3)}" for pid in (first, first + 1)]
    segments = [RingSegment.create(instance, "left", 4096) for instance in instances]
    for segment in segments:
        segment.close()
    yield instances
    for instance in instances:
        unlink_instance(instance)


@pytest.mark.timeout(10)
def test_a_sweep_of_one_dead_creator_removes_its_instances_only(dead_instances: list[str], instance: str) -> None:
    mine, other = dead_instances
    live = RingSegment.create(instance, "live", 4096)
    try:
        removed = sweep_stale(creator_pid=check_instance_id(mine))
        assert len(removed) == 3 and {instance_of(e) for e in removed} == {mine}
        remaining = {instance_of(e) for e in list_entries()}
        assert mine not in remaining and {other, instance} <= remaining
        assert sweep_stale(creator_pid=os.getpid()) == []  # alive: never touched
    finally:
        live.close()


@pytest.mark.timeout(10)
def test_a_sweep_leaves_the_entries_of_other_users_alone(dead_instances: list[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    someone_else = os.geteuid() + 1
    monkeypatch.setattr(os, "geteuid", lambda: someone_else)  # a sweep by another user
    swept_by_someone_else = sweep_stale()
    monkeypatch.undo()
    assert not {instance_of(e) for e in swept_by_someone_else} & set(dead_instances)
    assert {instance_of(e) for e in sweep_stale()} >= set(dead_instances)  # their owner's sweep removes them
