"""The cluster simulator: it runs the controller's admission, the trainer's batch choice and the rebalancer on
simulated time, so the guarantees those give hold in it too; and the model behaves as the system does."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_k8s.common.config import JobFileError
from areal_k8s.simulator.model import Simulation, simulate
from areal_k8s.simulator.plan import plan, recommend, static_splits
from areal_k8s.simulator.scenario import Scenario, load_scenario


def scenario(**parts) -> Scenario:
    base = {
        "name": "t",
        "job": {"batch_size": 8, "group_size": 4, "max_staleness": 2, "total_steps": 30, "groups_per_engine": 4},
        "split": {"rollout": 3, "trainer": 1},
        "engine": {"step_base_seconds": 0.02, "step_per_sequence_seconds": 0.001, "start_seconds": 30},
        "trainer": {"gpu_seconds_per_token": 0.0005, "rescale_seconds": 30},
        "push": {"seconds": 2},
        "workload": {"response": {"mean": 300, "sigma": 0.6, "max": 2000}},
    }
    for key, value in parts.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and key in base else value
    return Scenario.model_validate(base)


@settings(max_examples=25, deadline=None)
@given(
    eta=st.integers(0, 4),
    engines=st.integers(1, 6),
    sigma=st.floats(0, 1.2),
    seed=st.integers(0, 1000),
    backups=st.booleans(),
)
def test_every_step_trains_a_full_batch_and_no_sample_is_older_than_eta(eta, engines, sigma, seed, backups):
    result = simulate(
        scenario(
            seed=seed,
            job={"max_staleness": eta, "backup_stragglers": backups},
            split={"rollout": engines},
            workload={"response": {"mean": 200, "sigma": sigma, "max": 2000}},
        )
    )
    assert result.steps == 30 and result.samples == 30 * 8 * 4
    assert sum(result.staleness_counts) == result.samples
    assert len(result.staleness_counts) <= eta + 1  # the real admission rule and batch choice keep η


def recording(add, written: list[str]):
    """The simulated trainer's `add`, noting each group that enters the stream."""

    def add_and_note(group_id: str, *rest) -> None:
        written.append(group_id)
        add(group_id, *rest)

    return add_and_note


def test_the_stragglers_the_trainer_waits_on_are_backed_up_and_each_group_is_trained_once():
    """job.backup_stragglers, as the controller runs it (controller/backups.py): the trainer names the running groups
    it waits on, another engine generates each again, the copy finished first enters the stream and the other stops;
    off, none is backed up."""
    tail = {"response": {"mean": 200, "sigma": 1.4, "max": 4000}}
    runs = {}
    for backups in (False, True):
        sim = Simulation(scenario(job={"backup_stragglers": backups}, workload=tail))
        written: list[str] = []
        sim.training.add = recording(sim.training.add, written)
        runs[backups] = (sim, sim.run(), written)
    sim, result, written = runs[True]
    assert sim.core.backups_started > 0 and 0 < sim.core.backups_won <= sim.core.backups_started
    originals = [g.removesuffix("-backup") for g in written]
    assert len(originals) == len(set(originals))  # one copy of each group reached the stream
    assert sum(g.endswith("-backup") for g in written) == sim.core.backups_won
    assert result.samples == 30 * 8 * 4 and len(result.staleness_counts) <= 2 + 1
    assert not any(g in e.left for e in sim.engines for g in sim.core.superseded)  # a superseded copy stopped
    assert runs[False][0].core.backups_started == 0


def test_asynchronous_training_beats_synchronous_on_long_tails():
    """AReaL's result in the model: with long-tailed responses, a synchronous step waits for its slowest response."""
    tail = {"response": {"mean": 300, "sigma": 1.0, "max": 4000}}
    sync = simulate(scenario(job={"max_staleness": 0}, workload=tail))
    asynchronous = simulate(scenario(job={"max_staleness": 4}, workload=tail))
    assert asynchronous.seconds < sync.seconds
    assert asynchronous.trainer_wait_seconds < sync.trainer_wait_seconds


