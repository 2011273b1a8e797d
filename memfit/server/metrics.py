"""Prometheus metrics of one server: requests, tokens, latency, queue depth, the model serving and its swaps."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """Its own registry (not the process-global one), so two servers in one process never share counts."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("memfit_requests", "HTTP requests answered, by endpoint and status code.",
                                ["endpoint", "status"], registry=self.registry)
        self.tokens = Counter("memfit_tokens", "Tokens processed, by kind (prompt, completion).", ["kind"],
                              registry=self.registry)
        self.latency = Histogram("memfit_request_seconds", "Time from request to its last byte, by endpoint.",
                                 ["endpoint"], registry=self.registry,
                                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.queue_wait = Histogram("memfit_queue_wait_seconds", "Time a request waited for its batch.",
                                    registry=self.registry, buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30))
        self.queue_depth = Gauge("memfit_queue_depth", "Requests waiting for a batch.", registry=self.registry)
        self.model = Gauge("memfit_model_info", "1 for the model id serving now.", ["model"], registry=self.registry)
        self.swaps = Counter("memfit_model_swaps", "Alias moves handled, by result (ok, failed).", ["result"],
                             registry=self.registry)

    def serving(self, model_id: str) -> None:
        self.model.clear()
        self.model.labels(model=model_id).set(1)

    def swap(self, result: str, model_id: str) -> None:
        self.swaps.labels(result=result).inc()
        self.serving(model_id)

    def answered(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        self.latency.labels(endpoint=endpoint).observe(seconds)

    def counted(self, prompt: int, completion: int) -> None:
        self.tokens.labels(kind="prompt").inc(prompt)
        self.tokens.labels(kind="completion").inc(completion)

    def text(self) -> bytes:
        return generate_latest(self.registry)
