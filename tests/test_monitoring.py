"""The alert rules and the Grafana dashboard against what a running stack exports.

Every metric name in deploy/prometheus/alerts.yml (= the Kubernetes PrometheusRule) and in
deploy/grafana/dashboards/splitmoe.json must be one the gateway's /metrics serves once requests
went through; where Prometheus is installed (Debian's `prometheus` package: promtool and the
server), the rules are checked by promtool, unit-tested, and every query of the dashboard and the
alerts is run by a real Prometheus scraping the stack.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import REPO, free_port

DEPLOY = REPO / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "splitmoe.json"
# Series Prometheus makes itself for every target, not the services.
PROMETHEUS_OWN = {"up"}
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                 "offset", "inf", "nan"}


def alert_exprs() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p["targets"]]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions,
    keywords, label names or durations."""
    expr = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)          # strings (label values)
    expr = re.sub(r"\{[^}]*\}", "", expr)                     # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)                    # range durations, $__rate_interval
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"(?<![\w:.])[A-Za-z_:][\w:]*", expr):
        is_call = expr[m.end():].lstrip().startswith("(")
        if not is_call and m.group().lower() not in _PROMQL_WORDS:
            names.add(m.group())
    return names


def test_the_name_extractor_finds_metrics_and_skips_functions_and_labels():
    expr = ('histogram_quantile(0.95, sum by (le) (rate(splitmoe:e2e_request_latency_seconds_bucket[5m]))) > 60 '
            'and on (job) up{job="splitmoe-gateway"} == 0')
    assert metric_names(expr) == {"splitmoe:e2e_request_latency_seconds_bucket", "up"}


@pytest.fixture(scope="module")
def exported(bf16_stack, openai_client, served_model_id) -> set[str]:
    """Sample names on the stack's /metrics after a streamed and two plain chat requests (histograms,
    token counters, per-expert counts and drafts' acceptance by position only appear once something
    was generated)."""
    messages = [{"role": "user", "content": "Hello!"}]
    for chunk in openai_client.chat.completions.create(model=served_model_id, messages=messages, max_tokens=8,
                                                        stream=True):
        pass
    openai_client.chat.completions.create(model=served_model_id, messages=messages, max_tokens=4)
    # greedy, long enough for the stack's n-gram drafts (conftest: --speculative ngram) to be verified
    openai_client.chat.completions.create(model=served_model_id, messages=[{"role": "user", "content": "a b a b a b"}],
                                          max_tokens=24, temperature=0)
    text = httpx.get(bf16_stack.url + "/metrics", timeout=30).text
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_every_metric_named_is_one_the_running_stack_exports(exported, source):
    exprs = alert_exprs() if source == "alerts" else dashboard_exprs()
    named = set().union(*map(metric_names, exprs))
    assert len(named - PROMETHEUS_OWN) >= 5  # the extractor found the names at all
    missing = named - PROMETHEUS_OWN - exported
    assert not missing, f"{source} name metrics the stack does not export: {sorted(missing)}"


