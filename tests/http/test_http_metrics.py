"""Prometheus metrics: the exposition parses, carries the model name, and moves with requests."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.protocol import SpeculativeCounts, StatsReply
from pipeline.serve.metrics import FINISHED_REASONS, STATS_TOTALS, Metrics
from pipeline.serve.openai.app import OpenAIApi

SPEC_DECODE_SERIES = (
    "pipeline:spec_decode_num_draft_tokens_total", "pipeline:spec_decode_num_accepted_tokens_total",
    "pipeline:spec_decode_num_verifications_total", "pipeline:spec_decode_draft_acceptance_rate",
    "pipeline:spec_decode_mean_accepted_length",
)


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def value(metrics: Metrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, tuple(sorted({"model_name": "tiny", **labels}.items())))]


def test_every_metric_is_exposed_with_the_model_name_before_any_request():
    names = {name for name, _ in samples(Metrics("tiny"))}
    for expected in (
        "pipeline:num_requests_running", "pipeline:num_requests_waiting", "pipeline:kv_cache_usage_perc",
        "pipeline:prefix_cache_hit_rate", "pipeline:prompt_tokens_total", "pipeline:generation_tokens_total",
        "pipeline:stage_restarts_total", "pipeline:request_success_total",
        "pipeline:time_to_first_token_seconds_count", "pipeline:time_per_output_token_seconds_count",
        "pipeline:e2e_request_latency_seconds_count", "pipeline:request_queue_time_seconds_count",
        *SPEC_DECODE_SERIES,
    ):
        assert expected in names
    assert all(dict(labels).get("model_name") == "tiny" for _, labels in samples(Metrics("tiny")))
    for reason in FINISHED_REASONS:
        assert value(Metrics("tiny"), "pipeline:request_success_total", finished_reason=reason) == 0


def test_a_requests_life_moves_the_counters_and_histograms():
    metrics = Metrics("tiny")
    timeline = metrics.request_arrived(now=100.0)
    metrics.tokens_generated(timeline, 1, now=100.05)  # first token after 50 ms
    metrics.tokens_generated(timeline, 2, now=100.07)
    metrics.tokens_generated(timeline, 1, now=100.08)  # 3 more tokens in 30 ms: 10 ms each
    metrics.request_finished(timeline, "length", num_prompt_tokens=7, queue_time_s=0.02, now=100.1)

    assert value(metrics, "pipeline:generation_tokens_total") == 4
    assert value(metrics, "pipeline:prompt_tokens_total") == 7
    assert value(metrics, "pipeline:request_success_total", finished_reason="length") == 1
    assert value(metrics, "pipeline:request_success_total", finished_reason="stop") == 0
    assert value(metrics, "pipeline:time_to_first_token_seconds_sum") == pytest.approx(0.05)
    assert value(metrics, "pipeline:time_to_first_token_seconds_bucket", le="0.04") == 0
    assert value(metrics, "pipeline:time_to_first_token_seconds_bucket", le="0.06") == 1
    assert value(metrics, "pipeline:time_per_output_token_seconds_sum") == pytest.approx(0.01)
    assert value(metrics, "pipeline:e2e_request_latency_seconds_sum") == pytest.approx(0.1)
    assert value(metrics, "pipeline:request_queue_time_seconds_count") == 1


def test_a_request_aborted_before_its_first_token_counts_no_latency_per_token():
    metrics = Metrics("tiny")
    metrics.request_finished(metrics.request_arrived(now=5.0), "abort", num_prompt_tokens=3, now=6.0)
    assert value(metrics, "pipeline:request_success_total", finished_reason="abort") == 1
    assert value(metrics, "pipeline:time_to_first_token_seconds_count") == 0
    assert value(metrics, "pipeline:time_per_output_token_seconds_count") == 0
    assert value(metrics, "pipeline:e2e_request_latency_seconds_count") == 1


def test_an_unknown_finish_reason_is_refused_by_name():
    metrics = Metrics("tiny")
    with pytest.raises(ValueError, match="'done'"):
        metrics.request_finished(metrics.request_arrived(), "done", num_prompt_tokens=1)


def test_stats_set_the_gauges_and_restarts_count_only_their_rise():
    metrics = Metrics("tiny")
    metrics.set_stats(StatsReply(num_running_requests=3, num_waiting_requests=2, kv_blocks_used=2, kv_blocks_total=8,
                                 prefix_cache_hit_rate=0.5, num_restarts=1))
    metrics.set_stats(StatsReply(num_running_requests=1, num_waiting_requests=0, kv_blocks_used=1, kv_blocks_total=8,
                                 prefix_cache_hit_rate=0.5, num_restarts=1))
    assert value(metrics, "pipeline:num_requests_running") == 1
    assert value(metrics, "pipeline:num_requests_waiting") == 0
    assert value(metrics, "pipeline:kv_cache_usage_perc") == 0.125
    assert value(metrics, "pipeline:prefix_cache_hit_rate") == 0.5
    assert value(metrics, "pipeline:stage_restarts_total") == 1
    metrics.set_stats(StatsReply(num_restarts=3))
    assert value(metrics, "pipeline:stage_restarts_total") == 3


def test_resumed_and_guard_failed_requests_count_their_rise():
    metrics = Metrics("tiny")
    for resumed, failed in ((4, 0), (4, 0), (9, 1)):
        metrics.set_stats(StatsReply(num_restarts=1, num_resumed_requests=resumed, num_guard_failed_requests=failed))
    assert value(metrics, "pipeline:requests_resumed_total") == 9
    assert value(metrics, "pipeline:requests_failed_by_guard_total") == 1


def test_stage_deaths_and_stall_verdicts_count_apart():
    metrics = Metrics("tiny")
    for deaths, verdicts in ((1, 0), (1, 2), (3, 2)):
        metrics.set_stats(StatsReply(num_stage_deaths=deaths, num_stall_verdicts=verdicts))
    assert value(metrics, "pipeline:stage_deaths_total") == 3
    assert value(metrics, "pipeline:stage_stall_verdicts_total") == 2


def test_two_instances_share_nothing():
    first, second = Metrics("tiny"), Metrics("tiny")
    first.tokens_generated(first.request_arrived(now=0.0), 5, now=1.0)
    assert value(first, "pipeline:generation_tokens_total") == 5
    assert value(second, "pipeline:generation_tokens_total") == 0


def spec_decode_values(metrics: Metrics) -> list[float]:
    return [value(metrics, name) for name in SPEC_DECODE_SERIES]


def test_speculative_counts_rise_and_an_engine_restart_adds_its_fresh_counts():
    metrics = Metrics("tiny")
    assert spec_decode_values(metrics) == [0, 0, 0, 0, 0]
    metrics.set_stats(StatsReply(num_draft_tokens=30, num_accepted_tokens=21, num_verifications=10))
    assert spec_decode_values(metrics) == pytest.approx([30, 21, 10, 0.7, 3.1])
    metrics.set_stats(StatsReply(num_draft_tokens=40, num_accepted_tokens=29, num_verifications=14))
    assert spec_decode_values(metrics) == pytest.approx([40, 29, 14, 29 / 40, 1 + 29 / 14])
    # The engine restarted: its counts began again from zero, and every one of them is new.
    metrics.set_stats(StatsReply(num_draft_tokens=5, num_accepted_tokens=0, num_verifications=5))
    assert spec_decode_values(metrics) == pytest.approx([45, 29, 19, 0.0, 1.0])


def test_rows_not_drafting_are_counted_by_reason():
    metrics = Metrics("tiny")
    reasons = ("batch", "backoff", "logit_bias", "no_match")
    metrics.set_stats(StatsReply(num_rows_off_batch=4, num_rows_off_backoff=3, num_rows_off_logit_bias=2,
                                 num_rows_off_no_match=1, num_revivals=5))
    metrics.set_stats(StatsReply(num_rows_off_batch=6, num_rows_off_backoff=3, num_rows_off_logit_bias=2,
                                 num_rows_off_no_match=9, num_revivals=5))
    assert [value(metrics, f"pipeline:spec_decode_num_rows_off_{r}_total") for r in reasons] == [6, 3, 2, 9]
    assert value(metrics, "pipeline:spec_decode_num_revivals_total") == 5


class StatsServer:
    """What the /metrics handler reads of the daemon server: its stats and its metrics."""

    def __init__(self, reply: StatsReply) -> None:
        self.model = None
        self.metrics = Metrics("tiny")
        self.reply = reply

    def stats(self) -> StatsReply:
        return self.reply


def test_the_metrics_endpoint_exposes_the_daemons_speculative_counts():
    server = StatsServer(StatsReply(kv_blocks_total=8, num_draft_tokens=12, num_accepted_tokens=9,
                                    num_verifications=4))
    response = asyncio.run(OpenAIApi(server).metrics(None))  # type: ignore[arg-type]
    assert response.status == 200
    assert spec_decode_values(server.metrics) == pytest.approx([12, 9, 4, 0.75, 3.25])
    assert b"pipeline:spec_decode_num_draft_tokens_total{model_name=\"tiny\"} 12.0" in response.body


def test_every_speculative_count_is_exposed_as_a_counter():
    exposed = {field: name for name, _, field in STATS_TOTALS}
    for count in dataclasses.fields(SpeculativeCounts):
        assert f"pipeline:spec_decode_{count.name}" == exposed[count.name]
