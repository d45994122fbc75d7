"""The benchmark's analysis of stored runs (bench/sync_vs_async.py): pure functions over accuracy curves."""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # the scripts import their shared bench/figures.py


def load_bench(name: str):
    """bench/<name>.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve the module of the classes they build
    spec.loader.exec_module(module)
    return module


bench = load_bench("sync_vs_async")


def result(seed: int, curve: list[tuple[float, float]]) -> "bench.RunResult":
    return bench.RunResult(
        label=f"seed{seed}",
        seed=seed,
        max_staleness=0,
        decoupled=True,
        trainer_threads=1,
        steps=len(curve) - 1,
        base_accuracy=curve[0][1],
        final_accuracy=curve[-1][1],
        curve=curve,
        training_seconds=curve[-1][0],
        samples_per_second=1.0,
        tokens_per_second=1.0,
        trainer_idle_fraction=0.0,
        rollout_idle_fraction=0.0,
        mean_staleness=0.0,
    )


def test_averaged_curve_means_accuracy_per_evaluation_at_the_median_time():
    runs = [
        result(0, [(0, 0.1), (10, 0.3), (20, 0.5)]),
        result(1, [(0, 0.1), (12, 0.5), (26, 0.2)]),
        result(2, [(0, 0.1), (11, 0.4)]),
    ]
    assert bench.averaged_curve(runs) == [
        (0, pytest.approx(0.1)),
        (11, pytest.approx(0.4)),
    ]  # the shortest run bounds it


def test_averaged_curves_compare_where_each_reaches_syncs_averaged_final():
    """Sync averages to 0.5 at its end (60 s); async's average reaches it at its second evaluation (20 s): 3×."""
    synchronous = [result(0, [(0, 0.1), (30, 0.3), (60, 0.6)]), result(1, [(0, 0.1), (30, 0.3), (60, 0.4)])]
    asynchronous = [result(0, [(0, 0.1), (20, 0.6), (40, 0.5)]), result(1, [(0, 0.1), (20, 0.4), (40, 0.5)])]
    averaged = bench.compare_averaged(asynchronous, synchronous, smooth=1)
    assert averaged["target_accuracy"] == 0.5
    assert averaged["seconds_to_target"] == {"sync": 60, "async": 20}
    assert averaged["speedup"] == 3.0
    # An async average that never gets there has no ratio.
    never = bench.compare_averaged([result(0, [(0, 0.1), (20, 0.45)])], synchronous, smooth=1)
    assert never["seconds_to_target"]["async"] is None and never["speedup"] is None


def test_the_readme_carries_the_sglang_benchmark_as_measured():
    """docs/benchmarks.md's SGLang-vs-CPU-engine lines are the ones bench/sglang_vs_cpu.py writes from its committed
    results."""
    import json

    sglang_bench = load_bench("sglang_vs_cpu")
    report = json.loads(sglang_bench.RESULTS.read_text())
    assert sglang_bench.readme_block(report) in sglang_bench.DOC.read_text(), (
        "run `python bench/sglang_vs_cpu.py --readme`"
    )
    assert report["summary"]["sglang"]["samples_per_second"]["median"] / report["summary"]["cpu"]["samples_per_second"][
        "median"
    ] == pytest.approx(report["samples_per_second_ratio"], abs=1e-3)


def test_the_readme_carries_the_chaos_figures_as_measured():
    """docs/fault-tolerance.md's "What survives what" figures are the ones bench/chaos.py writes from its committed
    results, and those are the medians and ranges of the runs the file holds."""
    import json

    chaos = load_bench("chaos")
    report = json.loads(chaos.RESULTS.read_text())
    assert chaos.readme_block(report) in chaos.DOC.read_text(), "run `python bench/chaos.py --readme`"
    assert report["summary"] == chaos.summarize(report["runs"], len(report["runs"]) + len(report["failed_seeds"]))
    assert all(run["max_staleness_seen"] <= run["eta"] and run["dead_lettered"] == 0 for run in report["runs"])


