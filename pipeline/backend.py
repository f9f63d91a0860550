"""The daemon's handle on the stage processes: submit requests, abort them, read their output.

`Backend` creates every ring of its instance (`/pipeline-<instance>-<link>`) and the status
board, spawns the stages (runner, scheduler, detokenizer, `num_tokenizers` tokenizer workers),
waits until each reports ready, and then only writes requests and aborts and reads output
events. The runner makes the token mailbox itself, since its kind follows the runner's device.

    daemon -generate{i}-> tokenizer{i} -tokenized{i}-> scheduler -plan-> runner
    daemon -abort-> scheduler            runner -done-> scheduler, detokenizer (broadcast)
    scheduler -manifest-> detokenizer -events-> daemon;   detokenizer -stop_strings-> scheduler
"""
from __future__ import annotations

import atexit
import json
import logging
import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.errors import Overloaded, StageFailed
from pipeline.sampling_params import SamplingParams
from shm.naming import pid_alive, ring_name, sweep_stale, unlink_instance
from shm.ring import RingReader, RingTimeout, RingWriter
from shm.segment import PeerDied, RingSegment
from stages.gpu_runner.mailbox import unlink_mailbox
from stages.messages import Kind, decode_events, encode_generate, encode_req_id
from stages.process import EXIT_PEER_DIED, launch
from stages.profiling import ProfileControl
from stages.status import StatusBoard

log = logging.getLogger("pipeline.backend")

TOKENIZER_FILE = "tokenizer.json"
REQUEST_RING_BYTES = 4 << 20
PLAN_RING_BYTES = 16 << 20  # a plan carries every admitted request's whole prompt
EVENT_RING_BYTES = 8 << 20
CONTROL_RING_BYTES = 1 << 16
MIN_MAILBOX_SLOTS = 3  # two steps in flight (async) plus the one being written
MAX_TOKENIZERS = 32
LIVENESS_CHECK_S = 0.1  # read_events looks at the stage processes at least this often
MAX_RECORDS_PER_READ = 64  # event batches one read_events call returns at most
READY_POLL_S = 0.01
KILL_GRACE_S = 1.0
REAP_WAIT_S = 1.0  # how long a stage seen dead may take to become reapable (its threads exiting)
MIN_RATE_WINDOW_S = 0.5


@dataclass(slots=True)
class EngineConfig:
    model: str  # checkpoint directory
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_kv_blocks: int | None = None
    num_tokenizers: int = 1
    async_scheduling: bool = True
    enable_prefix_caching: bool = True
    kv_connector: str | None = None  # None | "offload"
    seed: int | None = None  # the runner's generator, for unseeded sampling
    mailbox_slots: int = 8  # token mailbox slots: more than the steps that can be in flight
    start_timeout_s: float = 300.0  # how long the stages may take to load the model and get ready


@dataclass(slots=True)
class OutputEvent:
    """New output of one request. The last event of a request has finish_reason or error set."""

    req_id: int
    text: str  # new text since the last event
    token_ids: np.ndarray  # int32: new token ids since the last event
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    prompt_token_ids: np.ndarray | None = None  # int32, in the request's first event
    logprobs: np.ndarray | None = None  # float32 [len(token_ids), 1 + k] when asked
    logprob_token_ids: np.ndarray | None = None  # int32 [len(token_ids), 1 + k]
    error_code: str | None = None  # wire error code when the request was refused
    error_message: str | None = None
    error_field: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it; None for EOS


@dataclass(slots=True)
class StageHealth:
    name: str
    pid: int
    alive: bool
    heartbeat_age_s: float  # seconds since the stage's loop last went round


@dataclass(slots=True)
class BackendStats:
    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_free: int
    generated_tokens_per_s: float
    num_restarts: int
    prefix_cache_hit_rate: float = 0.0


