"""The stage processes as the daemon's backend: submit requests, abort them, read their output.

`StageBackend` creates every link of its instance (`/pipeline-<instance>-<link>`, from the table
in stages/contracts/topology.py) and the status board, starts the stages the table names
(runner, scheduler, detokenizer, `num_tokenizers` tokenizer workers), waits until each reports
ready, and then only writes requests and aborts and reads output events. The runner makes the
token mailbox itself, since its kind follows the runner's device. When a stage of a group that
restarts alone dies (the frontend: tokenizer workers and detokenizer), `restart_stage` restarts
that group on fresh links while the engine's stages, and the KV cache they hold, run on.

The stages fork from a server process that the first backend starts and that has imported
their modules (torch among them) once: a restart after a crash then costs a fork and the
model's load from the page cache, a fraction of a second, instead of a fresh interpreter and
seconds of imports per stage. The server has touched no accelerator, so a forked runner starts
CUDA as a spawned one would. Under Nsight Systems, which traces a process only from its exec,
the stages are spawned instead.
"""
from __future__ import annotations

import atexit
import json
import logging
import multiprocessing as mp
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Sequence

from pipeline.errors import Overloaded, StageFailed
from pipeline.engine.backend import LIVENESS_CHECK_S, BackendStats, StageHealth
from pipeline.serve.nsys import SESSION_ENV
from pipeline.serve.profile_control import ProfileControl
from shm.naming import pid_alive, ring_name, sweep_stale, unlink_instance
from shm.ring import Record, RingReader, RingTimeout, RingWriter
from shm.segment import PeerDied, RingSegment
from stages.contracts.config import EngineConfig
from stages.contracts.outputs import OutputEvent, TokenTexts
from stages.contracts.params import SamplingParams
from stages.contracts.topology import (DAEMON, STAGES, Link, Stage, links, restart_group, segment_link, stages,
                                       touches)
from stages.events import coalesce_outputs, decode_events, decode_token_texts
from stages.messages import Kind, encode_generate, encode_req_id
from stages.process import EXIT_PEER_DIED, launch
from stages.status import StatusBoard

log = logging.getLogger("pipeline.engine.supervision")

# The daemon's read of the events ring sleeps on the doorbell at once: a step's events come once
# per device step, so a spin before sleeping is CPU spent for nothing on every step (about a
# tenth of the daemon's CPU at batch 256) and the wake-up costs tens of µs of delivery.
EVENTS_SPIN_S = 0.0
MAX_RECORDS_PER_READ = 64  # event batches one read_events call returns at most
READY_POLL_S = 0.01
KILL_GRACE_S = 1.0
REAP_WAIT_S = 1.0  # how long a stage seen dead may take to become reapable (its threads exiting)
MIN_RATE_WINDOW_S = 0.5
# multiprocessing's exit code for a child whose forkserver died: the server reports each child's
# exit, and with it gone the report is lost, though the child (a stage) may well run on.
FORKSERVER_LOST = 255
# What the stages' server imports before its first fork: every stage's module and torch._dynamo,
# which the runner's first model construction would import otherwise (nn.init on the meta
# device goes through it: a second and more).
PRELOAD_MODULES = sorted({stage.module for stage in STAGES} | {"torch._dynamo"})