def test_attending_to_longer_contexts_slows_generation_down():
    """Each decode step reads the batch's whole context: the closed-form advance must charge for it."""
    plain = simulate(scenario())
    with_context = simulate(scenario(engine={"step_per_context_token_seconds": 1e-5}))
    assert with_context.seconds > plain.seconds and with_context.samples == plain.samples


def test_the_rebalancer_grows_a_starved_rollout_pool_and_never_turns_back():
    starved = scenario(
        job={"total_steps": 80, "staleness_target": {"min": 0.8, "max": 1.5}},
        split={"rollout": 1},
        resources={"budget_gpus": 10, "max_rollout": 9},
        workload={"response": {"mean": 300, "sigma": 0.2, "max": 2000}},
        rebalance={"enabled": True, "window_seconds": 60, "cooldown_seconds": 60, "min_samples": 8},
    )
    result = simulate(starved)
    pools = [rollout for _, rollout, _ in result.splits]
    assert pools[0] == 1 and pools[-1] > 1, result.splits
    assert pools == sorted(pools), f"turned back: {result.splits}"  # (spare budget may add a trainer unit too)
    static = simulate(starved.model_copy(update={"rebalance": starved.rebalance.model_copy(update={"enabled": False})}))
    assert result.seconds < static.seconds and result.figures()["simulated"] is True


def test_plan_tries_every_split_the_budget_pays_for_and_ranks_them():
    budget = scenario(resources={"budget_gpus": 8, "rollout_unit_gpus": 2, "trainer_unit_gpus": 2})
    assert [(s.rollout, s.trainer) for s in static_splits(budget)] == [(3, 1), (2, 2), (1, 3)]
    ranked = plan(budget)
    assert [r.seconds for _, r in ranked] == sorted(r.seconds for _, r in ranked)
    assert ranked[-1][0].rollout == 1  # one engine for three trainer units starves the trainer


def test_the_example_scenario_loads_and_runs():
    result = simulate(load_scenario(Path(__file__).resolve().parents[2] / "examples" / "scenario-long-tail.yaml"))
    assert result.steps == 50 and result.figures()["simulated"] is True


