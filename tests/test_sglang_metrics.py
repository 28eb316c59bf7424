"""SGLang's own metrics (--enable-metrics), read from /metrics: the radix cache's evictions and
the load they happened under, summed over label sets; the regeneration driver's scraper keeps
the series of a server until it stops."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eaglenest.sglang import metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def exposition(scrape: int) -> str:
    """Prometheus text as SGLang's multiprocess registry writes it: a histogram of eviction
    times and a counter of evicted tokens from the radix cache, gauges from two scheduler
    processes (summed), and lines that are not samples."""
    evictions, seconds, tokens = 40 * scrape, 0.004 * 40 * scrape, 354 * 40 * scrape
    return "\n".join([
        "# HELP sglang:eviction_duration_seconds Time taken to evict memory from GPU to CPU in seconds.",
        "# TYPE sglang:eviction_duration_seconds histogram",
        f'sglang:eviction_duration_seconds_bucket{{cache_type="RadixCache",le="0.001"}} {evictions // 2}.0',
        f'sglang:eviction_duration_seconds_bucket{{cache_type="RadixCache",le="+Inf"}} {evictions}.0',
        f'sglang:eviction_duration_seconds_sum{{cache_type="RadixCache"}} {seconds}',
        f'sglang:eviction_duration_seconds_count{{cache_type="RadixCache"}} {evictions}.0',
        "# TYPE sglang:evicted_tokens_total counter",
        f'sglang:evicted_tokens_total{{cache_type="RadixCache"}} {tokens}.0',
        'sglang:evicted_tokens_created{cache_type="RadixCache"} 1.7648e+09',
        'sglang:num_running_reqs{model_name="m",pid="11",tp_rank="0"} 300.0',
        'sglang:num_running_reqs{model_name="m",pid="12",tp_rank="1"} 54.0',
        'sglang:cache_hit_rate{model_name="m",pid="11"} NaN',
        "",
    ])


class MetricsServer:
    """An HTTP server whose /metrics grows by one step of evictions per scrape; ``scrapes``
    answers, then it stops (a server shutting down); ``route`` None: no /metrics (404)."""

    def __init__(self, scrapes: int, route: str | None = "/metrics"):
        owner = self
        self.served = 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path != route:
                    self.send_error(404)
                    return
                owner.served += 1
                body = exposition(owner.served).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                if owner.served == scrapes:
                    threading.Thread(target=owner.close, daemon=True).start()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_samples_are_summed_over_their_label_sets_and_the_rest_left_out():
    values = metrics.parse_metrics(exposition(2))
    assert values == {
        "sglang:eviction_duration_seconds_sum": pytest.approx(0.32),
        "sglang:eviction_duration_seconds_count": 80.0,
        "sglang:evicted_tokens_total": 28320.0,
        "sglang:num_running_reqs": 354.0,  # two schedulers
    }  # no buckets, no _created, no NaN gauge, no comments
    assert metrics.parse_metrics(exposition(2), names=["sglang:num_running_reqs"]) == {"sglang:num_running_reqs": 354.0}


def test_eviction_between_two_scrapes():
    first, last = metrics.parse_metrics(exposition(1)), metrics.parse_metrics(exposition(3))
    assert metrics.eviction_summary(first, last, 10.0) == {
        "seconds": 10.0, "evictions": 80, "eviction_s": 0.32, "eviction_share": 0.032, "ms_per_eviction": 4.0,
        "evicted_tokens": 28320,
    }
    assert metrics.eviction_summary(first, first, 5.0)["ms_per_eviction"] is None


def test_the_driver_scrapes_a_server_until_it_stops_and_keeps_the_series(tmp_path):
    import sglang_regenerate

    server = MetricsServer(scrapes=3)
    record = tmp_path / "regenerate.json"
    record.write_text(json.dumps({"state": "ready", "url": server.url}))
    out = tmp_path / "metrics-workflow.json"
    assert sglang_regenerate.main(["metrics", "--record", str(record), "--every-s", "0.05", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [sample["sglang:evicted_tokens_total"] for sample in result["series"]] == [14160.0, 28320.0, 42480.0]
    assert result["eviction"]["evictions"] == 80 and result["eviction"]["ms_per_eviction"] == 4.0
    assert "ended" in result  # the server went away: the scraper stopped with what it had
    # The summary carries the eviction and the last scrape.
    summary = sglang_regenerate.regenerate_summary(tmp_path, "none", None, None, server_metrics=result)
    assert summary["server_metrics"]["eviction"] == result["eviction"]
    assert summary["server_metrics"]["last"]["sglang:num_running_reqs"] == 354.0


def test_a_server_started_without_metrics_is_reported_not_crashed(tmp_path):
    import sglang_regenerate

    server = MetricsServer(scrapes=99, route=None)
    out = tmp_path / "metrics.json"
    assert sglang_regenerate.main(["metrics", "--url", server.url, "--scrapes", "2", "--every-s", "0.01",
                                   "--out", str(out)]) == 1
    result = json.loads(out.read_text())
    assert result["series"] == [] and "404" in result["error"]
    server.close()
    # A limited number of scrapes of a server that keeps answering.
    server = MetricsServer(scrapes=99)
    assert sglang_regenerate.main(["metrics", "--url", server.url, "--scrapes", "2", "--every-s", "0.01",
                                   "--out", str(out)]) == 0
    assert len(json.loads(out.read_text())["series"]) == 2 and server.served == 2
    server.close()
