"""The simulator's parts on their own: an engine's continuous batch in a bounded KV cache (it never overfills, it
retracts and finishes every sequence, busy is decoded tokens over its KV-limited capacity), the response-length
model, the GPU costs from first principles, and the workers' pulls through the controller's own admission."""

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_k8s.controller.core import ControllerCore
from areal_k8s.cpu_engine.decoding import joining_count
from areal_k8s.data.dataset import DatasetItem
from areal_k8s.simulator.costs import GpuCosts, engine_costs, trainer_costs
from areal_k8s.simulator.engine import Engine, Sequence, capacity_rate
from areal_k8s.simulator.lengths import capped_share, group_lengths, mean_length
from areal_k8s.simulator.placement import ORDERS, Divided, Pulls, spread
from areal_k8s.simulator.scenario import EngineCost, Lengths, Scenario

COST = {"step_base_seconds": 0.01, "step_per_sequence_seconds": 1e-4, "step_per_context_token_seconds": 1e-7}


def drain(engine: Engine, limit: int = 100_000) -> dict[str, list[Sequence]]:
    """Run the engine's batch stop by stop until it holds nothing; every stop keeps the cache within its size."""
    done: dict[str, list[Sequence]] = {}
    cap = engine.cost.kv_capacity_tokens
    for _ in range(limit):
        if not engine.batch and not engine.waiting:
            return done
        assert engine.batch, "sequences wait while the batch is empty: nothing can make room"
        for group, sequences in engine.apply(engine.walk()):
            assert group not in done
            done[group] = sequences
        assert cap is None or engine.context() <= cap
    raise AssertionError("the engine did not drain")


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(st.lists(st.integers(1, 400), min_size=1, max_size=6), min_size=1, max_size=6),
    prompt=st.integers(1, 100),
    capacity=st.integers(600, 4000),
    reserve=st.integers(0, 20),
)
def test_a_bounded_cache_never_overfills_and_every_sequence_finishes_once(groups, prompt, capacity, reserve):
    engine = Engine("e", EngineCost(**COST, kv_capacity_tokens=capacity, kv_reserve_tokens=reserve), 0, 100.0)
    for g, lengths in enumerate(groups):
        engine.add_group(f"g{g}", [Sequence(f"g{g}", prompt, n) for n in lengths])
    done = drain(engine)
    assert sorted(done) == sorted(f"g{g}" for g in range(len(groups)))
    for g, lengths in enumerate(groups):  # a retracted sequence keeps its tokens and finishes at its length
        assert sorted(sum(q.tokens_by_version.values()) for q in done[f"g{g}"]) == sorted(lengths)
    assert engine.decoded == sum(map(sum, groups))


def test_a_full_cache_retracts_the_least_advanced_sequences_and_they_finish_later():
    cost = EngineCost(**COST, kv_capacity_tokens=2000, kv_reserve_tokens=0)
    engine = Engine("e", cost, 0, 100.0)
    engine.add_group("a", [Sequence("a", 100, 900) for _ in range(4)])  # 4 × 1,000 tokens cannot all fit in 2,000
    assert engine.running == 4 and engine.context() == 400
    done = drain(engine)
    assert engine.retractions >= 1 and len(done["a"]) == 4
    unbounded = Engine("u", EngineCost(**COST), 0, 100.0)
    unbounded.add_group("a", [Sequence("a", 100, 900) for _ in range(4)])
    drain(unbounded)
    assert unbounded.retractions == 0 and engine.clock > unbounded.clock  # retracting costs time


