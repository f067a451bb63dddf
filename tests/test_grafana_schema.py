"""dashboards/mmtrace.json type-checks against Grafana's own schema: the
TypeScript types of @grafana/schema (npm), checked by tsc, the dashboard
written as an object literal so that every field's type is checked, as
Grafana's front end would. Runs where node and npm are; the packages are
fetched once into tests/_build. In CI (CI=true) a failed fetch fails."""

import json
import os
import shutil
import subprocess

import pytest

from dashboard_exprs import DASHBOARD
from native import BUILD

SCHEMA = "@grafana/schema@13.2.3"
TYPESCRIPT = "typescript@5.9.3"
WORK = BUILD / "grafana-schema"

pytestmark = pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None,
                                reason="node and npm (the dashboard schema check uses tsc)")


@pytest.fixture(scope="module")
def tsc():
    done = WORK / "node_modules" / ".bin" / "tsc"
    if not done.exists():
        WORK.mkdir(parents=True, exist_ok=True)
        got = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent",
                              "--prefix", str(WORK), SCHEMA, TYPESCRIPT],
                             capture_output=True, text=True, timeout=300)
        if got.returncode != 0:
            why = f"npm install {SCHEMA} {TYPESCRIPT} failed: {got.stderr.strip()[-500:]}"
            if os.environ.get("CI") == "true":
                pytest.fail(why, pytrace=False)
            pytest.skip(why)
    return done


def type_check(tsc, dashboard: dict, name: str) -> subprocess.CompletedProcess:
    source = WORK / f"{name}.ts"
    source.write_text('import type { Dashboard } from "@grafana/schema";\n'
                      f"const dashboard: Dashboard = {json.dumps(dashboard, indent=1)};\n"
                      "export default dashboard;\n")
    return subprocess.run([str(tsc), "--noEmit", "--strict", "--skipLibCheck",
                           "--moduleResolution", "node", str(source)],
                          capture_output=True, text=True, timeout=300, cwd=WORK)


def test_the_dashboard_passes_grafanas_schema(tsc):
    result = type_check(tsc, json.loads(DASHBOARD.read_text()), "mmtrace")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_refuses_what_grafanas_schema_does(tsc):
    """Not vacuous: a variable whose `current` lacks text and value (what
    the dashboard once had), and a field the schema does not know, fail."""
    dash = json.loads(DASHBOARD.read_text())
    dash["templating"]["list"][0]["current"] = {}
    dash["templating"]["list"][1]["definition"] = "label_values(up, instance)"
    result = type_check(tsc, dash, "broken")
    assert result.returncode != 0
    assert "VariableOption" in result.stdout and "definition" in result.stdout, result.stdout
