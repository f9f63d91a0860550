"""One-process properties of the ring: what is written is read back, in order, whatever the
record sizes and wherever the data area wraps; a full ring refuses rather than overwrites."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shm.ring import RecordTooLarge, RingClosed, RingTimeout, RingWriter
from shm.ring_reader import RingReader
from shm.segment import RingSegment


def open_pair(instance: str, link: str, capacity_bytes: int) -> tuple[RingWriter, RingReader]:
    writer = RingWriter(RingSegment.create(instance, link, capacity_bytes))
    return writer, RingReader.attach(writer.name)


def record_bytes(num_bytes: int) -> int:
    return 8 + (num_bytes + 7) // 8 * 8


@dataclass
class Model:
    """Byte accounting of a ring, written from the format's definition."""

    capacity_bytes: int
    w: int = 0
    r: int = 0  # released read cursor: what the writer may reuse
    held: int = 0  # size of the record handed out and not yet released

    def __post_init__(self) -> None:
        self.queue: deque[tuple[str, int, bytes]] = deque()  # ("skip" | "record", size, payload)

    def write(self, payload_bytes: int, payload: bytes) -> str:
        need = record_bytes(payload_bytes)
        if need > self.capacity_bytes:
            return "too_large"
        tail = self.capacity_bytes - self.w % self.capacity_bytes
        if need > tail:
            if self.w + tail - self.r > self.capacity_bytes:
                return "full"
            self.queue.append(("skip", tail, b""))
            self.w += tail
        if self.w + need - self.r > self.capacity_bytes:
            return "full"
        self.queue.append(("record", need, payload))
        self.w += need
        return "ok"

    def release(self) -> None:
        self.r += self.held
        self.held = 0

    def read(self) -> bytes | None:
        self.release()
        while self.queue and self.queue[0][0] == "skip":
            self.r += self.queue.popleft()[1]
        if not self.queue:
            return None
        _, size, payload = self.queue.popleft()
        self.held = size
        return payload


def write_as(writer: RingWriter, style: int, kind: int, payload: bytes) -> None:
    """Write one record through one of the writer's input styles (timeout 0: never wait)."""
    if style == 0:
        writer.write(kind, payload, timeout=0)
    elif style == 1:  # several parts of several buffer types, joined by the ring
        third = len(payload) // 3
        writer.write(kind, memoryview(payload)[:third], np.frombuffer(payload[third:2 * third], np.uint8),
                     bytearray(payload[2 * third:]), timeout=0)
    else:
        view = writer.reserve(kind, len(payload), timeout=0)
        view[:] = payload
        writer.commit()


operations = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.binary(max_size=300), st.integers(0, 2)),
        st.tuples(st.just("read")),
        st.tuples(st.just("release")),
    ),
    max_size=80,
)


@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(capacity_bytes=st.sampled_from([64, 72, 128, 248, 512]), ops=operations)
def test_interleaved_writes_and_reads_match_the_byte_model(instance: str, capacity_bytes: int, ops: list) -> None:
    model = Model(capacity_bytes)
    link = f"prop{len(ops)}x{capacity_bytes}"
    writer, reader = open_pair(instance, link, capacity_bytes)
    try:
        kind = 0
        for op in ops:
            if op[0] == "write":
                _, payload, style = op
                expected = model.write(len(payload), payload)
                try:
                    write_as(writer, style, kind, payload)
                    outcome = "ok"
                except RecordTooLarge:
                    outcome = "too_large"
                except RingTimeout:
                    outcome = "full"
                assert outcome == expected, f"write of {len(payload)} bytes"
                kind += outcome == "ok"
            elif op[0] == "read":
                expected_payload = model.read()
                record = reader.try_read()
                if expected_payload is None:
                    assert record is None
                else:
                    assert record is not None and bytes(record.payload) == expected_payload
            else:
                model.release()
                reader.release()
        # Everything accepted is still there, in order, and nothing else.
        while (payload := model.read()) is not None:
            record = reader.try_read()
            assert record is not None and bytes(record.payload) == payload
        assert reader.try_read() is None
    finally:
        writer.close()
        reader.close()


