"""`make gpu-check` (scripts/gpu_check.py) in its CPU form: every part runs for real at tiny sizes (the megatron and
torch backends, bench/logprob_memory.py, our engine's process, an `arealctl run`), so the script a lent GPU runs
cannot rot where none is. Its results are complete and sane; no timing is asserted (speed lives in the file)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from areal_k8s.common.config import JobFileError
from areal_k8s.simulator.calibration import COSTS
from areal_k8s.simulator.scenario import load_scenario

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))  # the parts import each other as the script's folder's modules
import gpu_check_profile  # noqa: E402

PARTS = ["models", "megatron", "torch", "logprobs", "engine", "run"]


def gpu_check(work: Path, *options: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--work", str(work), "--out", str(work / "out.json")]
    return subprocess.run([*command, *options], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> tuple[dict, str, Path]:
    """The CPU form, its parts five at a time (its timings mean nothing, so they may share the cores)."""
    work = tmp_path_factory.mktemp("gpu-check")
    result = gpu_check(work, "--jobs", "5")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((work / "out.json").read_text()), result.stdout, work / "out.json"


def test_every_part_runs_and_passes_its_checks(checked):
    report, table, _ = checked
    assert list(report["parts"]) == PARTS
    for name, part in report["parts"].items():
        assert part["status"] == "ok", (name, part.get("error"))
        assert all(part.get("checks", {}).values()), name
    assert report["device"] == "cpu" and report["cuda"] is None and report["torch"]
    for name in PARTS:
        assert any(line.startswith(f"{name} ") and " ok " in line for line in table.splitlines()), table


def test_both_trainer_backends_score_as_hugging_face_and_report_their_speed(checked):
    report, _, _ = checked
    sizes = report["sizes"]
    for backend in ("megatron", "torch"):
        part = report["parts"][backend]
        assert part["precision"] == "fp32" and part["tolerance"] == 1e-4
        assert max(part["max_logprob_error_initial"], part["max_logprob_error_trained"]) <= 1e-4
        assert part["grad_norm"] > 0
        assert [t["length"] for t in part["throughput"]] == sizes["train_lengths"]
        for speed in part["throughput"]:
            assert speed["tokens_per_second"] > 0 and speed["rows"] * speed["length"] <= sizes["train_tokens"]
            assert speed["mfu"] is None  # no dense bf16 peak is known for a CPU
        assert part["peak_memory_mib"] > 0
        assert part["max_logprob_error_fast"] <= 1e-4  # packed rows, no checkpointing: the same log-probabilities
    assert all(report["parts"][backend]["activation_checkpointing"] for backend in ("megatron", "torch"))


def test_both_trainer_backends_measure_their_speed_matrix_and_profile_a_step(checked):
    """The speed matrix (scripts/gpu_check_speed.py): the planned configurations in order, each measured (or skipped
    for the time left, never the first two), on both models; the first run's path and the fast one profiled, their
    time split by what the model computes (scripts/gpu_check_profile.py)."""
    import gpu_check
    import gpu_check_speed

    report, _, _ = checked
    sizes = gpu_check.SIZES["cpu"]
    planned = gpu_check_speed.plan(sizes)
    for backend in ("megatron", "torch"):
        speed = report["parts"][backend]["speed"]
        assert [(m["model"], m["length"], m["rows"], m["variant"]) for m in speed] == [
            (p.model, p.length, p.rows, p.variant) for p in planned
        ]
        assert all(m["status"] in ("ok", "skipped") for m in speed) and speed[0]["status"] == speed[1]["status"] == "ok"
        for m in speed:
            if m["status"] == "ok":
                assert m["tokens"] == sum(gpu_check_speed.row_lengths(m["length"], m["rows"], sizes.speed_tokens))
                assert m["tokens_per_second"] > 0 and m["mfu"] is None and m["peak_memory_mib"] > 0
        assert {m["model"] for m in speed} == {name for name, _ in sizes.speed_models}
        for measured in speed[:2]:
            profile = measured["profile"]
            assert set(profile["seconds"]) == set(gpu_check_profile.CATEGORIES)
            # the model's own work is found where it is: the layers, the log-probabilities, the optimizer
            assert min(profile["seconds"][name] for name in ("attention", "mlp", "logprobs", "optimizer")) > 0
            assert profile["busy_seconds"] <= profile["step_seconds"] + 1e-3
        # activation checkpointing recomputes in the backward: the first run's path does, the fast one not
        baseline, fast = (m["profile"]["seconds"]["recompute"] for m in speed[:2])
        assert baseline > 0 and fast == 0, (baseline, fast)


def test_in_bf16_the_trained_weights_are_compared_as_the_engines_receive_them(tmp_path):
    """bf16 over float32 master weights, from a model saved in bfloat16 (as on a GPU): one step at the check's
    learning rate moves most weights by less than half a bfloat16 spacing, so the backend's bf16 forward sees little of
    it. Its exported weights, rounded to the dtype pushed to the engines, score the batch as it does; the float32
    master weights themselves would not (the first GPU run's failure). The torch backend: the megatron one's bf16
    backward runs on CUDA only."""
    import gpu_check
    from areal_k8s_testing.random_qwen2 import Qwen2Shape
    from gpu_check_training import trainer_part

    sizes = dataclasses.replace(
        gpu_check.SIZES["cpu"],
        model=Qwen2Shape(hidden=256, intermediate=512, layers=4, heads=4, kv_heads=2),
        model_dtype="bfloat16",
        precision="bf16",
        engine_dtype="bfloat16",
        train_lengths=(32,),
    )
    gpu_check.build_model(sizes, tmp_path / "model")
    part = trainer_part("torch", "cpu", sizes, tmp_path / "model", tmp_path)
    assert all(part["checks"].values()), part
    assert part["pushed_dtype"] == "bfloat16" and part["max_master_weight_change"] > 0
    assert part["max_logprob_error_trained"] <= part["tolerance"] < part["max_logprob_error_vs_master_weights"]


def test_a_rerun_of_some_parts_keeps_the_others_from_the_results_file_it_replaces(checked, tmp_path):
    """What `--parts` writes: the parts it ran over those of the file it replaces, where that file was written on
    the same kind of device at the same sizes; else the rerun's parts alone."""
    import gpu_check

    report, _, results = checked
    rerun = {**report, "parts": {"models": {"status": "ok", "parameters": 1, "dtype": "float32", "seconds": 1.0}}}
    merged = gpu_check.with_earlier_parts(rerun, results)
    assert list(merged["parts"]) == PARTS and merged["reran"] == ["models"]
    assert merged["parts"] == {**report["parts"], "models": rerun["parts"]["models"]}
    again = gpu_check.with_earlier_parts({**rerun, "parts": {"run": report["parts"]["run"]}}, write(tmp_path, merged))
    assert again["reran"] == ["models", "run"]  # an earlier rerun's parts stay named
    elsewhere = {**rerun, "device": "NVIDIA H100 80GB HBM3"}
    assert gpu_check.with_earlier_parts(elsewhere, results) == elsewhere
    # a part whose own sizes changed is not kept; the others are
    resized = {**rerun, "sizes": {**report["sizes"], "engine_batches": [1, 2]}}
    assert list(gpu_check.with_earlier_parts(resized, results)["parts"]) == [n for n in PARTS if n != "engine"]


def write(folder: Path, report: dict) -> Path:
    path = folder / "gpu_check.json"
    path.write_text(json.dumps(report))
    return path


def test_the_logprob_part_compares_full_and_chunked_logits_with_and_without_the_backward(checked):
    report, _, _ = checked
    part = report["parts"]["logprobs"]
    chunk = report["sizes"]["logprob_chunk"]
    assert [(r["backward"], r["chunk"]) for r in part["runs"]] == [
        (False, None),
        (False, chunk),
        (True, None),
        (True, chunk),
    ]
    assert all(r["peak_mib"] is not None for r in part["runs"])
    assert all(r["max_value_difference"] <= 1e-4 for r in part["runs"] if r["chunk"])


def test_the_engine_cost_model_is_fitted_to_every_experiment_and_a_scenario_loads_it(checked, tmp_path):
    report, _, results = checked
    sizes, part = report["sizes"], report["parts"]["engine"]
    grid = [(batch, sizes["engine_context"]) for batch in sizes["engine_batches"]]
    grid += [(sizes["engine_context_batch"], context) for context in sizes["engine_contexts"]]
    assert [(e["batch"], e["context"]) for e in part["experiments"]] == grid
    for experiment in part["experiments"]:
        # every request decodes after its prefill samples its first token
        assert experiment["decode_rows"] == experiment["batch"] * (sizes["engine_steps"] - 1)
        assert experiment["prefill_tokens"] >= experiment["batch"] * experiment["context"]
    assert all(part["cost_model"][cost] >= 0 for cost in COSTS) and part["cost_model"]["prefill_per_token_seconds"] > 0
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump({"split": {"rollout": 1}, "engine": {"measured": str(results), "threads": 2}}))
    engine = load_scenario(scenario).engine
    assert {cost: getattr(engine, cost) for cost in COSTS} == {cost: part["cost_model"][cost] for cost in COSTS}
    assert engine.threads == 2  # what the scenario says beside `measured` stays


