"""What /metrics reports, through prometheus_client: the scheduler's counts (requests by HTTP status, tokens,
cancelled requests, the queue, the batch, the time to the first token), the engine's prefix cache (bytes, budget,
blocks, tokens looked up and served, evictions, the hit ratio) and its speculation (tokens proposed and kept), read
at each scrape, in a registry of the server's own."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import (CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    Metric)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STATS = ("lookup_tokens", "hit_tokens", "bytes", "budget_bytes", "blocks", "evictions")  # the prefix cache's stats()


@dataclass
class Metrics:
    """The scheduler's counts (it updates them; a scrape reads them without a lock: each value is one Python
    object)."""

    requests: dict[str, int] = field(default_factory=dict)  # HTTP status -> count
    tokens: int = 0
    cancelled: int = 0
    queue_depth: int = 0
    batch_rows: int = 0
    ttft: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))
    ttft_sum: float = 0.0

    def observe_ttft(self, seconds: float) -> None:
        index = next((i for i, b in enumerate(TTFT_BUCKETS) if seconds <= b), len(TTFT_BUCKETS))
        self.ttft[index] += 1
        self.ttft_sum += seconds

    def count(self, status: int) -> None:
        self.requests[str(status)] = self.requests.get(str(status), 0) + 1


class _Exposition:
    """/metrics as prometheus_client collects it: a scheduler's `Metrics` and the engine's prefix cache (its
    `stats()`, where the batch has one; 0 where not), both read at each scrape."""

    def __init__(self, metrics: Metrics, batch: Any):
        self.metrics, self.batch = metrics, batch

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        requests = CounterMetricFamily("gptlab_requests", "Completion requests answered, by HTTP status.",
                                       labels=["status"])
        for status, n in sorted(m.requests.items()):
            requests.add_metric([status], n)
        yield requests
        yield CounterMetricFamily("gptlab_tokens_generated", "Tokens generated, all requests.", m.tokens)
        yield CounterMetricFamily("gptlab_requests_cancelled", "Requests whose client left before the end.",
                                  m.cancelled)
        yield GaugeMetricFamily("gptlab_queue_depth", "Requests waiting for a place in the batch.", m.queue_depth)
        yield GaugeMetricFamily("gptlab_batch_size", "Sequences decoded together at the last step.", m.batch_rows)
        bounds = [*map(str, TTFT_BUCKETS), "+Inf"]
        yield HistogramMetricFamily("gptlab_time_to_first_token_seconds", "From a request's arrival to its first "
                                    "token.", buckets=list(zip(bounds, itertools.accumulate(m.ttft))),
                                    sum_value=m.ttft_sum)
        yield from self._prefix_cache()
        tally = getattr(self.batch, "tally", None)
        yield CounterMetricFamily("gptlab_speculative_proposed_tokens", "Tokens proposed by speculation (--speculate "
                                  "auto) and checked.", tally.proposed if tally is not None else 0)
        yield CounterMetricFamily("gptlab_speculative_kept_tokens", "Proposed tokens kept: each the token drawn.",
                                  tally.kept if tally is not None else 0)

    def _prefix_cache(self) -> Iterator[Metric]:
        cache = getattr(self.batch, "prefix_cache", None)
        stats = cache.stats() if cache is not None else None
        got = {name: getattr(stats, name) if stats is not None else 0 for name in STATS}
        lookup, hit = got["lookup_tokens"], got["hit_tokens"]
        yield GaugeMetricFamily("gptlab_prefix_cache_bytes", "Bytes of keys and values the prefix cache holds.",
                                got["bytes"])
        yield GaugeMetricFamily("gptlab_prefix_cache_budget_bytes", "The prefix cache's budget of bytes.",
                                got["budget_bytes"])
        yield GaugeMetricFamily("gptlab_prefix_cache_blocks", "Blocks the prefix cache holds.", got["blocks"])
        yield CounterMetricFamily("gptlab_prefix_cache_lookup_tokens", "Prompt tokens looked up in the prefix "
                                  "cache.", lookup)
        yield CounterMetricFamily("gptlab_prefix_cache_hit_tokens", "Prompt tokens looked up whose keys and values "
                                  "the prefix cache served.", hit)
        yield CounterMetricFamily("gptlab_prefix_cache_evictions", "Blocks evicted from the prefix cache.",
                                  got["evictions"])
        yield GaugeMetricFamily("gptlab_prefix_cache_hit_ratio", "Prompt tokens served from the prefix cache per "
                                "prompt token looked up (0 before any).", hit / lookup if lookup else 0)


def metrics_registry(metrics: Metrics, batch: Any) -> CollectorRegistry:
    """A registry of its own (not prometheus_client's global one: one per server) whose exposition is /metrics."""
    registry = CollectorRegistry()
    registry.register(_Exposition(metrics, batch))
    return registry
