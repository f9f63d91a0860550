"""What every stage process shares: its spec, links, heartbeat, stop and daemon watch, exit codes.

A stage's process target is `run_stage(spec_json, serve)`. The spec is JSON (names of rings and
segments, the engine config as plain values), so nothing but strings crosses the spawn. The
process takes the title `pipeline: <stage>`, so ps, top and nvidia-smi tell the stages apart.
`serve` asks the context for its ring ends by link name (stages/contracts/topology.py),
builds the stage, calls `ctx.ready()`, and loops calling `ctx.tick()` at least every
TICK_S while it works and every IDLE_TICK_S once it has had no input for IDLE_AFTER_S (input
wakes it at once either way: `ctx.read_input`); tick raises StageStop when the daemon asked to
stop or is gone (seen by its pid, at most every DAEMON_CHECK_S), so a stage outlives the daemon
by at most about IDLE_TICK_S. Tick also answers the daemon's profile requests, and
`ctx.range(name)` marks a loop phase (stages/profiling.py).

Exit codes: 0 stopped when asked, EXIT_ERROR its own failure (message on the status board),
EXIT_PEER_DIED another stage died under it, EXIT_PARENT_GONE the daemon died. A stage that
exits after the daemon died removes the daemon's /dev/shm names (each stage does, whichever
goes last finds them gone): a daemon killed outright never could.
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from shm.mailbox import MailboxReader
from shm.naming import check_instance_id, pid_alive, ring_name, sweep_stale
from shm.ring import Record, RingTimeout, RingWriter
from shm.ring_reader import RingReader
from shm.segment import PeerDied
from stages.contracts.config import EngineConfig, ModelLimits
from stages.contracts.topology import (FRONTEND, MAILBOX_READERS, RESTARTS_ALONE, Link, links, segment_link, stages,
                                       touches)
from stages.profiling import PhaseRange, StageProfiler
from stages.status import StatusBoard

EXIT_ERROR = 1
EXIT_PEER_DIED = 3
EXIT_PARENT_GONE = 4
# How often a ticking stage checks, by its pid, that the daemon lives.
DAEMON_CHECK_S = 0.1
TICK_S = 0.05  # the longest a working stage loop blocks between ticks
# An idle stage wakes this often only: to beat, and to see a stop or the daemon's death. The
# daemon's stall limit must exceed it (pipeline.daemon.MIN_STALL_S).
IDLE_TICK_S = 0.5
IDLE_AFTER_S = 1.0  # without input for this long, a stage is idle
LIMITS_POLL_S = 0.005
_PR_SET_NAME = 15
MIN_SHARE_S = 0.005


def input_wait_s(idle_for_s: float, share: int = 1) -> float:
    """How long a stage loop blocks on one of `share` input rings it waits on in turn, having had
    no input for `idle_for_s` (see StageContext.read_input)."""
    if share == 1 and idle_for_s > IDLE_AFTER_S:
        return IDLE_TICK_S
    return max(TICK_S / share, MIN_SHARE_S)


class StageStop(Exception):
    """Leave the stage loop: the daemon asked us to stop, or is gone."""

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class StageContext:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.name: str = spec["name"]
        self.index: int = spec["index"]
        self.instance: str = spec["instance"]
        self.config = EngineConfig.from_dict(spec["config"])
        self._links = links(self.config.num_tokenizers, self.config.ranks_per_node)
        self._ring_names: dict[str, str] = dict(spec["links"])
        # A stage of a group that restarts alone attaches as replaceable: its death makes its
        # peers wait for the replacement the daemon starts (shm/segment.py).
        table = stages(self.config.num_tokenizers, self.config.ranks_per_node)
        self._replaceable = next((s.group for s in table if s.name == self.name), None) in RESTARTS_ALONE
        self._frontend = [s.name for s in table if s.group == FRONTEND]
        self._daemon_pid: int = spec["parent_pid"]
        self._next_daemon_check_s = 0.0  # the first tick checks
        self.board = StatusBoard.open(spec["status"])
        self.board.stages.mark_started(self.index, os.getpid())
        self.profiler = StageProfiler(self.name)
        # A stage (re)started after a capture began joins at the next one; a stop finds it idle.
        self._profile_generation = self.board.profile.generation()
        self._last_input_s = time.monotonic()
        self.cores: list[int] | None = None  # the cores run_stage kept this stage to (stage_cores); None: not pinned

    # ---- this stage's ends of the links

    def reader(self, name: str) -> RingReader:
        """This stage's end of the link it reads called `name` (or of the one link of family
        `name`, such as "generate{i}" for tokenizer i)."""
        link = self._link(name, reading=True)
        return RingReader.attach(self._ring_names[link.name], link.reader_index(self.name),
                                 replaceable=self._replaceable)

    def readers(self, family: str) -> list[RingReader]:
        """This stage's ends of every link of `family` it reads ("tokenized{i}": one per tokenizer)."""
        return [RingReader.attach(self._ring_names[link.name], link.reader_index(self.name),
                                  replaceable=self._replaceable)
                for link in self._links if link.family == family and self.name in link.readers]

    def writer(self, name: str) -> RingWriter:
        """This stage's end of the link it writes called `name` (or of family `name`)."""
        return RingWriter.attach(self._ring_names[self._link(name, reading=False).name], replaceable=self._replaceable)

    def _link(self, name: str, *, reading: bool) -> Link:
        found = [link for link in self._links if name in (link.name, link.family)
                 and (self.name in link.readers if reading else link.writer == self.name)]
        if len(found) != 1:
            raise ValueError(f"stage {self.name!r} {'reads' if reading else 'writes'} {len(found)} links "
                             f"called {name!r}; the topology gives it exactly one or none")
        return found[0]

    def relink(self, generation: int) -> None:
        """From now on `reader` and `writer` give the ends of frontend generation `generation`'s
        links (made by the daemon for a restart of the frontend group)."""
        for link in self._links:
            if touches(link, self._frontend):
                self._ring_names[link.name] = ring_name(self.instance, segment_link(link.name, generation))

    def frontend_consumers(self) -> list[int]:
        """The mailbox consumer indexes of the frontend group's stages."""
        return [index for index, name in enumerate(MAILBOX_READERS) if name in self._frontend]

    @property
    def mailbox_name(self) -> str:
        return self.spec["mailbox"]

    def mailbox(self) -> MailboxReader:
        """This stage's reader end of the token mailbox (the runner makes the mailbox)."""
        return MailboxReader(self.mailbox_name, MAILBOX_READERS.index(self.name), replaceable=self._replaceable)

    # ---- liveness

    def tick(self) -> None:
        """Heartbeat; answers a new profile request; raises StageStop when it is time to go."""
        board = self.board
        board.stages.beat(self.index)
        if board.stop_requested:
            raise StageStop(0, "stop requested")
        if time.monotonic() >= self._next_daemon_check_s:
            self._check_daemon()
        if board.profile.generation() != self._profile_generation:
            request = board.profile.current()
            self._profile_generation = request.generation
            board.profile.answer(self.index, self.profiler.answer(request))
            board.stages.beat(self.index)  # starting or writing a capture may take a while

    def _check_daemon(self) -> None:
        """By pid, not by parent: the forkserver this stage was forked from outlives the daemon for
        as long as a stage it forked lives (each holds the server's end of its pipe to the daemon)."""
        if not pid_alive(self._daemon_pid):
            raise StageStop(EXIT_PARENT_GONE, f"the daemon (pid {self._daemon_pid}) is gone")
        self._next_daemon_check_s = time.monotonic() + DAEMON_CHECK_S

    def read_input(self, reader: RingReader, share: int = 1) -> Record | None:
        """The next record of an input ring, or None after a while without one: TICK_S while
        the stage is busy, IDLE_TICK_S once it has had no input for IDLE_AFTER_S, so an idle
        stage costs next to no CPU; a record wakes it at once either way. A loop that waits on
        `share` rings in turn keeps to TICK_S / share each, so none of them waits long."""
        record = reader.read(timeout=input_wait_s(time.monotonic() - self._last_input_s, share))
        if record is not None:
            self._last_input_s = time.monotonic()
        return record

    def range(self, name: str) -> PhaseRange:
        """The loop phase `name`, for `with`: an NVTX range, and a torch.profiler range while the
        daemon has a capture running. Fetch it once, outside the loop."""
        return self.profiler.range(name)

    def write(self, writer: RingWriter, kind: int, *parts: object, give_up: Callable[[], bool] | None = None) -> bool:
        """Write one record, ticking while the ring stays full (a stalled reader never keeps
        this stage from seeing a stop request or the daemon's death). With `give_up`, a record
        still waiting for room once it holds is dropped: False."""
        while True:
            try:
                writer.write(kind, *parts, timeout=TICK_S)
                return True
            except RingTimeout:
                self.tick()
                if give_up is not None and give_up():
                    return False

    def frontend_generation(self) -> int:
        """How many times the frontend group has restarted alone (stages/status.py)."""
        return self.board.frontend_generation()

    def ready(self) -> None:
        """The stage is built: from here on it only loops. What it built (torch and the model's
        modules in the runner: hundreds of thousands of objects) is frozen out of the garbage
        collector, whose every full collection would otherwise walk it again: a pause of tens
        of ms in the middle of a step."""
        gc.freeze()
        self.board.stages.mark_ready(self.index)

    def wait_limits(self) -> ModelLimits:
        """The model limits the runner publishes once it has loaded the model."""
        timeout_s = self.config.start_timeout_s
        deadline = time.monotonic() + timeout_s
        while (limits := self.board.limits.read()) is None:
            self.tick()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: the runner published no model limits within {timeout_s} s")
            time.sleep(LIMITS_POLL_S)  # a start-up poll, once per process
        return limits


