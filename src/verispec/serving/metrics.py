"""The server's Prometheus metrics (the `serve` extra's prometheus_client), in the app's own registry."""

from __future__ import annotations

import math
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from verispec.decode import Generation


PREFIXES = ("verispec", "vllm")


class Metrics:
    """Prometheus metrics in the app's own registry: vLLM's speculative-decoding counters under a
    `verispec:` prefix (prometheus_client appends `_total` to counters, as for vLLM's), latencies,
    queue depth, running batch size, and per-rule fidelity histograms of the responses.

    Labels: `model_name` (the served model, as vLLM's) on every metric: the request and token counters,
    the queue and batch gauges, the latency histograms and the fidelity histograms, and `rule` too
    on the speculative-decoding counters, so a server mixing lossless and lossy requests does not blend
    their acceptance; a tree row's `rule` label is the rule then its draft shape, e.g. `lossless
    tree:widths=3,2,1` (its positions are depths and its drafts tree nodes). vLLM's per-position
    acceptance rate is
    `num_accepted_tokens_per_pos{position=i} / num_drafts` (accepted at position i per draft)."""

    def __init__(self, k: int, model_name: str = "", prefix: str = "verispec"):
        """`prefix`: the metric names' namespace: "verispec", or "vllm" so that dashboards written for
        vLLM's names (vllm:spec_decode_num_accepted_tokens_total, ...) read this server unchanged."""
        if prefix not in PREFIXES:
            raise ValueError(f"--metrics-names must be one of {', '.join(PREFIXES)}, got {prefix!r}")
        self.model_name, self.prefix = model_name, prefix
        self.registry = r = CollectorRegistry()
        spec = ["model_name", "rule"]
        self.num_drafts = Counter(f"{prefix}:spec_decode_num_drafts", "Blocks with at least one draft token",
                                  spec, registry=r)
        self.num_draft_tokens = Counter(f"{prefix}:spec_decode_num_draft_tokens", "Draft tokens proposed",
                                        spec, registry=r)
        self.num_accepted = Counter(f"{prefix}:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                    spec, registry=r)
        self.accepted_per_pos = Counter(f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (0-based, as vLLM)",
                                        [*spec, "position"], registry=r)
        self.generation_tokens = Counter(f"{prefix}:generation_tokens", "Generated tokens", ["model_name"],
                                         registry=r)
        self.prompt_tokens = Counter(f"{prefix}:prompt_tokens", "Prompt tokens", ["model_name"], registry=r)
        self.requests = Counter(f"{prefix}:request_success", "Finished requests",
                                ["model_name", "finished_reason"], registry=r)
        latency = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.latency = Histogram(f"{prefix}:e2e_request_latency_seconds", "Request latency (queue included)",
                                 ["model_name"], buckets=latency, registry=r)
        self.ttft = Histogram(f"{prefix}:time_to_first_token_seconds", "Time to first token (queue included)",
                              ["model_name"], buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                              registry=r)
        # the gauges' children for this model (`set` as on an unlabelled gauge)
        self.waiting = Gauge(f"{prefix}:num_requests_waiting", "Requests in the queue", ["model_name"],
                             registry=r).labels(model_name)
        self.running = Gauge(f"{prefix}:num_requests_running", "Rows decoding (running batch size)",
                             ["model_name"], registry=r).labels(model_name)
        small = (0.0, 1e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)
        self.mean_tv = Histogram(f"{prefix}:response_mean_tv", "Per-response mean per-token TV to the target",
                                 spec, buckets=small, registry=r)
        self.mean_kl = Histogram(f"{prefix}:response_mean_kl", "Per-response mean per-token KL to the target",
                                 spec, buckets=small + (3.0, 10.0), registry=r)
        self.log_ratio = Histogram(f"{prefix}:response_log_ratio_per_token",
                                   "Per-response exact sequence log-likelihood ratio vs the target, "
                                   "per token",
                                   spec, buckets=(-1, -0.1, -0.01, 0.0, 0.01, 0.1, 1, 10), registry=r)
        # prometheus_client leaves a histogram with negative buckets without `_sum` (OpenMetrics), so the
        # log ratios' sum is a gauge of its own: mean = delta(..._summed) / increase(..._count)
        self.log_ratio_sum = Gauge(f"{prefix}:response_log_ratio_per_token_summed",
                                   "Sum of the per-response per-token log-likelihood ratios (the histogram's "
                                   "sum)", spec, registry=r)

    def record(self, created: float, gen: Generation, report: dict, finish: str, returned: int) -> None:
        """One finished request; `returned`: its response's tokens (fewer than decoded after a stop
        string; the speculative counters count every decoded one)."""
        rule, model = report["rule"], self.model_name
        if report.get("tree") is not None:  # tree and chain acceptance are not blended under one label
            rule = f"{rule} {report['tree']}"
        self.num_drafts.labels(model, rule).inc(sum(1 for b in gen.blocks if b.proposed > 0))
        self.num_draft_tokens.labels(model, rule).inc(report["drafted_tokens"])
        self.num_accepted.labels(model, rule).inc(report["accepted_tokens"])
        for pos in report["acceptance_per_position"]:
            self.accepted_per_pos.labels(model, rule, str(pos["position"] - 1)).inc(pos["accepted"])
        self.generation_tokens.labels(model).inc(returned)
        self.prompt_tokens.labels(model).inc(len(gen.prompt_ids))
        self.requests.labels(model, finish).inc()
        self.latency.labels(model).observe(time.perf_counter() - created)
        for hist, value in ((self.mean_tv, report["mean_tv"]), (self.mean_kl, report["mean_kl"]),
                            (self.log_ratio, report["log_ratio_per_token"])):
            if value is not None and math.isfinite(value):
                hist.labels(model_name=model, rule=rule).observe(value)
                if hist is self.log_ratio:
                    self.log_ratio_sum.labels(model_name=model, rule=rule).inc(value)

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
