"""The server's Prometheus metrics (`GET /metrics`): HTTP requests by endpoint and status, the engine's gauges and
counters from the loop thread's last snapshot, latency histograms of finished requests, and the start-up figures.
One registry per app, so several apps in one process do not clash.

The figures that mean what vLLM's mean are also given under vLLM's names (`vllm:num_requests_running`,
`vllm:kv_cache_usage_perc`, `vllm:time_to_first_token_seconds`, ...; vllm/v1/metrics/loggers.py) with its labels
(`model_name`, `engine`) and buckets, so a Grafana dashboard, an autoscaler or a router built for vLLM reads this
server unchanged. `vllm:inter_token_latency_seconds` (and its older name `vllm:time_per_output_token_seconds`, which
vLLM's example Grafana dashboard reads) is the engine's own histogram of the time between a request's successive
tokens (`Scheduler.inter_token`); a request's mean of it is `vllm:request_time_per_output_token_seconds`."""

from __future__ import annotations

from typing import Optional

from swiftkv_jax.serving.scheduler import INTER_TOKEN_BUCKETS

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
# vLLM's buckets, for its names
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_TPOT_BUCKETS = INTER_TOKEN_BUCKETS
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")

# a finished request's `RequestOutput.metrics` key -> (our histogram or None, vLLM's name, help, vLLM's buckets;
# None: 1-2-5 up to the context)
REQUEST_HISTOGRAMS = {
    "ttft_s": ("swiftkv_time_to_first_token_seconds", "vllm:time_to_first_token_seconds",
               "time to first token, from arrival", VLLM_TTFT_BUCKETS),
    "tpot_s": ("swiftkv_time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds",
               "mean time per output token after the first", VLLM_TPOT_BUCKETS),
    "e2e_s": ("swiftkv_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds", "arrival to finish",
              VLLM_REQUEST_BUCKETS),
    "queue_s": ("swiftkv_request_queue_time_seconds", "vllm:request_queue_time_seconds",
                "arrival to first scheduled", VLLM_REQUEST_BUCKETS),
    "prefill_s": (None, "vllm:request_prefill_time_seconds", "first scheduled to first token", VLLM_REQUEST_BUCKETS),
    "decode_s": (None, "vllm:request_decode_time_seconds", "first token to last token", VLLM_REQUEST_BUCKETS),
    "inference_s": (None, "vllm:request_inference_time_seconds", "first scheduled to last token",
                    VLLM_REQUEST_BUCKETS),
    "prompt_tokens": (None, "vllm:request_prompt_tokens", "prompt tokens of a request", None),
    "generated_tokens": (None, "vllm:request_generation_tokens", "tokens a request generated", None),
    "max_tokens": (None, "vllm:request_params_max_tokens", "a request's max_tokens", None),
}
# vLLM's current name -> its older one, which dashboards in use still read (its example Grafana dashboard)
VLLM_ALIASES = {"vllm:kv_cache_usage_perc": "vllm:gpu_cache_usage_perc"}
# engine stats key -> vLLM's name, for the gauges and counters that mean the same
VLLM_GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
               "page_usage": "vllm:kv_cache_usage_perc"}
VLLM_COUNTERS = {"preemptions": "vllm:num_preemptions", "prompt_tokens_answered": "vllm:prompt_tokens",
                 "generated_tokens": "vllm:generation_tokens", "prefix_cache_queries": "vllm:prefix_cache_queries",
                 "prefix_cache_hits": "vllm:prefix_cache_hits"}


def _with_alias(name: str) -> tuple:
    return (name, VLLM_ALIASES[name]) if name in VLLM_ALIASES else (name,)


