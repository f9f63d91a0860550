"""The stage processes as the daemon's backend: submit requests, abort them, read their output.

`StageBackend` creates every link of its instance (stage_links.py) and the status board, starts
the stages the link table names (runner, scheduler, detokenizer, `num_tokenizers` tokenizer
workers: supervision.py), waits until each reports ready, and then only writes requests and
aborts and reads output events. The runner makes the token mailbox itself, since its kind
follows the runner's device. When a stage of a group that restarts alone dies (the frontend:
tokenizer workers and detokenizer), `restart_stage` restarts that group on fresh links while
the engine's stages, and the KV cache they hold, run on.
"""
from __future__ import annotations

import atexit
import logging
import os
import time
from collections.abc import Sequence

from pipeline.engine.backend import LIVENESS_CHECK_S, BackendStats, StageHealth
from pipeline.engine.profiling import ProfileControl
from pipeline.engine.stage_links import StageLinks
from pipeline.engine.supervision import StageProcesses
from shm.naming import ring_name, sweep_stale, unlink_instance
from shm.segment import PeerDied
from stages.contracts.config import EngineConfig
from stages.contracts.outputs import OutputEvent, TokenTexts
from stages.contracts.params import SamplingParams
from stages.contracts.topology import Stage, links, stages
from stages.messages import encode_generate
from stages.status import StatusBoard

log = logging.getLogger("pipeline.engine.multiprocess")

MIN_RATE_WINDOW_S = 0.5


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
        self.processes = StageProcesses(self.config)
        self._links = StageLinks(instance, config.num_tokenizers, self.processes.dead_peer_failure)
        self._board: StatusBoard | None = None
        self._next_liveness_check_s = 0.0  # read_outputs looks at the stage processes from then on
        self._rate = _TokenRate()
        swept = sweep_stale()
        if swept:
            log.info("removed %d /dev/shm entries left by dead daemons: %s", len(swept), " ".join(swept))
        atexit.register(self.close)
        try:
            self._board = StatusBoard.create(instance)
            self._profile = ProfileControl(self._board, self.processes.live_stages)
            ring_names = self._links.make(links(config.num_tokenizers, config.ranks_per_node))
            spec = {"instance": instance, "parent_pid": os.getpid(), "status": self._board.name,
                    "mailbox": ring_name(instance, "mailbox"), "config": self.config.to_dict()}
            self.processes.start(self._board, spec, ring_names, self.stage_table())
            self.limits = self._board.limits.read()
        except BaseException:
            self.close(timeout_s=2.0)
            raise
        # The status board and the mailbox keep their names while the instance lives, so that a
        # restarted frontend stage can open them; close() removes them, or, once the daemon is
        # dead, its stages as they exit (stages/process.py), or else the sweep of the next start.

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
        return self.processes.restart(stage, self._links.renew)

    def submit(self, req_id: int, prompt: str | list[int], params: SamplingParams,
               output_token_ids: Sequence[int] = ()) -> None:
        """Queue a request without ever waiting (the daemon calls this on its event loop);
        `output_token_ids` are outputs a resumed request already delivered.

        Raises Overloaded when the tokenizer worker's request ring is full (it is that far behind),
        RecordTooLarge when the prompt cannot fit a record of the request ring, StageFailed if
        the tokenizer worker died.
        """
        _check_req_id(req_id)
        self._links.submit(req_id, encode_generate(req_id, prompt, params, output_token_ids))

    def abort(self, req_id: int) -> None:
        """Stop a request; its last event has finish_reason "abort". Unknown or finished ids are
        ignored. Never waits: an abort that finds the abort ring full is sent later."""
        self._links.abort(req_id)

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
                record = self._links.events.read(timeout=min(LIVENESS_CHECK_S, max(0.0, deadline - time.monotonic())))
            except PeerDied:
                raise self.processes.dead_peer_failure("stage 'detokenizer' died", "detokenizer") from None
            if record is not None:
                return self._links.outputs_from(record)
            if time.monotonic() >= deadline:
                return []

    # ---- reading the events on an event loop, without a thread (the daemon's StageSupervisor)

    def events_fd(self) -> int:
        """Readable once the events ring has a record for a reader that `arm_events`ed; changes
        when the frontend restarts (restart_stage makes fresh links)."""
        return self._links.events.fileno()

    def arm_events(self) -> bool:
        """The reader sleeps until events_fd() is readable: True; False when there are events
        already (poll_outputs them first)."""
        return self._links.events.arm()

    def poll_outputs(self) -> list[OutputEvent | TokenTexts]:
        """`read_outputs` without waiting (after events_fd() turned readable, or arm_events said
        False): what the ring holds, maybe nothing. The stages' liveness is not looked at here:
        call check_stages (from any thread) every LIVENESS_CHECK_S."""
        events = self._links.events
        events.woken()
        self._links.retry_aborts()
        record = events.try_read()
        return [] if record is None else self._links.outputs_from(record)

    def check_stages(self) -> None:
        """Raises StageFailed naming a dead stage, if one died; starts a fresh forkserver where
        the old one died under running stages. A dead detokenizer is seen by its pid too, as a
        read that waits sees it: the exit status of a stage whose forkserver is stopped never comes."""
        self.processes.check()
        self._between_reads()  # while the loop reads events only when there are some
        try:
            self._links.events.check_writer()
        except PeerDied:
            raise self.processes.dead_peer_failure("stage 'detokenizer' died", "detokenizer") from None

    def _between_reads(self) -> None:
        """The token rate and the aborts that found the abort ring full: looked at on each read,
        and by check_stages every LIVENESS_CHECK_S, with events or without."""
        self._rate.update(self._board.counters.read().tokens_generated)
        self._links.retry_aborts()

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
        return self.processes.health()

    def stats(self) -> BackendStats:
        return BackendStats(self._board.counters.read(), self._rate.tokens_per_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops every stage and removes every shm entry of this instance."""
        if not self._links.mark_closed():
            return
        atexit.unregister(self.close)
        board = self._board
        if board is not None:
            board.request_stop()
        self.processes.stop(timeout_s)
        self._links.close()
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


def _check_req_id(req_id: int) -> None:
    if isinstance(req_id, bool) or not isinstance(req_id, int) or not 0 <= req_id < 2**63:
        raise ValueError(f"req_id must be an integer in [0, 2**63), got {req_id!r}")
