"""Replaceable ends: a ring end or mailbox consumer that claimed as replaceable makes its peer wait
for a replacement when it dies (while the creator, who starts the replacement, lives), instead of
raising PeerDied; the creator's own ends are told; `cover_for` lets the runner go on past a dead
consumer's slots, and its replacement reads from the next step."""
from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

from shm.mailbox import MailboxReader, MailboxWriter, create_mailbox
from shm.mailbox_layout import PID, REPLACEABLE, Mailbox
from shm.ring_reader import RingReader
from shm.segment import CREATOR_PID_SLOT, WRITER_PID, WRITER_REPLACEABLE, PeerDied, RingSegment

pytestmark = pytest.mark.timeout(30)


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_dead_replaceable_writer_makes_the_reader_wait_while_the_creator_lives(instance: str) -> None:
    segment = RingSegment.create(instance, "repl", 4096)
    reader = RingReader(segment)
    slots = segment.slots
    slots[WRITER_PID] = dead_pid()
    slots[WRITER_REPLACEABLE] = 1
    # This process created the ring: as the creator it is told of the death (it decides what follows).
    with pytest.raises(PeerDied, match="the writer"):
        reader.read(timeout=0.6)
    slots[CREATOR_PID_SLOT] = os.getppid()  # a live creator that is another process
    assert reader.read(timeout=0.6) is None  # waits for the replacement: no PeerDied
    slots[CREATOR_PID_SLOT] = dead_pid()  # no one is left to start a replacement
    with pytest.raises(PeerDied, match="the writer"):
        reader.read(timeout=0.6)
    slots[CREATOR_PID_SLOT] = os.getppid()
    slots[WRITER_REPLACEABLE] = 0  # an end that claimed as not replaceable
    with pytest.raises(PeerDied, match="the writer"):
        reader.read(timeout=0.6)
    reader.close()


def test_the_runner_waits_for_a_dead_replaceable_consumer_and_goes_on_once_covered_for(instance: str) -> None:
    name = create_mailbox(instance, num_slots=2, max_rows=4, logprob_width=1, num_consumers=2, cuda=False)
    writer, scheduler = MailboxWriter(name), MailboxReader(name, 0)
    detokenizer = MailboxReader(name, 1, replaceable=True)
    box = Mailbox.open(name)
    try:
        for step in range(2):
            writer.write(step, np.array([step], np.int32))
            scheduler.read(step)
            scheduler.release(step)
        detokenizer.read(0)
        detokenizer.release(0)
        detokenizer.close()
        box.slots[box.consumer_field(1, PID)] = dead_pid()
        # Step 3 needs step 1 released by both: the dead consumer holds it, and is waited for.
        with pytest.raises(TimeoutError, match="not released"):
            writer.write(3, np.array([3], np.int32), timeout_s=0.6)
        writer.write(2, np.array([2], np.int32))  # step 2's slot was free: released step 0
        scheduler.read(2)
        scheduler.release(2)
        assert scheduler.cover_for(1) == 3  # steps 0..2 released for it
        writer.write(3, np.array([3], np.int32), timeout_s=5.0)
        replacement = MailboxReader(name, 1, replaceable=True)
        assert replacement.read(3).token_ids.tolist() == [3]  # it reads from the next step on
        with pytest.raises(RuntimeError, match="runs"):
            scheduler.cover_for(1)  # a running consumer releases its own steps
        replacement.close()
        box.slots[box.consumer_field(1, REPLACEABLE)] = 0
        box.slots[box.consumer_field(1, PID)] = dead_pid()
        scheduler.read(3)
        scheduler.release(3)
        writer.write(4, np.array([4], np.int32))
        with pytest.raises(PeerDied, match="consumer 1"):  # not replaceable: the runner is told
            writer.write(5, np.array([5], np.int32), timeout_s=5.0)
    finally:
        box.close()
        scheduler.close()
        writer.close()
