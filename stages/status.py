"""The status board: one small shared segment where every stage reports liveness and counters.

Layout (int64 slots; each written by one process):

    0..7            magic, stop flag (the daemon's), model limits published by the runner:
                    limits ready, num_kv_blocks, max_model_len, vocab_size, num_host_blocks;
                    the frontend generation (the daemon's)
    8..15           eos token ids (count, then up to 7 ids)               (the runner's)
    16..23          scheduler counters: waiting, running, kv used, kv free, tokens
                    generated, preemptions, prefix cache tokens queried and hit (the scheduler's)
    24 + 8*s ..     stage s: pid, heartbeat (CLOCK_MONOTONIC ns), ready,
                    profile answer: generation answered, outcome,
                    frontend generation taken up                          (stage s's)
    then            an error message area of ERROR_BYTES per stage (utf-8, length-prefixed)
    then            the profile request: generation, active, directory
                    (PROFILE_DIRECTORY_BYTES, utf-8, length-prefixed)     (the daemon's)
    then            a profile answer message area of PROFILE_MESSAGE_BYTES per stage: the
                    trace file written, or why not                        (stage s's)
    then            speculative decoding counters: drafts verified, drafts accepted,
                    (request, step) pairs that verified drafts            (the scheduler's)

CLOCK_MONOTONIC is one clock for every process on the machine, so heartbeat ages compare.
A profile request is posted by writing the directory and the active flag, then bumping the
generation; a stage that sees a new generation on its tick answers with its outcome and message,
then the generation it answered (last, so the daemon that sees it sees the rest).

The frontend generation counts restarts of the frontend group alone (stages/contracts/topology.py):
the daemon bumps it once the fresh links exist, and the scheduler, having let go of every
request and moved its ends onto them, answers with the generation it took up.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from enum import IntEnum

from shm.naming import ring_name
from shm.segment import SharedSegment
from stages.contracts.config import ModelLimits

MAGIC = 0x31544154535F5049  # b"IP_STAT1"
MAX_STAGES = 64
MAX_EOS_IDS = 4
ERROR_BYTES = 1024
(_MAGIC, _STOP, _LIMITS_READY, _NUM_KV_BLOCKS, _MAX_MODEL_LEN, _VOCAB_SIZE, _NUM_HOST_BLOCKS,
 _FRONTEND_GENERATION) = range(8)
_EOS = 8  # a count, then MAX_EOS_IDS ids
_WINDOW, _LOCAL_WINDOW, _NUM_WINDOW_BLOCKS = 13, 14, 15
_COUNTERS = 16
_STAGES = 24
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
_SPEC_COUNTERS = (_PROFILE_MESSAGES_OFFSET + MAX_STAGES * PROFILE_MESSAGE_BYTES) // 8
_NUM_SPEC_COUNTERS = 3
SIZE_BYTES = (_SPEC_COUNTERS + _NUM_SPEC_COUNTERS) * 8


@dataclass(slots=True)
class SchedulerCounters:
    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_free: int
    tokens_generated: int
    num_preemptions: int
    num_prefix_queried_tokens: int
    num_prefix_hit_tokens: int
    num_draft_tokens: int = 0  # speculative decoding: drafts verified
    num_accepted_tokens: int = 0  # of those, accepted
    num_verifications: int = 0  # (request, step) pairs that verified drafts

    @property
    def prefix_cache_hit_rate(self) -> float:
        """The share of admitted requests' tokens found in the prefix cache (0 before any)."""
        return self.num_prefix_hit_tokens / self.num_prefix_queried_tokens if self.num_prefix_queried_tokens else 0.0


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


