"""Metrics, dashboards and the run report: the documented metric list is what the services export, and every
dashboard query returns data from a real Prometheus scraping a real local run."""

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from support.e2e_jobs import make_job, read_steps

from areal_k8s.cli.calibrate import calibrate
from areal_k8s.cli.launcher import LocalRun
from areal_k8s.cli.monitor import MetricsRecorder
from areal_k8s.cli.report import write_report
from areal_k8s.common.metrics import README_END, README_START, RolloutMetrics, catalogue, catalogue_markdown
from areal_k8s.common.ports import free_port
from areal_k8s.controller.admission import blocking_bound
from areal_k8s.observability.dashboards import DASHBOARD_DIR, queries, render
from areal_k8s.rollout.worker import IdleClock

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "docs" / "observability.md"  # the metric table's page
METRIC = re.compile(r"\b(areal_[a-z_]+)")


def readme_metrics() -> dict[str, str]:
    """name -> type, from the metric table in docs/observability.md."""
    table = README.read_text().split(README_START, 1)[1].split(README_END, 1)[0]
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| `")]
    return {cells[1].strip().strip("`"): cells[2].strip() for cells in rows}


def dashboards() -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARD_DIR.glob("*.json"))}


def family(series_name: str) -> str:
    return re.sub(r"_(bucket|sum|count)$", "", series_name)


def test_readme_metric_table_is_generated_from_the_catalogue():
    table = README.read_text().split(README_START, 1)[1].split(README_END, 1)[0]
    assert table == catalogue_markdown(), "run `python -m areal_k8s.common.metrics --write docs/observability.md`"


def test_metric_names_follow_the_naming_scheme():
    for name, kind, _roles, _labels, _help in catalogue():
        assert name.startswith("areal_"), name
        assert name.endswith("_total") == (kind == "counter"), f"{name}: only counters end in _total"
        assert not re.search(r"_(milliseconds|ms|kb|mb|percent)\b", name), f"{name}: base units (seconds, bytes)"


def test_committed_dashboards_are_the_generated_ones():
    assert {name: path.read_text() for name, path in ((p.name, p) for p in DASHBOARD_DIR.glob("*.json"))} == render(), (
        "run `make dashboards`"
    )


def test_dashboards_only_query_documented_metrics_and_filter_by_namespace_and_job():
    documented = readme_metrics()
    boards = dashboards()
    assert set(boards) == {"throughput.json", "staleness.json", "training-health.json"}
    for name, board in boards.items():
        assert {v["name"] for v in board["templating"]["list"]} >= {"datasource", "namespace", "job"}, name
        for title, expr in queries(board):
            used = {family(m) for m in METRIC.findall(expr)}
            assert used and used <= set(documented), f"{name} / {title}: {used - set(documented)} not documented"
            assert expr.count('rljob=~"$job"') == expr.count("areal_") and 'namespace=~"$namespace"' in expr, (
                f"{name} / {title}"
            )


def test_admission_names_the_bound_that_blocks_it():
    state = {"version": 0, "batch_size": 4, "max_staleness": 1, "max_concurrent": 100, "total_groups": 100}
    assert blocking_bound(**state, running=2, accepted=6) == "staleness"  # (1 + 0 + 1)·4 − 8 = 0
    assert blocking_bound(**state, running=2, accepted=5) is None
    assert blocking_bound(**{**state, "max_concurrent": 2}, running=2, accepted=0) == "concurrency"
    assert blocking_bound(**{**state, "total_groups": 8}, running=2, accepted=6) is None  # done, not blocked


def test_idle_clock_counts_only_time_with_nothing_in_flight():
    now = [100.0]
    metrics = RolloutMetrics("j")
    clock = IdleClock(metrics.idle_seconds, clock=lambda: now[0])
    now[0] = 103.0
    clock.started()  # idle 100 → 103
    now[0] = 110.0
    clock.started()
    clock.finished()
    clock.flush()  # busy: nothing credited
    now[0] = 112.0
    clock.finished()  # idle from 112
    now[0] = 115.5
    clock.flush()
    assert metrics.value("areal_rollout_idle_seconds_total") == pytest.approx(3.0 + 3.5)


