"""Prometheus metrics of the router (`pipeline:router_` prefix), in its own registry."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pipeline.router.policy import Route


class RouterMetrics:
    def __init__(self, backends: list[str]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("pipeline:router_requests", "Requests the router took, by endpoint.",
                                ["endpoint"], registry=self.registry)
        self.routed = Counter("pipeline:router_routed", "Upstream requests by how their replica was chosen "
                              "(prefix_owner is a prefix-routing hit).", ["route"], registry=self.registry)
        self.retries = Counter("pipeline:router_retries", "Upstream attempts after the first, for any reason.",
                               registry=self.registry)
        self.failovers = Counter("pipeline:router_failovers", "Streams resumed on another replica after theirs broke.",
                                 registry=self.registry)
        self.failed = Counter("pipeline:router_requests_failed", "Requests the router ended with an error of its own.",
                              ["reason"], registry=self.registry)
        self.outstanding = Gauge("pipeline:router_backend_outstanding", "Requests outstanding per backend.",
                                 ["backend"], registry=self.registry)
        self.healthy = Gauge("pipeline:router_backend_healthy", "1 while a backend is in the ring.",
                             ["backend"], registry=self.registry)
        self.sent = Counter("pipeline:router_backend_requests", "Upstream requests sent per backend.",
                            ["backend"], registry=self.registry)
        # Why an upstream stream ended before its end: a death is a fact (a connection refused, reset or
        # ended); a stall verdict is a judgement (silent past its deadline, and /health not ok).
        self.deaths = Counter("pipeline:router_backend_deaths", "Upstream requests whose replica died under "
                              "them (their connection ended or broke before their end).", ["backend"],
                              registry=self.registry)
        self.stalls = Counter("pipeline:router_backend_stall_verdicts", "Upstream streams taken for hung: silent "
                              "past their replica's deadline, and its /health not ok (not deaths).", ["backend"],
                              registry=self.registry)
        self.slow = Counter("pipeline:router_backend_slow_streams", "Upstream streams silent past their replica's "
                            "deadline whose replica answered /health ok: slow, waited for.", ["backend"],
                            registry=self.registry)
        for url in backends:
            self.outstanding.labels(url).set(0)
            self.healthy.labels(url).set(0)
            for counter in (self.sent, self.deaths, self.stalls, self.slow):
                counter.labels(url)
        for route in Route:
            self.routed.labels(route.value)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
