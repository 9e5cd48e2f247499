"""The server's Prometheus metrics (`GET /metrics`): HTTP requests by endpoint and status, the engine's gauges and
counters from the loop thread's last snapshot, latency histograms of finished requests, and the start-up figures.
One registry per app, so several apps in one process do not clash."""

from __future__ import annotations

from typing import Optional

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    """The registry of one app: `server` has .loop (its `stats` snapshot, `in_flight`, `alive`), .limit and
    .startup."""

    def __init__(self, server):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("swiftkv_http_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("swiftkv_engine_requests_finished", "engine requests finished, by the engine's "
                                "finish reason (stop: a stop id or string, length, abort)", ["finish_reason"],
                                registry=r)
        histogram = lambda name, text: Histogram(name, text, buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = histogram("swiftkv_time_to_first_token_seconds", "time to first token, from arrival")
        self.tpot = histogram("swiftkv_time_per_output_token_seconds", "mean time per output token after the first")
        self.e2e = histogram("swiftkv_e2e_request_latency_seconds", "arrival to finish")
        self.queue = histogram("swiftkv_request_queue_time_seconds", "arrival to first scheduled")
        r.register(_EngineCollector(server))

    def on_finish(self, out) -> None:  # the loop thread; prometheus_client is thread-safe
        self.finished.labels(out.finish_reason or "unknown").inc()
        m = out.metrics or {}
        for histogram, key in ((self.ttft, "ttft_s"), (self.tpot, "tpot_s"), (self.e2e, "e2e_s"),
                               (self.queue, "queue_s")):
            if m.get(key) is not None:
                histogram.observe(m[key])

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _EngineCollector:
    """Engine gauges and counters, from the snapshot the loop thread takes after every step."""

    def __init__(self, server):
        self.server = server

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.server.loop.stats
        gauges = (("swiftkv_num_requests_running", "requests holding a sequence slot", s["running"]),
                  ("swiftkv_num_requests_waiting", "requests queued in the engine", s["waiting"]),
                  ("swiftkv_num_requests_in_flight", "engine requests admitted by the server and not finished",
                   self.server.loop.in_flight),
                  ("swiftkv_max_requests_in_flight", "admission limit: max_num_seqs + max_waiting", self.server.limit),
                  ("swiftkv_kv_pages_total", "pages in the paged KV cache", s["pages_total"]),
                  ("swiftkv_kv_pages_free", "free pages in the paged KV cache", s["pages_free"]),
                  ("swiftkv_kv_cache_usage", "fraction of the KV cache's pages in use", s["page_usage"]),
                  ("swiftkv_compiled_buckets", "step shapes compiled", s["compiled_buckets"]),
                  ("swiftkv_prefix_cache_pages", "pages cached for prefix reuse", s["prefix_cache_pages"]),
                  ("swiftkv_engine_healthy", "1 while the engine loop runs", int(self.server.loop.alive)))
        for name, text, value in gauges:
            yield GaugeMetricFamily(name, text, value=value)
        yield from _startup_gauges(self.server.startup)
        counters = (("swiftkv_num_preemptions", "preemptions (a request gave its pages back)", s["preemptions"]),
                    ("swiftkv_prompt_tokens", "prompt tokens run (recomputed ones again)", s["prompt_tokens"]),
                    ("swiftkv_generation_tokens", "tokens generated", s["generated_tokens"]),
                    ("swiftkv_engine_steps", "engine steps", s["steps"]),
                    ("swiftkv_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                     s["prefix_cache_queries"]),
                    ("swiftkv_prefix_cache_hits", "prompt tokens found in the prefix cache", s["prefix_cache_hits"]),
                    ("swiftkv_prefix_cache_evictions", "cached pages evicted", s["prefix_cache_evictions"]))
        for name, text, value in counters:
            yield CounterMetricFamily(name, text, value=value)


def _startup_gauges(startup: Optional[dict]):
    """The start-up's figures (`process.start_engine`), when the app was given them."""
    from prometheus_client.core import GaugeMetricFamily

    if startup is None:
        return
    yield GaugeMetricFamily("swiftkv_startup_seconds", "engine build and warm-up, wall clock", value=startup["seconds"])
    yield GaugeMetricFamily("swiftkv_startup_compile_seconds", "seconds in XLA building the programs of the engine "
                            "build and warm-up (compiling, or loading from the compilation cache)",
                            value=startup["compile_seconds"])
    programs = GaugeMetricFamily("swiftkv_startup_programs", "XLA programs of the engine build and warm-up: compiled, "
                                 "or loaded from the persistent compilation cache", labels=["source"])
    programs.add_metric(["compiled"], startup["compiled"])
    programs.add_metric(["cache"], startup["loaded"])
    yield programs
    yield GaugeMetricFamily("swiftkv_compilation_cache_enabled", "1 when JAX's persistent compilation cache is on",
                            value=int(startup["compilation_cache"] is not None))


class CountRequests:
    """ASGI middleware: count every HTTP response by endpoint (one of `endpoints`, else "other") and status (a stream
    is counted when it ends)."""

    def __init__(self, app, counter, endpoints):
        self.app, self.counter, self.endpoints = app, counter, frozenset(endpoints)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            endpoint = scope["path"] if scope["path"] in self.endpoints else "other"
            self.counter.labels(endpoint, str(status[0])).inc()
