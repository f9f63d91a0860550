"""The status board: one small shared segment where every stage reports liveness and counters.

The board owns the segment; each area is read and written through its own view:
`board.limits` (the runner's model limits), `board.counters` (the scheduler's counters),
`board.stages` (each stage's liveness, readiness, error and frontend generation) and
`board.profile` (the daemon's profile requests and each stage's answer). The board itself holds
the daemon's stop flag and frontend generation.

Layout (int64 slots; each written by one process):

    0..7            magic, stop flag (the daemon's), model limits published by the runner:
                    limits ready, num_kv_blocks, max_model_len, vocab_size, num_host_blocks;
                    the frontend generation (the daemon's)
    8..15           eos token ids (count, then up to 4 ids), window sizes  (the runner's)
    16 + 8*s ..     stage s: pid, heartbeat (CLOCK_MONOTONIC ns), ready,
                    profile answer: generation answered, outcome,
                    frontend generation taken up                          (stage s's)
    then            an error message area of ERROR_BYTES per stage (utf-8, length-prefixed)
    then            the profile request: generation, active, directory
                    (PROFILE_DIRECTORY_BYTES, utf-8, length-prefixed)     (the daemon's)
    then            a profile answer message area of PROFILE_MESSAGE_BYTES per stage: the
                    trace file written, or why not                        (stage s's)
    then            the scheduler's counters: SchedulerCounters's ints in field order, nested
                    structs flattened (stages/contracts/counters.py)      (the scheduler's)
    then            what the model runs in (ModelLimits.runs_in, RUNS_IN_BYTES, utf-8,
                    length-prefixed), then the CPU kernels' state (ModelLimits.cpu_kernels,
                    CPU_KERNELS_BYTES, likewise), written before limits ready (the runner's)

CLOCK_MONOTONIC is one clock for every process on the machine, so heartbeat ages compare.
A profile request is posted by writing the directory and the active flag, then bumping the
generation; a stage that sees a new generation on its tick answers with its outcome and message,
then the generation it answered (last, so the daemon that sees it sees the rest).

The frontend generation counts restarts of the frontend group alone (stages/contracts/topology.py):
the daemon bumps it once the fresh links exist, and the scheduler, having let go of every
request and moved its ends onto them, answers with the generation it took up.
"""
from __future__ import annotations

import mmap
import time
from dataclasses import dataclass
from enum import IntEnum

from shm.naming import ring_name
from shm.segment import SharedSegment
from stages.contracts.config import ModelLimits
from stages.contracts.counters import SchedulerCounters, from_ints, num_counts, to_ints

MAGIC = 0x33544154535F5049  # b"IP_STAT3"
MAX_STAGES = 64
MAX_EOS_IDS = 4
ERROR_BYTES = 1024
(_MAGIC, _STOP, _LIMITS_READY, _NUM_KV_BLOCKS, _MAX_MODEL_LEN, _VOCAB_SIZE, _NUM_HOST_BLOCKS,
 _FRONTEND_GENERATION) = range(8)
_EOS = 8  # a count, then MAX_EOS_IDS ids
_WINDOW, _LOCAL_WINDOW, _NUM_WINDOW_BLOCKS = 13, 14, 15
_VERIFY_FREE_TOKENS_MILLI = 16  # ModelLimits.verify_free_tokens * 1000 (0: not measured)
_DRAFT_STEP_MILLI = 17  # ModelLimits.draft_step_tokens * 1000, two slots
_COSTS_BY_BATCH = 19  # a count, then MAX_COST_BATCHES of ModelLimits.verify_costs_by_batch, 4 slots * 1000 each
MAX_COST_BATCHES = 4
_STAGES = _COSTS_BY_BATCH + 1 + 4 * MAX_COST_BATCHES
_STAGE_SLOTS = 8
_PID, _HEARTBEAT, _READY, _PROFILE_ANSWERED, _PROFILE_OUTCOME, _FRONTEND_TAKEN = range(6)
_ERRORS_OFFSET = (_STAGES + MAX_STAGES * _STAGE_SLOTS) * 8
PROFILE_DIRECTORY_BYTES = 8 + 4096  # a length, then up to PATH_MAX bytes
PROFILE_MESSAGE_BYTES = 1024
_PROFILE_OFFSET = _ERRORS_OFFSET + MAX_STAGES * ERROR_BYTES
_PROFILE_GENERATION = _PROFILE_OFFSET // 8
_PROFILE_ACTIVE = _PROFILE_GENERATION + 1
_PROFILE_DIRECTORY_OFFSET = _PROFILE_OFFSET + 16
_PROFILE_MESSAGES_OFFSET = _PROFILE_DIRECTORY_OFFSET + PROFILE_DIRECTORY_BYTES
_COUNTERS = (_PROFILE_MESSAGES_OFFSET + MAX_STAGES * PROFILE_MESSAGE_BYTES) // 8
_NUM_COUNTERS = num_counts(SchedulerCounters)
RUNS_IN_BYTES = 1024
_RUNS_IN_OFFSET = (_COUNTERS + _NUM_COUNTERS) * 8
CPU_KERNELS_BYTES = 512
_CPU_KERNELS_OFFSET = _RUNS_IN_OFFSET + RUNS_IN_BYTES
SIZE_BYTES = _CPU_KERNELS_OFFSET + CPU_KERNELS_BYTES


