"""End to end with a real Prometheus scraping the real exporter demo on loopback.

Every dashboard query must return data, every rule expression must parse, and the
inconsistency alert must reach ``firing`` when the demo's lagging engine makes the fleet
disagree (the rules are loaded from a test copy whose ``for:`` durations are 0s). A second demo
in HTTP mode is scraped beside the owner-mode one: owner mode knows no request counts, so the
dashboard's request panels get their data from it (docs/activity.md, per attach mode).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exporter.base.ports import free_listen_port
from tests.harness.artefacts import (
    DASHBOARD_FILE,
    alerting_rules,
    load_rules,
    render_rules,
    tool,
)
from tests.harness.prometheus import (
    http_json,
    instant_query,
    start_prometheus,
    stop,
    wait_for,
)

#: Template variables replaced the way Grafana would for "All" over a short range.
GRAFANA_VARS = {
    "$__rate_interval": "5s",
    "$__interval": "1s",
    "$__range": "1m",
    "$job": ".*",
    "$instance": ".*",
    "$model_name": ".*",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    prometheus = tool("prometheus")
    tmp = tmp_path_factory.mktemp("prom")
    port, admin, prom_port = free_listen_port(), free_listen_port(), free_listen_port()
    http_port, http_admin = free_listen_port(), free_listen_port()
    rules_module = render_rules()
    short_rules: str = rules_module.rules_with_for(rules_module.read_rules(), "0s")
    demo = start_demo("owner", 3, port, admin, tmp / "owner-demo.log")
    http_demo = start_demo("http", 2, http_port, http_admin, tmp / "http-demo.log")
    (tmp / "rules.yml").write_text(short_rules)
    (tmp / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 500ms\n  evaluation_interval: 500ms\n"
        "rule_files: [rules.yml]\n"
        "scrape_configs:\n  - job_name: vllm-dp-exporter\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{port}', '127.0.0.1:{http_port}']}}]\n"
    )
    prom = start_prometheus(prometheus, tmp, prom_port)
    try:
        urls = {
            "exporter": f"http://127.0.0.1:{port}",
            "http_exporter": f"http://127.0.0.1:{http_port}",
            "owner": f'instance="127.0.0.1:{port}"',  # the owner-mode demo's series
            "prometheus": f"http://127.0.0.1:{prom_port}",
            "started": str(time.time()),
            "owner_log": str(tmp / "owner-demo.log"),
        }
        wait_for(
            lambda: len(query(urls, f"vllm_dp_engine_up{{{urls['owner']}}} == 1")) == 3,
            40,
            "3 engines up in Prometheus",
        )
        wait_for(
            lambda: query(urls, f'vllm_dp_engine_requests{{instance="127.0.0.1:{http_port}"}}'),
            40,
            "the HTTP-mode demo's request counts in Prometheus",
        )
        yield urls
    finally:
        stop(prom)
        stop(demo)
        stop(http_demo)


def start_demo(
    attach: str, engines: int, port: int, admin: int, log: Path
) -> subprocess.Popen[bytes]:
    """The demo at warning level, its output in ``log`` (what a failed wait shows)."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "exporter",
                "--log-level",
                "warning",
                "demo",
                "--attach",
                attach,
                "--engines",
                str(engines),
                "--listen",
                f"127.0.0.1:{port}",
                "--admin-listen",
                f"127.0.0.1:{admin}",
                "--poll-interval",
                "0.5",
                "--call-timeout",
                "2",
                "--story-period",
                "16",
                "--reset-every",
                "1",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def owner_evidence(urls: dict[str, str]) -> str:
    """The owner-mode demo's own reset series and the end of its log (why a wait failed)."""
    try:
        with urllib.request.urlopen(f"{urls['exporter']}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        series = "\n".join(
            line for line in text.splitlines() if line.startswith("vllm_dp_prefix_cache_")
        )
    except OSError as exc:
        series = f"/metrics: {exc!r}"
    tail = Path(urls["owner_log"]).read_text(errors="replace")[-3000:]
    return f"the demo's reset series:\n{series}\nits log ends:\n{tail}"


def query(urls: dict[str, str], expr: str) -> list[Any]:
    return instant_query(urls["prometheus"], expr)