class StatusBoard:
    """A mapping of the status segment. `create` in the daemon, `open` in each stage."""

    def __init__(self, segment: SharedSegment) -> None:
        self.name = segment.name
        self._segment = segment
        self._mm = segment.mm
        self._slots = segment.slots

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

    def bump_frontend_generation(self) -> int:
        """The fresh frontend links exist: the scheduler moves onto them. Returns the generation."""
        generation = self._slots[_FRONTEND_GENERATION] + 1
        self._slots[_FRONTEND_GENERATION] = generation
        return generation

    def frontend_generation(self) -> int:
        return self._slots[_FRONTEND_GENERATION]

    def take_up_frontend(self, index: int, generation: int) -> None:
        self._slots[self._stage(index, _FRONTEND_TAKEN)] = generation

    def frontend_taken(self, index: int) -> int:
        """The frontend generation stage `index` has moved onto."""
        return self._slots[self._stage(index, _FRONTEND_TAKEN)]

    @property
    def stop_requested(self) -> bool:
        return bool(self._slots[_STOP])

    # ---- model limits (the runner's)

    def publish_limits(self, limits: ModelLimits) -> None:
        eos = limits.eos_token_ids[:MAX_EOS_IDS]
        slots = self._slots
        slots[_NUM_KV_BLOCKS] = limits.num_kv_blocks
        slots[_MAX_MODEL_LEN] = limits.max_model_len
        slots[_VOCAB_SIZE] = limits.vocab_size
        slots[_NUM_HOST_BLOCKS] = limits.num_host_blocks
        slots[_WINDOW], slots[_LOCAL_WINDOW] = limits.window, limits.local_window
        slots[_NUM_WINDOW_BLOCKS] = limits.num_window_blocks
        slots[_EOS] = len(eos)
        for index, token_id in enumerate(eos):
            slots[_EOS + 1 + index] = token_id
        slots[_LIMITS_READY] = 1  # last: a reader that sees it sees the rest (x86-64 store order)

    def limits(self) -> ModelLimits | None:
        slots = self._slots
        if not slots[_LIMITS_READY]:
            return None
        eos = [slots[_EOS + 1 + i] for i in range(slots[_EOS])]
        return ModelLimits(slots[_NUM_KV_BLOCKS], slots[_MAX_MODEL_LEN], slots[_VOCAB_SIZE], eos,
                           slots[_NUM_HOST_BLOCKS], slots[_WINDOW], slots[_LOCAL_WINDOW], slots[_NUM_WINDOW_BLOCKS])

    # ---- scheduler counters

    def publish_counters(self, counters: SchedulerCounters) -> None:
        slots = self._slots
        slots[_COUNTERS + 0] = counters.num_waiting
        slots[_COUNTERS + 1] = counters.num_running
        slots[_COUNTERS + 2] = counters.kv_blocks_used
        slots[_COUNTERS + 3] = counters.kv_blocks_free
        slots[_COUNTERS + 4] = counters.tokens_generated
        slots[_COUNTERS + 5] = counters.num_preemptions
        slots[_COUNTERS + 6] = counters.num_prefix_queried_tokens
        slots[_COUNTERS + 7] = counters.num_prefix_hit_tokens
        slots[_SPEC_COUNTERS + 0] = counters.num_draft_tokens
        slots[_SPEC_COUNTERS + 1] = counters.num_accepted_tokens
        slots[_SPEC_COUNTERS + 2] = counters.num_verifications

    def counters(self) -> SchedulerCounters:
        slots = self._slots
        return SchedulerCounters(*(slots[_COUNTERS + i] for i in range(8)),
                                 *(slots[_SPEC_COUNTERS + i] for i in range(_NUM_SPEC_COUNTERS)))

    # ---- per stage

    def _stage(self, index: int, field: int) -> int:
        if not 0 <= index < MAX_STAGES:
            raise ValueError(f"stage index must be in [0, {MAX_STAGES}), got {index}")
        return _STAGES + index * _STAGE_SLOTS + field

    def beat(self, index: int) -> None:
        self._slots[self._stage(index, _HEARTBEAT)] = time.monotonic_ns()

    def mark_started(self, index: int, pid: int) -> None:
        self._slots[self._stage(index, _PID)] = pid
        self.beat(index)

    def mark_ready(self, index: int) -> None:
        self.beat(index)
        self._slots[self._stage(index, _READY)] = 1

    def clear_stage(self, index: int) -> None:
        """Forget stage `index`'s process (the daemon's, before starting a replacement there)."""
        for field in (_READY, _PID, _HEARTBEAT):
            self._slots[self._stage(index, field)] = 0
        self.set_error(index, "")

    def is_ready(self, index: int) -> bool:
        return bool(self._slots[self._stage(index, _READY)])

    def pid(self, index: int) -> int:
        return self._slots[self._stage(index, _PID)]

    def heartbeat_age_s(self, index: int) -> float:
        beat = self._slots[self._stage(index, _HEARTBEAT)]
        return float("inf") if beat == 0 else max(0.0, (time.monotonic_ns() - beat) / 1e9)

    def set_error(self, index: int, message: str) -> None:
        self._stage(index, 0)  # validates the index
        self._write_text(_ERRORS_OFFSET + index * ERROR_BYTES, ERROR_BYTES, message)

    def error(self, index: int) -> str:
        self._stage(index, 0)
        return self._read_text(_ERRORS_OFFSET + index * ERROR_BYTES)

    def _write_text(self, offset: int, area_bytes: int, text: str) -> None:
        """A length-prefixed utf-8 area, cut to fit (never inside a character)."""
        data = text.encode("utf-8")[:area_bytes - 8].decode("utf-8", "ignore").encode("utf-8")
        self._mm[offset + 8:offset + 8 + len(data)] = data
        self._mm[offset:offset + 8] = len(data).to_bytes(8, "little")

    def _read_text(self, offset: int) -> str:
        length = int.from_bytes(self._mm[offset:offset + 8], "little")
        return self._mm[offset + 8:offset + 8 + length].decode("utf-8", "replace")

    # ---- profile requests (the daemon's) and answers (each stage's own)

    def request_profile(self, directory: str | None) -> int:
        """Asks every stage to capture into `directory`, or (None) to stop; returns the request's
        generation. Raises ValueError for a directory whose utf-8 path does not fit the area."""
        if directory is not None:
            data = directory.encode("utf-8")
            if len(data) > PROFILE_DIRECTORY_BYTES - 8:
                raise ValueError(f"profile directory {directory!r} is {len(data)} bytes; at most "
                                 f"{PROFILE_DIRECTORY_BYTES - 8} fit")
            self._write_text(_PROFILE_DIRECTORY_OFFSET, PROFILE_DIRECTORY_BYTES, directory)
        slots = self._slots
        slots[_PROFILE_ACTIVE] = int(directory is not None)
        generation = slots[_PROFILE_GENERATION] + 1
        slots[_PROFILE_GENERATION] = generation  # last: a stage that sees it sees the request
        return generation

    def profile_generation(self) -> int:
        """The latest request's generation: what a stage reads on every tick."""
        return self._slots[_PROFILE_GENERATION]

    @property
    def profile_active(self) -> bool:
        return bool(self._slots[_PROFILE_ACTIVE])

    def profile_request(self) -> ProfileRequest:
        slots = self._slots
        while True:
            generation = slots[_PROFILE_GENERATION]
            active = slots[_PROFILE_ACTIVE]
            directory = self._read_text(_PROFILE_DIRECTORY_OFFSET) if active else None
            if slots[_PROFILE_GENERATION] == generation:  # else a newer request came in while reading
                return ProfileRequest(generation, directory)

    def answer_profile(self, index: int, answer: ProfileAnswer) -> None:
        outcome_slot = self._stage(index, _PROFILE_OUTCOME)
        self._write_text(_PROFILE_MESSAGES_OFFSET + index * PROFILE_MESSAGE_BYTES, PROFILE_MESSAGE_BYTES,
                         answer.message)
        self._slots[outcome_slot] = answer.outcome
        self._slots[self._stage(index, _PROFILE_ANSWERED)] = answer.generation  # last

    def profile_answer(self, index: int) -> ProfileAnswer:
        generation = self._slots[self._stage(index, _PROFILE_ANSWERED)]
        outcome = ProfileOutcome(self._slots[self._stage(index, _PROFILE_OUTCOME)])
        message = self._read_text(_PROFILE_MESSAGES_OFFSET + index * PROFILE_MESSAGE_BYTES)
        return ProfileAnswer(generation, outcome, message)