class ProfileOutcome(IntEnum):
    """A stage's answer to a profile request."""

    NONE = 0  # not answered yet
    STARTED = 1
    WRITTEN = 2  # the message is the trace file's path
    NOT_CAPTURING = 3  # a stop that found no capture (the stage started after the start request)
    FAILED = 4  # the message says why


@dataclass(slots=True)
class ProfileRequest:
    generation: int
    directory: str | None  # where to write traces while a capture is wanted; None: stop


@dataclass(slots=True)
class ProfileAnswer:
    generation: int  # the request this answers
    outcome: ProfileOutcome
    message: str


def _stage_slot(index: int, field: int) -> int:
    if not 0 <= index < MAX_STAGES:
        raise ValueError(f"stage index must be in [0, {MAX_STAGES}), got {index}")
    return _STAGES + index * _STAGE_SLOTS + field


def _write_text(mm: mmap.mmap, offset: int, area_bytes: int, text: str) -> None:
    """A length-prefixed utf-8 area, cut to fit (never inside a character)."""
    data = text.encode("utf-8")[:area_bytes - 8].decode("utf-8", "ignore").encode("utf-8")
    mm[offset + 8:offset + 8 + len(data)] = data
    mm[offset:offset + 8] = len(data).to_bytes(8, "little")


def _read_text(mm: mmap.mmap, offset: int) -> str:
    length = int.from_bytes(mm[offset:offset + 8], "little")
    return mm[offset + 8:offset + 8 + length].decode("utf-8", "replace")


