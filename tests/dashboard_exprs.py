"""The PromQL of dashboards/: every panel target of the Grafana dashboard
(Grafana's variables replaced as Grafana would) and every alert rule."""

import json
import re
from pathlib import Path

import yaml

DASHBOARDS = Path(__file__).resolve().parent.parent / "dashboards"
DASHBOARD = DASHBOARDS / "mmtrace.json"
RULES = DASHBOARDS / "alerts.yml"
RULE_TESTS = DASHBOARDS / "alerts_test.yml"
GRAFANA_VARS = {"$__rate_interval": "15s", "$instance": ".*", "$process": ".*"}


def dashboard_panels() -> list[dict]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def dashboard_exprs() -> dict[str, str]:
    """"panel title / refId" -> expression, variables substituted."""
    out = {}
    for panel in dashboard_panels():
        for target in panel["targets"]:
            expr = target["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            out[f"{panel['title']} / {target['refId']}"] = expr
    return out


def rule_exprs() -> dict[str, str]:
    doc = yaml.safe_load(RULES.read_text())
    return {rule["alert"]: rule["expr"] for group in doc["groups"] for rule in group["rules"]}


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(mmtrace_[a-z0-9_]+|up)\b", expr))