def test_the_docs_carry_the_cluster_chaos_table_as_measured():
    """docs/fault-tolerance.md's cluster table is the one bench/cluster_chaos.py writes from its committed results, the
    medians and ranges of the runs the file holds; in each, the full volume was reported and no sample was past η."""
    cluster = load_bench("cluster_chaos")
    report = json.loads(cluster.RESULTS.read_text())
    assert cluster.readme_block(report) in cluster.DOC.read_text(), "run `python bench/cluster_chaos.py --readme`"
    assert report["summary"] == cluster.summarize(report["runs"], len(report["runs"]) + len(report["failed_seeds"]))
    assert all(r["max_staleness_seen"] <= r["eta"] and r["checkpoint_failed_seconds"] > 0 for r in report["runs"])


def test_the_readme_carries_the_simulated_figures_as_computed():
    """docs/simulator.md's simulated 1,024-GPU table is the one bench/simulated.py writes from its committed results,
    and the summary is the median and range of the runs it keeps."""
    simulated = load_bench("simulated")
    report = json.loads(simulated.RESULTS.read_text())
    assert report["simulated"] is True
    assert simulated.readme_block(report) in simulated.DOC.read_text(), "run `python bench/simulated.py --readme`"
    for name, runs in report["runs"].items():
        assert len(runs) == report["seeds"]
        assert report["summary"][name]["hours"] == simulated.spread(runs, "hours")


def test_the_docs_carry_the_simulated_table_1_and_policy_sweep_as_computed():
    """docs/simulator.md's simulated Table 1 reproduction and strict/admission sweep are what
    bench/simulated_tail.py writes from its committed results; each summary is the median and range of the kept runs
    (one per seed), and the verdict against AReaL's published hours is recomputed from those medians."""
    tail = load_bench("simulated_tail")
    report = json.loads(tail.RESULTS.read_text())
    assert report["simulated"] is True
    assert tail.readme_block(report) in tail.DOC.read_text(), "run `python bench/simulated_tail.py --readme`"
    for name, runs in report["runs"].items():
        assert sorted(r["seed"] for r in runs) == list(range(len(runs))), name  # seeds 0.., one run each
        for key in tail.FIGURES:
            assert report["figures"][name][key] == tail.spread(runs, key)
    recomputed = tail.summarize(report["runs"])
    assert report["table1"] == recomputed["table1"]
    assert set(report["table1"]) == set(tail.PUBLISHED) and report["table1"]["1.5b"]["published_hours"] == {
        "async": 14.8,
        "sync": 41.0,
    }
    for model, row in report["table1"].items():  # a number outside its tolerance is explained in the results file
        missed = [figure for figure, ok in row["within"].items() if not ok]
        assert all(report["explanations"].get(f"{model}/{figure}") for figure in missed), (model, missed)


def test_the_docs_and_readme_carry_the_long_tail_policy_benchmark_as_measured():
    """docs/benchmarks.md's policy tables and the README's line are what bench/long_tail_policies.py writes from its
    committed results; each comparison is recomputed from the runs the file holds (every mode on the same seeds, ≥ 3),
    and no run under `strict` trained a token more than η versions old."""
    policies = load_bench("long_tail_policies")
    report = json.loads(policies.RESULTS.read_text())
    assert policies.doc_block(report) in policies.DOC.read_text(), "run `python bench/long_tail_policies.py --readme`"
    assert policies.readme_block(report) in policies.README.read_text()
    assert set(report["regimes"]) == set(policies.REGIMES)
    for regime in report["regimes"].values():
        runs = policies.stored_runs(regime)
        assert all(sorted(r.seed for r in results) == report["seeds"] for results in runs.values())
        assert len(report["seeds"]) >= 3
        assert regime["comparison"] == json.loads(json.dumps(policies.compare(runs, report["smooth"])))
        assert all(r.token_staleness["max"] <= report["max_staleness"] for r in runs["strict"])
        assert all(r.token_staleness["max"] == 0 for r in runs["sync"])
    # what the README's reason for the default (`strict`) rests on, in the tail regime
    tail = report["regimes"]["tail"]["comparison"]
    modes = tail["modes"]
    every_run_reached = [m for m in policies.POLICIES if None not in modes[m]["seconds_to_target_runs"].values()]
    assert every_run_reached == ["strict"] and tail["fastest_policy"] == "strict"
    averaged = tail["averaged_curves"]["speedup"]
    assert max(policies.POLICIES, key=lambda m: averaged[m] or 0) == "strict"
    assert min(policies.POLICIES, key=lambda m: modes[m]["final_accuracy"]["median"]) == "admission"
    assert max(policies.POLICIES, key=lambda m: modes[m]["token_staleness"]["max"]) == "admission"
    assert all(modes[m]["final_within_sync_spread"] for m in policies.POLICIES)
    spans = [modes[m]["samples_per_second"] for m in policies.POLICIES]  # their samples/s ranges overlap
    assert max(s["min"] for s in spans) <= min(s["max"] for s in spans)


