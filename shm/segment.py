"""Shared segments: one named POSIX shared-memory mapping with int64 header fields, and a ring's.

`SharedSegment` is the primitive under every layout here (rings, the token mailbox, the stages'
status board): create it exclusively (mode 0600), fill the header, write the magic number last
so an attacher that sees it sees a complete header; open it by name, checking the magic; unlink
the name once every process has attached; close the mapping. Header fields are int64 slots,
read and written through a native int64 memoryview: on an 8-aligned address that is one plain
8-byte load or store (the same instruction a numpy int64 element store compiles to), which
x86-64 performs atomically and in program order. aarch64 would need barriers that Python cannot
issue, so the segments refuse to map there.

A ring's layout (each 64-byte line written by exactly one process):

    line 0      magic, version, capacity_bytes, num_readers, creator_pid, fifo bells  (written once)
    line 1      write cursor, writer sleeping, writer pid, writer closed, writer replaceable
    line 2 + i  read cursor, reader sleeping, reader pid, reader closed, reader replaceable

An end that claims as replaceable is one the ring's creator restarts when it dies: its death
makes the other end wait (for the replacement, which claims the same end) instead of raising
PeerDied, for as long as the creator lives. The creator's own ends are told (it decides).
    data        capacity_bytes of records [u32 length | u32 kind | payload | pad to 8]

Cursors are monotonic byte counts; a record starts at `cursor % capacity_bytes`.

Each doorbell is a named semaphore, except the data doorbells of the readers the creator names
in `fifo_readers` (the header's bit mask): those are named pipes (shm/doorbell.py), for a reader
that waits in an event loop.
"""
from __future__ import annotations

import mmap
import os
import platform
from collections.abc import Collection, Mapping

import posix_ipc

from shm.doorbell import Doorbell, FifoDoorbell
from shm.fence import full_fence, register_process
from shm.naming import pid_alive, ring_name

MAGIC = 0x31474E5245504950  # b"PIPERNG1" little-endian
VERSION = 2
LINE_SLOTS = 8  # int64 slots per 64-byte cache line
MAX_READERS = 64
MIN_CAPACITY_BYTES = 64
MAX_CAPACITY_BYTES = 1 << 31  # so every payload length fits in a u32 below the wrap marker

# Slot indices into the int64 view of the header.
MAGIC_SLOT, VERSION_SLOT, CAPACITY_SLOT, NUM_READERS_SLOT, CREATOR_PID_SLOT, FIFO_READERS_SLOT = range(6)
MAX_FIFO_READER = 62  # fifo_readers is a bit mask in one int64 slot
WRITE_CURSOR = LINE_SLOTS
WRITER_SLEEPING = LINE_SLOTS + 1
WRITER_PID = LINE_SLOTS + 2
WRITER_CLOSED = LINE_SLOTS + 3
WRITER_REPLACEABLE = LINE_SLOTS + 4
READ_CURSOR, READER_SLEEPING, READER_PID, READER_CLOSED, READER_REPLACEABLE = range(5)  # offsets within a reader line
REPLACEABLE_AFTER_PID = WRITER_REPLACEABLE - WRITER_PID  # an end's replaceable flag, counted from its pid slot

_X86_64 = ("x86_64", "amd64")


def reader_slot(index: int, field: int) -> int:
    """Header slot of `field` (READ_CURSOR, READER_SLEEPING, ...) of reader `index`."""
    return (2 + index) * LINE_SLOTS + field


def data_offset(num_readers: int) -> int:
    return (2 + num_readers) * LINE_SLOTS * 8


class PeerDied(RuntimeError):
    """The process at the other end of a ring died (or never attached and its creator died)."""


def check_platform() -> None:
    machine = platform.machine().lower()
    if machine not in _X86_64:
        raise RuntimeError(
            f"shared-memory segments need x86-64 store ordering; on {platform.machine()!r} "
            "publishing a cursor needs a memory barrier that this implementation does not provide"
        )