def test_an_engine_runs_at_most_its_running_requests_and_the_rest_wait_their_turn():
    """SGLang's --max-running-requests (the CPU engine's max_batch_size): sequences past it wait, join as others
    finish, and every one finishes; the batch it caps decodes fewer tokens a step, and its capacity says so."""
    capped = Engine("capped", EngineCost(**COST, max_running_requests=3), 0, 100.0)
    capped.add_group("a", [Sequence("a", 10, n) for n in (5, 50, 50, 50, 50, 50, 50)])
    assert capped.running == 3 and len(capped.waiting) == 4
    done, most = {}, 0
    while capped.batch or capped.waiting:
        most = max(most, capped.running)
        done |= dict(capped.apply(capped.walk()))
    assert most == 3 and len(done["a"]) == 7 and capped.decoded == 5 + 6 * 50
    free = Engine("free", EngineCost(**COST), 0, 100.0)
    free.add_group("a", [Sequence("a", 10, n) for n in (5, 50, 50, 50, 50, 50, 50)])
    assert free.running == 7
    drain(free)
    assert capped.clock > free.clock  # seven at once amortize the step's base cost; three at a time do not
    rate = capacity_rate(EngineCost(**COST, max_running_requests=3), 100.0)
    assert math.isclose(rate, 3 / (0.01 + 1e-4 * 3 + 1e-7 * 300))


def test_a_revoked_group_leaves_the_batch_and_its_room_goes_to_the_sequences_waiting():
    engine = Engine("e", EngineCost(**COST, max_running_requests=4), 0, 100.0)
    engine.add_group("a", [Sequence("a", 10, 500) for _ in range(3)])
    engine.add_group("b", [Sequence("b", 10, 20) for _ in range(3)])
    assert engine.running == 4 and len(engine.waiting) == 2
    engine.apply(engine.walk(0.05))
    engine.revoke("a")
    assert engine.running == 3 and not engine.waiting and engine.groups == 1
    assert all(q.group_id == "b" for _, _, q in engine.batch)
    assert engine.context() == sum(q.context_at(engine.steps) for _, _, q in engine.batch)
    assert list(drain(engine)) == ["b"]