def test_the_run_trains_every_step_and_verifies_every_push_over_gloo(checked):
    report, table, _ = checked
    part = report["parts"]["run"]
    assert part["steps"] == part["pushes_verified"] == report["sizes"]["run_steps"] == 10
    assert part["push_bytes"] > 0 and part["arealctl_exit"] == 0
    assert "NCCL needs two GPUs" in part["weight_sync"]
    assert "pushes verified over gloo (NCCL needs two GPUs)" in table


def test_a_failing_part_is_reported_in_one_line_and_the_next_one_still_runs(tmp_path):
    """Without the models part the engine and run parts have no model: each fails with its reason, one line each,
    and the check exits non-zero with both in its results."""
    result = gpu_check(tmp_path, "--parts", "engine", "run")
    assert result.returncode == 1
    parts = json.loads((tmp_path / "out.json").read_text())["parts"]
    for name in ("engine", "run"):
        assert parts[name]["status"] == "failed"
        assert parts[name]["error"].startswith("RuntimeError: no model: the models part did not build one")
        assert f"{name:<9} failed    RuntimeError: no model" in result.stdout


def test_a_scenario_naming_results_without_an_engine_fit_is_refused_in_one_line(tmp_path):
    results = tmp_path / "gpu_check.json"
    results.write_text(json.dumps({"parts": {"engine": {"status": "timed out", "error": "no result within 90 s"}}}))
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump({"split": {"rollout": 1}, "engine": {"measured": "gpu_check.json"}}))
    with pytest.raises(
        JobFileError, match=r"engine\.measured: .*its engine part did not run \(no result within 90 s\)"
    ):
        load_scenario(scenario)


def test_the_docs_and_readme_carry_the_committed_gpu_run_as_measured():
    import gpu_check

    report = json.loads(gpu_check.RESULTS.read_text())
    assert report["cuda"] and report["device"] != "cpu"
    assert gpu_check.doc_block(report) in gpu_check.DOC.read_text(), "run `python scripts/gpu_check.py --readme`"
    assert gpu_check.readme_block(report) in gpu_check.README.read_text(), "run `python scripts/gpu_check.py --readme`"
