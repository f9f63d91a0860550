"""What the daemon says about itself: health (are the stages alive and going round?) and stats.

It reads the daemon server through `ServerState`, what the server holds, so that this module and
server.py (which answers Health and Stats with it) do not import each other.
"""
from __future__ import annotations

import time
from enum import Enum
from typing import Protocol

from pipeline.engine.backend import Backend
from pipeline.protocol import HealthReply, StatsReply
from pipeline.serve.config import DaemonConfig, version
from pipeline.serve.model import ServedModel
from pipeline.serve.recovery import Recovery
from pipeline.serve.stalls import StallJudge


class ServerState(Protocol):
    """What health and stats read of the daemon server (pipeline/serve/server.py)."""

    config: DaemonConfig
    backend: Backend | None
    model: ServedModel | None
    recovery: Recovery
    stalls: StallJudge
    state: Enum  # its value: "serving", "restarting" or "down"
    started_at: float
    shutting_down: bool
    last_failure: str | None
    down_reason: str | None
    http_url: str | None
    num_restarts: int
    num_finished: int
    num_overloaded: int
    num_prompt_tokens: int
    num_generated_tokens: int
    max_in_flight_requests: int


def health_reply(server: ServerState) -> HealthReply:
    """"ok" only while every stage lives and none is taken for hung (stalls.py: past the limit its
    pace allows), with no restart under way."""
    config = server.config
    reply = HealthReply("ok", version(), time.monotonic() - server.started_at, num_restarts=server.num_restarts,
                        last_failure=server.last_failure, shutdown_grace_s=config.grace_s, http_url=server.http_url,
                        delta_frames=True)
    problems = ["the daemon is shutting down"] if server.shutting_down else []
    state = server.state.value
    if state == "restarting":
        problems.append(f"stages are restarting after: {server.last_failure}")
    elif state == "down":
        problems.append(f"stages failed ({server.last_failure}) and are not restarted: {server.down_reason}")
    backend = server.backend
    if backend is not None:
        reply.instance = getattr(backend, "instance", None)
        try:
            stages = backend.health()
        except Exception as exc:  # noqa: BLE001 - a broken backend is what health must report
            stages = []
            problems.append(f"the stages' health is unreadable: {exc}")
        hung = server.stalls.observe(stages)
        for stage in stages:
            reply.stages[stage.name] = (f"{'alive' if stage.alive else 'dead'} pid {stage.pid} "
                                        f"heartbeat {stage.heartbeat_age_s:.2f}s")
            reply.stage_pids[stage.name] = stage.pid
            if not stage.alive:
                problems.append(f"stage {stage.name!r} is dead")
            elif stage.name in hung:
                problems.append(hung[stage.name])
    if problems:
        reply.status = "degraded"
        reply.reason = "; ".join(problems)
        if state != "serving":
            reply.stages["backend"] = f"failed: {server.last_failure}; {state}"
    return reply


def stats_reply(server: ServerState) -> StatsReply:
    reply = StatsReply(
        num_finished_requests=server.num_finished,
        num_prompt_tokens_total=server.num_prompt_tokens,
        num_generated_tokens_total=server.num_generated_tokens,
        uptime_s=time.monotonic() - server.started_at,
        num_restarts=server.num_restarts,
        num_overloaded_requests=server.num_overloaded,
        max_in_flight_requests=server.max_in_flight_requests,
        num_resumed_requests=server.recovery.num_resumed,
        num_guard_failed_requests=server.recovery.num_failed_by_guard,
        num_stage_deaths=server.recovery.num_crashes,
        num_stall_verdicts=server.stalls.num_verdicts,
    )
    model = server.model
    if model is not None:
        reply.model = model.name
        reply.vocab_size = model.vocab_size
        reply.max_model_len = model.max_model_len
        reply.chat_template = model.chat_template.available
        reply.special_token_ids = list(model.special_token_ids)
        reply.runs_in = model.runs_in
    if server.backend is None:
        return reply
    limits = getattr(server.backend, "limits", None)
    reply.cpu_kernels = "" if limits is None else limits.cpu_kernels
    try:
        stats = server.backend.stats()
    except Exception:  # noqa: BLE001 - the daemon's own counters still answer
        return reply
    counters = stats.scheduler
    reply.num_running_requests = counters.num_holding_rows
    reply.num_waiting_requests = counters.num_waiting
    reply.kv_blocks_used = counters.kv_blocks_used
    reply.kv_blocks_total = counters.kv_blocks_used + counters.kv_blocks_free
    reply.generated_tokens_per_s = stats.generated_tokens_per_s
    reply.prefix_cache_hit_rate = counters.prefix.hit_rate
    reply.prefix_cache_hit_tokens = counters.prefix.num_hit_tokens
    reply.speculative = counters.speculative
    return reply
