"""The daemon's ends of one engine instance's rings: requests and aborts go out, output events come in.

The links are made at start from the table in stages/contracts/topology.py
(`/pipeline-<instance>-<link>`), and those of a restarted frontend are made afresh
(`renew`). Every request written and not yet finished is tracked, as the target an abort may
name; an abort that finds its ring full waits here until the ring has room.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from pipeline.errors import Overloaded, StageFailed
from shm.ring import Record, RingTimeout, RingWriter
from shm.ring_reader import RingReader
from shm.segment import PeerDied, RingSegment
from stages.contracts.outputs import OutputEvent, TokenTexts
from stages.contracts.topology import DAEMON, Link, segment_link
from stages.events import coalesce_outputs, decode_events, decode_token_texts
from stages.messages import Kind, encode_req_id

# The daemon's read of the events ring sleeps on the doorbell at once: a step's events come once
# per device step, so a spin before sleeping is CPU spent for nothing on every step (about a
# tenth of the daemon's CPU at batch 256) and the wake-up costs tens of µs of delivery.
EVENTS_SPIN_S = 0.0
MAX_RECORDS_PER_READ = 64  # event batches one read returns at most

PeerFailure = Callable[[str, str | None], StageFailed]  # (message, stage) -> why a ring's peer died


class StageLinks:
    """The ring ends of one instance in this process. `submit`, `abort`, `retry_aborts`,
    `renew` and `outputs_from` may run on different threads: the ends they write and the
    requests they track are guarded by one lock. `events` is read by one thread."""

    def __init__(self, instance: str, num_tokenizers: int, peer_failure: PeerFailure) -> None:
        self.instance = instance
        self._num_tokenizers = num_tokenizers
        self._peer_failure = peer_failure
        self._lock = threading.Lock()
        self._closed = False
        self._ends: dict[str, RingWriter | RingReader] = {}  # this process's ends, by link name
        self._live: set[int] = set()  # submitted and not yet finished: abort targets
        self._pending_aborts: deque[int] = deque()  # aborts that found the abort ring full
        self._next_tokenizer = 0
        self._generation = 0  # of the frontend's links

    def make(self, table: list[Link], generation: int = 0) -> dict[str, str]:
        """Creates the segments of `table`'s links in frontend generation `generation` and this
        process's ends of them; returns each link's segment name, for the stages."""
        names: dict[str, str] = {}
        for link in table:
            # The daemon reads its links on its event loop: their doorbells are descriptors it waits on.
            fifo_readers = [link.reader_index(DAEMON)] if DAEMON in link.readers else []
            segment = RingSegment.create(self.instance, segment_link(link.name, generation), link.capacity_bytes,
                                         len(link.readers), fifo_readers)
            names[link.name] = segment.name
            if link.writer == DAEMON:
                self._ends[link.name] = RingWriter(segment)
            elif DAEMON in link.readers:
                self._ends[link.name] = RingReader(segment, link.reader_index(DAEMON), spin_s=EVENTS_SPIN_S)
            else:
                segment.close()  # the creator's mapping is not needed: the stages attach by name
        self._generate = [self._ends[f"generate{i}"] for i in range(self._num_tokenizers)]
        self._abort = self._ends["abort"]
        self.events: RingReader = self._ends["events"]
        return names

    def renew(self, fresh: list[Link]) -> dict[str, str]:
        """Replaces the links `fresh` (those of a restarting frontend) with new ones in the next
        frontend generation; every request tracked is forgotten. Returns their segment names."""
        with self._lock:
            self._check_open()
            for link in fresh:
                end = self._ends.pop(link.name, None)
                if end is not None:
                    end.close()
            self._generation += 1
            names = self.make(fresh, self._generation)
            self._live.clear()
            self._pending_aborts.clear()
            self._next_tokenizer = 0
        return names

    def submit(self, req_id: int, parts: list[bytes]) -> None:
        """Writes an encoded request to the next tokenizer worker's ring without waiting;
        Overloaded when that ring is full."""
        with self._lock:
            self._check_open()
            if req_id in self._live:
                raise ValueError(f"req_id {req_id} is already running; ids must be unique among running requests")
            index = self._next_tokenizer
            self._next_tokenizer = (index + 1) % len(self._generate)
            if not self._write(self._generate[index], Kind.GENERATE, parts):
                raise Overloaded(f"the request ring of tokenizer{index} is full ({self._generate[index].capacity_bytes} "
                                 "bytes of requests not yet tokenized); retry later")
            self._live.add(req_id)

    def abort(self, req_id: int) -> None:
        """Writes an abort of a running request, or keeps it until the abort ring has room;
        ignores ids not running."""
        with self._lock:
            self._check_open()
            if req_id not in self._live:
                return  # finished already (or never submitted): nothing to stop
            self._pending_aborts.append(req_id)
            self._send_pending_aborts()

    def _send_pending_aborts(self) -> None:
        """Writes the aborts that fit, oldest first. Call with the lock held."""
        while self._pending_aborts:
            if not self._write(self._abort, Kind.ABORT, [encode_req_id(self._pending_aborts[0])]):
                return  # the scheduler drains the ring every step; the next read tries again
            self._pending_aborts.popleft()

    def retry_aborts(self) -> None:
        """Writes the aborts that found the abort ring full, as far as it has room now."""
        if self._pending_aborts:
            with self._lock:
                self._send_pending_aborts()

    def _write(self, writer: RingWriter, kind: int, parts: list[bytes]) -> bool:
        """Writes one record if there is room now; False if the ring is full."""
        try:
            writer.write(kind, *parts, timeout=0.0)
        except RingTimeout:
            return False
        except PeerDied as exc:
            raise self._peer_failure(str(exc), None) from None
        return True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the backend is closed")

    def outputs_from(self, record: Record) -> list[OutputEvent | TokenTexts]:
        """`record`'s events and those of the records after it, up to MAX_RECORDS_PER_READ."""
        events: list[OutputEvent | TokenTexts] = []
        for _ in range(MAX_RECORDS_PER_READ):
            if record.kind == Kind.TOKEN_TEXTS:
                events.append(decode_token_texts(record.payload))
            else:
                events.extend(decode_events(record.payload))
            record = self.events.try_read()
            if record is None:
                break
        self.events.release()
        events = coalesce_outputs(events)  # several records: the reader fell behind, so one delta per request
        finished = [e.req_id for e in events if isinstance(e, OutputEvent) and e.is_last]
        if finished:
            with self._lock:
                self._live.difference_update(finished)
        return events

    def mark_closed(self) -> bool:
        """From now on nothing is written; False if that was so already."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def close(self) -> None:
        """Lets go of every end (the backend removes the segments)."""
        for end in self._ends.values():
            end.close()