class LimitsArea:
    """The loaded model's limits: published once by the runner, read by the scheduler and the daemon."""

    def __init__(self, segment: SharedSegment) -> None:
        self._slots = segment.slots
        self._mm = segment.mm

    def publish(self, limits: ModelLimits) -> None:
        eos = limits.eos_token_ids[:MAX_EOS_IDS]
        slots = self._slots
        _write_text(self._mm, _RUNS_IN_OFFSET, RUNS_IN_BYTES, limits.runs_in)
        _write_text(self._mm, _CPU_KERNELS_OFFSET, CPU_KERNELS_BYTES, limits.cpu_kernels)
        slots[_NUM_KV_BLOCKS] = limits.num_kv_blocks
        slots[_MAX_MODEL_LEN] = limits.max_model_len
        slots[_VOCAB_SIZE] = limits.vocab_size
        slots[_NUM_HOST_BLOCKS] = limits.num_host_blocks
        slots[_WINDOW], slots[_LOCAL_WINDOW] = limits.window, limits.local_window
        slots[_NUM_WINDOW_BLOCKS] = limits.num_window_blocks
        free = limits.verify_free_tokens
        slots[_VERIFY_FREE_TOKENS_MILLI] = 0 if free is None else max(1, round(free * 1000))
        for index, tokens in enumerate(limits.draft_step_tokens):
            slots[_DRAFT_STEP_MILLI + index] = round(tokens * 1000)
        by_batch = limits.verify_costs_by_batch[:MAX_COST_BATCHES]
        slots[_COSTS_BY_BATCH] = len(by_batch)
        for index, fit in enumerate(by_batch):
            for field, value in enumerate(fit):
                slots[_COSTS_BY_BATCH + 1 + 4 * index + field] = round(value * 1000)
        slots[_EOS] = len(eos)
        for index, token_id in enumerate(eos):
            slots[_EOS + 1 + index] = token_id
        slots[_LIMITS_READY] = 1  # last: a reader that sees it sees the rest (x86-64 store order)

    def read(self) -> ModelLimits | None:
        """The limits, or None before the runner published them."""
        slots = self._slots
        if not slots[_LIMITS_READY]:
            return None
        eos = [slots[_EOS + 1 + i] for i in range(slots[_EOS])]
        free = slots[_VERIFY_FREE_TOKENS_MILLI]
        return ModelLimits(slots[_NUM_KV_BLOCKS], slots[_MAX_MODEL_LEN], slots[_VOCAB_SIZE], eos,
                           slots[_NUM_HOST_BLOCKS], slots[_WINDOW], slots[_LOCAL_WINDOW], slots[_NUM_WINDOW_BLOCKS],
                           verify_free_tokens=free / 1000 if free else None,
                           draft_step_tokens=(slots[_DRAFT_STEP_MILLI] / 1000, slots[_DRAFT_STEP_MILLI + 1] / 1000),
                           verify_costs_by_batch=tuple(
                               tuple(slots[_COSTS_BY_BATCH + 1 + 4 * index + field] / 1000 for field in range(4))
                               for index in range(slots[_COSTS_BY_BATCH])),
                           runs_in=_read_text(self._mm, _RUNS_IN_OFFSET),
                           cpu_kernels=_read_text(self._mm, _CPU_KERNELS_OFFSET))


class CountersArea:
    """The scheduler's counters, every field of SchedulerCounters in a slot of its own."""

    def __init__(self, slots: memoryview) -> None:
        self._slots = slots

    def publish(self, counters: SchedulerCounters) -> None:
        for index, value in enumerate(to_ints(counters)):
            self._slots[_COUNTERS + index] = value

    def read(self) -> SchedulerCounters:
        return from_ints(SchedulerCounters, self._slots[_COUNTERS:_COUNTERS + _NUM_COUNTERS].tolist())


class StageArea:
    """Each stage's own slots, by stage index: its process, heartbeat, readiness, the error it
    died of, and the frontend generation it took up."""

    def __init__(self, segment: SharedSegment) -> None:
        self._slots = segment.slots
        self._mm = segment.mm

    def beat(self, index: int) -> None:
        self._slots[_stage_slot(index, _HEARTBEAT)] = time.monotonic_ns()

    def mark_started(self, index: int, pid: int) -> None:
        self._slots[_stage_slot(index, _PID)] = pid
        self.beat(index)

    def mark_ready(self, index: int) -> None:
        self.beat(index)
        self._slots[_stage_slot(index, _READY)] = 1

    def clear(self, index: int) -> None:
        """Forget stage `index`'s process (the daemon's, before starting a replacement there)."""
        for field in (_READY, _PID, _HEARTBEAT):
            self._slots[_stage_slot(index, field)] = 0
        self.set_error(index, "")

    def is_ready(self, index: int) -> bool:
        return bool(self._slots[_stage_slot(index, _READY)])

    def pid(self, index: int) -> int:
        return self._slots[_stage_slot(index, _PID)]

    def heartbeat_age_s(self, index: int) -> float:
        beat = self._slots[_stage_slot(index, _HEARTBEAT)]
        return float("inf") if beat == 0 else max(0.0, (time.monotonic_ns() - beat) / 1e9)

    def set_error(self, index: int, message: str) -> None:
        _stage_slot(index, 0)  # validates the index
        _write_text(self._mm, _ERRORS_OFFSET + index * ERROR_BYTES, ERROR_BYTES, message)

    def error(self, index: int) -> str:
        _stage_slot(index, 0)
        return _read_text(self._mm, _ERRORS_OFFSET + index * ERROR_BYTES)

    def take_up_frontend(self, index: int, generation: int) -> None:
        self._slots[_stage_slot(index, _FRONTEND_TAKEN)] = generation

    def frontend_taken(self, index: int) -> int:
        """The frontend generation stage `index` has moved onto."""
        return self._slots[_stage_slot(index, _FRONTEND_TAKEN)]