def test_every_metric_the_docs_list_is_exported(exported):
    section = (REPO / "docs" / "operate.md").read_text().split("## Monitoring", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(splitmoe:\w+)", section))
    assert len(listed) >= 15
    # a histogram is listed by its family name; its samples carry the suffixes
    missing = {name for name in listed if name not in exported and f"{name}_count" not in exported}
    assert not missing, f"docs/operate.md lists metrics the stack does not export: {sorted(missing)}"


def test_the_dashboard_has_the_panels_operators_look_for():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        assert p["datasource"]["uid"] == "${datasource}" and all(t["datasource"]["uid"] == "${datasource}"
                                                                  for t in p["targets"])
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    exprs = "\n".join(dashboard_exprs())
    for metric in ("num_requests_running", "num_requests_waiting", "time_to_first_token_seconds_bucket",
                   "inter_token_latency_seconds_bucket", "generation_tokens_total", "kv_cache_usage_perc",
                   "expert_hop_seconds_total", "expert_tokens_total"):
        assert f"splitmoe:{metric}" in exprs
    heat = next(p for p in panels if p["type"] == "heatmap")
    assert "by (layer, expert)" in heat["targets"][0]["expr"]


def test_compose_provisions_prometheus_and_grafana_from_deploy():
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    prom_mounts = dict(v.rsplit(":", 2)[:2] for v in compose["prometheus"]["volumes"])
    assert prom_mounts["./deploy/prometheus"] == "/etc/prometheus"
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    (job,) = config["scrape_configs"]
    gateway_port = compose["gateway"]["command"][compose["gateway"]["command"].index("--port") + 1]
    assert job["static_configs"][0]["targets"] == [f"gateway:{gateway_port}"]
    assert job["authorization"]["credentials_file"] in compose["prometheus"]["entrypoint"][-1]
    grafana_mounts = dict(v.rsplit(":", 2)[:2] for v in compose["grafana"]["volumes"])
    assert grafana_mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    assert grafana_mounts["./deploy/grafana/dashboards"] == "/var/lib/grafana/dashboards"
    provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "splitmoe.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    (source,) = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
                               .read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"


# ---- with Prometheus itself (Debian's package), where installed ----

def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return path


@pytest.mark.stack
def test_promtool_accepts_the_rules():
    done = subprocess.run([promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.stack
def test_the_alerts_fire_when_they_should(tmp_path):
    """promtool's rule unit tests: each alert on series shaped as the gateway exports them."""
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    (tmp_path / "alerts_test.yml").write_text(yaml.safe_dump(ALERT_TESTS, sort_keys=False))
    done = subprocess.run([promtool(), "test", "rules", "alerts_test.yml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def _alert(name: str, at: str, labels: dict | None = None) -> dict:
    return {"eval_time": at, "alertname": name, "exp_alerts": [{"exp_labels": labels or {}}] if labels is not None
            else []}


ADDR = "10.0.0.7:50061"
ALERT_TESTS = {
    "rule_files": ["alerts.yml"],
    "evaluation_interval": "1m",
    "tests": [
        {"interval": "1m",
         "input_series": [
             {"series": f'splitmoe:expert_service_healthy{{address="{ADDR}",instance="g1"}}', "values": "1 1 0x5"},
             {"series": 'splitmoe:kv_cache_usage_perc{instance="g1"}', "values": "0.5 0.96x10"},
             {"series": 'splitmoe:num_requests_waiting{instance="g1"}', "values": "0 40x10"},
             {"series": 'up{job="splitmoe-gateway",instance="g1"}', "values": "1x12"},
             {"series": 'splitmoe:attention_service_up{instance="g1"}', "values": "1x12"},
         ],
         "alert_rule_test": [
             _alert("SplitMoEExpertServiceDown", "1m"),
             {"eval_time": "5m", "alertname": "SplitMoEExpertServiceDown",
              "exp_alerts": [{"exp_labels": {"severity": "critical", "address": ADDR},
                              "exp_annotations": {"summary": f"Expert service {ADDR} is unhealthy",
                                                  "description": "Its experts are served by a replica if one hosts "
                                                                 "them; requests for the others fail with 503."}}]},
             _alert("SplitMoEKVCacheNearlyFull", "3m"),
             {"eval_time": "8m", "alertname": "SplitMoEKVCacheNearlyFull",
              "exp_alerts": [{"exp_labels": {"severity": "warning"},
                              "exp_annotations": {"summary": "KV cache 96% used: new requests wait for blocks"}}]},
             {"eval_time": "8m", "alertname": "SplitMoEQueueBacklog",
              "exp_alerts": [{"exp_labels": {"severity": "warning"},
                              "exp_annotations": {"summary": "40 requests waiting for admission (429 past "
                                                             "--max-waiting)"}}]},
             _alert("SplitMoEGatewayDown", "10m"),
             _alert("SplitMoEAttentionServiceDown", "10m"),
         ]},
        {"interval": "1m",
         # hops of 0.2 s each, 10 per second; every request between 60 and 120 s: p95 interpolated at 117 s
         "input_series": [
             {"series": f'splitmoe:expert_hop_seconds_total{{address="{ADDR}",instance="g1"}}', "values": "0+120x20"},
             {"series": f'splitmoe:expert_hops_total{{address="{ADDR}",instance="g1"}}', "values": "0+600x20"},
             {"series": 'splitmoe:e2e_request_latency_seconds_bucket{le="60.0",instance="g1"}', "values": "0x20"},
             {"series": 'splitmoe:e2e_request_latency_seconds_bucket{le="120.0",instance="g1"}', "values": "0+10x20"},
             {"series": 'splitmoe:e2e_request_latency_seconds_bucket{le="+Inf",instance="g1"}', "values": "0+10x20"},
         ],
         "alert_rule_test": [
             {"eval_time": "20m", "alertname": "SplitMoEExpertHopSlow",
              "exp_alerts": [{"exp_labels": {"severity": "warning", "address": ADDR},
                              "exp_annotations": {"summary": f"Hops to expert service {ADDR} take 200ms on average"}}]},
             {"eval_time": "20m", "alertname": "SplitMoEEndToEndLatencyHigh",
              "exp_alerts": [{"exp_labels": {"severity": "warning"},
                              "exp_annotations": {"summary": "p95 end-to-end request latency 1m 57s"}}]},
         ]},
    ],
}


@pytest.fixture(scope="module")
def prometheus(bf16_stack, exported, tmp_path_factory):
    """Debian's Prometheus scraping the running stack's gateway every second, with the rules loaded."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    work = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(ALERTS)]
    job = config["scrape_configs"][0]
    job["static_configs"] = [{"targets": [bf16_stack.url.removeprefix("http://")]}]
    (work / "api-key").write_text("")  # as compose writes it when the gateway has no key
    job["authorization"]["credentials_file"] = str(work / "api-key")
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with open(work / "prometheus.log", "w") as log:
        proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work}/data",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_scraped(url, proc, work / "prometheus.log")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _wait_scraped(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            result = httpx.get(url + "/api/v1/query", params={"query": "count_over_time(up[1m])"}, timeout=5).json()
            if result["status"] == "success" and result["data"]["result"] and \
                    float(result["data"]["result"][0]["value"][1]) >= 3:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"Prometheus did not scrape the stack in {timeout_s} s: {log.read_text()[-3000:]}")


def test_prometheus_scrapes_the_gateway_with_the_compose_config(prometheus):
    targets = httpx.get(prometheus + "/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    assert [(t["labels"]["job"], t["health"]) for t in targets] == [("splitmoe-gateway", "up")], targets


def test_every_dashboard_query_returns_series_from_the_running_stack(prometheus):
    for expr in dashboard_exprs():
        result = _query(prometheus, expr.replace("$__rate_interval", "30s"))
        assert result, f"no series: {expr}"


def test_every_alert_expression_evaluates_and_none_fires_on_a_healthy_stack(prometheus):
    for expr in alert_exprs():
        assert _query(prometheus, expr) == [], expr
    rules = httpx.get(prometheus + "/api/v1/rules", timeout=10).json()["data"]["groups"]
    assert {r["health"] for g in rules for r in g["rules"]} == {"ok"}


def _query(url: str, expr: str) -> list:
    answer = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def test_the_preview_draws_every_panel_from_prometheus(prometheus, tmp_path):
    """deploy/grafana/preview.py, which drew the README's picture, on the live Prometheus."""
    out = tmp_path / "preview.png"
    done = subprocess.run([sys.executable, str(DEPLOY / "grafana" / "preview.py"), "--prometheus", prometheus,
                           "--minutes", "2", "--rate-interval", "30s", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