def test_arealctl_simulate_labels_its_figures_and_rejects_a_bad_scenario_in_one_line(tmp_path):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(json.dumps(scenario(sources={"toy": "assumed: a test's figures"}).model_dump()))
    bad.write_text("sources: {toy: assumed}\nsplit: {rollout: 0}\n")
    out = subprocess.run(
        [sys.executable, "-m", "areal_k8s.cli.main", "simulate", str(good)], capture_output=True, text=True
    )
    assert out.returncode == 0 and json.loads(out.stdout)["simulated"] is True
    out = subprocess.run(
        [sys.executable, "-m", "areal_k8s.cli.main", "simulate", str(bad)], capture_output=True, text=True
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "split.rollout" in out.stderr


def test_without_a_budget_plan_needs_both_maxima_and_tries_every_pair():
    assert len(static_splits(scenario(resources={"max_rollout": 4, "max_trainer": 2}))) == 4 * 2
    with pytest.raises(JobFileError, match=re.escape("plan needs resources.budget_gpus")):
        static_splits(scenario(resources={"max_rollout": 4}))


def test_engines_and_a_trainer_sharing_too_few_cores_slow_each_other_down():
    separate = simulate(scenario())
    shared = simulate(scenario(cores=2))  # three engines and the trainer, one thread each, on two cores
    enough = simulate(scenario(cores=4))
    assert shared.seconds > separate.seconds and shared.samples == separate.samples
    assert enough.seconds == separate.seconds  # as many cores as busy threads: nobody waits for a core
    assert separate.engine_pace == enough.engine_pace == 1.0 < shared.engine_pace <= (3 + 1) / 2


def test_time_between_the_last_token_and_the_stream_and_retracting_on_each_push_both_cost_time():
    plain = simulate(scenario())
    completing = simulate(scenario(workload={"completion_seconds": 5.0}))  # (a small delay hides in the waits)
    # (a prefill cost large enough that the retraction outweighs the noise of a different interleaving of events)
    retracting = simulate(scenario(push={"retract": True}, engine={"prefill_per_token_seconds": 1e-3}))
    without = simulate(scenario(engine={"prefill_per_token_seconds": 1e-3}))
    assert completing.seconds > plain.seconds and completing.samples == plain.samples
    assert len(completing.staleness_counts) <= 3  # η = 2 still holds: a group's slot stays taken until it lands
    assert retracting.seconds > without.seconds


def test_plan_names_the_staleness_bound_as_the_limit_when_raising_eta_pays_and_the_split_when_it_does_not():
    """Little's law: with long tails and η = 0 every step waits for its slowest group, so raising η pays more than
    any split; with short tails and η = 4 the bound holds nobody and the split decides."""
    budget = {"budget_gpus": 8, "rollout_unit_gpus": 1, "trainer_unit_gpus": 1}
    tight = scenario(
        job={"max_staleness": 0, "total_steps": 20},
        resources=budget,
        workload={"response": {"mean": 300, "sigma": 1.0, "max": 4000}},
    )
    advice = recommend(tight, plan(tight, 20), 20)
    assert advice.limit == "staleness bound" and advice.max_staleness > 0
    assert advice.lines[-1].startswith("recommended:") and "Little's law" in advice.lines[1]
    loose = scenario(
        job={"max_staleness": 4, "total_steps": 20},
        resources=budget,
        workload={"response": {"mean": 300, "sigma": 0.1, "max": 4000}},
    )
    advice = recommend(loose, plan(loose, 20), 20)
    assert advice.limit == "split" and advice.split.rollout > advice.split.trainer


def test_arealctl_plan_ranks_the_splits_and_recommends_a_split_batch_and_eta(tmp_path):
    path = tmp_path / "budget.yaml"
    budget = scenario(sources={"toy": "assumed"}, resources={"budget_gpus": 5, "trainer_unit_gpus": 1})
    path.write_text(json.dumps(budget.model_dump()))
    out = subprocess.run(
        [sys.executable, "-m", "areal_k8s.cli.main", "plan", str(path), "--steps", "10"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("simulated:") and len(lines) >= 2 + len(static_splits(budget))
    assert re.search(r"^recommended: \d+ rollout and \d+ trainer units, B = \d+, η = \d+$", lines[-3]), lines[-3]
    assert re.search(r"^limit: the (split|staleness bound) ", lines[-4])
    # what the figures rest on, and how far off they may be: this scenario's costs are stated and not validated
    assert lines[-2] == "calibration: costs as the scenario states them, not calibrated; not validated"
    assert lines[-1].startswith("expected error: unknown")


def test_a_validated_scenario_says_what_its_costs_rest_on_and_plan_reads_its_expected_error(tmp_path):
    from areal_k8s.simulator.plan import expected_error

    row = load_scenario(Path(__file__).resolve().parents[2] / "bench" / "scenarios" / "areal-table1.yaml", "32b")
    assert "DeepSeek-R1-Distill-Qwen-32B on H800 SXM, engines of 2 GPUs" in row.calibration()
    assert "validated by ../results/simulated_table1.json" in row.calibration()
    report = json.loads(row.validation_path.read_text())["expected_error"]
    assert expected_error(row).startswith(f"expected error: hours ±{report['hours_median']:.0%} (median)")
    moved = tmp_path / "moved.yaml"
    moved.write_text(json.dumps(scenario(sources={"toy": "assumed"}, validation="missing.json").model_dump()))
    with pytest.raises(JobFileError, match="cannot read the validation's expected error"):
        expected_error(load_scenario(moved))


@pytest.mark.parametrize("placement", [{"order": "token_load"}, {"split_groups": True}])
@settings(max_examples=8, deadline=None)
@given(eta=st.integers(0, 3), engines=st.integers(1, 5), seed=st.integers(0, 1000))
def test_placed_by_token_load_or_divided_every_group_is_trained_once_within_eta(placement, eta, engines, seed):
    """A group completed twice would find its lease gone (the simulation raises); one lost would stall the run."""
    result = simulate(scenario(seed=seed, job={"max_staleness": eta}, split={"rollout": engines}, placement=placement))
    assert result.steps == 30 and result.samples == 30 * 8 * 4
    assert len(result.staleness_counts) <= eta + 1