class Backend:
    """The stage processes of one engine instance and the daemon's ends of their rings.

    Threads: `read_events` is meant for one thread; `submit`, `abort`, `health`, `stats` may be
    called from another (the ring ends they write are guarded by one lock). `close` from any.
    """

    def __init__(self, config: EngineConfig, instance: str) -> None:
        """Creates the rings and the mailbox, spawns the stages, returns once all are ready."""
        _check_config(config)
        self.config = config
        self.instance = instance
        self._lock = threading.Lock()
        self._closed = False
        self._procs: list[tuple[str, mp.process.BaseProcess]] = []
        self._live: set[int] = set()  # submitted and not yet finished: abort targets
        self._pending_aborts: deque[int] = deque()  # aborts that found the abort ring full
        self._next_tokenizer = 0
        self._rate = _TokenRate()
        self._writers: list[RingWriter] = []
        self._readers: list[RingReader] = []
        swept = sweep_stale()
        if swept:
            log.info("removed %d /dev/shm entries left by dead instances", len(swept))
        atexit.register(self.close)
        try:
            self._start()
        except BaseException:
            self.close(timeout_s=2.0)
            raise

    def _start(self) -> None:
        config, instance = self.config, self.instance
        self._board = StatusBoard.create(instance)
        self._profile = ProfileControl(
            self._board, lambda: {index: name for index, (name, p) in enumerate(self._procs) if p.is_alive()})
        segments: dict[str, RingSegment] = {}

        def ring(link: str, capacity_bytes: int, num_readers: int = 1) -> str:
            segments[link] = RingSegment.create(instance, link, capacity_bytes, num_readers)
            return segments[link].name

        num_tok = config.num_tokenizers
        rings = {
            "generate": [ring(f"generate{i}", REQUEST_RING_BYTES) for i in range(num_tok)],
            "tokenized": [ring(f"tokenized{i}", REQUEST_RING_BYTES) for i in range(num_tok)],
            "abort": ring("abort", CONTROL_RING_BYTES),
            "plan": ring("plan", PLAN_RING_BYTES),
            "done": ring("done", CONTROL_RING_BYTES, num_readers=2),
            "manifest": ring("manifest", PLAN_RING_BYTES),
            "stop_strings": ring("stop_strings", CONTROL_RING_BYTES),
            "events": ring("events", EVENT_RING_BYTES),
        }
        # The daemon's own ends; the creator's mappings of the others are not needed.
        self._generate = [RingWriter(segments[f"generate{i}"]) for i in range(num_tok)]
        self._abort = RingWriter(segments["abort"])
        self._events = RingReader(segments["events"])
        self._writers = [*self._generate, self._abort]
        self._readers = [self._events]
        for link, segment in segments.items():
            if not (link.startswith("generate") or link in ("abort", "events")):
                segment.close()
        model_dir = Path(config.model)
        tokenizer_file = model_dir / TOKENIZER_FILE
        common = {
            "instance": instance, "parent_pid": os.getpid(), "status": self._board.name,
            "mailbox": ring_name(instance, "mailbox"), "tokenizer_path": str(tokenizer_file),
            "start_timeout_s": config.start_timeout_s, "config": _plain(config),
        }
        stages = [("runner", "stages.gpu_runner.stage", {"plan": rings["plan"], "done": rings["done"]}),
                  ("scheduler", "stages.scheduler.stage", rings),
                  ("detokenizer", "stages.detokenizer.stage", rings)]
        stages += [(f"tokenizer{i}", "stages.tokenizer.stage",
                    {"generate": rings["generate"][i], "tokenized": rings["tokenized"][i]}) for i in range(num_tok)]
        ctx = mp.get_context("spawn")
        for index, (name, module, stage_rings) in enumerate(stages):
            spec = dict(common, name=name, index=index, rings=stage_rings)
            # Not daemonic, so a daemon that is itself a multiprocessing child may start stages;
            # the atexit hook registered in __init__ stops them if the owner exits without close().
            process = ctx.Process(target=_stage_process, args=(module, json.dumps(spec)), name=f"pipeline-{name}")
            process.start()
            self._procs.append((name, process))
        self._wait_ready()
        # Every end has attached: the rings unlinked themselves; these two are ours to unlink.
        unlink_mailbox(ring_name(instance, "mailbox"))
        self._board.unlink()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while not all(self._board.is_ready(index) for index in range(len(self._procs))):
            failed = self._failed_stage()
            if failed is not None:
                raise failed
            if time.monotonic() > deadline:
                waiting = [name for index, (name, _) in enumerate(self._procs) if not self._board.is_ready(index)]
                raise StageFailed(f"stages {waiting} were not ready within {self.config.start_timeout_s} s")
            time.sleep(READY_POLL_S)  # start-up only: model loading takes seconds

    def _failed_stage(self) -> StageFailed | None:
        """StageFailed naming a dead stage, if any died: one that failed on its own (killed, or
        its own error) is named before one that ended because a peer died under it."""
        dead = [(index, name, p.exitcode) for index, (name, p) in enumerate(self._procs) if p.exitcode is not None]
        if not dead:
            return None
        if all(code == EXIT_PEER_DIED for _, _, code in dead) and self._reap_dead_peers():
            return self._failed_stage()
        dead.sort(key=lambda d: (d[2] == EXIT_PEER_DIED, d[2] >= 0))  # killed first, then own errors
        index, name, code = dead[0]
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        error = self._board.error(index)
        ready = "" if self._board.is_ready(index) else " while starting"
        return StageFailed(f"stage {name!r} {how}{ready}" + (f": {error}" if error else ""))

    def _reap_dead_peers(self) -> bool:
        """Waits (briefly) for the exit status of stages that are dead but not yet reapable; True
        if one came. A stage that ended because a peer died can be reaped before that peer: a
        killed process with many threads is seen dead (a zombie leader) while its threads exit."""
        reaped = False
        for _, process in self._procs:
            if process.exitcode is None and not pid_alive(process.pid or 0):
                process.join(REAP_WAIT_S)
                reaped = reaped or process.exitcode is not None
        return reaped

    def submit(self, req_id: int, prompt: str | list[int], params: SamplingParams) -> None:
        """Queue a request without ever waiting (the daemon calls this on its event loop).

        Raises Overloaded when the tokenizer worker's request ring is full (it is that far behind),
        RecordTooLarge when the prompt cannot fit a record (REQUEST_RING_BYTES), StageFailed if
        the tokenizer worker died.
        """
        _check_req_id(req_id)
        parts = encode_generate(req_id, prompt, params)
        with self._lock:
            self._check_open()
            if req_id in self._live:
                raise ValueError(f"req_id {req_id} is already running; ids must be unique among running requests")
            index = self._next_tokenizer
            self._next_tokenizer = (index + 1) % len(self._generate)
            if not self._write(self._generate[index], Kind.GENERATE, parts):
                raise Overloaded(f"the request ring of tokenizer{index} is full ({REQUEST_RING_BYTES} bytes of "
                                 "requests not yet tokenized); retry later")
            self._live.add(req_id)

    def abort(self, req_id: int) -> None:
        """Stop a request; its last event has finish_reason "abort". Unknown or finished ids are
        ignored. Never waits: an abort that finds the abort ring full is sent later."""
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
                return  # the scheduler drains the ring every step; read_events tries again
            self._pending_aborts.popleft()

    def _write(self, writer: RingWriter, kind: int, parts: list[bytes]) -> bool:
        """Writes one record if there is room now; False if the ring is full."""
        try:
            writer.write(kind, *parts, timeout=0.0)
        except RingTimeout:
            return False
        except PeerDied as exc:
            raise self._failed_stage() or StageFailed(str(exc)) from None
        return True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the backend is closed")

    def read_events(self, timeout_s: float) -> list[OutputEvent]:
        """Blocks up to timeout_s for output; raises StageFailed when a stage has died."""
        deadline = time.monotonic() + timeout_s
        self._rate.update(self._board.counters().tokens_generated)
        if self._pending_aborts:
            with self._lock:
                self._send_pending_aborts()
        while True:
            failed = self._failed_stage()
            if failed is not None:
                raise failed
            try:
                record = self._events.read(timeout=min(LIVENESS_CHECK_S, max(0.0, deadline - time.monotonic())))
            except PeerDied:
                raise self._failed_stage() or StageFailed("stage 'detokenizer' died") from None
            if record is not None:
                break
            if time.monotonic() >= deadline:
                return []
        events: list[OutputEvent] = []
        for _ in range(MAX_RECORDS_PER_READ):
            events.extend(decode_events(record.payload, OutputEvent))
            record = self._events.try_read()
            if record is None:
                break
        self._events.release()
        finished = [e.req_id for e in events if e.finish_reason is not None or e.error_code is not None]
        if finished:
            with self._lock:
                self._live.difference_update(finished)
        return events

    def start_profile(self, directory: str) -> None:
        """Every live stage starts a torch.profiler capture (stages/profiling.py) for `directory`, an
        absolute path to a directory only its owner may write; returns once all have started.
        Raises InvalidRequest (bad directory, a capture already running) or StageFailed."""
        self._profile.start(directory)

    def stop_profile(self) -> list[str]:
        """Ends the capture; returns the Chrome-trace file each live stage wrote
        (`<directory>/<stage>.json`). Raises InvalidRequest when none runs, or StageFailed."""
        return self._profile.stop()

    def health(self) -> list[StageHealth]:
        return [StageHealth(name, process.pid or 0, process.is_alive(), self._board.heartbeat_age_s(index))
                for index, (name, process) in enumerate(self._procs)]

    def stats(self) -> BackendStats:
        counters = self._board.counters()
        return BackendStats(counters.num_waiting, counters.num_running, counters.kv_blocks_used,
                            counters.kv_blocks_free, self._rate.tokens_per_s, num_restarts=0,
                            prefix_cache_hit_rate=counters.prefix_cache_hit_rate)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops every stage and removes every shm entry of this instance."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        board = getattr(self, "_board", None)
        if board is not None:
            board.request_stop()
        deadline = time.monotonic() + timeout_s
        for _, process in self._procs:
            process.join(max(0.0, deadline - time.monotonic()))
        for _, process in self._procs:
            if process.exitcode is None:
                process.terminate()
        for _, process in self._procs:
            process.join(KILL_GRACE_S)
            if process.exitcode is None:
                process.kill()
                process.join()
        for end in [*self._writers, *self._readers]:
            end.close()
        if board is not None:
            board.close()
        unlink_instance(self.instance)


