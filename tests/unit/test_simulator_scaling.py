"""The costs that scale with the model: tensor parallelism's all-reduces and an engine's smallest TP, the pipeline's
bubble, the trainer's efficiency read from measurements at their model size, the reward's verification time, and
one parameter set's rows (each checked against values computed by hand or published)."""

import math
from pathlib import Path

import pytest

from areal_k8s.common.config import JobFileError
from areal_k8s.simulator.costs import GpuCosts, Measurement, engine_costs, engine_tp, measured_mfu, trainer_costs
from areal_k8s.simulator.parallel import all_reduce_bytes_per_token, pipeline_bubble, smallest_tp
from areal_k8s.simulator.rows import RowError, expand_row
from areal_k8s.simulator.scenario import Reward, load_scenario

ROOT = Path(__file__).resolve().parents[2]
TABLE1 = ROOT / "bench" / "scenarios" / "areal-table1.yaml"
QWEN_32B = {"name": "32b", "parameters": 32.8e9, "layers": 64, "hidden": 5120, "kv_heads": 8, "head_dim": 128}
H800 = {"name": "H800", "flops": 989.4e12, "memory_bytes_per_second": 3.35e12, "memory_bytes": 80e9}


def gpu(model=QWEN_32B, **parallelism) -> GpuCosts:
    return GpuCosts.model_validate(
        {
            "sources": ["s"],
            "hardware": H800,
            "model": model,
            "efficiency": {
                "decode_bandwidth": 0.7,
                "decode_step_overhead_seconds": 0.002,
                "decode_flops": 0.5,
                "prefill_flops": 0.5,
                "train_flops": 0.44,
                "kv_memory_fraction": 0.7,
            },
            "parallelism": parallelism,
        }
    )


def test_a_ring_all_reduce_moves_2_tp_minus_1_over_tp_of_the_hidden_state_twice_a_layer():
    assert all_reduce_bytes_per_token(5120, 2, 1) == 0.0
    assert math.isclose(all_reduce_bytes_per_token(5120, 2, 8), 2 * 2 * 7 / 8 * 5120 * 2)


def test_the_pipeline_bubble_is_stages_minus_one_over_microbatches_plus_stages_minus_one():
    assert pipeline_bubble(1, 4) == 0.0
    assert math.isclose(pipeline_bubble(8, 25), 7 / 32)
    with pytest.raises(ValueError):
        pipeline_bubble(4, 0)


def test_a_32b_engine_does_not_fit_one_h800_and_takes_the_smallest_tp_that_holds_weights_and_kv():
    # 65.6 GB of weights against 56 GB (70 % of 80): TP 1 cannot; TP 2 holds 32.8 GB a GPU and 23.2 GB of KV cache,
    # 131 kB a token a GPU (4 of 8 KV heads, 64 layers, 128 wide, key and value, 2 bytes): 177k tokens >= 32k
    assert engine_tp(gpu()) == 2
    assert engine_tp(gpu(engine_min_kv_tokens=200_000)) == 4
    with pytest.raises(ValueError, match="do not fit"):
        smallest_tp(1e12, 1, 1, 80e9, 0.7, 1, 8)
    costs = engine_costs(gpu())
    assert costs["kv_capacity_tokens"] == int((56e9 - 32.8e9) // (2 * 64 * 128 * 2 * 4))
    bandwidth = 3.35e12 * 0.7
    latency = 64 * 2 * 10e-6  # two all-reduces a layer, each step
    assert math.isclose(costs["step_base_seconds"], 65.6e9 / 2 / bandwidth + 0.002 + latency)
    link = 64 * 2 * (2 * 1 / 2) * 5120 * 2 / 400e9  # every token's hidden state through both all-reduces a layer
    assert math.isclose(costs["step_per_sequence_seconds"], 2 * 32.8e9 / (2 * 989.4e12 * 0.5) + link)


def test_the_trainers_efficiency_comes_from_measurements_at_their_model_size_and_its_bubble_is_charged():
    points = [Measurement(parameters=1e9, mfu=0.2, source="a"), Measurement(parameters=100e9, mfu=0.4, source="b")]
    assert measured_mfu(points, 10e9) == pytest.approx(0.3)  # halfway in log parameters
    assert measured_mfu(points, 1e6) == 0.2 and measured_mfu(points, 1e12) == 0.4  # the nearest beyond them
    with pytest.raises(ValueError, match="no training efficiency"):
        measured_mfu([], 1e9)
    flat, piped = trainer_costs(gpu()), trainer_costs(gpu(trainer_pp=8, microbatch_tokens=1000), 4 * 6 * 25_000, 6)
    assert math.isclose(flat["gpu_seconds_per_token"], 8 * 32.8e9 / (989.4e12 * 0.44))
    # 25 microbatches per minibatch and rank: a bubble of 7/32
    assert math.isclose(piped["gpu_seconds_per_token"], flat["gpu_seconds_per_token"] / (1 - 7 / 32))


def test_a_groups_verification_time_is_its_samples_over_the_engines_reward_workers():
    code = Reward(seconds_per_sample=0.026, tests_per_sample=20, seconds_per_test=0.5, workers_per_gpu=2)
    assert math.isclose(code.group_seconds(16, 1), 8 * 10.026)  # 16 samples on 2 workers: 8 rounds
    assert math.isclose(code.group_seconds(16, 8), 10.026)  # an engine of 8 GPUs has 16 workers


def test_a_row_is_the_shared_parameters_its_familys_and_its_own_merged_and_a_bad_row_is_one_clear_line():
    data = {"name": "p", "a": {"x": 1, "y": 2}, "families": {"f": {"a": {"y": 3}}}, "rows": {"r": {"family": "f"}}}
    assert expand_row(data, "r") == {"name": "p-r", "a": {"x": 1, "y": 3}}
    assert expand_row({"name": "plain"}, None) == {"name": "plain"}
    for row, message in ((None, "name one of r"), ("q", "no row 'q'")):
        with pytest.raises(RowError, match=message):
            expand_row(data, row)
    with pytest.raises(JobFileError, match=r"rows: 1\.5b, 7b, 14b, 32b"):
        load_scenario(TABLE1, "70b")


def test_the_table_1_rows_derive_their_engines_trainer_push_and_reward_from_one_parameter_set():
    rows = {row: load_scenario(TABLE1, row) for row in ("1.5b", "7b", "14b", "32b")}
    assert [s.resources.rollout_unit_gpus for s in rows.values()] == [1, 1, 1, 2]  # the 32B needs two H800s
    for s in rows.values():  # AReaL's 75:25, in GPUs
        assert s.split.rollout * s.resources.rollout_unit_gpus == 3 * s.split.trainer * s.resources.trainer_unit_gpus
    assert rows["14b"].workload.completion_seconds > 60 > rows["7b"].workload.completion_seconds  # code's tests
    pushes = [s.push.seconds for s in rows.values()]
    assert pushes == sorted(pushes) and math.isclose(pushes[0], 5 + 3.56)  # 5 s + 3.56 GB at 1 GB/s
    per_token = [s.trainer.gpu_seconds_per_token for s in rows.values()]
    assert per_token == sorted(per_token)
