"""The daemon's stats, in one process: the scheduler's counters on the status board, through a
backend's `stats()` and the daemon's `StatsReply`, to what a client reads over the wire."""
from __future__ import annotations

import time
from dataclasses import asdict
from types import SimpleNamespace

import pytest

from pipeline.engine.backend import BackendStats
from pipeline.engine.inprocess import InProcessBackend
from pipeline.engine.multiprocess import StageBackend
from pipeline.protocol import FrameDecoder, ServerMessage, SpeculativeCounts, StatsReply, encode_frame
from pipeline.serve.model import ServedModel
from pipeline.serve.status import stats_reply
from stages.contracts.counters import PrefixCacheCounts, SchedulerCounters, from_ints, num_counts
from stages.status import StatusBoard

pytestmark = pytest.mark.timeout(30)


def server_with(backend: object) -> SimpleNamespace:
    """The parts of the daemon server that `stats_reply` reads."""
    return SimpleNamespace(num_finished=3, num_prompt_tokens=40, num_generated_tokens=50, started_at=time.monotonic(),
                           num_restarts=0, num_overloaded=0, max_in_flight_requests=8,
                           recovery=SimpleNamespace(num_resumed=0, num_failed_by_guard=0, num_crashes=0),
                           stalls=SimpleNamespace(num_verdicts=0), model=None, backend=backend)


def over_the_wire(reply: StatsReply) -> StatsReply:
    decoder: FrameDecoder = FrameDecoder(ServerMessage)
    decoder.feed(encode_frame(reply))
    return decoder.next_message()


def test_the_schedulers_speculative_counts_reach_the_client(board: StatusBoard) -> None:
    board.counters.publish(SchedulerCounters(num_waiting=1, num_running=1, num_draining=1, kv_blocks_used=3,
                                             kv_blocks_free=5, tokens_generated=50, prefix=PrefixCacheCounts(40, 10),
                                             speculative=SpeculativeCounts(num_draft_tokens=60, num_accepted_tokens=45,
                                                                           num_verifications=20)))
    # StageBackend.stats reads only the board and its token rate: no stage processes are needed.
    backend = SimpleNamespace(_board=board, _rate=SimpleNamespace(tokens_per_s=0.0))
    backend.stats = lambda: StageBackend.stats(backend)  # type: ignore[arg-type]
    reply = over_the_wire(stats_reply(server_with(backend)))  # type: ignore[arg-type]
    assert (reply.num_running_requests, reply.kv_blocks_total, reply.prefix_cache_hit_tokens) == (2, 8, 10)
    assert reply.prefix_cache_hit_rate == 0.25
    assert reply.speculative == SpeculativeCounts(num_draft_tokens=60, num_accepted_tokens=45, num_verifications=20)
    assert reply.speculative.draft_acceptance_rate == pytest.approx(0.75)
    assert reply.speculative.mean_accepted_length == pytest.approx(3.25)


def test_the_in_process_engine_reports_its_schedulers_speculative_counts() -> None:
    scheduler_stats = SchedulerCounters(num_running=1, kv_blocks_free=7, kv_blocks_used=1,
                                        speculative=SpeculativeCounts(num_draft_tokens=9, num_accepted_tokens=4,
                                                                      num_verifications=3))
    backend = SimpleNamespace(llm=SimpleNamespace(scheduler=SimpleNamespace(stats=lambda: scheduler_stats)),
                              _started_at=time.monotonic(), _num_generated=0)
    stats = InProcessBackend.stats(backend)  # type: ignore[arg-type]
    assert stats.scheduler.speculative == SpeculativeCounts(9, 4, 3)
    assert stats_reply(server_with(SimpleNamespace(stats=lambda: stats))).speculative == SpeculativeCounts(9, 4, 3)


def test_a_backend_that_does_not_speculate_reports_none_drafted() -> None:
    backend = SimpleNamespace(stats=lambda: BackendStats(SchedulerCounters(kv_blocks_used=4, kv_blocks_free=4)))
    reply = over_the_wire(stats_reply(server_with(backend)))  # type: ignore[arg-type]
    assert reply.speculative == SpeculativeCounts()
    assert (reply.speculative.draft_acceptance_rate, reply.speculative.mean_accepted_length) == (0.0, 0.0)


def test_every_speculative_count_reaches_the_client_under_its_own_name() -> None:
    counts = from_ints(SpeculativeCounts, list(range(1, num_counts(SpeculativeCounts) + 1)))
    backend = SimpleNamespace(stats=lambda: BackendStats(SchedulerCounters(speculative=counts)))
    reply = over_the_wire(stats_reply(server_with(backend)))  # type: ignore[arg-type]
    assert reply.speculative == counts
    assert all(getattr(reply, name) == value for name, value in asdict(counts).items())


def test_what_the_model_runs_in_reaches_the_client() -> None:
    runs_in = ("weights: 10 Q8_0 quantized (0.2 MB); quantization q8_0: float weights quantized at load; "
               "dense dtype float32; KV cache float32, 256 tokens")
    model = ServedModel("tiny", "/nowhere", 256, 1024, [], runs_in=runs_in)
    server = server_with(SimpleNamespace(stats=lambda: BackendStats()))
    server.model = model
    assert over_the_wire(stats_reply(server)).runs_in == runs_in  # type: ignore[arg-type]
    server.model = None  # before the model is loaded: nothing to say
    assert over_the_wire(stats_reply(server)).runs_in == ""  # type: ignore[arg-type]
