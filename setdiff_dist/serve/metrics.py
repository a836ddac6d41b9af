"""The server's Prometheus metrics (``GET /metrics``), on a registry of its own.

What vLLM also measures carries vLLM's name and its ``model_name`` label, so that vLLM's
Grafana dashboards and alerts apply as they are (``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:request_success_total{finished_reason}``,
``vllm:time_to_first_token_seconds``, ``vllm:time_per_output_token_seconds``,
``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds``); what only set
decoding has is ``setdiff_*``, with the same label (tokens per forward step, forward steps,
each step's rows and time, requests by outcome)."""

from __future__ import annotations

from .messages import Finished

# latency buckets from a few milliseconds (a CPU step of a tiny model) to minutes (a long
# completion of a large one)
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
           300.0)
PER_STEP = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0)
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
OUTCOMES = ("completed", "cancelled", "rejected_queue_full", "bad_request", "unauthorized",
            "failed")


class Metrics:
    def __init__(self, model_name: str, max_batch: int = 1):
        import prometheus_client
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        # no *_created series beside every counter and histogram (dashboards never read them;
        # vLLM turns them off too)
        prometheus_client.disable_created_metrics()
        self.registry = r = CollectorRegistry()
        self.max_batch = max(int(max_batch), 1)
        m = ["model_name"]

        def make(kind, name, doc, labels=(), **kw):
            metric = kind(name, doc, m + list(labels), registry=r, **kw)
            return metric if labels else metric.labels(model_name=model_name)

        self.model = model_name
        # vLLM's
        self.running = make(Gauge, "vllm:num_requests_running", "Requests in the running batch")
        self.queue_depth = make(Gauge, "vllm:num_requests_waiting", "Requests waiting for a row")
        self.cache_usage = make(Gauge, "vllm:kv_cache_usage_perc", "Fraction of the KV cache's "
                                "rows in use (1 = every row of --max-batch-size)")
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "Prompt tokens of completed "
                                  "requests")
        self.generation_tokens = make(Counter, "vllm:generation_tokens", "Tokens generated for "
                                      "completed requests")
        self.success = make(Counter, "vllm:request_success", "Completed requests by why they "
                            "ended (stop, length)", ["finished_reason"])
        self.ttft = make(Histogram, "vllm:time_to_first_token_seconds", "From arrival to the "
                         "first generated token committed next to the prompt", buckets=SECONDS)
        self.inter_token = make(Histogram, "vllm:time_per_output_token_seconds", "Per "
                                "completed request, the time after its first token over the "
                                "tokens after it", buckets=SECONDS)
        self.latency = make(Histogram, "vllm:e2e_request_latency_seconds", "From arrival to "
                            "the last token, completed requests", buckets=SECONDS)
        self.queue_seconds = make(Histogram, "vllm:request_queue_time_seconds", "From arrival "
                                  "to joining the batch", buckets=SECONDS)
        # set decoding's own
        self.requests = make(Counter, "setdiff_requests", "Completion requests by outcome "
                             f"({', '.join(OUTCOMES)})", ["outcome"])
        self.forward_steps = make(Counter, "setdiff_request_forward_steps", "Forward steps "
                                  "each completed request decoded in, summed")
        self.tokens_per_step = make(Histogram, "setdiff_tokens_per_step", "Tokens per forward "
                                    "step of each completed request", buckets=PER_STEP)
        self.batch_rows = make(Histogram, "setdiff_step_batch_size", "Rows of each decoding "
                               "step", buckets=ROWS)
        self.step_seconds = make(Histogram, "setdiff_step_seconds", "Wall time of each "
                                 "decoding step", buckets=SECONDS)
        make(Gauge, "setdiff_model_info", "The served model").set(1)
        for outcome in OUTCOMES:  # (every series exists from the start)
            self.requests.labels(model_name=model_name, outcome=outcome)
        for reason in ("stop", "length"):
            self.success.labels(model_name=model_name, finished_reason=reason)

    def count(self, outcome: str) -> None:
        """A request that ended with this outcome before or without finishing (rejected, bad,
        cancelled, failed)."""
        self.requests.labels(model_name=self.model, outcome=outcome).inc()

    def rows(self, running: int, waiting: int) -> None:
        """The batch's rows in use and the requests waiting for one."""
        self.running.set(running)
        self.queue_depth.set(waiting)
        self.cache_usage.set(running / self.max_batch)

    def step(self, rows: int, seconds: float) -> None:
        """One decoding step of ``rows`` rows."""
        self.step_seconds.observe(seconds)
        self.batch_rows.observe(rows)

    def queued(self, seconds: float) -> None:
        """A request joined the batch after waiting this long."""
        self.queue_seconds.observe(seconds)

    def finished(self, out: Finished) -> None:
        """A completed request's numbers (the scheduler's event)."""
        self.count("completed")
        self.success.labels(model_name=self.model, finished_reason=out.finish_reason).inc()
        n = len(out.tokens)
        self.prompt_tokens.inc(out.prompt_tokens)
        self.generation_tokens.inc(n)
        self.forward_steps.inc(out.steps)
        self.tokens_per_step.observe(out.tokens_per_step)
        self.latency.observe(out.seconds)
        self.ttft.observe(out.time_to_first_token)
        if n > 1:
            self.inter_token.observe(max(out.seconds - out.time_to_first_token, 0.0) / (n - 1))

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class NoMetrics:
    """What the scheduler reports to, when nothing measures (a scheduler in a test, a tool):
    :class:`Metrics`'s calls, doing nothing."""

    def count(self, outcome: str) -> None:
        pass

    def rows(self, running: int, waiting: int) -> None:
        pass

    def step(self, rows: int, seconds: float) -> None:
        pass

    def queued(self, seconds: float) -> None:
        pass

    def finished(self, out: Finished) -> None:
        pass