def prometheus_get(url: str, path: str, **params) -> dict:
    with urllib.request.urlopen(f"{url}{path}?{urllib.parse.urlencode(params)}", timeout=30) as reply:
        body = json.load(reply)
    assert body["status"] == "success", body
    return body["data"]


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs Debian's prometheus (.ci/run installs it)")
def test_every_dashboard_query_returns_series_from_a_real_prometheus(assets, tmp_path, reward_importable):
    job = make_job(
        assets,
        tmp_path / "run",
        algorithm={"total_steps": 20, "max_staleness": 1, "staleness_target": {"min": 0.5, "max": 1.0}},
        trainer={"eval_interval": 10},
    )
    run = LocalRun(job)
    try:
        endpoints = run.start("new", prometheus="250ms")  # the tiny job trains several steps a second
        run.recorder.interval = 0.5
        final = run.wait(endpoints.controller, lambda status: None, poll=0.5, timeout=300)
        steps = read_steps(run.run_dir)
        # Every service was up and scraped while the last step ran; later they stop one by one.
        at = steps[-1]["finished_at"]
        time.sleep(max(0.0, at + 1.0 - time.time()))
        url = run.prometheus.url

        targets = prometheus_get(url, "/api/v1/targets")["activeTargets"]
        assert {t["labels"]["service"] for t in targets} == {"controller", "reward", "rollout-0", "trainer"}

        # names and types: exactly docs/observability.md's list (nothing undocumented exported, nothing documented
        # missing)
        # (scraped as OpenMetrics, where a counter's family name has no `_total`; its series do)
        metadata = prometheus_get(url, "/api/v1/metadata")
        exported = {
            name + ("_total" if entries[0]["type"] == "counter" else ""): entries[0]["type"]
            for name, entries in metadata.items()
            if name.startswith("areal_")
        }
        assert exported == readme_metrics()

        empty = []
        for board_name, board in dashboards().items():
            for title, expr in queries(board):
                promql = expr.replace("$__rate_interval", "5m").replace("$namespace", "local").replace("$job", job.name)
                result = prometheus_get(url, "/api/v1/query", query=promql, time=f"{at:.3f}")["result"]
                if not result:
                    empty.append(f"{board_name} / {title}: {promql}")
        assert not empty, "panels with no data:\n" + "\n".join(empty)

        # the figures behind the panels are the run's own
        def value(promql: str) -> float:
            return float(prometheus_get(url, "/api/v1/query", query=promql, time=f"{at:.3f}")["result"][0]["value"][1])

        assert 1 <= value(f'max(areal_trainer_policy_version{{rljob="{job.name}"}})') <= 20
        trained = value(f'sum(areal_trainer_trained_samples_total{{rljob="{job.name}"}})')
        assert 0 < trained <= 20 * 2 * 4 and trained % (2 * 4) == 0  # whole batches of B groups × n samples
        # every trained response's length, once
        assert value(f'sum(areal_trainer_response_tokens_count{{rljob="{job.name}"}})') == trained
        assert value(f'sum(areal_trainer_response_tokens_sum{{rljob="{job.name}"}})') == value(
            f'sum(areal_trainer_trained_tokens_total{{rljob="{job.name}"}})'
        )
        assert value(f'max(areal_trainer_sample_staleness_bucket{{rljob="{job.name}", le="1.0"}})') == value(
            f'max(areal_trainer_sample_staleness_count{{rljob="{job.name}"}})'
        )  # nothing staler than η = 1
        assert value(f'max(areal_controller_staleness_target{{rljob="{job.name}", edge="max"}})') == 1.0
        # the engine's own counters, through its worker: a mean batch within the engine's rows
        decoded = value(f'sum(areal_engine_decode_steps_total{{rljob="{job.name}"}})')
        rows = value(f'sum(areal_engine_decode_rows_total{{rljob="{job.name}"}})')
        assert 0 < decoded <= rows <= decoded * job.rollout.max_batch_size

        # the simulator calibrated on what Prometheus kept of the run: the engine's windows from its worker's
        # series, each service's CPU by role and target
        calibration = calibrate(run.run_dir, prometheus=url)
        assert calibration["measured_by"] == f"Prometheus at {url}" and calibration["engine"]["windows"] >= 4
        assert calibration["measured"]["steps"] == len(steps) and calibration["train_seconds_per_token"] > 0
        assert calibration["engine"]["step_base_seconds"] + calibration["engine"]["step_per_sequence_seconds"] > 0
        refused = subprocess.run(
            [
                sys.executable,
                "-m",
                "areal_k8s.cli.main",
                "calibrate",
                str(run.run_dir),
                "--prometheus",
                "http://127.0.0.1:9",
            ],
            capture_output=True,
            text=True,
        )
        assert refused.returncode == 2 and "did not answer" in refused.stderr and len(refused.stderr.splitlines()) == 1
        # a cluster's job, its files copied here: the cores its services shared are not this machine's to guess
        copied = tmp_path / "copied"
        (copied / "trainer").mkdir(parents=True)
        shutil.copy(run.run_dir / "job.yaml", copied / "job.yaml")
        shutil.copy(run.run_dir / "trainer" / "steps.jsonl", copied / "trainer" / "steps.jsonl")
        unsized = subprocess.run(
            [sys.executable, "-m", "areal_k8s.cli.main", "calibrate", str(copied), "--prometheus", url],
            capture_output=True,
            text=True,
        )
        assert unsized.returncode == 2 and "--prometheus needs --cores" in unsized.stderr

        # a rollout worker the rebalancer starts mid-run becomes a target through the file Prometheus watches
        run.prometheus.targets["rollout-1"] = run.free_address()
        run.prometheus.refresh()
        deadline = time.monotonic() + 120  # a liveness bound
        while "rollout-1" not in {
            t["labels"]["service"] for t in prometheus_get(url, "/api/v1/targets")["activeTargets"]
        }:
            assert time.monotonic() < deadline, "the new target never showed"
            time.sleep(0.2)
    finally:
        run.stop()
    assert final.version == 20

    # the run directory keeps the scrapes, and the report is drawn from the run's records
    scrapes = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(s["services"].get("trainer", {}).get("areal_trainer_steps_total", 0) for s in scrapes) >= 1
    run.write_summary(final, interrupted=False)
    png, md = write_report(run.run_dir)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = md.read_text()
    assert "| steps | 20 |" in report and "![report](report.png)" in report


