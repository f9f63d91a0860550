"""Prometheus metrics of the serving front end, named and bucketed like vLLM's (`pipeline:` prefix).

A `Metrics` owns its registry, so two servers in one process (or two tests) never share a
counter. Every series carries a `model_name` label. A request's life is recorded in three
calls: `request_arrived` returns its `RequestTimeline`, `tokens_generated` counts each batch of
output tokens (the first gives the time to first token), and `request_finished` observes the
latencies and counts the request under its finish reason. Label children are bound once here,
so a call is a few counter or histogram updates. `set_stats` sets every series of STATS_GAUGES
and STATS_TOTALS from the daemon's stats reply: a count the reply carries is exposed by one row there.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from operator import attrgetter

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pipeline.protocol import StatsReply

FINISHED_REASONS = ("stop", "length", "abort", "error")

# vLLM's buckets. Time per output token also gets finer ones at the bottom: a small model here
# decodes in a few milliseconds per token.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                  1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                             120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# Gauges set from a stats reply: (metric, help, the reply's attribute).
STATS_GAUGES = (
    ("pipeline:num_requests_running", "Requests the engine is running now.", "num_running_requests"),
    ("pipeline:num_requests_waiting", "Requests waiting for the engine to start them.", "num_waiting_requests"),
    ("pipeline:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", "kv_cache_usage"),
    ("pipeline:prefix_cache_hit_rate", "Share of prompt tokens found in the prefix cache.", "prefix_cache_hit_rate"),
    ("pipeline:spec_decode_draft_acceptance_rate", "Share of verified draft tokens accepted, since the engine started.",
     "speculative.draft_acceptance_rate"),
    ("pipeline:spec_decode_mean_accepted_length", "Tokens a verifying step gives a request on average, since the "
     "engine started: accepted drafts and one sampled token.", "speculative.mean_accepted_length"),
)
# Counters that follow a total of the stats reply (each adds the rise; a total that falls started
# again from zero, and all of it is new): (metric, help, the reply's attribute). Restarts and
# requests count since the daemon started, speculative decoding since the engine (re)started.
STATS_TOTALS = (
    ("pipeline:stage_restarts", "Times the stage processes were restarted.", "num_restarts"),
    ("pipeline:prefix_cache_hits", "Admitted prompt tokens found in the prefix cache (vLLM's prefix_cache_hits).",
     "prefix_cache_hit_tokens"),
    ("pipeline:requests_resumed", "Requests resubmitted to restarted stages after a crash (each time counts).",
     "num_resumed_requests"),
    ("pipeline:requests_failed_by_guard", "Requests ended because they were in flight during two crashes of one "
     "stage.", "num_guard_failed_requests"),
    ("pipeline:stage_deaths", "Stage failures: a stage process exited, known by its exit status or pid.",
     "num_stage_deaths"),
    ("pipeline:stage_stall_verdicts", "Times a live stage was taken for hung: its loop had not gone round within "
     "the limit its pace allows. Not deaths: nothing restarts for one.", "num_stall_verdicts"),
    ("pipeline:spec_decode_num_draft_tokens", "Speculative draft tokens verified.", "num_draft_tokens"),
    ("pipeline:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.", "num_accepted_tokens"),
    ("pipeline:spec_decode_num_verifications", "Steps of a request that verified speculative drafts.",
     "num_verifications"),
    ("pipeline:spec_decode_num_rows_off_batch", "Decode steps of rows that could draft and did not: at the step's "
     "batch, verifying drafts costs more than the row's acceptance rate pays for.", "num_rows_off_batch"),
    ("pipeline:spec_decode_num_rows_off_backoff", "Decode steps of rows that did not draft: backed off, their drafts "
     "rarely accepted.", "num_rows_off_backoff"),
    ("pipeline:spec_decode_num_rows_off_logit_bias", "Decode steps of rows that did not draft: their logit_bias (grammar rows draft, checked against the grammar).",
     "num_rows_off_logit_bias"),
    ("pipeline:spec_decode_num_rows_off_no_match", "Decode steps of rows that did not draft: their last tokens have no "
     "earlier occurrence to copy (n-gram).", "num_rows_off_no_match"),
    ("pipeline:spec_decode_num_revivals", "Backed-off rows seen copying again on the host and drafting at once.",
     "num_revivals"),
)


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

        self._stats_gauges = [(gauge(name, doc), attrgetter(field)) for name, doc, field in STATS_GAUGES]
        self._prompt_tokens = counter("pipeline:prompt_tokens", "Prompt tokens of finished requests.")
        self._generation_tokens = counter("pipeline:generation_tokens", "Output tokens generated.")
        self._stats_totals = [(counter(name, doc), attrgetter(field)) for name, doc, field in STATS_TOTALS]
        success = Counter("pipeline:request_success", "Finished requests, by finish reason.",
                          [*labels, "finished_reason"], registry=self.registry)
        self._success = {reason: success.labels(model_name, reason) for reason in FINISHED_REASONS}
        self._ttft = histogram("pipeline:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS_S)
        self._tpot = histogram("pipeline:time_per_output_token_seconds",
                               "Mean time per output token after the first, one sample per request.", TPOT_BUCKETS_S)
        self._e2e = histogram("pipeline:e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS_S)
        self._queue_time = histogram("pipeline:request_queue_time_seconds", "Time waiting before the engine started the request.",
                                     REQUEST_LATENCY_BUCKETS_S)
        self._totals_seen: dict[Counter, int] = {}  # the total each counter of STATS_TOTALS last saw

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

    def set_stats(self, stats: StatsReply) -> None:
        """Every series of STATS_GAUGES and STATS_TOTALS from a stats snapshot."""
        for gauge, value_of in self._stats_gauges:
            gauge.set(value_of(stats))
        for counter, total_of in self._stats_totals:
            total, seen = total_of(stats), self._totals_seen.get(counter, 0)
            if total != seen:
                counter.inc(total - seen if total > seen else total)
                self._totals_seen[counter] = total

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its Content-Type, for `GET /metrics`."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