def run_stage(spec_json: str, serve: Callable[[StageContext], None]) -> None:
    """Process body of one stage: run `serve` and exit with the code that says why it ended."""
    # The daemon stops stages through the status board; a Ctrl-C meant for it must not kill
    # a stage half-way through a record.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = json.loads(spec_json)
    set_process_title(f"pipeline: {spec['name']}")
    try:
        ctx = StageContext(spec)
        ctx.cores = stage_cores(ctx.name, ctx.config, sorted(os.sched_getaffinity(0)))
        if ctx.cores is not None:
            os.sched_setaffinity(0, ctx.cores)
        code = _serve(ctx, serve)
    finally:
        # The status board and the mailbox keep their names for restarted stages while the daemon
        # lives; a daemon killed outright cannot remove them, so its stages do as they exit.
        sweep_stale(creator_pid=check_instance_id(spec["instance"]))
    sys.stdout.flush()
    sys.exit(code)


def _serve(ctx: StageContext, serve: Callable[[StageContext], None]) -> int:
    """Runs the stage loop; its exit code."""
    try:
        serve(ctx)
    except StageStop as stop:
        return stop.exit_code
    except PeerDied as exc:
        if not ctx.board.stop_requested:  # else the peer stopped as asked, before this stage saw the request
            ctx.board.stages.set_error(ctx.index, f"{ctx.name}: {exc}")
            return EXIT_PEER_DIED
    except BaseException as exc:  # noqa: BLE001 - reported to the daemon, then the process ends
        ctx.board.stages.set_error(ctx.index, f"{ctx.name}: {type(exc).__name__}: {exc}")
        return EXIT_ERROR
    return 0


