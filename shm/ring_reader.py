"""Reader `index` of a shared-memory ring (the format, and the writer, are in shm/ring.py): records
handed out one at a time as views into the ring, waited for by spinning, then sleeping on the
reader's doorbell (a semaphore, or a named pipe an event loop can watch: fileno, arm, woken).
"""
from __future__ import annotations

from time import monotonic as now

import shm.ring as ring
from shm.fence import PUBLISH_NEEDS_FENCE, full_fence, heavy_fence
from shm.ring import RECORD_HEADER, SPIN_S, WRAP_LENGTH, Record, RingClosed, RingEnd
from shm.segment import (
    READ_CURSOR, READER_CLOSED, READER_PID, READER_SLEEPING, WRITE_CURSOR, WRITER_CLOSED, WRITER_PID,
    WRITER_SLEEPING, PeerDied, RingSegment, reader_slot,
)

class RingReader(RingEnd):
    """Reader `index` of a ring. read()/try_read() hand out one Record at a time; the next call,
    or release(), frees its space for the writer."""

    def __init__(self, segment: RingSegment, index: int = 0, *, spin_s: float = SPIN_S,
                 replaceable: bool = False) -> None:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < segment.num_readers:
            raise ValueError(f"reader index must be in [0, {segment.num_readers}) for ring {segment.name!r}, "
                             f"got {index!r}")
        segment.claim(reader_slot(index, READER_PID), f"reader {index}", replaceable=replaceable)
        super().__init__(segment, spin_s)
        self._index = index
        self._unpack = RECORD_HEADER.unpack_from
        self._cursor_slot = reader_slot(index, READ_CURSOR)
        self._sleeping_slot = reader_slot(index, READER_SLEEPING)
        self._closed_slot = reader_slot(index, READER_CLOSED)
        self._bell = segment.data_bells[index]
        self._r = self._slots[self._cursor_slot]
        self._w_seen = self._r  # last write cursor loaded: records up to it need no reload
        self._held_end = -1  # cursor after the record handed out and not yet released

    @classmethod
    def attach(cls, name: str, index: int = 0, *, spin_s: float = SPIN_S, replaceable: bool = False) -> RingReader:
        """Open ring `name` (made by RingSegment.create, maybe in another process) as reader
        `index`; `replaceable`: see shm/segment.py."""
        segment = RingSegment.open(name)
        try:
            return cls(segment, index, spin_s=spin_s, replaceable=replaceable)
        except BaseException:
            segment.close()
            raise

    def try_read(self) -> Record | None:
        """The next record, or None if none is published yet. Releases the previous record.
        Raises RingClosed once the writer closed and everything was read."""
        slots = self._slots
        r = self._held_end
        if r >= 0:  # release() inlined: this is the hot path
            self._held_end = -1
            self._r = r
            slots[self._cursor_slot] = r
            if PUBLISH_NEEDS_FENCE:
                full_fence()  # see shm/fence.py
            if slots[WRITER_SLEEPING]:
                self._seg.space_bell.ring()
        else:
            r = self._r
        if r == self._w_seen:
            w = slots[WRITE_CURSOR]
            if w == r:
                if slots[WRITER_CLOSED] and slots[WRITE_CURSOR] == r:
                    raise RingClosed(f"ring {self._seg.name!r}: the writer closed")
                return None
            self._w_seen = w
        pos = r % self._cap
        offset = self._base + pos
        num_bytes, kind = self._unpack(self._mm, offset)
        if num_bytes == WRAP_LENGTH:  # the rest of the data area is skipped
            self._r = r + self._cap - pos
            self._store_read_cursor(self._r)
            return self.try_read()
        self._held_end = r + ((num_bytes + 15) & -8)
        offset += 8
        return Record(kind, self._data[offset:offset + num_bytes])

    def fileno(self) -> int:
        """The descriptor that becomes readable when the writer rings this reader's doorbell, for
        a reader that waits in an event loop (`arm`, `woken`) rather than in read(). Only a reader
        the ring's creator gave a named-pipe doorbell (RingSegment.create's fifo_readers) has one."""
        fileno = getattr(self._bell, "fileno", None)
        if fileno is None:
            raise ValueError(f"ring {self._seg.name!r}: reader {self._index}'s doorbell is a semaphore, "
                             "not a descriptor (create the ring with fifo_readers)")
        return fileno()

    def arm(self) -> bool:
        """Announce that this reader sleeps until fileno() is readable; True if it may, False if a
        record (or the writer's close) is there already: read it now instead. Releases the
        record held, if any. After fileno() turns readable, call woken() before reading."""
        self.release()
        return self._announce_sleep()

    def _announce_sleep(self) -> bool:
        """The sleep handshake: raise this reader's sleeping flag, then look at the writer's
        cursor. True: nothing new, so sleep (the writer rings for its next record); False: the
        flag is down again, read now."""
        slots = self._slots
        slots[self._sleeping_slot] = 1
        heavy_fence()  # the writer sees our flag, or we see its cursor (shm/fence.py)
        if slots[WRITE_CURSOR] == self._r and not slots[WRITER_CLOSED]:
            return True
        slots[self._sleeping_slot] = 0
        return False

    def check_writer(self) -> None:
        """Raises PeerDied if the writer died (what a read() that waits finds out by itself); any
        thread may ask."""
        self._seg.check_peer(WRITER_PID, "writer")

    def woken(self) -> None:
        """The doorbell rang (or may have): no longer asleep, and fileno() quiet until the next ring."""
        self._slots[self._sleeping_slot] = 0
        self._bell.drain()

    def release(self) -> None:
        """Give the last record's space back to the writer; its payload view becomes invalid."""
        end = self._held_end
        if end >= 0:
            self._held_end = -1
            self._r = end
            self._store_read_cursor(end)

    def _store_read_cursor(self, r: int) -> None:
        slots = self._slots
        slots[self._cursor_slot] = r
        if PUBLISH_NEEDS_FENCE:
            full_fence()  # see shm/fence.py
        if slots[WRITER_SLEEPING]:
            self._seg.space_bell.ring()

    def read(self, timeout: float | None = None) -> Record | None:
        """The next record, waiting up to `timeout` seconds (None: as long as the writer lives);
        None on timeout. Raises PeerDied if the writer dies, RingClosed after it closed."""
        record = self.try_read()
        if record is not None or timeout == 0:
            return record
        return self._wait(timeout)

    def _wait(self, timeout: float | None) -> Record | None:
        slots = self._slots
        deadline = float("inf") if timeout is None else now() + timeout
        spin_end = min(now() + self._spin_s, deadline)
        r = self._r
        while now() < spin_end:
            if slots[WRITE_CURSOR] != r:
                record = self.try_read()
                if record is not None:
                    return record
                r = self._r  # it was a wrap record
        while True:
            if self._announce_sleep():
                left = deadline - now()
                if left <= 0:
                    slots[self._sleeping_slot] = 0
                    return None
                rung = self._bell.wait(min(ring.WAKE_S, left))  # the writer's period too, read at each sleep
                slots[self._sleeping_slot] = 0
            else:
                rung = True
            record = self.try_read()
            if record is not None:
                return record
            r = self._r
            if not rung:
                try:
                    self._seg.check_peer(WRITER_PID, "writer")
                except PeerDied:
                    if slots[WRITE_CURSOR] != r:  # it published just before dying
                        continue
                    raise

    def close(self) -> None:
        """Stop reading: the writer no longer waits for this reader. Unmaps the ring."""
        self._held_end = -1
        slots = self._slots
        slots[self._closed_slot] = 1
        if PUBLISH_NEEDS_FENCE:
            full_fence()
        if slots[WRITER_SLEEPING]:
            self._seg.space_bell.ring()
        self._seg.close()

