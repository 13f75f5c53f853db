"""The server's Prometheus series (`duoka_serve_*`, with vLLM's meanings, so dashboards and
alerts written for `vllm:*` carry over by renaming) and its console line.

Each ServeMetrics owns a CollectorRegistry rather than registering in prometheus_client's
global one: a process (a test session) may build several apps, and the global registry
refuses a second series of the same name.

Who writes what: the engine thread (duoka/serve/async_engine.py) observes the per-request
latencies as tokens arrive and hands over one EngineStats snapshot after every step; the
event loop reads the snapshot for /metrics and for the console line. prometheus_client's
metrics are thread-safe, and a snapshot is an immutable object swapped in one assignment.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "duoka_serve_"
# vLLM's bucket edges (vllm/v1/metrics/loggers.py), so that quantiles compare bucket for bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
# vLLM's finish reasons plus "error" (the engine failed under the request). Every label value
# exists from the start, so a rate() over a reason that has not happened yet reads 0, not absent.
FINISH_REASONS = ("stop", "length", "abort", "error")
CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass(frozen=True)
class _Snapshot:
    """What the last console line showed, to say rates over the interval since."""

    at: float
    running: int
    waiting: int
    kv_usage: float
    prompt_tokens: int
    generation_tokens: int
    prefix_queries: int
    prefix_hits: int


class ServeMetrics:
    def __init__(self, model_name: str, clock=time.monotonic):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._clock = clock
        labels = ["model_name"]

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name, doc):  # exposed as NAME_total
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Time from a request's arrival to its first output token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Time between two output tokens of a request.", ITL_BUCKETS)
        self.e2e_latency = histogram("e2e_request_latency_seconds",
                                     "Time from a request's arrival to its last output.", E2E_BUCKETS)
        self.running = gauge("num_requests_running", "Requests in the engine's running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for admission (KV blocks or batch slots).")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage; 1 means every block is in use.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).")
        self.generation_tokens = counter("generation_tokens", "Output tokens generated.")
        self.preemptions = counter("num_preemptions", "Running requests preempted (recomputed later) for lack of KV blocks.")
        self.logprob_bypass_tokens = counter("prefix_cache_logprob_bypass_tokens",
                                             "Prefix-cache tokens that requests with prompt logprobs computed again: "
                                             "their blocks carried no stored prompt logprobs of the request's k.")
        # Speculative decoding, as vLLM's spec_decode series (all 0 without it).
        self.spec_drafts = counter("spec_decode_num_drafts", "Sequence-steps that verified speculative draft tokens.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative draft tokens verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                            "Speculative draft tokens the model accepted.")
        self.spec_steps_off = counter("spec_decode_disabled_steps",
                                      "Steps decoded without speculation: more requests running than "
                                      "--speculative-disable-by-batch-size.")
        self.spec_acceptance_rate = gauge("spec_decode_acceptance_rate",
                                          "Accepted over verified draft tokens since the start (0 before any).")
        self.spec_acceptance_length = gauge("spec_decode_mean_acceptance_length",
                                            "Tokens per speculating sequence-step since the start: 1 + accepted "
                                            "drafts per draft (0 before any).")
        success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                          ["model_name", "finished_reason"], registry=self.registry)
        self._success = success
        self.request_success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}

        self._stats = None  # the latest EngineStats; the engine's counters are cumulative
        self._last_printed = _Snapshot(clock(), 0, 0, 0.0, 0, 0, 0, 0)  # rates of the first line count from here
        self._last_line_state: tuple = (0, 0, 0.0, 0, 0)  # idle: a server that never worked says nothing

    # ---- written by the engine thread
    def observe_first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def observe_inter_token(self, seconds: float, count: int = 1) -> None:
        """`count` tokens that arrived together, `seconds` after the previous one: each gets
        seconds / count, as vLLM spreads a multi-token step."""
        for _ in range(count):
            self.inter_token_latency.observe(seconds / count)

    def observe_inter_tokens(self, seconds: list[float]) -> None:
        """Many inter-token gaps at once (one engine step's)."""
        observe = self.inter_token_latency.observe
        for value in seconds:
            observe(value)

    def observe_finished(self, reason: str | None, e2e_seconds: float) -> None:
        if reason not in self.request_success:  # a reason this file does not list still gets counted
            self.request_success[reason] = self._success.labels(self.model_name, str(reason))
        self.request_success[reason].inc()
        self.e2e_latency.observe(e2e_seconds)

    def update_engine(self, stats) -> None:
        """Take one EngineStats (duoka/serve/engine.py): gauges are set, and the counters move
        by how much the engine's cumulative counts moved since the last call."""
        last = self._stats
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        for metric, field in ((self.prefix_queries, "prefix_queries"), (self.prefix_hits, "prefix_hits"),
                              (self.prompt_tokens, "prompt_tokens"), (self.generation_tokens, "generation_tokens"),
                              (self.preemptions, "num_preemptions"), (self.spec_drafts, "spec_drafts"),
                              (self.spec_draft_tokens, "spec_draft_tokens"),
                              (self.spec_accepted_tokens, "spec_accepted_tokens"),
                              (self.spec_steps_off, "spec_steps_off"),
                              (self.logprob_bypass_tokens, "logprob_bypass_tokens")):
            delta = getattr(stats, field) - (getattr(last, field) if last is not None else 0)
            if delta > 0:
                metric.inc(delta)
        self.spec_acceptance_rate.set(stats.spec_acceptance_rate)
        self.spec_acceptance_length.set(stats.spec_mean_acceptance_length)
        self._stats = stats

    # ---- read by the event loop
    def render(self) -> bytes:
        return generate_latest(self.registry)

    def console_line(self) -> str | None:
        """One line of what the server did since the previous line, or None when nothing has
        changed since then (an idle server stays quiet)."""
        stats = self._stats
        if stats is None:
            return None
        now = self._clock()
        state = (stats.num_running, stats.num_waiting, round(stats.kv_usage, 4), stats.prompt_tokens,
                 stats.generation_tokens)
        last = self._last_printed
        self._last_printed = _Snapshot(now, stats.num_running, stats.num_waiting, stats.kv_usage, stats.prompt_tokens,
                                       stats.generation_tokens, stats.prefix_queries, stats.prefix_hits)
        if state == self._last_line_state:
            return None
        self._last_line_state = state
        elapsed = now - last.at
        prompt, generated = stats.prompt_tokens - last.prompt_tokens, stats.generation_tokens - last.generation_tokens
        rate = (lambda n: n / elapsed) if elapsed > 0 else (lambda n: 0.0)
        hit_rate = 100 * stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0
        spec = (f" | draft acceptance {100 * stats.spec_acceptance_rate:.1f}%, "
                f"{stats.spec_mean_acceptance_length:.2f} tokens per step" if stats.spec_draft_tokens else "")
        return (f"duoka serve: running {stats.num_running}, waiting {stats.num_waiting} | "
                f"prompt {rate(prompt):,.1f} tok/s, generation {rate(generated):,.1f} tok/s | "
                f"KV cache {100 * stats.kv_usage:.1f}% | prefix cache hits {hit_rate:.1f}%{spec}")
