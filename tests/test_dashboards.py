"""dashboards/: the Grafana dashboard takes its data source as a template
variable and every expression in it parses; the alert rules pass
`promtool check rules` and their `promtool test rules` cases. (That every
expression evaluates with data against a real Prometheus scraping the
daemon is test_metrics_bpf.py's.)"""

import json
import shutil
import subprocess

import pytest
import yaml

from dashboard_exprs import (DASHBOARD, RULE_TESTS, RULES, dashboard_exprs, dashboard_panels,
                             metric_names, rule_exprs)

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool (Debian's prometheus package)")


def test_data_source_is_a_template_variable():
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["datasource"]["uid"] == "${datasource}"
    for panel in dashboard_panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
    # no data source is named anywhere else
    assert '"uid": "' not in DASHBOARD.read_text().replace('"uid": "${datasource}"', "") \
        .replace('"uid": "mmtrace-host"', "")


def test_dashboard_answers_the_designs_questions():
    used = set().union(*map(metric_names, dashboard_exprs().values()))
    for metric in ("mmtrace_submitter_runq_delay_seconds", "mmtrace_device_sync_wait_seconds",
                   "mmtrace_device_submit_to_retire_seconds", "mmtrace_device_memcpy_bytes_total",
                   "mmtrace_gpu_device_weight", "mmtrace_anomalies_total",
                   "mmtrace_events_lost_total", "mmtrace_launcher_time_share",
                   "mmtrace_launcher_runnable_threshold", "mmtrace_device_memory_outstanding_bytes",
                   "mmtrace_device_calls_stuck"):
        assert any(m.startswith(metric) for m in used), metric


@needs_promtool
def test_every_dashboard_expression_parses(tmp_path):
    """promtool parses the expressions of a rule file: each one as a rule."""
    rules = [{"record": f"dashboard:expr_{i}", "expr": expr}
             for i, expr in enumerate(dashboard_exprs().values())]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


@needs_promtool
def test_alert_rules_check_and_their_tests_pass():
    result = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    result = subprocess.run(["promtool", "test", "rules", str(RULE_TESTS)], capture_output=True,
                            text=True, cwd=RULE_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_test_cases():
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    tested = {case["alertname"] for t in tests for case in t.get("alert_rule_test", [])
              if case.get("exp_alerts")}
    assert tested == set(rule_exprs()) == {
        "MmtraceP99DriftFiring", "MmtraceEntropyDrift", "MmtraceEventsLost", "MmtraceProbeDown",
        "MmtraceAgentDown", "MmtraceNvmlMissing", "MmtraceCallFailures",
        "MmtraceLauncherStarved", "MmtraceDeviceHang", "MmtraceDeviceMemoryLeak"}