def test_the_policy_comparison_times_each_mode_to_syncs_median_final_accuracy():
    policies = load_bench("long_tail_policies")

    def run(mode: str, seed: int, curve: list[tuple[float, float]], samples_per_second: float):
        r = result(seed, curve)
        r.label, r.samples_per_second, r.smoothed_final = mode, samples_per_second, curve[-1][1]
        r.token_staleness = {"p50": 0, "p99": 0, "max": 0} if mode == "sync" else {"p50": 1, "p99": 2, "max": 3}
        return r

    runs = {
        "sync": [run("sync", s, [(0, 0.5), (100, 0.6), (200, f)], 10.0) for s, f in ((0, 0.70), (1, 0.72), (2, 0.74))],
        "strict": [run("strict", s, [(0, 0.5), (50, 0.72), (100, 0.75)], 20.0) for s in (0, 1, 2)],
        "admission": [run("admission", s, [(0, 0.5), (80, 0.7), (160, 0.73)], 15.0) for s in (0, 1, 2)],
        "capped": [run("capped", s, [(0, 0.5), (60, 0.6), (120, 0.65)], 18.0) for s in (0, 1, 2)],
    }
    comparison = policies.compare(runs, smooth=1)
    modes = comparison["modes"]
    assert comparison["target_accuracy"] == 0.72  # sync's median final
    assert modes["sync"]["seconds_to_target_runs"] == {"0": None, "1": 200, "2": 200}
    assert modes["sync"]["seconds_to_target"] == 200 and modes["strict"]["seconds_to_target"] == 50
    assert modes["strict"]["speedup"] == 4.0 and modes["admission"]["speedup"] == 1.25
    assert modes["capped"]["seconds_to_target"] is None and modes["capped"]["speedup"] is None  # never got there
    assert modes["strict"]["speedup_per_seed"] == {"0": None, "1": 4.0, "2": 4.0}  # sync's seed 0 never did
    assert comparison["fastest_policy"] == "strict"
    assert modes["admission"]["final_within_sync_spread"] and not modes["capped"]["final_within_sync_spread"]
    assert modes["strict"]["samples_per_second"] == {"median": 20.0, "min": 20.0, "max": 20.0}
    assert modes["strict"]["token_staleness"] == {"p50": 1, "p99": 2, "max": 3}
    levels = comparison["seconds_to_threshold"]
    assert levels["0.65"] == {"sync": 200, "strict": 50, "admission": 80, "capped": 120}
    assert levels["0.72"] == {"sync": 200, "strict": 50, "admission": 160, "capped": None}  # sync: 2 runs of 3
    averaged = comparison["averaged_curves"]  # sync's averaged curve ends at 72 %; strict's passes it at 50 s
    assert averaged["target_accuracy"] == 0.72 and averaged["seconds_to_target"]["strict"] == 50
    assert averaged["speedup"] == {"sync": 1.0, "strict": 4.0, "admission": 1.25, "capped": None}


@pytest.mark.parametrize(
    "script",
    [
        "code_sandbox",
        "logprob_memory",
        "calibrate",
        "demo_runs",
        "ablation",
        "sync_vs_async",
        "rebalance_local",
        "weight_push",
        "slow_engine",
        "gateway_overhead",
        "agent_runs",
    ],
)
def test_the_readme_carries_each_benchmarks_figures_as_measured(script):
    """The README or docs lines written by a benchmark script from its committed results file
    (`python bench/<script>.py --readme`)."""
    module = load_bench(script)
    report = json.loads(module.RESULTS.read_text())
    assert module.readme_block(report) in module.DOC.read_text(), f"run `python bench/{script}.py --readme`"


def test_the_control_plane_doc_carries_the_control_plane_figures_as_measured():
    """The tables and the figures docs/control-plane.md reasons with, as bench/control_plane.py writes them from its
    committed results (its report is bench/control_plane_report.py)."""
    module = load_bench("control_plane_report")
    report = json.loads(module.RESULTS.read_text())
    assert module.readme_block(report) in module.DOC.read_text(), "run `python bench/control_plane.py --readme`"
    assert module.capacity_block(report) in module.DOC.read_text(), "run `python bench/control_plane.py --readme`"