class StageBackend:
    """The stage processes of one engine instance and the daemon's ends of their rings.

    Threads: `read_events` (or `poll_outputs`) is meant for one thread; `submit`, `abort`,
    `health`, `stats` may be called from another (the ring ends they write are guarded by one
    lock), `check_stages` from another. `close` from any.
    """

    def __init__(self, config: EngineConfig, instance: str) -> None:
        """Creates the rings and the mailbox, spawns the stages, returns once all are ready."""
        if not config.tokenizer_path.is_file():
            raise ValueError(f"model {config.model!r} has no {config.tokenizer_path.name}")
        self.config = config.with_rendezvous_port()  # a fresh port per instance: a restart never meets the last
        self.instance = instance
        self._lock = threading.Lock()
        self._closed = False
        self._procs: list[tuple[str, mp.process.BaseProcess]] = []
        self._live: set[int] = set()  # submitted and not yet finished: abort targets
        self._pending_aborts: deque[int] = deque()  # aborts that found the abort ring full
        self._next_liveness_check_s = 0.0  # read_outputs looks at the stage processes from then on
        self._next_tokenizer = 0
        self._forkserver_watch: threading.Thread | None = None  # replacing a dead forkserver
        self._rate = _TokenRate()
        self._ends: dict[str, RingWriter | RingReader] = {}  # this process's ends, by link name
        self._frontend_generation = 0
        swept = sweep_stale()
        if swept:
            log.info("removed %d /dev/shm entries left by dead daemons: %s", len(swept), " ".join(swept))
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
        self._ring_names = self._make_links(links(config.num_tokenizers, config.ranks_per_node), generation=0)
        self._common_spec = {"instance": instance, "parent_pid": os.getpid(), "status": self._board.name,
                             "mailbox": ring_name(instance, "mailbox"), "config": config.to_dict()}
        for index, stage in enumerate(self.stage_table()):
            self._procs.append((stage.name, self._spawn(index, stage)))
        self._wait_ready(range(len(self._procs)))
        self.limits = self._board.limits()
        # The status board and the mailbox keep their names while the instance lives, so that a
        # restarted frontend stage can open them; close() removes them, or, once the daemon is
        # dead, its stages as they exit (stages/process.py), or else the sweep of the next start.

    def _make_links(self, table: list[Link], generation: int) -> dict[str, str]:
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
        self._generate = [self._ends[f"generate{i}"] for i in range(self.config.num_tokenizers)]
        self._abort = self._ends["abort"]
        self._events = self._ends["events"]
        return names

    def _spawn(self, index: int, stage: Stage) -> mp.process.BaseProcess:
        spec = dict(self._common_spec, name=stage.name, index=index, links=self._ring_names)
        # Not daemonic, so a daemon that is itself a multiprocessing child may start stages;
        # the atexit hook registered in __init__ stops them if the owner exits without close().
        process = _process_context().Process(target=_stage_process, args=(stage.module, json.dumps(spec)),
                                             name=f"pipeline-{stage.name}")
        process.start()
        return process

    def stage_table(self) -> list[Stage]:
        """The stage processes to start, in order: the link table's (a test double swaps a module)."""
        return stages(self.config.num_tokenizers, self.config.ranks_per_node)

    def restart_stage(self, stage: str) -> bool:
        """Restarts the group of `stage`, which died, while the other stages run on, if that group
        restarts alone (stages/contracts/topology.py); False if it does not (the whole backend
        must restart). The group's other stages are killed; its links are made afresh; the stages
        at their other ends move onto them, letting go of every request, before the fresh group
        starts. Every request submitted before is gone: resubmit those still wanted. Raises
        StageFailed if the restart failed (the backend is then only good for closing)."""
        group = restart_group(stage, self.config.num_tokenizers, self.config.ranks_per_node)
        indexes = [index for index, (name, _) in enumerate(self._procs) if name in group]
        if len(indexes) == len(self._procs):
            return False
        # By pid: the exit status of a stage whose forkserver is stopped or gone never comes.
        if not all(pid_alive(process.pid or 0) for name, process in self._procs if name not in group):
            return False  # a stage of another group died as well (it may be the cause): every stage restarts
        deadline = time.monotonic() + KILL_GRACE_S
        for index in indexes:
            _signal(self._procs[index][1], signal.SIGKILL)
        for index in indexes:
            process = self._procs[index][1]
            process.join(max(0.0, deadline - time.monotonic()))
            while pid_alive(process.pid or 0) and time.monotonic() < deadline:
                time.sleep(READY_POLL_S)
            if pid_alive(process.pid or 0):
                raise StageFailed(f"stage {self._procs[index][0]!r} outlived SIGKILL for {KILL_GRACE_S:g} s",
                                  stage=self._procs[index][0])
        fresh = [link for link in links(self.config.num_tokenizers, self.config.ranks_per_node) if touches(link, group)]
        with self._lock:
            self._check_open()
            for link in fresh:
                end = self._ends.pop(link.name, None)
                if end is not None:
                    end.close()
            self._frontend_generation += 1
            self._ring_names.update(self._make_links(fresh, self._frontend_generation))
            self._live.clear()
            self._pending_aborts.clear()
            self._next_tokenizer = 0
        for index in indexes:
            self._board.clear_stage(index)
        movers = {name for link in fresh for name in (link.writer, *link.readers)} - set(group) - {DAEMON}
        self._wait_taken_up([index for index, (name, _) in enumerate(self._procs) if name in movers],
                            self._board.bump_frontend_generation())
        table = self.stage_table()
        for index in indexes:
            self._procs[index] = (table[index].name, self._spawn(index, table[index]))
        self._wait_ready(indexes)
        log.warning("restarted %s after %s died; the other stages ran on", ", ".join(group), stage)
        return True

    def _wait_taken_up(self, indexes: list[int], generation: int) -> None:
        """Waits until the stages at `indexes` have moved onto frontend generation `generation`."""
        deadline = time.monotonic() + self.config.start_timeout_s
        while not all(self._board.frontend_taken(index) == generation for index in indexes):
            failed = self._failed_stage(among=indexes)
            if failed is not None:
                raise failed
            dead = [self._procs[index][0] for index in indexes if not pid_alive(self._procs[index][1].pid or 0)]
            if dead:
                raise StageFailed(f"stage {dead[0]!r} died during the frontend's restart", stage=dead[0])
            if time.monotonic() > deadline:
                raise StageFailed(f"the stages at the frontend's links did not move onto fresh ones within "
                                  f"{self.config.start_timeout_s} s")
            time.sleep(READY_POLL_S)  # a restart's wait: the scheduler drains at most two steps

    def _wait_ready(self, indexes: Sequence[int]) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while not all(self._board.is_ready(index) for index in indexes):
            failed = self._failed_stage()
            if failed is not None:
                raise failed
            if time.monotonic() > deadline:
                waiting = [self._procs[index][0] for index in indexes if not self._board.is_ready(index)]
                raise StageFailed(f"stages {waiting} were not ready within {self.config.start_timeout_s} s")
            time.sleep(READY_POLL_S)  # start-up only: model loading takes seconds

    def _failed_stage(self, among: Sequence[int] | None = None) -> StageFailed | None:
        """StageFailed naming a dead stage (of those at `among`, if given), if any died: one that
        failed on its own (killed, or its own error) is named before one that ended because a
        peer died under it."""
        dead = [(index, name, code) for index, (name, p) in enumerate(self._procs)
                if (among is None or index in among) and (code := _exit_code(p)) is not None]
        if not dead:
            return None
        if all(code == EXIT_PEER_DIED for _, _, code in dead) and self._reap_dead_peers():
            return self._failed_stage(among)
        dead.sort(key=lambda d: (d[2] == EXIT_PEER_DIED, d[2] >= 0))  # killed first, then own errors
        index, name, code = dead[0]
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        if code == FORKSERVER_LOST:
            how = "died (its exit status was lost with the forkserver it was forked from)"
        error = self._board.error(index)
        ready = "" if self._board.is_ready(index) else " while starting"
        return StageFailed(f"stage {name!r} {how}{ready}" + (f": {error}" if error else ""), stage=name)

    def _dead_peer_failure(self, message: str, stage: str | None) -> StageFailed:
        """The failure behind a ring's PeerDied: the ring sees its peer dead as soon as it is a
        zombie, which may be before its exit status can be read, so that is waited for briefly."""
        self._reap_dead_peers()
        return self._failed_stage() or StageFailed(message, stage=stage)

    def _reap_dead_peers(self) -> bool:
        """Waits (briefly) for the exit status of stages that are dead but not yet reapable; True
        if one came. A stage that ended because a peer died can be reaped before that peer: a
        killed process with many threads is seen dead (a zombie leader) while its threads exit."""
        reaped = False
        for _, process in self._procs:
            if _exit_code(process) is None and not pid_alive(process.pid or 0):
                process.join(REAP_WAIT_S)
                reaped = reaped or process.exitcode is not None
        return reaped

    def submit(self, req_id: int, prompt: str | list[int], params: SamplingParams,
               output_token_ids: Sequence[int] = ()) -> None:
        """Queue a request without ever waiting (the daemon calls this on its event loop);
        `output_token_ids` are outputs a resumed request already delivered.

        Raises Overloaded when the tokenizer worker's request ring is full (it is that far behind),
        RecordTooLarge when the prompt cannot fit a record of the request ring, StageFailed if
        the tokenizer worker died.
        """
        _check_req_id(req_id)
        parts = encode_generate(req_id, prompt, params, output_token_ids)
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
            raise self._dead_peer_failure(str(exc), None) from None
        return True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the backend is closed")

    def read_events(self, timeout_s: float) -> list[OutputEvent]:
        """Blocks up to timeout_s for output events; raises StageFailed when a stage has died."""
        events: list[OutputEvent] = []
        for item in self.read_outputs(timeout_s):
            events.extend(item.to_events() if isinstance(item, TokenTexts) else (item,))
        return events

    def read_outputs(self, timeout_s: float) -> list[OutputEvent | TokenTexts]:
        """As `read_events`, but each step's plain events come as one `TokenTexts`, in order with
        the others: what the daemon routes without an object per token."""
        deadline = time.monotonic() + timeout_s
        self._between_reads()
        while True:
            # Asking each process whether it has exited costs a system call or more per stage:
            # once per LIVENESS_CHECK_S, not once per step.
            if time.monotonic() >= self._next_liveness_check_s:
                self.check_stages()
                self._next_liveness_check_s = time.monotonic() + LIVENESS_CHECK_S
            try:
                record = self._events.read(timeout=min(LIVENESS_CHECK_S, max(0.0, deadline - time.monotonic())))
            except PeerDied:
                raise self._dead_peer_failure("stage 'detokenizer' died", "detokenizer") from None
            if record is not None:
                return self._outputs_from(record)
            if time.monotonic() >= deadline:
                return []

    # ---- reading the events on an event loop, without a thread (the daemon's StageSupervisor)

    def events_fd(self) -> int:
        """Readable once the events ring has a record for a reader that `arm_events`ed; changes
        when the frontend restarts (restart_stage makes fresh links)."""
        return self._events.fileno()

    def arm_events(self) -> bool:
        """The reader sleeps until events_fd() is readable: True; False when there are events
        already (poll_outputs them first)."""
        return self._events.arm()

    def poll_outputs(self) -> list[OutputEvent | TokenTexts]:
        """`read_outputs` without waiting (after events_fd() turned readable, or arm_events said
        False): what the ring holds, maybe nothing. The stages' liveness is not looked at here:
        call check_stages (from any thread) every LIVENESS_CHECK_S."""
        self._events.woken()
        self._retry_aborts()
        record = self._events.try_read()
        return [] if record is None else self._outputs_from(record)

    def check_stages(self) -> None:
        """Raises StageFailed naming a dead stage, if one died; starts a fresh forkserver where
        the old one died under running stages. A dead detokenizer is seen by its pid too, as a
        read that waits sees it: the exit status of a stage whose forkserver is stopped never comes."""
        self._watch_forkserver()
        failed = self._failed_stage()
        if failed is not None:
            raise failed
        self._between_reads()  # while the loop reads events only when there are some
        try:
            self._events.check_writer()
        except PeerDied:
            raise self._dead_peer_failure("stage 'detokenizer' died", "detokenizer") from None

    def _between_reads(self) -> None:
        """The token rate and the aborts that found the abort ring full: looked at on each read,
        and by check_stages every LIVENESS_CHECK_S, with events or without."""
        self._rate.update(self._board.counters().tokens_generated)
        self._retry_aborts()

    def _retry_aborts(self) -> None:
        if self._pending_aborts:
            with self._lock:
                self._send_pending_aborts()

    def _outputs_from(self, record: Record) -> list[OutputEvent | TokenTexts]:
        """`record`'s events and those of the records after it, up to MAX_RECORDS_PER_READ."""
        events: list[OutputEvent | TokenTexts] = []
        for _ in range(MAX_RECORDS_PER_READ):
            if record.kind == Kind.TOKEN_TEXTS:
                events.append(decode_token_texts(record.payload))
            else:
                events.extend(decode_events(record.payload))
            record = self._events.try_read()
            if record is None:
                break
        self._events.release()
        events = coalesce_outputs(events)  # several records: the reader fell behind, so one delta per request
        finished = [e.req_id for e in events if isinstance(e, OutputEvent) and e.is_last]
        if finished:
            with self._lock:
                self._live.difference_update(finished)
        return events

    def _watch_forkserver(self) -> None:
        """Once the forkserver has died under running stages, a thread starts a fresh one."""
        if self._forkserver_watch is None and any(p.exitcode == FORKSERVER_LOST for _, p in self._procs):
            procs = [p for _, p in self._procs]
            self._forkserver_watch = threading.Thread(target=replace_dead_forkserver, args=(procs,),
                                                      name="pipeline-forkserver", daemon=True)
            self._forkserver_watch.start()

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
        return [StageHealth(name, process.pid or 0, _exit_code(process) is None, self._board.heartbeat_age_s(index))
                for index, (name, process) in enumerate(self._procs)]

    def stats(self) -> BackendStats:
        counters = self._board.counters()
        return BackendStats(counters.num_waiting, counters.num_running, counters.kv_blocks_used,
                            counters.kv_blocks_free, self._rate.tokens_per_s, num_restarts=0,
                            prefix_cache_hit_rate=counters.prefix_cache_hit_rate,
                            prefix_cache_hit_tokens=counters.num_prefix_hit_tokens,
                            num_draft_tokens=counters.num_draft_tokens,
                            num_accepted_tokens=counters.num_accepted_tokens, num_verifications=counters.num_verifications)

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
            _join(process, deadline)
        for _, process in self._procs:
            if _exit_code(process) is None:
                _signal(process, signal.SIGTERM)
        for _, process in self._procs:
            _join(process, time.monotonic() + KILL_GRACE_S)
            if _exit_code(process) is None:
                _signal(process, signal.SIGKILL)
                _join(process, time.monotonic() + KILL_GRACE_S)
        for end in self._ends.values():
            end.close()
        if board is not None:
            board.close()
        unlink_instance(self.instance)


