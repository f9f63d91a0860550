"""The stage processes of one engine instance: start them, watch them, restart a group, stop them.

`StageProcesses` owns the processes only; the rings between them and the daemon are
`StageLinks`' (stage_links.py), and `StageBackend` (multiprocess.py) joins the two.

A runner forks from a server process that the first backend starts and that has imported the
runner's modules (torch among them) once: a runner's restart after a crash then costs a fork
and the model's load from the page cache, not a fresh interpreter and seconds of imports (some
6 s of CPU time on a 2-core machine). The server has touched no accelerator, so a forked
runner starts CUDA as a spawned one would. The stages that hold no tensors (tokenizers,
detokenizer, scheduler) are spawned: a fresh interpreter that never imports torch (half a
second of imports), so none of them maps torch's libraries or shares the server's heap, whose
pages copied on write would cost each some tens of MiB. Under Nsight Systems, which traces a
process only from its exec, the runner is spawned as well.
"""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence

from pipeline.engine.backend import StageHealth
from pipeline.errors import StageFailed
from shm.naming import pid_alive
from stages.contracts.config import EngineConfig
from stages.contracts.topology import DAEMON, RUNNER, STAGES, Link, Stage, links, restart_group, touches
from stages.process import EXIT_PEER_DIED, launch, model_on_cpu
from stages.status import StatusBoard

log = logging.getLogger("pipeline.engine.supervision")

# Set in the daemon's environment while it runs under Nsight Systems (pipeline/serve/nsys.py):
# its stages are then spawned, not forked.
SESSION_ENV = "PIPELINE_NSYS_SESSION"
READY_POLL_S = 0.01
KILL_GRACE_S = 1.0  # how long stop() lets a stage take to end after SIGTERM, then after SIGKILL
# How often a wait for a dead stage's exit status looks again whether its parent can still report it.
REPORT_POLL_S = 0.05
# multiprocessing's exit code for a child whose forkserver died: the server reports each child's
# exit, and with it gone the report is lost, though the child (a stage) may well run on.
FORKSERVER_LOST = 255
RUNNER_MODULE = next(stage.module for stage in STAGES if stage.name == RUNNER)
# What the runners' server imports before its first fork: the runner's module. The models build
# their layers without torch's random init, which on the meta device would import torch._dynamo
# (a second and more) and with it Triton's library (60+ MB resident on the CPU); the other
# stages' modules import no torch (tests/architecture/test_torch_free.py).
PRELOAD_MODULES = [RUNNER_MODULE]
# After each parallel region libgomp's threads (torch's pool, which the CPU kernels share) spin
# for GOMP_SPINCOUNT pauses before they sleep: 300,000 by default, milliseconds. A runner on the
# CPU shares its cores with the other stages and, on a busy machine, with other work; a thread
# that spins for a preempted peer burns the time slice that peer waits for. SmolLM2 Q4_1, one
# stream, in process: with two busy processes per core 808 ms a token by default, 204 ms with
# 10,000 and 170 ms passive; on a quiet machine, served, 43.5 ms by default, 42.2 ms with 10,000
# (the forward's back-to-back regions still find their threads awake) and 50.9 ms passive.
# The runners' server reads it as it starts (so do spawned runners); a value set by the user wins.
RUNNER_SPIN_ENV = {"GOMP_SPINCOUNT": "10000"}

Relink = Callable[[list[Link]], dict[str, str]]  # fresh segments for these links -> their names


