"""Prometheus metrics of the serving front end, named and bucketed like vLLM's (`pipeline:` prefix).

A `Metrics` owns its registry, so two servers in one process (or two tests) never share a
counter. Every series carries a `model_name` label. A request's life is recorded in three
calls: `request_arrived` returns its `RequestTimeline`, `tokens_generated` counts each batch of
output tokens (the first gives the time to first token), and `request_finished` observes the
latencies and counts the request under its finish reason. Label children are bound once here,
so a call is a few counter or histogram updates.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pipeline.protocol import SpeculativeCounts

FINISHED_REASONS = ("stop", "length", "abort", "error")

# vLLM's buckets. Time per output token also gets finer ones at the bottom: a small model here
# decodes in a few milliseconds per token.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                  1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                             120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(slots=True)
class RequestTimeline:
    """One request's times on the `time.monotonic()` clock, kept by whoever serves it."""

    arrival_s: float
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_output_tokens: int = 0


class Metrics:
    """The server's metrics for the model it serves; `render` is the `/metrics` body."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=self.registry, buckets=buckets).labels(model_name)

        self._running = gauge("pipeline:num_requests_running", "Requests the engine is running now.")
        self._waiting = gauge("pipeline:num_requests_waiting", "Requests waiting for the engine to start them.")
        self._kv_cache_usage = gauge("pipeline:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.")
        self._prefix_cache_hit_rate = gauge("pipeline:prefix_cache_hit_rate", "Share of prompt tokens found in the prefix cache.")
        self._prompt_tokens = counter("pipeline:prompt_tokens", "Prompt tokens of finished requests.")
        self._generation_tokens = counter("pipeline:generation_tokens", "Output tokens generated.")
        self._stage_restarts = counter("pipeline:stage_restarts", "Times the stage processes were restarted.")
        self._resumed = counter("pipeline:requests_resumed",
                                "Requests resubmitted to restarted stages after a crash (each time counts).")
        self._guard_failed = counter("pipeline:requests_failed_by_guard",
                                     "Requests ended because they were in flight during two crashes of one stage.")
        self._draft_tokens = counter("pipeline:spec_decode_num_draft_tokens", "Speculative draft tokens verified.")
        self._accepted_tokens = counter("pipeline:spec_decode_num_accepted_tokens",
                                        "Speculative draft tokens accepted.")
        self._verifications = counter("pipeline:spec_decode_num_verifications",
                                      "Steps of a request that verified speculative drafts.")
        self._acceptance_rate = gauge("pipeline:spec_decode_draft_acceptance_rate",
                                      "Share of verified draft tokens accepted, since the engine started.")
        self._mean_accepted_length = gauge("pipeline:spec_decode_mean_accepted_length",
                                           "Tokens a verifying step gives a request on average, since the engine "
                                           "started: accepted drafts and one sampled token.")
        success = Counter("pipeline:request_success", "Finished requests, by finish reason.",
                          [*labels, "finished_reason"], registry=self.registry)
        self._success = {reason: success.labels(model_name, reason) for reason in FINISHED_REASONS}
        self._ttft = histogram("pipeline:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS_S)
        self._tpot = histogram("pipeline:time_per_output_token_seconds",
                               "Mean time per output token after the first, one sample per request.", TPOT_BUCKETS_S)
        self._e2e = histogram("pipeline:e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS_S)
        self._queue_time = histogram("pipeline:request_queue_time_seconds", "Time waiting before the engine started the request.",
                                     REQUEST_LATENCY_BUCKETS_S)
        self._totals_seen: dict[Counter, int] = {}

    def request_arrived(self, now: float | None = None) -> RequestTimeline:
        return RequestTimeline(time.monotonic() if now is None else now)

    def tokens_generated(self, timeline: RequestTimeline, num_tokens: int, now: float | None = None) -> None:
        """A batch of `num_tokens` output tokens reached the client (a delta, or the whole output)."""
        if num_tokens <= 0:
            return
        self.tokens_reached(timeline, num_tokens, time.monotonic() if now is None else now)
        self._generation_tokens.inc(num_tokens)

    def tokens_reached(self, timeline: RequestTimeline, num_tokens: int, now: float) -> None:
        """`tokens_generated` for the request's timeline only: a caller with many requests' tokens
        counts them all at once with `tokens_counted`."""
        if timeline.first_token_s is None:
            timeline.first_token_s = now
            self._ttft.observe(now - timeline.arrival_s)
        timeline.last_token_s = now
        timeline.num_output_tokens += num_tokens

    def tokens_counted(self, num_tokens: int) -> None:
        """`num_tokens` output tokens reached clients (their timelines moved by `tokens_reached`)."""
        self._generation_tokens.inc(num_tokens)

    def request_finished(
        self,
        timeline: RequestTimeline,
        finished_reason: str,
        *,
        num_prompt_tokens: int,
        queue_time_s: float | None = None,
        now: float | None = None,
    ) -> None:
        """The request ended: "stop" or "length" as the engine said, "abort" when the client
        left or aborted, "error" when it failed. `queue_time_s` when the engine reported it."""
        success = self._success.get(finished_reason)
        if success is None:
            raise ValueError(f"finished_reason must be one of {', '.join(FINISHED_REASONS)}, got {finished_reason!r}")
        now = time.monotonic() if now is None else now
        success.inc()
        self._prompt_tokens.inc(num_prompt_tokens)
        self._e2e.observe(now - timeline.arrival_s)
        if queue_time_s is not None:
            self._queue_time.observe(queue_time_s)
        if timeline.num_output_tokens > 1:
            decode_s = timeline.last_token_s - timeline.first_token_s
            self._tpot.observe(decode_s / (timeline.num_output_tokens - 1))

    def set_stats(
        self,
        *,
        num_requests_running: int,
        num_requests_waiting: int,
        kv_cache_usage: float,
        prefix_cache_hit_rate: float,
        num_stage_restarts: int,
        num_resumed_requests: int = 0,
        num_guard_failed_requests: int = 0,
        num_draft_tokens: int = 0,
        num_accepted_tokens: int = 0,
        num_verifications: int = 0,
    ) -> None:
        """Gauges from a stats snapshot. `kv_cache_usage` is used / total KV blocks (0 to 1); the
        `num_*` are totals (each counter adds the rise): the restarts and requests since the daemon
        started, the speculative decoding counts since the engine (re)started, so a count that
        falls started again from zero and all of it is new."""
        self._running.set(num_requests_running)
        self._waiting.set(num_requests_waiting)
        self._kv_cache_usage.set(kv_cache_usage)
        self._prefix_cache_hit_rate.set(prefix_cache_hit_rate)
        speculative = SpeculativeCounts(num_draft_tokens, num_accepted_tokens, num_verifications)
        self._acceptance_rate.set(speculative.draft_acceptance_rate)
        self._mean_accepted_length.set(speculative.mean_accepted_length)
        for counter, total in ((self._stage_restarts, num_stage_restarts), (self._resumed, num_resumed_requests),
                               (self._guard_failed, num_guard_failed_requests), (self._draft_tokens, num_draft_tokens),
                               (self._accepted_tokens, num_accepted_tokens), (self._verifications, num_verifications)):
            seen = self._totals_seen.get(counter, 0)
            if total != seen:
                counter.inc(total - seen if total > seen else total)
                self._totals_seen[counter] = total

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its Content-Type, for `GET /metrics`."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