@pytest.mark.timeout(30)
def test_records_cross_the_end_of_the_data_area_at_every_offset(instance: str) -> None:
    capacity_bytes = 256
    max_payload = capacity_bytes - 8
    for start in range(0, capacity_bytes, 8):
        writer, reader = open_pair(instance, f"wrap{start}", capacity_bytes)
        if start:  # move both cursors to `start` with one filler record
            writer.write(0, bytes(start - 8))
            reader.read(0)
            reader.release()
        tail = capacity_bytes - start
        for size in sorted({0, 1, tail - 8, tail - 7, tail, tail + 1, max_payload}):
            if not 0 <= size <= max_payload:
                continue
            payload = bytes((start + size + i) % 251 for i in range(size))
            try:
                writer.write(size, payload, timeout=0)
            except RingTimeout:
                # Fits only once the reader has skipped the tail: the writer published the skip
                # marker, the reader passes it, and the write then lands at offset 0.
                assert reader.try_read() is None
                writer.write(size, payload, timeout=0)
            record = reader.read(0)
            assert (record.kind, bytes(record.payload)) == (size, payload), (start, size)
            reader.release()
            assert reader.try_read() is None
        writer.close()
        reader.close()


@pytest.mark.timeout(10)
def test_oversized_record_is_rejected_at_the_writer_and_the_ring_stays_usable(instance: str) -> None:
    writer, reader = open_pair(instance, "big", 128)
    with pytest.raises(RecordTooLarge, match="at most 120 bytes"):
        writer.write(1, bytes(121))
    with pytest.raises(RecordTooLarge):
        writer.write(1, bytes(60), bytes(61))  # too large only once its parts are joined
    with pytest.raises(RecordTooLarge):
        writer.reserve(1, 200)
    writer.write(2, bytes(range(120)))  # the largest record fits exactly
    assert bytes(reader.read(0).payload) == bytes(range(120))
    writer.close()
    reader.close()


@pytest.mark.timeout(10)
def test_full_ring_blocks_for_the_timeout_then_raises_and_never_overwrites(instance: str) -> None:
    writer, reader = open_pair(instance, "full", 64)
    for i in range(4):
        writer.write(i, bytes([i]) * 8)  # 16 bytes each: exactly full
    with pytest.raises(RingTimeout):
        writer.write(9, bytes(8), timeout=0.05)
    assert [bytes(reader.read(0).payload) for _ in range(4)] == [bytes([i]) * 8 for i in range(4)]
    reader.release()
    writer.write(9, b"after")  # room again once read
    assert bytes(reader.read(0).payload) == b"after"
    writer.close()
    reader.close()


@pytest.mark.timeout(10)
def test_bad_arguments_are_refused_with_the_bad_value_named(instance: str) -> None:
    writer, reader = open_pair(instance, "args", 256)
    with pytest.raises(ValueError, match="kind must be in .* got -1"):
        writer.write(-1, b"x")
    with pytest.raises(ValueError, match="got 4294967296"):
        writer.write(1 << 32, b"x", b"y")
    with pytest.raises(ValueError, match="num_bytes"):
        writer.reserve(1, -5)
    writer.reserve(1, 4)
    with pytest.raises(RuntimeError, match="commit"):
        writer.write(1, b"x")
    writer.abort()
    with pytest.raises(RuntimeError, match="without reserve"):
        writer.commit()
    assert reader.try_read() is None  # the aborted record never appeared
    with pytest.raises(ValueError, match="capacity_bytes .* got 100"):
        RingSegment.create(instance, "odd", 100)
    with pytest.raises(ValueError, match="num_readers .* got 0"):
        RingSegment.create(instance, "none", 1024, num_readers=0)
    writer.close()
    reader.close()


@pytest.mark.timeout(10)
def test_reader_drains_then_sees_the_writer_close(instance: str) -> None:
    writer, reader = open_pair(instance, "close", 256)
    writer.write(1, b"last words")
    writer.close()
    assert bytes(reader.read(1.0).payload) == b"last words"
    with pytest.raises(RingClosed):
        reader.read(1.0)
    reader.close()


@pytest.mark.timeout(10)
def test_writer_sees_every_reader_close(instance: str) -> None:
    writer, reader = open_pair(instance, "rclose", 64)
    for _ in range(4):
        writer.write(0, bytes(8))
    reader.close()
    with pytest.raises(RingClosed):
        writer.write(0, bytes(8), timeout=1.0)
    writer.close()