class _TokenRate:
    """Tokens per second over the last window of at least MIN_RATE_WINDOW_S. `update` is called by
    one thread (read_events' at least every call's timeout, or check_stages'); `tokens_per_s` may
    be read by any."""

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


def _exit_code(process: mp.process.BaseProcess) -> int | None:
    """A stage's exit code, None while it runs. Its pid decides when its forkserver died (the
    process's own exitcode then says FORKSERVER_LOST whether or not the stage still runs)."""
    code = process.exitcode
    if code == FORKSERVER_LOST and process.pid is not None and pid_alive(process.pid):
        return None
    return code


def _join(process: mp.process.BaseProcess, deadline: float) -> None:
    """Waits until the stage has exited or the deadline passed."""
    process.join(max(0.0, deadline - time.monotonic()))
    while _exit_code(process) is None and time.monotonic() < deadline:
        time.sleep(READY_POLL_S)  # a stage whose forkserver died: not our child, no sentinel to wait on


def _signal(process: mp.process.BaseProcess, signum: int) -> None:
    """Signals a running stage, also one that multiprocessing, its forkserver dead, takes for ended."""
    try:
        os.kill(process.pid, signum)
    except ProcessLookupError:
        pass


def replace_dead_forkserver(procs: Sequence[mp.process.BaseProcess]) -> bool:
    """Starts a fresh forkserver when the one `procs` were forked from has died (they run on,
    orphaned), so that the next restart forks at once instead of starting one then; True if
    one was started. Blocks while the new server imports the stages' modules."""
    if not any(p.exitcode == FORKSERVER_LOST and _exit_code(p) is None for p in procs):
        return False
    try:
        multiprocessing.forkserver.ensure_running()
    except Exception:  # noqa: BLE001 - the next restart starts one itself, and says why it cannot
        log.exception("could not replace the dead forkserver")
        return False
    log.warning("the forkserver died; a fresh one serves the next restart (the stages run on)")
    return True


def _process_context() -> mp.context.BaseContext:
    """How stage processes start: forked from the warm server (see the module's docstring), or
    spawned under Nsight Systems."""
    if os.environ.get(SESSION_ENV):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD_MODULES)  # takes effect when the server starts: the same list every time
    return ctx


def _check_req_id(req_id: int) -> None:
    if isinstance(req_id, bool) or not isinstance(req_id, int) or not 0 <= req_id < 2**63:
        raise ValueError(f"req_id must be an integer in [0, 2**63), got {req_id!r}")