def test_recorder_rates_come_from_consecutive_scrapes(tmp_path):
    metrics = RolloutMetrics("j")
    port = metrics.serve("127.0.0.1", free_port("127.0.0.1"))
    recorder = MetricsRecorder({"rollout-0": f"127.0.0.1:{port}"}, tmp_path / "metrics.jsonl")
    metrics.generated_tokens.inc(5)
    recorder.tick(force=True)
    assert recorder.rate("areal_rollout_generated_tokens_total") is None  # one scrape: no rate yet
    metrics.generated_tokens.inc(10)
    recorder.tick(force=True)
    recorder.snapshots[0].at = recorder.snapshots[1].at - 2.0
    assert recorder.rate("areal_rollout_generated_tokens_total") == pytest.approx(5.0)
    assert recorder.total("areal_rollout_generated_tokens_total") == 15
    assert recorder.tick() is None  # within the interval: no scrape
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["services"]["rollout-0"]["areal_rollout_generated_tokens_total"] for line in lines] == [
        5,
        15,
    ]


def test_live_view_shows_the_services_figures(tmp_path):
    from areal_k8s.cli.monitor import Snapshot
    from areal_k8s.cli.progress import metric_rows

    def trainer(wait: float, fb: float) -> list:
        return [
            ("areal_trainer_phase_seconds_total", {"phase": "wait"}, wait),
            ("areal_trainer_phase_seconds_total", {"phase": "forward_backward"}, fb),
            ("areal_weight_sync_duration_seconds_count", {}, 4),
            ("areal_weight_sync_duration_seconds_sum", {}, 0.5),
        ]

    recorder = MetricsRecorder({}, tmp_path / "m.jsonl")
    recorder.snapshots = [
        Snapshot(
            10.0, {"trainer": trainer(1.0, 1.0), "rollout-0": [("areal_rollout_generated_tokens_total", {}, 100)]}
        ),
        Snapshot(
            12.0,
            {
                "trainer": trainer(1.5, 2.5),
                "rollout-0": [
                    ("areal_rollout_generated_tokens_total", {}, 500),
                    ("areal_rollout_inflight_requests", {}, 7),
                ],
                "reward": [("areal_reward_scored_items_total", {"verifier": "math", "status": "timeout"}, 3)],
            },
        ),
    ]
    rows = dict(metric_rows(recorder))
    assert rows["generation"].startswith("200 tokens/s, 7 requests in flight")
    assert rows["trainer time"] == "wait 25%, forward_backward 75%"
    assert rows["weight sync"].startswith("4 pushes, 0.125 s each")
    assert rows["reward"].endswith("3 timeouts or errors")
