"""Prometheus metrics of a server, labelled only by configured model names (never by request text)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds: from 100 us (a tiny model) to 10 s (a queue under overload)
BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.2, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("cuvil_requests", "Inference requests received", ["model"], registry=r)
        self.failures = Counter("cuvil_request_failures", "Inference requests not answered with outputs, by reason "
                                "(bad_request, rejected: 429, shed: 503, unavailable, error)",
                                ["model", "reason"], registry=r)
        self.queue_seconds = Histogram("cuvil_queue_seconds", "Time from arrival to the start of compute",
                                       ["model"], buckets=BUCKETS, registry=r)
        self.compute_seconds = Histogram("cuvil_compute_seconds", "Time a library's run took",
                                         ["model"], buckets=BUCKETS, registry=r)
        self.request_seconds = Histogram("cuvil_request_seconds", "Time from the request's handler starting to "
                                         "its answer being ready (answered requests)", ["model"], buckets=BUCKETS,
                                         registry=r)
        self.deadline_misses = Counter("cuvil_deadline_misses", "Requests answered after their deadline",
                                       ["model"], registry=r)
        self.swaps = Counter("cuvil_swaps", "Hot updates by result (swapped, unchanged, signature_changed, "
                             "build_failed)", ["model", "result"], registry=r)
        self.ready = Gauge("cuvil_model_ready", "1 while a version of the model is loaded", ["model"], registry=r)
        # a collection holds the GIL: the event loop and every compute thread wait for it
        self.gc_pause_seconds = Histogram("cuvil_gc_pause_seconds", "Time the server's garbage collections took "
                                          "(every thread waits for them)", ["generation"], buckets=BUCKETS,
                                          registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