class _TokenRate:
    """Tokens per second over the last window of at least MIN_RATE_WINDOW_S. `update` is called by
    the thread in read_events (at least every call's timeout); `tokens_per_s` may be read by any."""

    def __init__(self) -> None:
        self._last = (time.monotonic(), 0)
        self.tokens_per_s = 0.0

    def update(self, tokens_generated: int) -> None:
        now = time.monotonic()
        last_time, last_tokens = self._last
        if now - last_time >= MIN_RATE_WINDOW_S:
            self.tokens_per_s = (tokens_generated - last_tokens) / (now - last_time)
            self._last = (now, tokens_generated)


def _stage_process(module: str, spec_json: str) -> None:
    """Process target of a stage: runs it, then ends the process at once with its exit code.

    Skipping the interpreter's teardown is safe, since a stage leaves nothing to finalize (its
    rings are shared memory, its own cleanup ran before it returned), and needed: with torch
    loaded the teardown takes a second or more, which a stage following a dead daemon or a
    restart waiting for the old stages to go should not spend.
    """
    code = 1
    try:
        launch(module, spec_json)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - the stage could not even start: say why before leaving
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _plain(config: EngineConfig) -> dict[str, object]:
    """The config as JSON-able values, for the stage specs."""
    return {name: getattr(config, name) for name in EngineConfig.__slots__}


def _check_req_id(req_id: int) -> None:
    if isinstance(req_id, bool) or not isinstance(req_id, int) or not 0 <= req_id < 2**63:
        raise ValueError(f"req_id must be an integer in [0, 2**63), got {req_id!r}")


def _check_config(config: EngineConfig) -> None:
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_tokenizers", "mailbox_slots"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if config.mailbox_slots < MIN_MAILBOX_SLOTS:
        raise ValueError(f"mailbox_slots must be at least {MIN_MAILBOX_SLOTS} (the steps that can be in flight "
                         f"plus one), got {config.mailbox_slots}")
    if config.num_tokenizers > MAX_TOKENIZERS:
        raise ValueError(f"num_tokenizers must be at most {MAX_TOKENIZERS}, got {config.num_tokenizers}")
    if config.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {config.device!r}")
    if config.kv_connector not in (None, "offload"):
        raise ValueError(f"kv_connector must be None or 'offload', got {config.kv_connector!r}")
    if not (Path(config.model) / TOKENIZER_FILE).is_file():
        raise ValueError(f"model {config.model!r} has no {TOKENIZER_FILE}")
    if not config.start_timeout_s > 0:
        raise ValueError(f"start_timeout_s must be positive, got {config.start_timeout_s!r}")