def buckets_1_2_5(highest: int) -> tuple:
    """1, 2, 5, 10, 20, 50, ... up to `highest` (vLLM's `build_1_2_5_buckets`, for token counts)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > highest:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


class Metrics:
    """The registry of one app: `server` has .loop (its `stats` snapshot, `in_flight`, `alive`), .limit, .startup,
    .model_name and .max_model_len."""

    def __init__(self, server):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = r = CollectorRegistry()
        self.labels = labels = dict(model_name=server.model_name, engine="0")  # vLLM's
        self.requests = Counter("swiftkv_http_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("swiftkv_engine_requests_finished", "engine requests finished, by the engine's "
                                "finish reason (stop: a stop id or string, length, abort)", ["finish_reason"],
                                registry=r)
        success = Counter("vllm:request_success", "engine requests finished, by finish reason",
                          [*labels, "finished_reason"], registry=r)
        self.success = {reason: success.labels(*labels.values(), reason) for reason in FINISH_REASONS}
        self.histograms = []  # (metrics key, histogram)
        tokens = buckets_1_2_5(server.max_model_len)
        for key, (ours, vllm, text, buckets) in REQUEST_HISTOGRAMS.items():
            if ours:
                self.histograms.append((key, Histogram(ours, text, buckets=LATENCY_BUCKETS, registry=r)))
            for name in _with_alias(vllm):
                histogram = Histogram(name, text, list(labels), buckets=buckets or tokens, registry=r)
                self.histograms.append((key, histogram.labels(*labels.values())))
        # per request (vLLM's ParentRequest: its n choices together), once all of its choices have finished
        tokens_family = Histogram("vllm:request_max_num_generation_tokens", "the most tokens any of a request's "
                                  "choices generated", list(labels), buckets=tokens, registry=r)
        self.max_generated = tokens_family.labels(*labels.values())
        n_family = Histogram("vllm:request_params_n", "a request's n", list(labels), buckets=(1, 2, 5, 10, 20),
                             registry=r)  # vLLM's buckets
        self.n = n_family.labels(*labels.values())
        r.register(_EngineCollector(server, labels))

    def on_finish(self, out) -> None:  # the loop thread; prometheus_client is thread-safe
        reason = out.finish_reason or "unknown"
        self.finished.labels(reason).inc()
        if reason in self.success:
            self.success[reason].inc()
        m = out.metrics or {}
        for key, histogram in self.histograms:
            if m.get(key) is not None:
                histogram.observe(m[key])

    def on_request(self, generated: list) -> None:
        """A request (one prompt's n choices, `generated`: the tokens each generated) has finished: vLLM's
        `request_max_num_generation_tokens` and `request_params_n`."""
        self.max_generated.observe(max(generated))
        self.n.observe(len(generated))

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _EngineCollector:
    """Engine gauges and counters, from the snapshot the loop thread takes after every step."""

    def __init__(self, server, labels: dict):
        self.server, self.labels = server, labels

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.server.loop.stats
        gauges = (("swiftkv_num_requests_running", "requests holding a sequence slot", "running"),
                  ("swiftkv_num_requests_waiting", "requests queued in the engine", "waiting"),
                  ("swiftkv_num_requests_in_flight", "engine requests admitted by the server and not finished",
                   self.server.loop.in_flight),
                  ("swiftkv_max_requests_in_flight", "admission limit: max_num_seqs + max_waiting", self.server.limit),
                  ("swiftkv_kv_pages_total", "pages in the paged KV cache", "pages_total"),
                  ("swiftkv_kv_pages_free", "free pages in the paged KV cache", "pages_free"),
                  ("swiftkv_kv_cache_usage", "fraction of the KV cache's pages in use", "page_usage"),
                  ("swiftkv_compiled_buckets", "step shapes compiled", "compiled_buckets"),
                  ("swiftkv_prefix_cache_pages", "pages cached for prefix reuse", "prefix_cache_pages"),
                  ("swiftkv_engine_healthy", "1 while the engine loop runs", int(self.server.loop.alive)))
        counters = (("swiftkv_num_preemptions", "preemptions (a request gave its pages back)", "preemptions"),
                    ("swiftkv_prompt_tokens", "prompt tokens run (recomputed ones again)", "prompt_tokens"),
                    ("swiftkv_prompt_tokens_answered", "prompt tokens of the requests given a first token (cached "
                     "ones too)", "prompt_tokens_answered"),
                    ("swiftkv_generation_tokens", "tokens generated", "generated_tokens"),
                    ("swiftkv_engine_steps", "engine steps", "steps"),
                    ("swiftkv_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                     "prefix_cache_queries"),
                    ("swiftkv_prefix_cache_hits", "prompt tokens found in the prefix cache", "prefix_cache_hits"),
                    ("swiftkv_prefix_cache_evictions", "cached pages evicted", "prefix_cache_evictions"))
        for family, table, vllm_names in ((GaugeMetricFamily, gauges, VLLM_GAUGES),
                                          (CounterMetricFamily, counters, VLLM_COUNTERS)):
            for name, text, key in table:
                value = s[key] if isinstance(key, str) else key
                yield family(name, text, value=value)
                for vllm_name in _with_alias(vllm_names[key]) if isinstance(key, str) and key in vllm_names else ():
                    vllm_family = family(vllm_name, text, labels=list(self.labels))
                    vllm_family.add_metric(list(self.labels.values()), value)
                    yield vllm_family
        yield from _inter_token_histograms(s["inter_token_latency"], self.labels)
        yield from _startup_gauges(self.server.startup)


def _inter_token_histograms(h: dict, labels: dict):
    """The engine's inter-token latency histogram (`Histogram.snapshot`) under vLLM's current and older names."""
    from prometheus_client.core import HistogramMetricFamily

    cumulative, buckets = 0, []
    for bound, count in zip((*h["bounds"], float("inf")), h["counts"]):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        family = HistogramMetricFamily(name, "seconds between a request's successive tokens", labels=list(labels))
        family.add_metric(list(labels.values()), buckets, sum_value=h["sum"])
        yield family


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
