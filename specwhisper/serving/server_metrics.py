"""Prometheus metrics of one server app, in the app's own registry (several apps in one process,
e.g. tests or two mounted engines, never clash in prometheus-client's global registry)."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 300)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, in_flight, waiting, running):
        """`in_flight`, `waiting`, `running`: callables read at scrape time (request counts)."""
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specwhisper_requests", "HTTP requests answered, by route and status",
                                ["path", "status"], registry=r)
        self.latency = Histogram("specwhisper_request_seconds", "HTTP request latency (receipt to last byte)",
                                 ["path"], buckets=LATENCY_BUCKETS, registry=r)
        self.engine_seconds = Histogram("specwhisper_engine_seconds", "Engine wall time per transcription",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.audio_seconds = Counter("specwhisper_audio_seconds", "Seconds of audio transcribed", registry=r)
        self.tokens = Counter("specwhisper_generated_tokens", "Tokens generated (EOT excluded)", registry=r)
        self.drafted = Counter("specwhisper_draft_tokens", "Draft tokens proposed to the target", registry=r)
        self.accepted = Counter("specwhisper_draft_accepted_tokens", "Draft tokens the target accepted",
                                registry=r)
        self.acceptance = Histogram("specwhisper_draft_acceptance_rate",
                                    "Per-request draft acceptance rate (requests that drafted)",
                                    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0), registry=r)
        Gauge("specwhisper_in_flight_requests", "Admitted requests not finished (decoding audio, queued or "
              "decoding); the server answers 429 at max_queue", registry=r).set_function(in_flight)
        Gauge("specwhisper_queue_depth", "Transcriptions submitted to the engine and not started",
              registry=r).set_function(waiting)
        Gauge("specwhisper_running_batch_size", "Transcriptions the engine is decoding now",
              registry=r).set_function(running)

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        self.requests.labels(path, str(status)).inc()
        self.latency.labels(path).observe(seconds)

    def observe_result(self, result) -> None:
        stats = result.stats
        self.engine_seconds.observe(stats.seconds)
        self.audio_seconds.inc(result.duration)
        self.tokens.inc(len(result.tokens))
        if stats.drafted:
            self.drafted.inc(stats.drafted)
            self.accepted.inc(stats.accepted)
            self.acceptance.observe(stats.acceptance_rate)

    def render(self) -> bytes:
        return generate_latest(self.registry)