def test_the_demo_figures_summarise_every_run():
    """The README's demo figures are medians and ranges over all recorded runs of the shipped job, never one run."""
    module = load_bench("demo_runs")
    report = json.loads(module.RESULTS.read_text())
    assert len(report["runs"]) >= 5
    for key in module.FIGURES:
        assert report["summary"][key] == module.spread(report["runs"], key)
    assert report["distinct_base_models"] == len({r["weights_sha256"] for r in report["runs"]})
    job = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())["algorithm"]
    assert report["job"]["steps"] == job["total_steps"] == report["runs"][0]["steps"]


def test_the_agent_figures_summarise_every_seed_of_the_shipped_job_for_each_program():
    """The README's agent figures are medians and ranges over ≥ 3 seeds of the shipped example for each program,
    never one run; each seed's programs ran on the same assets, the job's own program first."""
    module = load_bench("agent_runs")
    report = json.loads(module.RESULTS.read_text())
    job = yaml.safe_load((ROOT / "examples" / "agent.yaml").read_text())
    assert report["programs"] == module.PROGRAMS
    assert next(iter(module.PROGRAMS.values())) == job["agents"]["command"][-1]
    for program in module.PROGRAMS:
        runs = [r for r in report["runs"] if r["program"] == program]
        assert len({r["seed"] for r in runs}) == len(runs) >= 3
        assert report["summary"][program] == module.summary(report["runs"], program)
        for run in runs:
            assert run["episodes_played"] == sum(run["episode_outcomes"].values())
            assert run["steps"] == job["algorithm"]["total_steps"]
    by_seed = {}
    for run in report["runs"]:
        by_seed.setdefault(run["seed"], set()).add(run["weights_sha256"])
    for run in report["pods"]["runs"]:  # the RLJob's own build of the seed: the same weights
        by_seed[run["seed"]].add(run["weights_sha256"])
    assert all(len(digests) == 1 for digests in by_seed.values())  # one model per seed, played by every program
    assert sorted(r["seed"] for r in report["pods"]["runs"]) == sorted(by_seed)
    assert report["pods"]["summary"] == {key: module.spread(report["pods"]["runs"], key) for key in module.POD_FIGURES}
    assert report["job"]["agents_mode"] == job["agents"]["mode"]


def test_the_ablation_runs_eta_zero_once_and_tabulates_medians_and_ranges():
    """At η = 0 decoupled and naive PPO are one loss: that cell runs once per seed and fills both rows."""
    module = load_bench("ablation")
    assert module.cells([0, 2]) == [(0, "decoupled"), (2, "decoupled"), (2, "naive")]
    runs = [
        {
            "max_staleness": eta,
            "objective": objective,
            "seed": seed,
            "accuracy": 0.3 + 0.01 * seed + 0.1 * eta,
            "mean_staleness": eta / 2,
            "samples_per_second": 100.0 + seed,
        }
        for seed in (0, 1, 2)
        for eta, objective in module.cells([0, 2])
    ]
    report = module.report(runs, [0, 2], [0, 1, 2], 3, 200)
    assert report["summary"]["2/naive"]["accuracy"] == module.spread(
        [r for r in runs if r["objective"] == "naive"], "accuracy"
    )
    table = module.readme_block(report)
    assert "| decoupled PPO | 31.0% (30.0%–32.0%) | 51.0% (50.0%–52.0%) |" in table
    assert "| naive PPO | 31.0% (30.0%–32.0%) | 51.0% (50.0%–52.0%) |" in table