class SharedSegment:
    """One mapped segment. `slots` is its int64 view; slot 0 holds the layout's magic number."""

    __slots__ = ("name", "mm", "slots")

    def __init__(self, name: str, mm: mmap.mmap) -> None:
        self.name = name
        self.mm = mm
        self.slots = memoryview(mm).cast("q")

    @classmethod
    def create(cls, name: str, size_bytes: int, magic: int, header: Mapping[int, int] = {}) -> SharedSegment:
        """Make `name` (it must not exist), set the `header` slots, then the magic number."""
        check_platform()
        try:
            shared = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size_bytes)
        except posix_ipc.ExistentialError:
            raise FileExistsError(f"shared segment {name!r} already exists: each is created once") from None
        try:
            mm = mmap.mmap(shared.fd, size_bytes)
        except BaseException:
            shared.unlink()
            raise
        finally:
            shared.close_fd()
        segment = cls(name, mm)
        for slot, value in header.items():
            segment.slots[slot] = value
        segment.slots[MAGIC_SLOT] = magic  # last: an attacher that sees it sees a complete header
        return segment

    @classmethod
    def open(cls, name: str, magic: int, what: str) -> SharedSegment:
        """Map an existing segment by name (in any process); ValueError unless it holds `magic`."""
        check_platform()
        try:
            shared = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise FileNotFoundError(f"no {what} segment {name!r}: never created, or unlinked because all "
                                    "its processes attached") from None
        try:
            if shared.size < 8:
                raise ValueError(f"{name!r} is too small ({shared.size} bytes) to be a {what}")
            mm = mmap.mmap(shared.fd, shared.size)
        finally:
            shared.close_fd()
        segment = cls(name, mm)
        if segment.slots[MAGIC_SLOT] != magic:
            found = segment.slots[MAGIC_SLOT]
            segment.close()
            raise ValueError(f"{name!r} is not a {what} (magic {found:#x})")
        return segment

    @property
    def size_bytes(self) -> int:
        return self.mm.size()

    def unlink(self) -> None:
        """Remove the name; every mapping already open keeps working."""
        unlink_segment(self.name)

    def close(self) -> None:
        """Unmap. A view still held elsewhere keeps the mapping alive until it is dropped."""
        self.slots.release()
        try:
            self.mm.close()
        except BufferError:
            pass  # a numpy or payload view still references the mapping; unmapped when freed


def unlink_segment(name: str) -> None:
    """Remove a segment's name, if it is still there (another process may have got there first)."""
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


def _check_geometry(capacity_bytes: int, num_readers: int) -> None:
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
        raise ValueError(f"capacity_bytes must be an int, got {capacity_bytes!r}")
    if not MIN_CAPACITY_BYTES <= capacity_bytes <= MAX_CAPACITY_BYTES or capacity_bytes % 8:
        raise ValueError(
            f"capacity_bytes must be a multiple of 8 in [{MIN_CAPACITY_BYTES}, {MAX_CAPACITY_BYTES}], "
            f"got {capacity_bytes}"
        )
    if isinstance(num_readers, bool) or not isinstance(num_readers, int) or not 1 <= num_readers <= MAX_READERS:
        raise ValueError(f"num_readers must be an int in [1, {MAX_READERS}], got {num_readers!r}")


