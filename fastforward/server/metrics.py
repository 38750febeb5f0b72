"""Server metrics kept by the engine thread and rendered in the Prometheus text format.

No global registry: one ``ServerMetrics`` per server, owned by its engine loop.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from fastforward.outputs import RequestOutput

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for bound, c in zip(self.buckets, self.counts, strict=True):
            lines.append(f'{name}_bucket{{le="{bound}"}} {c}')
        lines += [
            f'{name}_bucket{{le="+Inf"}} {self.count}',
            f"{name}_sum {self.total}",
            f"{name}_count {self.count}",
        ]
        return lines


@dataclass(slots=True)
class EngineGauges:
    """A snapshot of the engine taken after each step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_verifications: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class ServerMetrics:
    """Counters, gauges and histograms; written by the engine thread, read by HTTP handlers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.gauges = EngineGauges()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_prompt_tokens = 0
        self.requests_finished: dict[str, int] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)

    def set_gauges(self, gauges: EngineGauges) -> None:
        with self._lock:
            self.gauges = gauges

    def record_finished(self, out: RequestOutput) -> None:
        with self._lock:
            self.prompt_tokens += len(out.prompt_token_ids)
            self.cached_prompt_tokens += out.num_cached_tokens
            for c in out.outputs:
                self.generation_tokens += len(c.token_ids)
                reason = c.finish_reason or "unknown"
                self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1
            m = out.metrics
            if m is None or m.first_token_time is None:
                return
            self.ttft.observe(m.first_token_time - m.arrival_time)
            n = max(len(c.token_ids) for c in out.outputs)
            if m.finished_time is not None:
                self.e2e.observe(m.finished_time - m.arrival_time)
                if n > 1:
                    self.tpot.observe((m.finished_time - m.first_token_time) / (n - 1))

    def render(self) -> str:
        with self._lock:
            g = self.gauges
            hit_rate = g.prefix_cache_hits / g.prefix_cache_queries if g.prefix_cache_queries else 0
            lines = [
                *_gauge(
                    "fastforward_num_requests_running",
                    "Requests in the running batch",
                    g.num_running,
                ),
                *_gauge(
                    "fastforward_num_requests_waiting",
                    "Requests waiting to be scheduled",
                    g.num_waiting,
                ),
                *_gauge(
                    "fastforward_kv_cache_blocks_used",
                    "KV cache blocks referenced by live requests",
                    g.kv_blocks_used,
                ),
                *_gauge(
                    "fastforward_kv_cache_blocks_free",
                    "KV cache blocks free to allocate (cached prefix blocks no request holds count "
                    "as free)",
                    g.kv_blocks_free,
                ),
                *_counter(
                    "fastforward_num_preemptions_total",
                    "Requests preempted (recompute)",
                    g.num_preemptions,
                ),
                *_counter(
                    "fastforward_prompt_tokens_total",
                    "Prompt tokens of finished requests",
                    self.prompt_tokens,
                ),
                *_counter(
                    "fastforward_generation_tokens_total",
                    "Generated tokens of finished requests",
                    self.generation_tokens,
                ),
                *_counter(
                    "fastforward_cached_prompt_tokens_total",
                    "Prompt tokens served from the prefix cache",
                    self.cached_prompt_tokens,
                ),
                *_counter(
                    "fastforward_prefix_cache_queries_total",
                    "Prompt tokens looked up in the prefix cache",
                    g.prefix_cache_queries,
                ),
                *_counter(
                    "fastforward_prefix_cache_hits_total",
                    "Prompt tokens found in the prefix cache",
                    g.prefix_cache_hits,
                ),
                *_gauge(
                    "fastforward_prefix_cache_hit_rate", "Prefix cache hit rate (tokens)", hit_rate
                ),
                *_counter(
                    "fastforward_spec_decode_num_drafts_total",
                    "Request steps that verified speculative draft tokens",
                    g.spec_verifications,
                ),
                *_counter(
                    "fastforward_spec_decode_num_draft_tokens_total",
                    "Speculative draft tokens verified by the target",
                    g.spec_draft_tokens,
                ),
                *_counter(
                    "fastforward_spec_decode_num_accepted_tokens_total",
                    "Speculative draft tokens the target accepted",
                    g.spec_accepted_tokens,
                ),
                *_gauge(
                    "fastforward_spec_decode_acceptance_rate",
                    "Accepted / verified draft tokens since start",
                    g.spec_accepted_tokens / g.spec_draft_tokens if g.spec_draft_tokens else 0,
                ),
                "# HELP fastforward_request_success_total Finished sequences by finish reason",
                "# TYPE fastforward_request_success_total counter",
                *(
                    f'fastforward_request_success_total{{finished_reason="{k}"}} {v}'
                    for k, v in sorted(self.requests_finished.items())
                ),
                *self.ttft.render("fastforward_time_to_first_token_seconds", "Time to first token"),
                *self.tpot.render(
                    "fastforward_time_per_output_token_seconds",
                    "Time per output token after the first",
                ),
                *self.e2e.render("fastforward_e2e_request_latency_seconds", "Request latency"),
            ]
        return "\n".join(lines) + "\n"


def _gauge(name: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"]


def _counter(name: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