def test_the_rebalancer_benchmark_reads_band_share_and_split_over_training_time():
    """Steps in the band count by their batch's mean staleness; a decision's time is on the training clock (the
    evaluations before it left out), and only decisions that moved a side change the split."""
    module = load_bench("rebalance_local")
    steps = [
        {"staleness": [2, 2], "finished_at": 10.0, "seconds": {"wait": 1.0, "train": 1.0, "eval": 0.0}},
        {"staleness": [1, 2], "finished_at": 20.0, "seconds": {"wait": 1.0, "train": 1.0, "eval": 5.0}},
        {"staleness": [1, 1], "finished_at": 30.0, "seconds": {"wait": 1.0, "train": 1.0, "eval": 0.0}},
    ]
    assert module.steps_in_band(steps, (1.0, 1.5)) == 2 / 3
    decisions = [
        {"at": 15.0, "moved": [], "rollout": 1, "trainer": 1, "code": "LatencyBound"},
        {"at": 25.0, "moved": ["rollout"], "rollout": 2, "trainer": 1, "code": "MovedToRollout"},
    ]
    timeline = module.split_over_time(steps, decisions, (1, 1))
    # the first step began at 10 − 2 = 8 s; the move at 25 s comes after 5 s of evaluation: 25 − 8 − 5 = 12 s
    assert timeline == [
        {"seconds": 0.0, "rollout": 1, "trainer": 1, "code": "start"},
        {"seconds": 12.0, "rollout": 2, "trainer": 1, "code": "MovedToRollout"},
    ]


def test_the_rebalancer_benchmark_tabulates_each_mode_against_the_static_split():
    module = load_bench("rebalance_local")
    args = argparse.Namespace(smooth=1, band=[1.0, 1.5], window=20.0, cooldown=10.0)

    def run(mode: str, seed: int, seconds: float, final: float, moves: int) -> dict:
        timeline = [{"seconds": 0.0, "rollout": 2, "trainer": 1, "code": "start"}] + [
            {"seconds": 10.0 * (i + 1), "rollout": 1 + i % 2, "trainer": 1, "code": "MovedToRollout"}
            for i in range(moves)
        ]
        return {
            "mode": mode,
            "seed": seed,
            "training_seconds": seconds,
            "samples_per_second": 3200 / seconds,
            "trainer_idle_fraction": 0.3,
            "mean_staleness": 1.9,
            "steps_in_band": 0.1,
            "smoothed_final": final,
            "curve": [(0.0, 0.2), (seconds / 2, final - 0.1), (seconds, final)],
            "decisions": [{"moved": ["rollout"]}] * moves,
            "split_over_time": timeline,
        }

    runs = [run("static", s, 100.0 + s, 0.5 + 0.01 * s, 0) for s in (0, 1, 2)] + [
        run("rebalanced", s, 80.0 + s, 0.5 + 0.01 * s, 2) for s in (0, 1, 2)
    ]
    results = module.report(runs, [0, 1, 2], args, 200)
    assert results["target_accuracy"] == 0.51
    assert results["summary"]["static"]["reached_target"] == 2  # seeds 1 and 2 end at or above it
    assert results["summary"]["rebalanced"]["seconds_to_target"] == 82.0  # 81, 82 and never: the middle one
    table = module.readme_block(results)
    assert "| training seconds (static ÷ mode) | 101 (100–102) | 81 (80–82) · 1.25× |" in table
    assert "| rebalancer moves · final split (rollout:trainer) | 0 · 2:1 | 2 · 2:1 |" in table


def test_the_docs_carry_the_one_parameter_set_check_and_a_rerun_gives_the_committed_figures():
    """docs/simulator.md's Table 1 / Fig. 5c / Table 7 check is what bench/simulated_table1.py writes from its
    committed results, the summary is recomputed from the runs, and one run simulated again (the 7B row, AReaL's η,
    at the fitted parameters) gives the figures the file holds."""
    check = load_bench("simulated_table1")
    report = json.loads(check.RESULTS.read_text())
    assert report["simulated"] is True
    assert check.readme_block(report) in check.DOC.read_text(), "run `python bench/simulated_table1.py --readme`"
    assert {k: report[k] for k in ("params", "table1", "leave_one_out", "expected_error")} == {
        k: v
        for k, v in check.summarize(report["runs"]).items()
        if k in ("params", "table1", "leave_one_out", "expected_error")
    }
    assert report["table1"]["32b"]["published_hours"] == {"async": 31.1, "sync": 51.1}
    for row in report["table1"].values():  # a goal missed names the input that is missing
        assert (row["missing_input"] is None) == all(row["goal_met"].values())
    kept = next(r for r in report["runs"] if r["part"] == "table1" and r["row"] == "7b" and r["eta"] == 8)
    assert check.run({k: kept[k] for k in ("part", "row", "eta", "seed", "params")}) == kept
