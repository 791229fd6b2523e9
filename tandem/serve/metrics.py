"""Prometheus metrics of one server (its own registry: two servers in one process do not mix)."""

from __future__ import annotations

from tandem.core.extras import require

require("serve", "tandem serve")  # the whole serving stack, checked before any of it is imported: a
# missing extra is one line naming it, even where part of the stack is installed
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest  # noqa: E402

from tandem.serve.llm_metrics import LLMMetrics  # noqa: E402

LATENCY_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tandem_serve_requests", "HTTP requests answered, by route and status code",
                                ["route", "code"], registry=r)
        self.latency = Histogram("tandem_serve_request_seconds", "Time from a request's arrival to its answer",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("tandem_serve_queue_depth", "Requests admitted and waiting for a replica",
                                 registry=r)
        self.inflight = Gauge("tandem_serve_inflight", "Requests being handled (queued or on a replica)",
                              registry=r)
        self.batch_size = Histogram("tandem_serve_batch_size", "Examples (predict) or requests (generate) "
                                    "per batch sent to a replica", ["kind"], buckets=BATCH_BUCKETS, registry=r)
        self.restarts = Counter("tandem_serve_replica_restarts", "Replicas restarted after they died or hung",
                                registry=r)
        self.retries = Counter("tandem_serve_retried_batches", "Batches put back in the queue because their "
                               "replica died", registry=r)
        self.given_up = Counter("tandem_serve_requests_given_up", "Requests answered 500 and not retried: "
                                "lost inside a live replica (no token for --hang-s), or held by 2 replicas "
                                "that died", ["reason"], registry=r)
        self.replicas_ready = Gauge("tandem_serve_replicas_ready", "Replicas loaded, warmed up and serving",
                                    registry=r)
        self.replicas_target = Gauge("tandem_serve_replicas_target", "Replicas the pool runs (autoscaling "
                                     "moves it within --replicas MIN:MAX)", registry=r)
        self.scale_decisions = Counter("tandem_serve_autoscale_decisions", "Autoscaling decisions, by "
                                       "direction and signal (queue, p99, idle; reasons in RUN_DIR/autoscale.jsonl)",
                                       ["direction", "signal"], registry=r)
        self.recent_p99 = Gauge("tandem_serve_recent_p99_seconds", "p99 of the requests answered in the last "
                                "autoscaling window (--replicas MIN:MAX only; 0 when none were)", registry=r)
        self.tokens = Counter("tandem_serve_generated_tokens", "Tokens generated", registry=r)
        self.llm = LLMMetrics(r)   # vLLM's names, for the OpenAI routes (llm_metrics.py)

    def render(self) -> bytes:
        return generate_latest(self.registry)
