"""Shared-memory rings joining the pipeline's processes, and the binary layouts sent over them.

A creator (the daemon) makes each ring with `RingSegment.create(instance, link, capacity_bytes,
num_readers)`, `instance` from `new_instance_id()`, and hands `segment.name` (a string) to the
processes it spawns; they open their end with `RingWriter.attach(name)` or
`RingReader.attach(name, index)`. The names leave /dev/shm once every end has attached;
`sweep_stale()` removes what dead instances left behind. Messages are `Layout`s: a struct header
plus raw arrays, decoded as numpy views into the ring.

    writer.write(kind, header_bytes, token_ids)        # parts are copied back to back
    record = reader.read(timeout=1.0)                  # Record(kind, payload) or None
    message = STEP_LAYOUT.decode(record.payload)       # views valid until the next read
"""
from shm.codec import Layout
from shm.naming import list_entries, new_instance_id, pid_alive, ring_name, sweep_stale, unlink_instance
from shm.ring import Record, RecordTooLarge, RingClosed, RingTimeout, RingWriter
from shm.ring_reader import RingReader
from shm.segment import PeerDied, RingSegment

__all__ = [
    "Layout", "PeerDied", "Record", "RecordTooLarge", "RingClosed", "RingReader", "RingSegment",
    "RingTimeout", "RingWriter", "list_entries", "new_instance_id", "pid_alive", "ring_name",
    "sweep_stale", "unlink_instance",
]
