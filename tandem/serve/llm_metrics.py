"""LLM serving metrics under vLLM's names, next to tandem's own (same registry, same /metrics), so the
dashboards and routers that read a vLLM server read this one too. Each carries vLLM's ``model_name``
label. Times run from the request's arrival at the front.

    vllm:time_to_first_token_seconds   histogram  arrival -> first generated token reaches the front
    vllm:inter_token_latency_seconds   histogram  between consecutive tokens of one sequence
    vllm:e2e_request_latency_seconds   histogram  arrival -> last token
    vllm:num_requests_running          gauge      sequences on a replica (prefilling or decoding)
    vllm:num_requests_waiting          gauge      sequences queued for a replica
    vllm:prompt_tokens_total           counter    prompt tokens of the sequences run
    vllm:generation_tokens_total       counter    tokens generated (also those of cancelled sequences)
    vllm:request_success_total         counter    sequences finished, by finished_reason (stop, length, abort)
    vllm:kv_cache_usage_perc           gauge      KV-cache slots held / slots of the ready replicas, 0..1
                                                  (tandem's cache is one slot of the model's whole
                                                  context per sequence, not vLLM's blocks)

With tandem_serve_cancelled_sequences_total and tandem_serve_cancelled_decoded_tokens_total: sequences
a replica dropped early, and the tokens they had decoded by then.

Counted for the generate requests of the OpenAI routes (/v1/completions, /v1/chat/completions), one
sequence per choice.
"""

from __future__ import annotations

from tandem.core.extras import require

require("serve", "tandem serve")  # checked before the serving stack is imported: a missing extra is one line
from prometheus_client import Counter, Gauge, Histogram  # noqa: E402

TTFT_BUCKETS = (.001, .005, .01, .02, .04, .06, .08, .1, .25, .5, .75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
ITL_BUCKETS = (.001, .0025, .005, .01, .025, .05, .075, .1, .15, .2, .3, .4, .5, .75, 1, 2.5, 5, 10)
E2E_BUCKETS = (.01, .025, .05, .1, .3, .5, .8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120)


class LLMMetrics:
    def __init__(self, registry, model_name: str = ""):
        r, lab = registry, ["model_name"]
        self.model_name = model_name
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", lab,
                               buckets=TTFT_BUCKETS, registry=r)
        self._itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive tokens", lab,
                              buckets=ITL_BUCKETS, registry=r)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token", lab,
                              buckets=E2E_BUCKETS, registry=r)
        self._running = Gauge("vllm:num_requests_running", "Sequences on a replica", lab, registry=r)
        self._waiting = Gauge("vllm:num_requests_waiting", "Sequences waiting for a replica", lab, registry=r)
        self._kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache slots in use, 0..1", lab, registry=r)
        self._prompt = Counter("vllm:prompt_tokens", "Prompt tokens of the sequences run", lab, registry=r)
        self._gen = Counter("vllm:generation_tokens", "Tokens generated", lab, registry=r)
        self._done = Counter("vllm:request_success", "Sequences finished", lab + ["finished_reason"], registry=r)
        # tandem's own: how early a cancel (client gone, stop sequence) took a sequence off its replica
        self.cancelled = Counter("tandem_serve_cancelled_sequences", "Sequences a replica dropped before their "
                                 "end (client gone, or a stop sequence seen by the front)", registry=r)
        self.cancelled_tokens = Counter("tandem_serve_cancelled_decoded_tokens", "Tokens those sequences had "
                                        "decoded when their replica dropped them", registry=r)
        self.running = self.waiting = 0
        self.slots = 0            # KV-cache slots of the ready replicas (set by the front from the pool)

    def bind(self, model_name: str, slots) -> None:
        """The served model's name (the label) and a callable giving the ready replicas' slots."""
        self.model_name = model_name
        self._running.labels(model_name).set_function(lambda: self.running)
        self._waiting.labels(model_name).set_function(lambda: self.waiting)
        self._kv.labels(model_name).set_function(lambda: min(1.0, self.running / s) if (s := slots()) else 0.0)

    def ttft(self, s: float) -> None:
        self._ttft.labels(self.model_name).observe(s)

    def itl(self, s: float, n: int = 1) -> None:
        h = self._itl.labels(self.model_name)
        for _ in range(n):
            h.observe(s)

    def finished(self, e2e_s: float, prompt: int, generated: int, reason: str) -> None:
        """One sequence ended; an aborted one (client gone, refused, failed) counts its tokens only."""
        if reason != "abort":
            self._e2e.labels(self.model_name).observe(e2e_s)
        self._prompt.labels(self.model_name).inc(prompt)
        self._gen.labels(self.model_name).inc(generated)
        self._done.labels(self.model_name, reason).inc()