class StageProcesses:
    """The stage processes of one instance, by index in the stage table (`procs`: name and
    process). `check` may be called from one thread while another reads the rings; the rest
    runs on the thread that owns the backend."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.procs: list[tuple[str, mp.process.BaseProcess]] = []
        self._board: StatusBoard | None = None
        self._spec: dict[str, object] = {}
        self._ring_names: dict[str, str] = {}
        self._table: list[Stage] = []
        self._forkserver_watch: threading.Thread | None = None  # replacing a dead forkserver

    def start(self, board: StatusBoard, spec: dict[str, object], ring_names: dict[str, str],
              table: list[Stage]) -> None:
        """Starts every stage of `table` (`spec` is what each is told, with its name, index and
        the links' segment names); returns once all are ready."""
        self._board, self._spec, self._ring_names, self._table = board, spec, ring_names, table
        if model_on_cpu(self.config.device):
            for key, value in RUNNER_SPIN_ENV.items():
                os.environ.setdefault(key, value)
        for index, stage in enumerate(table):
            self.procs.append((stage.name, self._spawn(index, stage)))
        self._wait_ready(range(len(self.procs)))

    def _spawn(self, index: int, stage: Stage) -> mp.process.BaseProcess:
        spec = dict(self._spec, name=stage.name, index=index, links=self._ring_names)
        # Not daemonic, so a daemon that is itself a multiprocessing child may start stages;
        # the backend's atexit hook stops them if the owner exits without close().
        process = _process_context(stage).Process(target=_stage_process, args=(stage.module, json.dumps(spec)),
                                             name=f"pipeline-{stage.name}")
        process.start()
        return process

    def live_stages(self) -> dict[int, str]:
        """The stages running now: index -> name."""
        return {index: name for index, (name, p) in enumerate(self.procs) if p.is_alive()}

    def health(self) -> list[StageHealth]:
        board = self._board
        return [StageHealth(name, process.pid or 0, _exit_code(process) is None, board.stages.heartbeat_age_s(index))
                for index, (name, process) in enumerate(self.procs)]

    def restart(self, stage: str, relink: Relink) -> bool:
        """Restarts the group of `stage` (see StageBackend.restart_stage); `relink` makes the
        fresh links of the group, once its stages are gone, and returns their segment names."""
        num_tokenizers, num_ranks = self.config.num_tokenizers, self.config.ranks_per_node
        group = restart_group(stage, num_tokenizers, num_ranks)
        indexes = [index for index, (name, _) in enumerate(self.procs) if name in group]
        if len(indexes) == len(self.procs):
            return False
        # By pid: the exit status of a stage whose forkserver is stopped or gone never comes.
        if not all(pid_alive(process.pid or 0) for name, process in self.procs if name not in group):
            return False  # a stage of another group died as well (it may be the cause): every stage restarts
        self._kill(indexes)
        fresh = [link for link in links(num_tokenizers, num_ranks) if touches(link, group)]
        self._ring_names.update(relink(fresh))
        for index in indexes:
            self._board.stages.clear(index)
        movers = {name for link in fresh for name in (link.writer, *link.readers)} - set(group) - {DAEMON}
        self._wait_taken_up([index for index, (name, _) in enumerate(self.procs) if name in movers],
                            self._board.bump_frontend_generation())
        for index in indexes:
            self.procs[index] = (self._table[index].name, self._spawn(index, self._table[index]))
        self._wait_ready(indexes)
        log.warning("restarted %s after %s died; the other stages ran on", ", ".join(group), stage)
        return True

    def _kill(self, indexes: list[int]) -> None:
        """SIGKILLs the stages at `indexes` and waits until they are gone, by their pids: a killed
        process always ends, though on a busy machine its many threads may take seconds to, so
        the wait is bounded by the stages' start timeout, not by a guess of how fast that is."""
        timeout_s = self.config.start_timeout_s
        deadline = time.monotonic() + timeout_s
        for index in indexes:
            _signal(self.procs[index][1], signal.SIGKILL)
        for index in indexes:
            process = self.procs[index][1]
            while pid_alive(process.pid or 0) and time.monotonic() < deadline:
                process.join(READY_POLL_S)  # by the pid: a stopped forkserver never reports its exit
            process.join(0)  # reaps a child of our own
            if pid_alive(process.pid or 0):
                raise StageFailed(f"stage {self.procs[index][0]!r} outlived SIGKILL for {timeout_s:g} s",
                                  stage=self.procs[index][0])

    def _wait_taken_up(self, indexes: list[int], generation: int) -> None:
        """Waits until the stages at `indexes` have moved onto frontend generation `generation`."""
        deadline = time.monotonic() + self.config.start_timeout_s
        while not all(self._board.stages.frontend_taken(index) == generation for index in indexes):
            failed = self.failed_stage(among=indexes)
            if failed is not None:
                raise failed
            dead = [self.procs[index][0] for index in indexes if not pid_alive(self.procs[index][1].pid or 0)]
            if dead:
                raise StageFailed(f"stage {dead[0]!r} died during the frontend's restart", stage=dead[0])
            if time.monotonic() > deadline:
                raise StageFailed(f"the stages at the frontend's links did not move onto fresh ones within "
                                  f"{self.config.start_timeout_s} s")
            time.sleep(READY_POLL_S)  # a restart's wait: the scheduler drains at most two steps

    def _wait_ready(self, indexes: Sequence[int]) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while not all(self._board.stages.is_ready(index) for index in indexes):
            failed = self.failed_stage()
            if failed is not None:
                raise failed
            if time.monotonic() > deadline:
                waiting = [self.procs[index][0] for index in indexes if not self._board.stages.is_ready(index)]
                raise StageFailed(f"stages {waiting} were not ready within {self.config.start_timeout_s} s")
            time.sleep(READY_POLL_S)  # start-up only: model loading takes seconds

    def check(self) -> None:
        """Raises StageFailed naming a dead stage, if one died; starts a fresh forkserver where
        the old one died under running stages."""
        self._watch_forkserver()
        failed = self.failed_stage()
        if failed is not None:
            raise failed

    def failed_stage(self, among: Sequence[int] | None = None) -> StageFailed | None:
        """StageFailed naming a dead stage (of those at `among`, if given), if any died.

        Who died is known by pid: a stage whose pid is gone or a zombie is dead, whether or not
        its exit status has come. The status says how; it is waited for (see _await_exit_status)
        whenever the parent that reaps the stage can report it, however long the kernel takes to
        tear a killed process down. The stage named is the cause: one killed (by a signal, or
        dead without a word on the board), then one that failed on its own, before one that
        ended because a peer died under it."""
        dead = self._dead(among)
        if not dead:
            return None
        if any(code is None for _, _, code in dead):
            self._await_exit_status([index for index, _, code in dead if code is None])
            dead = self._dead(among)
        index, name, code = min(dead, key=lambda d: self._blame_rank(*d))
        if code is None:
            how = "died (seen by its pid; the parent that reaps it has not reported its exit status)"
        elif code == FORKSERVER_LOST:
            how = "died (its exit status was lost with the forkserver it was forked from)"
        else:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        error = self._board.stages.error(index)
        ready = "" if self._board.stages.is_ready(index) else " while starting"
        return StageFailed(f"stage {name!r} {how}{ready}" + (f": {error}" if error else ""), stage=name)

    def _dead(self, among: Sequence[int] | None) -> list[tuple[int, str, int | None]]:
        """The dead stages (of those at `among`, if given): index, name, exit code (None while unreported)."""
        return [(index, name, code) for index, (name, p) in enumerate(self.procs)
                if (among is None or index in among)
                and ((code := _exit_code(p)) is not None or not pid_alive(p.pid or 0))]

    def _blame_rank(self, index: int, name: str, code: int | None) -> int:
        """0 killed, 1 failed on its own, 3 ended because a peer died. A stage whose status has not
        come is told by the board, where a stage that ends by itself leaves its reason before it
        exits: with none it was killed (0), with one it failed or followed a peer (2)."""
        if code is None:
            return 2 if self._board.stages.error(index) else 0
        return 3 if code == EXIT_PEER_DIED else 0 if code < 0 else 1

    def dead_peer_failure(self, message: str, stage: str | None) -> StageFailed:
        """The failure behind a ring's PeerDied, which sees its peer dead by its pid: the stage
        that died, as failed_stage names it."""
        return self.failed_stage() or StageFailed(message, stage=stage)

    def _await_exit_status(self, indexes: Sequence[int]) -> None:
        """Waits until the exit status of each dead stage at `indexes` has come, as long as the
        parent that reaps it can report it (see _reported_later). A killed process with many
        threads is a zombie at once but reapable only once every thread is gone, which on a busy
        machine may take seconds; its parent then reports at once. A start timeout bounds the
        wait against a process the kernel never lets go."""
        deadline = time.monotonic() + self.config.start_timeout_s
        while time.monotonic() < deadline:
            waiting = [p for p in (self.procs[index][1] for index in indexes)
                       if _exit_code(p) is None and _reported_later(p)]
            if not waiting:
                return
            multiprocessing.connection.wait([p.sentinel for p in waiting], REPORT_POLL_S)

    def _watch_forkserver(self) -> None:
        """Once the forkserver has died under running stages, a thread starts a fresh one."""
        if self._forkserver_watch is None and any(p.exitcode == FORKSERVER_LOST for _, p in self.procs):
            procs = [p for _, p in self.procs]
            self._forkserver_watch = threading.Thread(target=replace_dead_forkserver, args=(procs,),
                                                      name="pipeline-forkserver", daemon=True)
            self._forkserver_watch.start()

    def stop(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` for every stage to exit (the board has asked them to stop),
        then ends the rest with SIGTERM, then SIGKILL."""
        deadline = time.monotonic() + timeout_s
        for _, process in self.procs:
            _join(process, deadline)
        for _, process in self.procs:
            if _exit_code(process) is None:
                _signal(process, signal.SIGTERM)
        for _, process in self.procs:
            _join(process, time.monotonic() + KILL_GRACE_S)
            if _exit_code(process) is None:
                _signal(process, signal.SIGKILL)
                _join(process, time.monotonic() + KILL_GRACE_S)


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


def _reported_later(process: mp.process.BaseProcess) -> bool:
    """Whether the exit status of a dead stage that has not come yet will: its parent (the
    forkserver it was forked from, or this process for a spawned one) reaps it and reports, unless
    that parent is stopped. Once the stage is reaped its status is on the way; once the forkserver
    is dead, its end of the status pipe is closed and the status taken as lost (FORKSERVER_LOST)."""
    fields = _stat_fields(process.pid or 0)
    if not fields:
        return True
    parent = int(fields[1])
    return parent == os.getpid() or _stat_fields(parent)[:1] not in ([b"T"], [b"t"])


def _stat_fields(pid: int) -> list[bytes]:
    """The fields of /proc/<pid>/stat after the command name (state, parent pid, ...); [] once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            stat = stat_file.read()
    except OSError:
        return []
    return stat[stat.rfind(b")") + 2:].split()  # the command name may hold spaces and parentheses


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


def _process_context(stage: Stage) -> mp.context.BaseContext:
    """How a stage's process starts: a runner forked from the warm server (see the module's
    docstring), the other stages, and every stage under Nsight Systems, spawned."""
    if stage.module != RUNNER_MODULE or os.environ.get(SESSION_ENV):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD_MODULES)  # takes effect when the server starts: the same list every time
    return ctx