# From this many cores on, `auto` placement splits: one core for the tokenizer, scheduler,
# detokenizer and daemon costs the forward at most 1/8 of its threads. Below, it shares: on two
# cores a dedicated one halves the forward, which costs more than the other stages' wakeups that
# preempt its threads (SmolLM2-135M, bfloat16, 32 streams: 284 tok/s shared, 176 split).
SPLIT_MIN_CORES = 8


def stage_cores(name: str, config: EngineConfig, cores: list[int]) -> list[int] | None:
    """The cores stage `name` keeps to when the model runs on the CPU, by `config.cpu_placement`:
    split, the runner all of `cores` but the last and every other stage the last (a forward's
    threads wait for each other at every operator, so one preempted by a tokenizer, scheduler or
    detokenizer wakeup stalls the step); shared, the runner all of them and the others anywhere
    (None). None (stay where started) on a GPU, under tensor parallelism (each rank sets its own
    threads), or with a single core."""
    if (not model_on_cpu(config.device) or len(cores) < 2 or config.tensor_parallel_size > 1
            or config.simulated_device_ms is not None):
        return None
    split = config.cpu_placement == "split" or (config.cpu_placement == "auto" and len(cores) >= SPLIT_MIN_CORES)
    if not split:
        return cores if name == "runner" else None
    return cores[:-1] if name == "runner" else cores[-1:]


def model_on_cpu(device: str) -> bool:
    """Whether EngineConfig.device `device` puts the model on the CPU ("auto": no CUDA driver)."""
    return device == "cpu" or (device == "auto" and not _cuda_driver_present())


def _cuda_driver_present() -> bool:
    """Whether the CUDA driver library loads: what "auto" then resolves to, asked without torch."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def set_process_title(title: str) -> None:
    """The name ps, top and nvidia-smi show for this process (not `multiprocessing.spawn`)."""
    try:
        import setproctitle
    except ImportError:  # the kernel's own 15-character name then, as `top` and `ps -o comm` show it
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0)
        return
    setproctitle.setproctitle(title)


def launch(module: str, spec_json: str) -> None:
    """Process target: import stage `module` in the child and run its `main`. The daemon names
    the module instead of passing the function, so it never imports the model stack itself."""
    import importlib

    importlib.import_module(module).main(spec_json)
