"""A reader with a named-pipe doorbell waits for records in an event loop: its descriptor turns
readable when the writer (another process) rings it, no ring is lost when every wait sleeps,
and the pipe's name is swept with the rest of a dead instance."""
from __future__ import annotations

import asyncio
import os
import stat

import pytest
import shm_procs

from shm.doorbell import FifoDoorbell
from shm.naming import SHM_DIR, instance_of, ring_name
from shm.ring import RingClosed, RingWriter
from shm.ring_reader import RingReader
from shm.segment import RingSegment

pytestmark = pytest.mark.timeout(60)


def test_a_fifo_bell_is_readable_once_rung_until_drained(instance: str) -> None:
    bell = FifoDoorbell(ring_name(instance, "bell"), create=True)
    peer = FifoDoorbell(bell.name, create=False)
    try:
        assert stat.S_ISFIFO(os.stat(bell.path).st_mode) and stat.S_IMODE(os.stat(bell.path).st_mode) == 0o600
        assert instance_of(os.path.basename(bell.path)) == instance  # swept with the instance's names
        assert not bell.wait(0.01)
        for _ in range(100_000):  # more rings than the pipe holds: the extra ones are dropped, not blocked on
            peer.ring()
        assert bell.wait(0.0)  # rung; the wait took every ring
        assert not bell.wait(0.01)
    finally:
        bell.unlink()
        peer.unlink()  # the second unlink finds nothing, and says nothing
        bell.close()
        peer.close()
    assert not os.path.exists(os.path.join(SHM_DIR, bell.name.lstrip("/")))


def test_only_the_named_readers_get_a_descriptor(instance: str) -> None:
    segment = RingSegment.create(instance, "mixed", 4096, num_readers=2, fifo_readers=[1])
    reader0, reader1 = RingReader(segment, 0), RingReader(RingSegment.open(segment.name), 1)
    try:
        assert reader1.fileno() >= 0
        with pytest.raises(ValueError, match="reader 0's doorbell is a semaphore"):
            reader0.fileno()
    finally:
        reader0.close()
        reader1.close()
    with pytest.raises(ValueError, match=r"fifo_readers must be reader indexes in \[0, 1\), got \[1\]"):
        RingSegment.create(instance, "bad", 4096, fifo_readers=[1])


async def read_in_loop(reader: RingReader, num_records: int) -> list[int]:
    """Every record's first 4 bytes, read by arming the reader and waiting on its descriptor."""
    loop = asyncio.get_running_loop()
    got: list[int] = []
    done = loop.create_future()

    def on_readable() -> None:
        reader.woken()
        try:
            while (record := reader.try_read()) is not None:
                got.append(int.from_bytes(record.payload[:4], "little"))
        except RingClosed:
            done.set_result(None) if not done.done() else None
            return
        if len(got) >= num_records:
            done.set_result(None) if not done.done() else None
        elif not reader.arm():
            loop.call_soon(on_readable)

    loop.add_reader(reader.fileno(), on_readable)
    try:
        if not reader.arm():
            on_readable()
        await asyncio.wait_for(done, 50)
    finally:
        loop.remove_reader(reader.fileno())
    return got


def test_a_reader_in_an_event_loop_gets_every_record_of_a_writer_that_always_sleeps(instance: str,
                                                                                      start_child) -> None:
    """The child writes with no spinning into a ring that fills, so both sides sleep all the time;
    one lost ring would stall the loop (there is no timeout on the descriptor)."""
    num_records = 20_000
    segment = RingSegment.create(instance, "loop", 256, fifo_readers=[0])
    reader = RingReader(segment)
    child = start_child(shm_procs.write_numbers, segment.name, num_records)
    try:
        got = asyncio.run(read_in_loop(reader, num_records))
    finally:
        reader.close()
    child.join(10)
    assert child.exitcode == 0
    assert got == list(range(num_records))
