"""The server's Prometheus metrics, in a registry of its own (several servers can live in one process)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from runtime.online.messages import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels, mine = ["model_name"], {"model_name": model_name}

        def metric(kind, name: str, doc: str, **kw):
            return kind(name, doc, labels, registry=r, **kw).labels(**mine)

        self.running = metric(Gauge, "skill_num_requests_running", "Requests in the running batch")
        self.waiting = metric(Gauge, "skill_num_requests_waiting", "Requests waiting for a batch slot")
        self.kv_used = metric(Gauge, "skill_kv_cache_used_blocks", "KV cache blocks in use")
        self.kv_total = metric(Gauge, "skill_kv_cache_total_blocks", "KV cache blocks in the pool")
        self.prompt_tokens = metric(Counter, "skill_prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = metric(Counter, "skill_generation_tokens", "Generated tokens")
        self.ttft = metric(
            Histogram,
            "skill_time_to_first_token_seconds",
            "Time from arrival to the first token",
            buckets=_LATENCY_BUCKETS,
        )
        self.tpot = metric(
            Histogram,
            "skill_time_per_output_token_seconds",
            "Time between output tokens",
            buckets=_LATENCY_BUCKETS,
        )
        self._finished = Counter(
            "skill_request_success",
            "Finished requests by finish reason",
            [*labels, "finished_reason"],
            registry=r,
        )
        self._name = model_name

    def finished(self, reason: str) -> None:
        self._finished.labels(model_name=self._name, finished_reason=reason).inc()

    def set_engine(self, stats: list[EngineStats | None]) -> None:
        known = [s for s in stats if s is not None]
        self.running.set(sum(s.running for s in known))
        self.waiting.set(sum(s.waiting for s in known))
        self.kv_used.set(sum(s.kv_used_blocks for s in known))
        self.kv_total.set(sum(s.kv_total_blocks for s in known))

    def render(self) -> bytes:
        return generate_latest(self.registry)
