"""Prometheus metrics of `k3jax-serve` (names after SGLang's `sglang:*` metrics, `k3jax_` prefix).

Latencies are measured in the server at the gRPC layer (what a client sees, minus the network):
time to first token from the arrival of the Generate call, inter-token latency between streamed
tokens, end-to-end latency to the last response. Engine gauges are read at scrape time.
"""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)

# every metric name the server exports (docs/serving.md lists them; tests check them)
NAMES = (
    "k3jax_time_to_first_token_seconds", "k3jax_inter_token_latency_seconds", "k3jax_e2e_request_latency_seconds",
    "k3jax_num_queue_reqs", "k3jax_num_running_reqs", "k3jax_num_streams", "k3jax_cache_hit_rate",
    "k3jax_token_usage", "k3jax_gen_throughput", "k3jax_generation_tokens_total", "k3jax_prompt_tokens_total",
    "k3jax_cached_tokens_total", "k3jax_requests_total", "k3jax_request_errors_total", "k3jax_ready",
    "k3jax_engine_steps_total", "k3jax_engine_step_host_seconds_total", "k3jax_engine_step_wait_seconds_total",
)


class _StepCollector:
    """The engine's `StepTiming` as counters, read at scrape time: steps, and their seconds of host work and of
    waiting for the device (rate(host) / rate(steps) is the host time per step)."""

    def __init__(self, timing):
        self.timing = timing

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        t = self.timing
        yield CounterMetricFamily("k3jax_engine_steps", "Engine steps run (launched or collected).", value=t.steps)
        yield CounterMetricFamily("k3jax_engine_step_host_seconds", "Engine loop time spent on the host: scheduling, "
                                  "packing, launching, applying tokens.", value=t.host_s)
        yield CounterMetricFamily("k3jax_engine_step_wait_seconds", "Engine loop time blocked on the device's sampled "
                                  "tokens (device time the host work did not hide).", value=t.wait_s)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None, throughput_window_s: float = 10.0):
        self.registry = reg = registry or CollectorRegistry()
        self.ttft = Histogram("k3jax_time_to_first_token_seconds", "Time from request arrival to its first token.",
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("k3jax_inter_token_latency_seconds", "Time between consecutive streamed tokens.",
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram("k3jax_e2e_request_latency_seconds", "Time from request arrival to its last token.",
                             buckets=_E2E_BUCKETS, registry=reg)
        self.queue = Gauge("k3jax_num_queue_reqs", "Requests waiting for admission (queued or preempted).", registry=reg)
        self.running = Gauge("k3jax_num_running_reqs", "Requests holding a working slot (prefill or decode).",
                             registry=reg)
        self.streams = Gauge("k3jax_num_streams", "Open Generate streams.", registry=reg)
        self.hit_rate = Gauge("k3jax_cache_hit_rate", "Prompt tokens restored from the prefix cache / prompt tokens "
                              "(finished requests, cumulative).", registry=reg)
        self.token_usage = Gauge("k3jax_token_usage", "Fraction of KV pages in use (running requests + cache).",
                                 registry=reg)
        self.throughput = Gauge("k3jax_gen_throughput", f"Generated tokens per second over the last "
                                f"{throughput_window_s:g} s.", registry=reg)
        self.gen_tokens = Counter("k3jax_generation_tokens", "Generated tokens streamed to clients.", registry=reg)
        self.prompt_tokens = Counter("k3jax_prompt_tokens", "Prompt tokens of finished requests.", registry=reg)
        self.cached_tokens = Counter("k3jax_cached_tokens", "Prompt tokens restored from the prefix cache "
                                     "(finished requests).", registry=reg)
        self.requests = Counter("k3jax_requests", "Finished requests by finish reason.", ["finish_reason"],
                                registry=reg)
        self.errors = Counter("k3jax_request_errors", "Calls refused or failed, by gRPC status code.",
                              ["code"], registry=reg)
        self.ready = Gauge("k3jax_ready", "1 once the engine has warmed up and serves.", registry=reg)
        self._lock = threading.Lock()
        self._prompt = self._cached = 0
        self.hit_rate.set_function(self._hit_rate)
        self._window = throughput_window_s
        self._samples: collections.deque = collections.deque()  # (time, cumulative generated tokens)
        self._generated = 0
        self.throughput.set_function(self._throughput)
        self._http = None

    def bind_engine(self, core, streams_fn) -> None:
        """Read engine gauges at scrape time (plain int reads: no lock on the engine thread)."""
        s = core.scheduler
        self.queue.set_function(lambda: len(s.waiting))
        self.running.set_function(lambda: len(s.running))
        self.token_usage.set_function(lambda: 1.0 - s.pages.free_count / max(1, s.pages.capacity))
        self.streams.set_function(streams_fn)
        self.registry.register(_StepCollector(core.timing))

    # ---- events -------------------------------------------------------------------------------
    def tokens(self, n: int) -> None:
        if n:
            self.gen_tokens.inc(n)
            with self._lock:
                self._generated += n

    def finished(self, reason: str, prompt_tokens: int, cached_tokens: int) -> None:
        self.requests.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        with self._lock:
            self._prompt += prompt_tokens
            self._cached += cached_tokens

    def error(self, code_name: str) -> None:
        self.errors.labels(code=code_name).inc()

    # ---- derived gauges -----------------------------------------------------------------------
    def _hit_rate(self) -> float:
        with self._lock:
            return self._cached / self._prompt if self._prompt else 0.0

    def sample_throughput(self) -> None:
        """Call periodically (the server does, every second)."""
        now = time.monotonic()
        with self._lock:
            self._samples.append((now, self._generated))
            while len(self._samples) > 2 and now - self._samples[0][0] > self._window:
                self._samples.popleft()

    def _throughput(self) -> float:
        with self._lock:
            if len(self._samples) < 2:
                return 0.0
            (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
            return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    # ---- HTTP ---------------------------------------------------------------------------------
    def serve(self, host: str, port: int) -> int:
        """Serve /metrics over HTTP on host:port (0: any free port); returns the bound port."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
