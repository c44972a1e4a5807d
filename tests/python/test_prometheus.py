"""A real Prometheus (Debian's `prometheus`, installed by scripts/install-test-packages)
scrapes `ingot serve` every second; the series come back through its HTTP API."""
import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from conftest import MODEL_NAME, ROOT, _free_port

DASHBOARD = os.path.join(ROOT, "docs", "grafana", "ingot.json")

CONFIG = """
global:
  scrape_interval: 1s
scrape_configs:
  - job_name: ingot
    static_configs:
      - targets: ["127.0.0.1:{port}"]
"""


def query(base, promql):
    url = base + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return {json.dumps(s["metric"], sort_keys=True): float(s["value"][1]) for s in body["data"]["result"]}


def test_prometheus_scrapes_the_series(server, client, tmp_path):
    binary = shutil.which("prometheus")
    if not binary:
        pytest.skip("prometheus missing: scripts/install-test-packages installs it")
    config = tmp_path / "prometheus.yml"
    config.write_text(CONFIG.format(port=server.port))
    port = _free_port()
    log = open(tmp_path / "prometheus.log", "w")
    prom = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for i in range(3):
            client.completions.create(model=MODEL_NAME, prompt=f"Count to {i}", max_tokens=8, temperature=0)
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        deadline = time.time() + 60
        success = {}
        while sum(success.values()) < 4:
            assert time.time() < deadline and prom.poll() is None, (success, open(tmp_path / "prometheus.log").read())
            time.sleep(0.5)
            try:
                success = query(base, "sum by (finished_reason) (ingot:request_success_total)")
            except OSError:
                pass
        targets = json.load(urllib.request.urlopen(base + "/api/v1/targets", timeout=5))["data"]["activeTargets"]
        assert [(t["health"], t["lastError"]) for t in targets] == [("up", "")], targets
        assert query(base, "ingot:generation_tokens_total")
        assert list(query(base, "ingot:prompt_tokens_total").values())[0] > 0
        for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                     "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                     "request_prompt_tokens", "request_generation_tokens"):
            counts = query(base, f"ingot:{name}_count")
            assert counts and list(counts.values())[0] >= 4, (name, counts)
            median = query(base, f"histogram_quantile(0.5, ingot:{name}_bucket)")
            assert median and list(median.values())[0] >= 0, (name, median)
        for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                      "kv_cache_blocks_in_use", "kv_cache_blocks_total"):
            assert query(base, f"ingot:{gauge}"), gauge
        assert list(query(base, "ingot:kv_cache_blocks_total").values())[0] > 0
        assert query(base, "ingot:prefix_cache_queries_total")

        # Every panel of the Grafana dashboard is a query Prometheus takes, over series
        # that ingot serves.
        served = {k.split("{")[0] for k in server.metrics()}
        panels = json.load(open(DASHBOARD))["panels"]
        assert panels
        for panel in panels:
            for target in panel["targets"]:
                expr = target["expr"].replace("$__rate_interval", "1m")
                query(base, expr)
                for name in re.findall(r"ingot:[a-z0-9_]+", expr):
                    assert name in served or name + "_total" in served, (panel["title"], name)
    finally:
        prom.terminate()
        prom.wait(timeout=30)
