"""Two or more processes: long streams arrive complete, uncorrupted and in order, through small
rings that wrap and fill all the time; and no doorbell is ever lost."""
from __future__ import annotations

import threading
import time

import pytest
import shm_procs

import shm.fence
import shm.ring
import shm.ring_reader
from shm.ring import RingWriter
from shm.ring_reader import RingReader
from shm.segment import RingSegment

NUM_RECORDS = 1_000_000
NUM_BROADCAST_RECORDS = 300_000  # 4 processes share 2 cores: a third of the SPSC count keeps it ~2 s


@pytest.mark.timeout(60)
def test_million_records_cross_processes_complete_and_in_order(instance: str, start_child) -> None:
    segment = RingSegment.create(instance, "stress", 4096)  # ~100 records: wraps and fills constantly
    check = shm_procs.StreamCheck(NUM_RECORDS, seed=7)
    producer = start_child(shm_procs.produce, segment.name, NUM_RECORDS, 7)
    with RingReader(segment) as reader:
        check.collect(reader)
        with pytest.raises(shm.ring.RingClosed):
            reader.read(10.0)
    producer.join(10)
    assert producer.exitcode == 0
    check.verify()


@pytest.mark.timeout(60)
def test_broadcast_delivers_the_whole_stream_to_each_of_three_readers(instance: str, start_child) -> None:
    segment = RingSegment.create(instance, "bcast", 1 << 16, num_readers=3)
    readers = [start_child(shm_procs.consume, segment.name, index, NUM_BROADCAST_RECORDS, 11) for index in range(3)]
    with RingWriter(segment) as writer:
        shm_procs.write_stream(writer, NUM_BROADCAST_RECORDS, 11)
    for child in readers:
        child.join(30)
    assert [child.exitcode for child in readers] == [0, 0, 0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("barrier", ["membarrier", "locked_instruction"])
def test_no_doorbell_is_lost_when_every_wait_sleeps(instance: str, start_child, monkeypatch, barrier: str) -> None:
    """With spinning off, every empty or full wait sleeps and needs the peer's doorbell; the
    bounded sleep is raised to 20 s, so one lost doorbell would stall the stream visibly.
    Both barrier strategies of shm/fence.py are exercised, in both processes."""
    if barrier == "membarrier":
        monkeypatch.setenv("PIPELINE_SHM_MEMBARRIER", "1")  # read by the child at import
        membarrier = shm.fence._load_membarrier()
        if membarrier is None:
            pytest.skip("membarrier(GLOBAL_EXPEDITED) is not available here")
        monkeypatch.setattr(shm.fence, "_membarrier", membarrier)
        monkeypatch.setattr(shm.ring, "PUBLISH_NEEDS_FENCE", False)
        monkeypatch.setattr(shm.ring_reader, "PUBLISH_NEEDS_FENCE", False)
        shm.fence.register_process()
    else:
        monkeypatch.delenv("PIPELINE_SHM_MEMBARRIER", raising=False)
        monkeypatch.setattr(shm.fence, "_membarrier", None)
        monkeypatch.setattr(shm.ring, "PUBLISH_NEEDS_FENCE", True)
        monkeypatch.setattr(shm.ring_reader, "PUBLISH_NEEDS_FENCE", True)
    monkeypatch.setattr(shm.ring, "WAKE_S", 20.0)
    num_records = 5_000
    to_child = RingSegment.create(instance, "lw-out", 256)
    from_child = RingSegment.create(instance, "lw-in", 256)
    child = start_child(shm_procs.echo_sleeping, to_child.name, from_child.name, num_records, 20.0)
    writer = RingWriter(to_child, spin_s=0.0)
    reader = RingReader(from_child, spin_s=0.0)

    def feed() -> None:
        for i in range(num_records):
            writer.write(i, i.to_bytes(4, "little") * 5, timeout=None)

    feeder = threading.Thread(target=feed)
    feeder.start()
    kinds = []
    longest_gap_s = 0.0
    last = time.monotonic()
    for _ in range(num_records):
        record = reader.read(timeout=30.0)
        assert record is not None
        assert bytes(record.payload) == record.kind.to_bytes(4, "little") * 5
        kinds.append(record.kind)
        now = time.monotonic()
        longest_gap_s, last = max(longest_gap_s, now - last), now
    feeder.join()
    assert kinds == list(range(num_records))
    assert longest_gap_s < 10.0, f"the stream stalled for {longest_gap_s:.1f} s: a doorbell was lost"
    child.join(10)
    assert child.exitcode == 0
    writer.close()
    reader.close()
