"""The chart's PrometheusRule (templates/monitoring/prometheusrule.yaml), rendered by the real Helm engine, checked
by `promtool check rules` and unit-tested by `promtool test rules` on the series of
tests/cluster/alerts/promtool-tests.yaml.
"""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from support.chart import documents, of_kind, render_files

pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="needs promtool from Debian's prometheus (.ci/run installs it)"
)
ALERTS_TEST = Path(__file__).parent / "alerts" / "promtool-tests.yaml"
ALERTS = {
    "ArealStalenessOutOfBand",
    "ArealNoTrainingProgress",
    "ArealWeightPushSlow",
    "ArealItemsDeadLettered",
    "ArealContainersRestarting",
    "ArealPauseLapsed",
}


def rules_of(alerts: dict) -> dict:
    """The rule groups the chart renders with monitoring.alerts = `alerts`, as a Prometheus rule file."""
    (rule,) = of_kind(documents(render_files({"monitoring": {"alerts": alerts}})), "PrometheusRule")
    return {"groups": rule["spec"]["groups"]}


def promtool(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_the_rules_are_off_by_default():
    assert of_kind(documents(render_files({})), "PrometheusRule") == []


def test_the_rules_pass_promtool_check_and_their_unit_tests(tmp_path):
    rules = rules_of({"enabled": True, "labels": {"release": "kube-prometheus-stack"}})
    assert {r.get("alert") for group in rules["groups"] for r in group["rules"]} - {None} == ALERTS
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    shutil.copy(ALERTS_TEST, tmp_path)
    checked = promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", ALERTS_TEST.name, cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_thresholds_come_from_the_values(tmp_path):
    """With more patience than the unit tests assume, the stuck job's alert does not fire in them."""
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules_of({"enabled": True, "noProgressMinutes": 60})))
    shutil.copy(ALERTS_TEST, tmp_path)
    tested = promtool("test", "rules", ALERTS_TEST.name, cwd=tmp_path)
    assert tested.returncode != 0
    assert "ArealNoTrainingProgress" in tested.stdout + tested.stderr
    assert "ArealStalenessOutOfBand" not in tested.stdout + tested.stderr
