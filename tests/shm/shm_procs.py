"""Child-process bodies for the ring tests; a module of its own so 'spawn' children can import them.

A child that finds a wrong record raises, so its exit code is non-zero and its traceback shows
in the test's captured output.
"""
from __future__ import annotations

import os
import time

import numpy as np

import shm.ring
import shm.ring_reader
from shm.naming import new_instance_id
from shm.ring import RingWriter
from shm.ring_reader import RingReader
from shm.segment import RingSegment

POOL_BYTES = 1 << 16
MAX_RECORD_BYTES = 64


def stream_plan(num_records: int, seed: int) -> tuple[bytes, np.ndarray, np.ndarray]:
    """The records both ends agree on: record i is pool[starts[i]:starts[i] + lengths[i]]."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, POOL_BYTES, dtype=np.uint8).tobytes()
    lengths = rng.integers(0, MAX_RECORD_BYTES + 1, num_records)
    starts = rng.integers(0, POOL_BYTES - MAX_RECORD_BYTES, num_records)
    return pool, starts, lengths


def expected_stream(pool: bytes, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """All payloads back to back, gathered with numpy (no per-record Python work)."""
    ends = np.cumsum(lengths)
    within = np.arange(int(ends[-1])) - np.repeat(ends - lengths, lengths)
    return np.frombuffer(pool, np.uint8)[np.repeat(starts, lengths) + within]


def write_stream(writer: RingWriter, num_records: int, seed: int) -> None:
    """Write the planned stream, record i with kind i."""
    pool, starts, lengths = stream_plan(num_records, seed)
    view = memoryview(pool)
    write = writer.write
    for i, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist())):
        write(i, view[start:start + length], timeout=10.0)


def produce(name: str, num_records: int, seed: int) -> None:
    """Write the planned stream, then close."""
    with RingWriter.attach(name) as writer:
        write_stream(writer, num_records, seed)


class StreamCheck:
    """Collects a stream as it arrives and compares it with the plan in one numpy pass."""

    def __init__(self, num_records: int, seed: int) -> None:
        self.num_records = num_records
        self.seed = seed
        self.received = bytearray(num_records * MAX_RECORD_BYTES)
        self.kinds = np.empty(num_records, np.int64)
        self.lengths = np.empty(num_records, np.int64)

    def collect(self, reader: RingReader) -> None:
        received, kinds, lengths = self.received, self.kinds, self.lengths
        offset = 0
        read = reader.read
        for i in range(self.num_records):
            record = read(10.0)
            if record is None:
                raise AssertionError(f"record {i} of {self.num_records} did not arrive within 10 s")
            size = len(record.payload)
            received[offset:offset + size] = record.payload
            kinds[i] = record.kind
            lengths[i] = size
            offset += size
        reader.release()

    def verify(self) -> None:
        pool, starts, lengths = stream_plan(self.num_records, self.seed)
        order = np.flatnonzero(self.kinds != np.arange(self.num_records))
        if order.size:
            raise AssertionError(f"record {order[0]} arrived with kind {self.kinds[order[0]]}: lost or reordered")
        bad = np.flatnonzero(self.lengths != lengths)
        if bad.size:
            raise AssertionError(f"record {bad[0]} has {self.lengths[bad[0]]} bytes, expected {lengths[bad[0]]}")
        expected = expected_stream(pool, starts, lengths)
        got = np.frombuffer(self.received, np.uint8)[:expected.size]
        diff = np.flatnonzero(got != expected)
        if diff.size:
            record = int(np.searchsorted(np.cumsum(lengths), diff[0], side="right"))
            raise AssertionError(f"payload of record {record} is corrupt (stream byte {diff[0]})")


def consume(name: str, index: int, num_records: int, seed: int) -> None:
    """Reader `index`: receive and check the planned stream."""
    check = StreamCheck(num_records, seed)
    with RingReader.attach(name, index) as reader:
        check.collect(reader)
    check.verify()


def produce_forever(name: str) -> None:
    """Write numbered records until killed (blocking while the ring is full)."""
    with RingWriter.attach(name) as writer:
        i = 0
        while True:
            writer.write(i % (1 << 32), i.to_bytes(8, "little"), timeout=None)
            i += 1


def read_some_then_hang(name: str, index: int, num_records: int) -> None:
    """Attach as reader `index`, read `num_records`, then stop reading (until killed)."""
    reader = RingReader.attach(name, index)
    for _ in range(num_records):
        reader.read(10.0)
    reader.release()
    time.sleep(60)


def create_rings_then_hang(link: str) -> None:
    """Create an instance of our own (named after this pid) with two rings, then wait to be killed."""
    instance = new_instance_id()
    RingSegment.create(instance, link, 4096)
    RingSegment.create(instance, link + "-bcast", 4096, num_readers=2)
    time.sleep(60)


def echo_sleeping(name_in: str, name_out: str, num_records: int, wake_s: float) -> None:
    """Echo records with no spinning, so every wait sleeps on a doorbell that must be rung.

    `wake_s` replaces the bounded-sleep period, so a missed doorbell would stall for that long.
    """
    shm.ring.WAKE_S = wake_s
    assert shm.ring.PUBLISH_NEEDS_FENCE == shm.ring_reader.PUBLISH_NEEDS_FENCE == (
        not os.environ.get("PIPELINE_SHM_MEMBARRIER"))
    with RingReader.attach(name_in, spin_s=0.0) as reader, RingWriter.attach(name_out, spin_s=0.0) as writer:
        for _ in range(num_records):
            record = reader.read(timeout=None)
            writer.write(record.kind, record.payload, timeout=None)


def write_numbers(name: str, num_records: int) -> None:
    """Writes records 0..num_records-1 (4-byte little-endian, padded to 20 bytes) without spinning."""
    with RingWriter.attach(name, spin_s=0.0) as writer:
        for i in range(num_records):
            writer.write(0, i.to_bytes(4, "little") * 5, timeout=None)