@settings(max_examples=200, deadline=None)
@given(max_batch=st.integers(1, 64), running=st.integers(0, 64), waiting=st.integers(1, 80))
def test_waiting_sequences_join_a_batch_as_the_cpu_engine_admits_them(max_batch, running, waiting):
    """The simulated engine calibrated on the CPU engine joins waiting sequences when the CPU engine's scheduler
    would (cpu_engine/decoding.py `joining_count`: a chunk of an eighth of the batch, or all that wait, or any into
    an empty batch)."""
    running = min(running, max_batch)
    cost = EngineCost(**COST, max_running_requests=max_batch, min_join_rows=max(1, max_batch // 8))
    engine = Engine("e", cost, 0, 10.0)
    engine.batch = [(10**6, i, Sequence("r", 1, 10**6)) for i in range(running)]
    engine.waiting.extend(Sequence("w", 1, 5) for _ in range(waiting))
    assert engine.may_join(running, running) == (joining_count(max_batch - running, waiting, max_batch) > 0)


def test_busy_is_decoded_tokens_over_the_kv_limited_capacity():
    """An engine holding one sequence is nowhere near busy; one whose cache is nearly full nearly is."""
    cost = EngineCost(**COST, prefill_per_token_seconds=1e-7, kv_capacity_tokens=200_000, kv_reserve_tokens=0)
    one = Engine("one", cost, 0, 1000.0)
    one.add_group("a", [Sequence("a", 1000, 100)])
    drain(one)
    full = Engine("full", cost, 0, 1000.0)
    full.add_group("a", [Sequence("a", 1000, 100) for _ in range(170)])  # 1,000 to 1,100 tokens each: 170 of ~190
    drain(full)
    assert one.decoded / one.capacity < 0.05
    assert 0.7 < full.decoded / full.capacity <= 1.0
    # the KV-limited batch: capacity over (context + reserve) sequences, each step reading the full cache
    rate = capacity_rate(cost, 1000.0)
    assert math.isclose(rate, 200 / (0.01 + 1e-4 * 200 + 1e-7 * 200_000))


def test_lengths_are_capped_their_uncapped_mean_grows_and_a_group_shares_its_prompts_spread():
    lengths = Lengths(mean=1000, sigma=0.9, prompt_sigma=0.8, max=4000, growth_per_step=0.01)
    rng = random.Random(0)
    groups = [group_lengths(rng, lengths, 0, 16) for _ in range(400)]
    flat = [n for g in groups for n in g]
    assert all(1 <= n <= 4000 for n in flat)
    assert abs(sum(n == 4000 for n in flat) / len(flat) - capped_share(lengths, 0)) < 0.01
    assert math.isclose(mean_length(lengths, 10), 1000 * 1.01**10)
    within = sum(sum((math.log(n) - sum(map(math.log, g)) / 16) ** 2 for n in g) for g in groups) / len(flat)
    total_mean = sum(map(math.log, flat)) / len(flat)
    total = sum((math.log(n) - total_mean) ** 2 for n in flat) / len(flat)
    assert within < 0.5 * total  # most of the spread is the prompt's: siblings are alike
    uncapped = Lengths(mean=1000, sigma=0.5, max=10**9)
    sample = [n for _ in range(2000) for n in group_lengths(rng, uncapped, 0, 4)]
    assert abs(sum(sample) / len(sample) / 1000 - 1) < 0.03


def test_lengths_from_measured_groups_are_one_of_them_times_the_mean_at_its_version():
    lengths = Lengths(mean=100, growth_per_step=0.1, max=150, groups=[[0.5, 1.0, 2.0]])
    rng = random.Random(0)
    assert group_lengths(rng, lengths, 0, 3) == [50, 100, 150]  # 200 is cut at the cap
    assert group_lengths(rng, lengths, 1, 3) == [55, 110, 150]
    drawn = [n for _ in range(50) for n in group_lengths(rng, lengths, 0, 5)]  # more responses than measured
    assert set(drawn) == {50, 100, 150}
    two = Lengths(mean=100, groups=[[1.0, 1.0], [0.2, 1.8]])
    assert {tuple(group_lengths(rng, two, 0, 2)) for _ in range(50)} == {(100, 100), (20, 180)}
    with pytest.raises(ValueError, match="at least one response"):
        Lengths(groups=[[1.0], []])


def test_gpu_costs_from_a_models_shape_and_a_gpus_figures():
    gpu = GpuCosts.model_validate(
        {
            "sources": ["s"],
            "hardware": {"name": "H800", "flops": 1e15, "memory_bytes_per_second": 3e12, "memory_bytes": 80e9},
            "model": {"name": "m", "parameters": 2e9, "layers": 28, "hidden": 1536, "kv_heads": 2, "head_dim": 128},
            "efficiency": {
                "decode_bandwidth": 0.5,
                "decode_step_overhead_seconds": 0.002,
                "decode_flops": 0.5,
                "prefill_flops": 0.5,
                "train_flops": 0.4,
                "kv_memory_fraction": 0.8,
            },
        }
    )
    engine, trainer = engine_costs(gpu), trainer_costs(gpu)
    assert math.isclose(engine["step_base_seconds"], 4e9 / 1.5e12 + 0.002)  # the weights read once a step
    assert math.isclose(engine["step_per_context_token_seconds"], 28672 / 1.5e12)  # 2·28·2·128·2 bytes a token
    assert engine["kv_capacity_tokens"] == int((64e9 - 4e9) // 28672)
    assert math.isclose(trainer["gpu_seconds_per_token"], 8 * 2e9 / 4e14)


def test_pulls_go_through_the_controllers_admission_and_a_held_pull_is_served_when_room_opens():
    scenario = Scenario.model_validate(
        {"job": {"batch_size": 2, "group_size": 1, "max_staleness": 0, "total_steps": 3}, "split": {"rollout": 2}}
    )
    now = [0.0]
    items = [DatasetItem(id=f"p{i}", prompt="", reference="", verifier="exact") for i in range(8)]
    core = ControllerCore(scenario.job_config(), items, lease_seconds=math.inf, clock=lambda: now[0])
    a, b = (Engine(name, EngineCost(), 0, 10.0) for name in ("a", "b"))
    for engine in (a, b):
        core.register(engine.name, "sim", -1)
    pulls = Pulls(core, lambda: now[0])
    assert len(pulls.ask(a, 2)) == 2  # η = 0: one batch's worth, then the bound refuses
    assert pulls.ask(b, 2) == [] and pulls.held == [b]
    now[0] = 5.0
    assert pulls.open(lambda engine: 2) == []  # no room until a version goes live
    for group in list(core.outstanding()):
        core.complete(group, "accepted")
    core.announce_version(1, restored=False)
    b.set_version(1)
    served = pulls.open(lambda engine: 2)
    assert [(engine.name, len(admitted)) for engine, admitted in served] == [("b", 2)] and pulls.held == []
    assert pulls.held_seconds["staleness"] == 5.0


@settings(max_examples=60, deadline=None)
@given(
    loads=st.lists(st.floats(0, 1), min_size=1, max_size=12),
    count=st.integers(0, 64),
    each=st.floats(0.001, 0.5),
)
def test_spread_places_every_sample_each_on_an_engine_that_was_least_loaded(loads, count, each):
    places = spread(count, loads, each)
    assert len(places) == count and all(0 <= i < len(loads) for i in places)
    final = [load + each * places.count(i) for i, load in enumerate(loads)]
    for i in set(places):  # its last sample found it least loaded, and every load only grew since
        assert final[i] <= min(final) + each + 1e-9


@settings(max_examples=30, deadline=None)
@given(groups=st.lists(st.lists(st.integers(1, 300), min_size=1, max_size=8), min_size=1, max_size=6))
def test_a_divided_group_completes_once_with_all_its_samples_after_its_last_part(groups):
    cost = EngineCost(**COST, kv_capacity_tokens=5000, kv_reserve_tokens=4)
    engines = [Engine(f"e{i}", cost, 0, 100.0) for i in range(3)]
    divided = Divided()
    sequences = [[Sequence(f"g{g}", 10, n) for n in lengths] for g, lengths in enumerate(groups)]
    for engine, parts in divided.place(engines[0], sequences, engines, 0.01).items():
        for part_id, part in parts:
            engine.add_group(part_id, part)
    assert divided.held["e0"] == len(groups)
    completed = {}
    for engine in engines:
        for part_id, part in drain(engine).items():
            if whole := divided.finished(part_id, part):
                owner, group, samples = whole
                assert owner is engines[0] and group not in completed
                completed[group] = samples
                divided.completed(owner)
    assert sorted(completed) == sorted(f"g{g}" for g in range(len(groups)))
    for g, lengths in enumerate(groups):
        assert sorted(q.length for q in completed[f"g{g}"]) == sorted(lengths)
    assert divided.held["e0"] == 0 and not divided.group_of and not divided.parts_left


def test_token_load_serves_the_least_loaded_engines_held_pull_first_where_first_come_serves_the_oldest():
    scenario = Scenario.model_validate(
        {"job": {"batch_size": 2, "group_size": 1, "max_staleness": 0, "total_steps": 3}, "split": {"rollout": 3}}
    )
    cost = EngineCost(kv_capacity_tokens=10_000)
    served = {}
    for order in ("first_come", "token_load"):
        items = [DatasetItem(id=f"p{i}", prompt="", reference="", verifier="exact") for i in range(8)]
        core = ControllerCore(scenario.job_config(), items, lease_seconds=math.inf, clock=lambda: 0.0)
        a, busy, idle = (Engine(name, cost, 0, 10.0) for name in ("a", "busy", "idle"))
        for engine in (a, busy, idle):
            core.register(engine.name, "sim", -1)
        busy.add_group("other", [Sequence("other", 100, 50) for _ in range(20)])  # 2,000 tokens of its cache
        pulls = Pulls(core, lambda: 0.0, ORDERS[order])
        assert len(pulls.ask(a, 2)) == 2 and pulls.ask(busy, 2) == [] and pulls.ask(idle, 2) == []
        for group in list(core.outstanding()):
            core.complete(group, "accepted")
        core.announce_version(1, restored=False)
        for engine in (busy, idle):
            engine.set_version(1)
        served[order] = [(engine.name, len(admitted)) for engine, admitted in pulls.open(lambda engine: 2)]
    assert served == {"first_come": [("busy", 2)], "token_load": [("idle", 2)]}  # one batch of room: one pull served
