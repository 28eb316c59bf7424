"""What an SGLang server counts about itself: its Prometheus metrics (``--enable-metrics``),
read from ``GET /metrics`` and summed over their labels; and what a client of it measures of
the same path (RequestTiming: the regenerate stage's requests, from sent to read).

The one the regeneration benchmark watches is the radix cache's eviction (SGLang 0.5.14, read
in its source): once the KV pool is full of cached prefixes, every allocation the pool cannot
serve (a decode step's new tokens, a prefill) evicts from the tree first
(``srt/mem_cache/common.py:298-321``), and each eviction heapifies every evictable leaf of the
tree before it frees a token (``srt/mem_cache/radix_cache.py:558-585``), on the scheduler's
thread. With ``--enable-metrics`` the cache times each eviction
(``srt/mem_cache/base_prefix_cache.py:217-236``) into ``sglang:eviction_duration_seconds``
and counts ``sglang:evicted_tokens_total`` (``srt/observability/metrics_collector.py:1843-1940``).
"""

from __future__ import annotations

import math
import re
import threading
import urllib.request

# name{labels} value  (Prometheus text exposition; labels optional)
SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")

# The samples kept from a scrape (summed over labels): eviction, and the load it happened under.
WATCHED = (
    "sglang:eviction_duration_seconds_sum",
    "sglang:eviction_duration_seconds_count",
    "sglang:evicted_tokens_total",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:num_used_tokens",
    "sglang:token_usage",
    "sglang:cache_hit_rate",
    "sglang:gen_throughput",
)


def parse_metrics(text: str, names=WATCHED) -> dict[str, float]:
    """``{name: value}`` of the samples named in ``names``, each summed over its label sets (one
    per scheduler or cache); names the text does not hold are left out."""
    wanted = set(names)
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = SAMPLE.match(line)
        if match is None or match["name"] not in wanted:
            continue
        value = float(match["value"])
        if math.isnan(value):
            continue
        values[match["name"]] = values.get(match["name"], 0.0) + value
    return values


def read_metrics(url: str, timeout_s: float = 10.0, names=WATCHED) -> dict[str, float]:
    """The watched samples of the server at ``url`` (its base URL) now. An SGLang started
    without ``--enable-metrics`` answers 404, which raises."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as response:
        return parse_metrics(response.read().decode("utf-8", "replace"), names)


def eviction_summary(first: dict[str, float], last: dict[str, float], seconds: float) -> dict:
    """Eviction between two scrapes ``seconds`` apart: how many evictions, the scheduler time
    they took (and its share of the interval), the tokens they freed."""
    def delta(name: str) -> float:
        return last.get(name, 0.0) - first.get(name, 0.0)

    evictions = delta("sglang:eviction_duration_seconds_count")
    eviction_s = delta("sglang:eviction_duration_seconds_sum")
    return {
        "seconds": round(seconds, 3),
        "evictions": int(evictions),
        "eviction_s": round(eviction_s, 4),
        "eviction_share": round(eviction_s / seconds, 4) if seconds > 0 else None,
        "ms_per_eviction": round(1000 * eviction_s / evictions, 4) if evictions else None,
        "evicted_tokens": int(delta("sglang:evicted_tokens_total")),
    }


class RequestTiming:
    """A server client's time, summed over its threads (thread-safe): ``in_request_s`` from
    each request sent to its answer read (or its failure), ``first_chunk_s`` to a streamed
    answer's first chunk (the server's queue and prefill), ``conversation_s`` each
    conversation's whole time on its thread (the client's own work between turns included).
    Over the shard's wall time, ``in_request_s`` is how many requests it kept in flight."""

    KEYS = ("requests", "in_request_s", "first_chunks", "first_chunk_s", "conversation_s")

    def __init__(self):
        self._lock = threading.Lock()
        self.sums = dict.fromkeys(self.KEYS, 0.0)

    def add(self, **amounts: float) -> None:
        with self._lock:
            for key, amount in amounts.items():
                self.sums[key] += amount

    def report(self, seconds: float) -> dict:
        """The sums, and what they mean over ``seconds`` of the shard's wall time."""
        sums = {key: round(value, 3) if key.endswith("_s") else int(value) for key, value in self.sums.items()}
        return {**sums, **client_means(sums, seconds)}


def client_means(sums: dict, seconds: float | None) -> dict:
    """What RequestTiming's sums (one shard's, or all shards' from client_totals) mean over
    ``seconds`` of wall time: requests in flight, threads busy, a request's and a first chunk's time."""
    return {
        "mean_in_flight": round(sums["in_request_s"] / seconds, 2) if seconds else None,
        "mean_busy_threads": round(sums["conversation_s"] / seconds, 2) if seconds else None,
        "mean_request_s": round(sums["in_request_s"] / sums["requests"], 4) if sums["requests"] else None,
        "mean_first_chunk_s": round(sums["first_chunk_s"] / sums["first_chunks"], 4) if sums["first_chunks"] else None,
    }


def client_totals(reports: list[dict]) -> dict | None:
    """The server clients' time (RequestTiming) summed over the shard reports that have it."""
    clients = [report["client"] for report in reports if report.get("client")]
    if not clients:
        return None
    return {"shards": len(clients), **{key: round(sum(client.get(key, 0) for client in clients), 3)
                                       for key in RequestTiming.KEYS}}