class ProfileArea:
    """Profile requests (the daemon's) and each stage's answer (the stage's own)."""

    def __init__(self, segment: SharedSegment) -> None:
        self._slots = segment.slots
        self._mm = segment.mm

    def request(self, directory: str | None) -> int:
        """Asks every stage to capture into `directory`, or (None) to stop; returns the request's
        generation. Raises ValueError for a directory whose utf-8 path does not fit the area."""
        if directory is not None:
            data = directory.encode("utf-8")
            if len(data) > PROFILE_DIRECTORY_BYTES - 8:
                raise ValueError(f"profile directory {directory!r} is {len(data)} bytes; at most "
                                 f"{PROFILE_DIRECTORY_BYTES - 8} fit")
            _write_text(self._mm, _PROFILE_DIRECTORY_OFFSET, PROFILE_DIRECTORY_BYTES, directory)
        slots = self._slots
        slots[_PROFILE_ACTIVE] = int(directory is not None)
        generation = slots[_PROFILE_GENERATION] + 1
        slots[_PROFILE_GENERATION] = generation  # last: a stage that sees it sees the request
        return generation

    def generation(self) -> int:
        """The latest request's generation: what a stage reads on every tick."""
        return self._slots[_PROFILE_GENERATION]

    @property
    def active(self) -> bool:
        return bool(self._slots[_PROFILE_ACTIVE])

    def current(self) -> ProfileRequest:
        """The latest request."""
        slots = self._slots
        while True:
            generation = slots[_PROFILE_GENERATION]
            active = slots[_PROFILE_ACTIVE]
            directory = _read_text(self._mm, _PROFILE_DIRECTORY_OFFSET) if active else None
            if slots[_PROFILE_GENERATION] == generation:  # else a newer request came in while reading
                return ProfileRequest(generation, directory)

    def answer(self, index: int, answer: ProfileAnswer) -> None:
        """Stage `index` answers a request."""
        outcome_slot = _stage_slot(index, _PROFILE_OUTCOME)
        _write_text(self._mm, _PROFILE_MESSAGES_OFFSET + index * PROFILE_MESSAGE_BYTES, PROFILE_MESSAGE_BYTES,
                    answer.message)
        self._slots[outcome_slot] = answer.outcome
        self._slots[_stage_slot(index, _PROFILE_ANSWERED)] = answer.generation  # last

    def answer_of(self, index: int) -> ProfileAnswer:
        """Stage `index`'s latest answer."""
        generation = self._slots[_stage_slot(index, _PROFILE_ANSWERED)]
        outcome = ProfileOutcome(self._slots[_stage_slot(index, _PROFILE_OUTCOME)])
        message = _read_text(self._mm, _PROFILE_MESSAGES_OFFSET + index * PROFILE_MESSAGE_BYTES)
        return ProfileAnswer(generation, outcome, message)


class StatusBoard:
    """A mapping of the status segment. `create` in the daemon, `open` in each stage."""

    def __init__(self, segment: SharedSegment) -> None:
        self.name = segment.name
        self._segment = segment
        self._slots = segment.slots
        self.limits = LimitsArea(segment)
        self.counters = CountersArea(segment.slots)
        self.stages = StageArea(segment)
        self.profile = ProfileArea(segment)

    @classmethod
    def create(cls, instance: str) -> StatusBoard:
        return cls(SharedSegment.create(ring_name(instance, "status"), SIZE_BYTES, MAGIC))

    @classmethod
    def open(cls, name: str) -> StatusBoard:
        return cls(SharedSegment.open(name, MAGIC, "status board"))

    def unlink(self) -> None:
        self._segment.unlink()

    def close(self) -> None:
        self._segment.close()

    # ---- the daemon's

    def request_stop(self) -> None:
        self._slots[_STOP] = 1

    @property
    def stop_requested(self) -> bool:
        return bool(self._slots[_STOP])

    def bump_frontend_generation(self) -> int:
        """The fresh frontend links exist: the scheduler moves onto them. Returns the generation."""
        generation = self._slots[_FRONTEND_GENERATION] + 1
        self._slots[_FRONTEND_GENERATION] = generation
        return generation

    def frontend_generation(self) -> int:
        return self._slots[_FRONTEND_GENERATION]
