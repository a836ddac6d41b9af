"""The server's Prometheus metrics (``GET /metrics``), on a registry of its own."""

from __future__ import annotations

# latency buckets from a few milliseconds (a CPU step of a tiny model) to minutes (a long
# completion of a large one)
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
           300.0)
PER_STEP = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0)
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    def __init__(self, model_name: str):
        import prometheus_client
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        # no *_created series beside every counter and histogram (dashboards never read them;
        # vLLM turns them off too)
        prometheus_client.disable_created_metrics()
        self.registry = r = CollectorRegistry()
        self.requests = Counter("setdiff_requests", "Completion requests by outcome "
                                "(completed, cancelled, rejected_queue_full, bad_request, "
                                "unauthorized, failed)", ["outcome"], registry=r)
        self.prompt_tokens = Counter("setdiff_prompt_tokens", "Prompt tokens of completed "
                                     "requests", registry=r)
        self.generation_tokens = Counter("setdiff_generation_tokens", "Tokens generated for "
                                         "completed requests", registry=r)
        self.forward_steps = Counter("setdiff_request_forward_steps", "Forward steps each "
                                     "completed request decoded in, summed", registry=r)
        self.tokens_per_step = Histogram("setdiff_tokens_per_step", "Tokens per forward step "
                                         "of each completed request", buckets=PER_STEP,
                                         registry=r)
        self.running = Gauge("setdiff_batch_size", "Requests in the running batch", registry=r)
        self.queue_depth = Gauge("setdiff_queue_depth", "Requests waiting for a row",
                                 registry=r)
        self.batch_rows = Histogram("setdiff_step_batch_size", "Rows of each decoding step",
                                    buckets=ROWS, registry=r)
        self.step_seconds = Histogram("setdiff_step_seconds", "Wall time of each decoding "
                                      "step", buckets=SECONDS, registry=r)
        self.latency = Histogram("setdiff_request_latency_seconds", "From arrival to the last "
                                 "token, completed requests", buckets=SECONDS, registry=r)
        self.ttft = Histogram("setdiff_time_to_first_token_seconds", "From arrival to the "
                              "first generated token committed next to the prompt",
                              buckets=SECONDS, registry=r)
        self.queue_seconds = Histogram("setdiff_queue_seconds", "From arrival to joining the "
                                       "batch", buckets=SECONDS, registry=r)
        info = Gauge("setdiff_model_info", "The served model", ["model"], registry=r)
        info.labels(model=model_name).set(1)
        for outcome in ("completed", "cancelled", "rejected_queue_full", "bad_request",
                        "unauthorized", "failed"):
            self.requests.labels(outcome=outcome)  # (every series exists from the start)

    def count(self, outcome: str) -> None:
        """A request that ended with this outcome before decoding (rejected, bad, failed)."""
        self.requests.labels(outcome=outcome).inc()

    def finished(self, out: dict) -> None:
        """A completed request's numbers (the scheduler's outcome dict)."""
        self.requests.labels(outcome="completed").inc()
        self.prompt_tokens.inc(out["prompt_tokens"])
        self.generation_tokens.inc(len(out["tokens"]))
        self.forward_steps.inc(out["steps"])
        self.tokens_per_step.observe(out["tokens_per_step"])
        self.latency.observe(out["seconds"])
        self.ttft.observe(out["time_to_first_token"])

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