def query_range(urls: dict[str, str], expr: str, seconds: int) -> list[Any]:
    end = time.time()
    q = urllib.parse.urlencode({"query": expr, "start": end - seconds, "end": end, "step": "1"})
    with urllib.request.urlopen(f"{urls['prometheus']}/api/v1/query_range?{q}", timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", (expr, body)
    return list(body["data"]["result"])


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"unsubstituted variable in {expr}"
            found.append((panel["title"], expr))
    assert found
    return found


def test_promtool_check_metrics_on_a_live_scrape(stack: dict[str, str]) -> None:
    promtool = tool("promtool")
    for exporter in ("exporter", "http_exporter"):
        with urllib.request.urlopen(f"{stack[exporter]}/metrics", timeout=5) as resp:
            body = resp.read()
        proc = subprocess.run(
            [promtool, "check", "metrics"], input=body, capture_output=True, timeout=30
        )
        assert proc.returncode == 0, (exporter, proc.stdout + proc.stderr)


def test_inconsistency_alert_fires(stack: dict[str, str]) -> None:
    def firing() -> bool:
        alerts = http_json(f"{stack['prometheus']}/api/v1/alerts")["data"]["alerts"]
        return any(
            a["labels"]["alertname"] == "VllmDpEnginesInconsistent" and a["state"] == "firing"
            for a in alerts
        )

    wait_for(firing, 45, "VllmDpEnginesInconsistent firing")


def test_every_dashboard_query_returns_data(stack: dict[str, str]) -> None:
    # Let the owner-mode demo's story run through sleep, wake, lag and refused resets first (its
    # own series: the HTTP-mode demo must not end these waits early).
    owner = stack["owner"]
    wait_for(
        lambda: query(
            stack, f"increase(vllm_dp_inconsistent_utility_results_total{{{owner}}}[1m]) > 0"
        ),
        45,
        "an inconsistent poll",
    )
    wait_for(
        lambda: query(stack, f"vllm_dp_prefix_cache_reset_engine_failures_total{{{owner}}} > 0"),
        45,
        "a refused reset",
    )
    # A reset every engine confirmed: the story refuses them half of each period and the fleet
    # sleeps through part of the other half, so a short run may have seen none.
    wait_for(
        lambda: query(stack, f"vllm_dp_prefix_cache_last_success_timestamp_seconds{{{owner}}} > 0"),
        60,
        "a reset confirmed by every engine",
        lambda: owner_evidence(stack),
    )
    # The per-action failure series appears with its first failure (no zero before it): wait
    # until Prometheus has two samples of it, as increase() needs.
    wait_for(
        lambda: query(
            stack, f"increase(vllm_dp_admin_action_engine_failures_total{{{owner}}}[5s])"
        ),
        15,
        "a refused admin action in two scrapes",
    )
    # The aggregate is absent while the engines disagree, and a run that has been scraped only
    # a few times may have seen nothing but the story's first inconsistency window.
    wait_for(lambda: query(stack, f"vllm_dp_sleeping{{{owner}}}"), 45, "the engines to agree once")
    # The whole run so far: a series that is legitimately absent at times (the aggregate while
    # the engines disagree) must still have data somewhere in it.
    window = int(time.time() - float(stack["started"])) + 1
    empty = [
        (title, expr) for title, expr in dashboard_queries() if not query_range(stack, expr, window)
    ]
    assert empty == [], f"dashboard queries without data: {empty}"


def test_every_rule_expression_parses(stack: dict[str, str]) -> None:
    rules = [r for g in load_rules()["groups"] for r in g["rules"]]
    assert len(alerting_rules()) >= 5
    for rule in rules:
        query(stack, rule["expr"])  # asserts status == success (a parse error is an error)


def test_rules_loaded_by_prometheus_without_errors(stack: dict[str, str]) -> None:
    groups = http_json(f"{stack['prometheus']}/api/v1/rules")["data"]["groups"]
    loaded = {r["name"]: r for g in groups for r in g["rules"]}
    assert {r["alert"] for r in alerting_rules()} <= set(loaded)
    bad = {name: r.get("lastError") for name, r in loaded.items() if r.get("health") == "err"}
    assert bad == {}
    assert re.match(r"^http://127\.0\.0\.1:\d+$", stack["prometheus"])