class RingSegment:
    """A ring's shared segment plus its doorbells. Each ring end owns one."""

    __slots__ = ("segment", "name", "capacity_bytes", "num_readers", "data_offset", "mm", "slots", "data",
                 "space_bell", "data_bells")

    def __init__(self, segment: SharedSegment, space_bell: Doorbell,
                 data_bells: list[Doorbell | FifoDoorbell]) -> None:
        self.segment = segment
        self.name = segment.name
        self.mm = segment.mm
        self.slots = segment.slots
        self.data = memoryview(segment.mm)
        self.capacity_bytes = self.slots[CAPACITY_SLOT]
        self.num_readers = self.slots[NUM_READERS_SLOT]
        self.data_offset = data_offset(self.num_readers)
        self.space_bell = space_bell
        self.data_bells = data_bells

    @staticmethod
    def _bells(name: str, num_readers: int, fifo_mask: int, *, create: bool) -> list[Doorbell | FifoDoorbell]:
        """The space doorbell, then each reader's data doorbell (made, or opened by name)."""
        bells: list[Doorbell | FifoDoorbell] = []
        try:
            bells.append(Doorbell(f"{name}.space", create=create))
            for index in range(num_readers):
                kind = FifoDoorbell if fifo_mask >> index & 1 else Doorbell
                bells.append(kind(f"{name}.data{index}", create=create))
        except BaseException:
            for bell in bells:
                if create:
                    bell.unlink()
                bell.close()
            raise
        return bells

    @classmethod
    def create(cls, instance: str, link: str, capacity_bytes: int, num_readers: int = 1,
               fifo_readers: Collection[int] = ()) -> RingSegment:
        """Make the segment (mode 0600) and doorbells of link `link` of `instance`. The names
        stay until every end has attached; pass `segment.name` to the processes that attach.
        The readers in `fifo_readers` get a named pipe for a data doorbell (their fileno())."""
        name = ring_name(instance, link)
        _check_geometry(capacity_bytes, num_readers)
        if not all(isinstance(i, int) and 0 <= i < min(num_readers, MAX_FIFO_READER + 1) for i in fifo_readers):
            raise ValueError(f"fifo_readers must be reader indexes in [0, {min(num_readers, MAX_FIFO_READER + 1)}), "
                             f"got {list(fifo_readers)!r}")
        fifo_mask = sum(1 << index for index in set(fifo_readers))
        try:
            segment = SharedSegment.create(name, data_offset(num_readers) + capacity_bytes, MAGIC, {
                VERSION_SLOT: VERSION, CAPACITY_SLOT: capacity_bytes, NUM_READERS_SLOT: num_readers,
                CREATOR_PID_SLOT: os.getpid(), FIFO_READERS_SLOT: fifo_mask})
        except FileExistsError:
            raise FileExistsError(f"ring {name!r} already exists: each link of an instance is created once") from None
        try:
            made = cls._bells(name, num_readers, fifo_mask, create=True)
        except BaseException:
            segment.unlink()
            segment.close()
            raise
        return cls(segment, made[0], made[1:])

    @classmethod
    def open(cls, name: str) -> RingSegment:
        """Map an existing ring by name (in any process, e.g. one started with 'spawn')."""
        try:
            segment = SharedSegment.open(name, MAGIC, "ring")
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no ring segment {name!r}: never created, or unlinked because all its ends attached"
            ) from None
        version, capacity_bytes, num_readers = (segment.slots[VERSION_SLOT], segment.slots[CAPACITY_SLOT],
                                                segment.slots[NUM_READERS_SLOT])
        problem = None
        if version != VERSION:
            problem = f"{name!r} is a version-{version} ring; this is version {VERSION}"
        elif data_offset(num_readers) + capacity_bytes != segment.size_bytes:
            problem = (f"ring {name!r} header says {capacity_bytes} bytes x {num_readers} readers, "
                       f"but the segment has {segment.size_bytes} bytes")
        if problem is not None:
            segment.close()
            raise ValueError(problem)
        try:
            bells = cls._bells(name, num_readers, segment.slots[FIFO_READERS_SLOT], create=False)
        except BaseException:
            segment.close()
            raise
        return cls(segment, bells[0], bells[1:])

    @property
    def creator_pid(self) -> int:
        return self.slots[CREATOR_PID_SLOT]

    def peer_pid_slots(self) -> list[int]:
        return [WRITER_PID] + [reader_slot(i, READER_PID) for i in range(self.num_readers)]

    def claim(self, pid_slot: int, role: str, *, replaceable: bool = False) -> None:
        """Write this process's pid as `role`'s, then unlink the names if every end is attached.
        A `replaceable` end's death makes its peer wait for a replacement (see the module's doc)."""
        register_process()
        holder = self.slots[pid_slot]
        if holder != 0:
            raise RuntimeError(f"ring {self.name!r} already has a {role} (pid {holder})")
        self.slots[pid_slot + REPLACEABLE_AFTER_PID] = int(replaceable)
        self.slots[pid_slot] = os.getpid()
        full_fence()  # two ends attaching at once must not both miss each other's pid
        if all(self.slots[slot] != 0 for slot in self.peer_pid_slots()):
            self.unlink()

    def check_peer(self, pid_slot: int, role: str) -> None:
        """Raise PeerDied if the process holding `pid_slot` died (unless it is replaceable and the
        creator, who replaces it, lives), or never came and the creator died."""
        pid = self.slots[pid_slot]
        if pid == 0:
            creator = self.creator_pid
            if not pid_alive(creator):
                raise PeerDied(f"ring {self.name!r}: the {role} never attached and the creator (pid {creator}) died")
        elif not pid_alive(pid):
            creator = self.creator_pid
            if self.slots[pid_slot + REPLACEABLE_AFTER_PID] and creator != os.getpid() and pid_alive(creator):
                return  # the creator starts its replacement, or stops everything
            raise PeerDied(f"ring {self.name!r}: the {role} (pid {pid}) died")

    def unlink(self) -> None:
        """Remove the names; every mapping and doorbell handle already open keeps working."""
        self.segment.unlink()
        self.space_bell.unlink()
        for bell in self.data_bells:
            bell.unlink()

    def close(self) -> None:
        """Unmap. A payload view still held by the caller keeps the mapping alive until dropped."""
        self.data.release()
        self.segment.close()
        self.space_bell.close()
        for bell in self.data_bells:
            bell.close()

