"""The staleness rebalancer's policy: each rule alone, then its behaviour against a toy plant over time."""

import itertools
from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from areal_k8s.common.rebalance import (
    Limits,
    Settings,
    Split,
    State,
    Totals,
    Verdict,
    Window,
    advance,
    decide,
    observe,
    toward_rollout,
    toward_training,
)

BAND = (1.0, 2.0)
SETTINGS = Settings(band=BAND, window_seconds=60, cooldown_seconds=120)


def window(mean: float, *, samples: int = 100, trainer_idle: float = 0.0, rollout_held: float = 0.0) -> Window:
    return Window(
        seconds=60,
        samples=samples,
        mean_staleness=mean,
        within_band=0.0,
        trainer_idle=trainer_idle,
        rollout_held=rollout_held,
        trained_per_second=samples / 60,
        accepted_groups_per_second=1.0,
    )


def test_inside_the_band_nothing_moves():
    decision, _ = decide(window(1.5), Split(4, 2), Limits(), SETTINGS)
    assert (decision.split, decision.code) == (None, "WithinBand")


def test_above_the_band_with_the_trainer_busy_one_unit_moves_to_training_within_the_budget():
    limits = Limits(rollout_unit=1, trainer_unit=2, budget=10)
    decision, _ = decide(window(3.0, rollout_held=0.4), Split(6, 2), limits, SETTINGS)
    assert (decision.split, decision.code) == (Split(4, 3), "MovedToTraining")  # a trainer unit costs two engines
    assert "3.00" in decision.message and "[1, 2]" in decision.message


def test_below_the_band_with_the_trainer_waiting_one_engine_moves_to_rollout():
    decision, _ = decide(window(0.2, trainer_idle=0.3), Split(4, 2), Limits(budget=7), SETTINGS)
    assert (decision.split, decision.code) == (Split(5, 2), "MovedToRollout")  # spare budget first


def test_a_move_corrects_a_share_of_the_imbalance_it_measured():
    # the bound held 3/4 of 16 engines back: half of the 12 surplus engines go, as three trainer units of two GPUs
    surplus, _ = decide(window(3.5, rollout_held=0.75), Split(16, 2), Limits(trainer_unit=2, budget=20), SETTINGS)
    assert surplus.split == Split(10, 5)
    # the trainer waited 80% of the window: generation is 5× too slow, the pool lacks 4× itself; half of that, capped
    short, _ = decide(window(0.1, trainer_idle=0.8), Split(2, 2), Limits(max_rollout=30), SETTINGS)
    assert short.split == Split(6, 2)
    # a long move stops before a split measured on the other side of the band
    memory = (Verdict(Split(5, 2), "above", 2.6),)
    stopped, _ = decide(window(0.1, trainer_idle=0.8), Split(2, 2), Limits(max_rollout=30), SETTINGS, memory)
    assert stopped.split == Split(4, 2)


def test_with_no_spare_budget_a_trainer_unit_is_traded_for_the_engines_its_gpus_pay_for():
    limits = Limits(rollout_unit=2, trainer_unit=4, budget=16)
    assert toward_rollout(Split(4, 2), limits) == Split(6, 1)
    assert toward_rollout(Split(6, 1), limits) is None  # no spare budget, and the trainer is at its minimum
    assert toward_rollout(Split(4, 2), replace(limits, max_rollout=4)) is None  # nothing to gain


def test_a_trainer_at_its_maximum_gives_way_to_releasing_an_engine():
    limits = Limits(min_trainer=1, max_trainer=1, min_rollout=2)
    assert toward_training(Split(3, 1), limits) == Split(2, 1)
    assert toward_training(Split(2, 1), limits) is None


def test_below_the_band_while_the_bound_holds_the_pool_and_the_trainer_is_busy_the_split_stays():
    below_but_held, _ = decide(window(0.5, trainer_idle=0.1, rollout_held=0.5), Split(4, 2), Limits(), SETTINGS)
    assert (below_but_held.split, below_but_held.code) == (None, "SignalsDisagree")


def test_below_the_band_with_both_sides_waiting_one_engine_more_is_tried_and_kept_only_if_it_pays():
    """Fresh samples, the trainer waiting, the workers refused more work: the engines' queues hold the whole
    admission window (make bench-rebalance's one-engine start: a worker takes 24 groups, 192 samples, for an engine
    that runs 128 at once). The bound looks full, but another engine would finish the window sooner."""
    limits = Limits(budget=3)
    starved = replace(window(0.7, trainer_idle=0.6, rollout_held=0.9), trained_per_second=71.0)
    decision, memory = decide(starved, Split(1, 1), limits, SETTINGS)
    assert (decision.split, decision.code) == (Split(2, 1), "MovedToRollout")
    assert "the trainer waits for data" in decision.message and memory[-1].latency_bound
    faster = replace(window(1.2, trainer_idle=0.3, rollout_held=0.9), trained_per_second=82.0)
    kept, _ = decide(faster, Split(2, 1), limits, SETTINGS, memory)
    assert kept.code == "WithinBand"
    slower = replace(window(0.8, trainer_idle=0.5, rollout_held=0.9), trained_per_second=60.0)
    back, _ = decide(slower, Split(2, 1), limits, SETTINGS, memory)
    assert (back.split, back.code) == (Split(1, 1), "MovedToTraining")


def latency_bound(rate: float, **fields) -> Window:
    """Above the band while the trainer waits: samples old because each takes long to generate."""
    return replace(window(3.8, trainer_idle=0.5, rollout_held=0.8, **fields), trained_per_second=rate)


def test_latency_bound_it_probes_one_unit_toward_rollout():
    decision, memory = decide(latency_bound(2.0), Split(4, 2), Limits(budget=12), SETTINGS)
    assert (decision.split, decision.code) == (Split(5, 2), "MovedToRollout")  # one unit, however idle the trainer
    assert memory[-1].latency_bound and memory[-1].wants == "rollout" and memory[-1].trained_per_second == 2.0


def test_latency_bound_it_goes_on_only_while_more_rollout_pays():
    memory = (Verdict(Split(4, 2), "above", 3.8, latency_bound=True, trained_per_second=2.0),)
    paid, _ = decide(latency_bound(2.5), Split(5, 2), Limits(budget=12), SETTINGS, memory)
    assert (paid.split, paid.code) == (Split(6, 2), "MovedToRollout")
    flat, _ = decide(latency_bound(2.05), Split(5, 2), Limits(budget=12), SETTINGS, memory)  # under 5% more
    assert (flat.split, flat.code) == (None, "LatencyBound")
    assert "max_staleness" in flat.message
    lost, _ = decide(latency_bound(1.5), Split(5, 2), Limits(budget=12), SETTINGS, memory)
    assert (lost.split, lost.code) == (Split(4, 2), "MovedToTraining")  # the probe cost throughput: back
    assert "trained faster" in lost.message
    # back where it came from, the split it probed is remembered as no faster: it stays
    memory += (Verdict(Split(5, 2), "above", 3.8, latency_bound=True, trained_per_second=1.5),)
    back, _ = decide(latency_bound(2.0), Split(4, 2), Limits(budget=12), SETTINGS, memory)
    assert (back.split, back.code) == (None, "LatencyBound")


def test_samples_as_old_as_the_bound_allows_with_both_sides_busy_hold_the_split():
    full = window(3.7, trainer_idle=0.1, rollout_held=0.1)  # η = 4: the bound is full, and nobody waits
    decision, _ = decide(full, Split(4, 2), Limits(budget=12), replace(SETTINGS, max_staleness=4))
    assert (decision.split, decision.code) == (None, "LatencyBound")
    behind, _ = decide(
        replace(full, rollout_held=0.6), Split(4, 2), Limits(budget=12), replace(SETTINGS, max_staleness=4)
    )
    assert behind.code == "MovedToTraining"  # the bound holds the pool: the trainer is behind, as usual


def test_with_the_bound_full_the_throughput_tells_two_splits_apart():
    memory = (Verdict(Split(4, 3), "above", 3.8, latency_bound=True, trained_per_second=2.0),)
    busy = replace(window(3.8, trainer_idle=0.05, rollout_held=0.9), trained_per_second=2.4)  # the trainer is behind
    full = replace(SETTINGS, max_staleness=4)
    decision, _ = decide(busy, Split(5, 2), Limits(budget=7), full, memory)
    assert (decision.split, decision.code) == (None, "LatencyBound")  # the split toward training measured slower
    slower, _ = decide(replace(busy, trained_per_second=1.6), Split(5, 2), Limits(budget=7), full, memory)
    assert (slower.split, slower.code) == (Split(4, 3), "MovedToTraining")  # the faster split, back
    # without η the staleness reads as usual: the split toward training asked for rollout, so the balance is between
    bracketed, _ = decide(busy, Split(5, 2), Limits(budget=7), SETTINGS, memory)
    assert (bracketed.split, bracketed.code) == (None, "BandBetweenSplits")


def test_at_the_limits_it_says_so():
    decision, _ = decide(window(0.2, trainer_idle=0.9), Split(4, 1), Limits(max_rollout=4), SETTINGS)
    assert (decision.split, decision.code) == (None, "AtLimit")
    assert "4 rollout / 1 trainer" in decision.message


def test_too_few_samples_give_no_verdict_and_leave_the_memory_alone():
    memory = (Verdict(Split(4, 2), "above", 3.0),)
    decision, kept = decide(window(0.0, samples=3), Split(4, 2), Limits(), replace(SETTINGS, min_samples=10), memory)
    assert (decision.split, decision.code, kept) == (None, "CollectingData", memory)


def test_a_band_between_two_splits_is_recognised_and_the_split_stays():
    memory = (Verdict(Split(5, 2), "above", 2.6),)  # one engine more was too stale
    decision, memory = decide(window(0.7, trainer_idle=0.3), Split(4, 2), Limits(budget=8), SETTINGS, memory)
    assert (decision.split, decision.code) == (None, "BandBetweenSplits")
    assert Verdict(Split(4, 2), "below", 0.7, trained_per_second=100 / 60) in memory


def test_responses_of_another_length_mean_drift_and_clear_the_memory():
    memory = (Verdict(Split(5, 2), "above", 2.6, tokens_per_sample=400.0),)
    longer = replace(window(0.7, trainer_idle=0.3), tokens_per_sample=600.0)  # without the drift: BandBetweenSplits
    decision, memory = decide(longer, Split(4, 2), Limits(budget=8), SETTINGS, memory)
    assert (decision.split, decision.code) == (Split(5, 2), "MovedToRollout")
    assert memory == (Verdict(Split(4, 2), "below", 0.7, 600.0, trained_per_second=100 / 60),)


def test_a_split_that_measures_differently_than_before_means_drift_and_clears_the_memory():
    memory = (Verdict(Split(5, 2), "above", 2.6), Verdict(Split(4, 2), "below", 0.9))
    decision, memory = decide(window(0.2, trainer_idle=0.3), Split(4, 2), Limits(budget=8), SETTINGS, memory)
    assert (decision.split, decision.code) == (Split(5, 2), "MovedToRollout")
    assert memory == (Verdict(Split(4, 2), "below", 0.2, trained_per_second=100 / 60),)


def totals(
    at: float,
    samples: int,
    staleness: list[int],
    wait: float = 0.0,
    held: float = 0.0,
    accepted: int = 0,
    workers: int = 2,
) -> Totals:
    return Totals(
        at=at,
        trained_samples=samples,
        trained_tokens=100 * samples,
        staleness_sum=float(sum(s * n for s, n in enumerate(staleness))),
        staleness_counts=tuple(staleness),
        trainer_wait_seconds=wait,
        held_by_staleness_seconds=held,
        accepted_groups=accepted,
        workers=workers,
    )


def test_a_window_is_the_difference_of_two_snapshots_of_the_totals():
    seen = observe(totals(100, 10, [10], wait=5), totals(160, 40, [12, 10, 8], wait=20, held=30, accepted=12), BAND)
    assert seen.samples == 30
    assert seen.mean_staleness == pytest.approx((10 + 16) / 30)
    assert seen.within_band == pytest.approx(18 / 30)
    assert seen.trainer_idle == pytest.approx(15 / 60)
    assert seen.rollout_held == pytest.approx(30 / (60 * 2))  # worker-seconds over the workers' time
    assert (seen.trained_per_second, seen.accepted_groups_per_second) == (0.5, 0.2)


def test_advance_waits_out_the_window_then_the_cooldown_after_a_change():
    state, limits = State(Split(4, 1)), Limits(budget=8)
    state, decision = advance(state, totals(0, 0, [0]), limits, SETTINGS)
    assert decision is None and state.window_start.at == 0
    state, decision = advance(state, totals(30, 25, [25], wait=15), limits, SETTINGS)
    assert decision is None  # half a window
    state, decision = advance(state, totals(60, 50, [50], wait=15), limits, SETTINGS)  # fresh, the trainer idle 1/4
    assert (decision.code, state.split, state.last_change_at) == ("MovedToRollout", Split(5, 1), 60)
    state, decision = advance(state, totals(170, 150, [150], wait=80), limits, SETTINGS)
    assert decision is None and state.window_start.at == 170  # settling: the window restarts once the cooldown ends
    state, decision = advance(state, totals(190, 170, [170], wait=90), limits, SETTINGS)
    assert decision is None and state.window_start.at == 190
    state, decision = advance(state, totals(250, 230, [170, 30, 30], wait=90), limits, SETTINGS)
    assert (decision.code, state.split) == ("WithinBand", Split(5, 1))


def test_a_window_without_enough_samples_stays_open():
    state = State(Split(4, 1), window_start=totals(0, 0, [0]))
    state, decision = advance(state, totals(60, 2, [2]), Limits(), replace(SETTINGS, min_samples=5))
    assert decision.code == "CollectingData" and state.window_start.at == 0
    state, decision = advance(state, totals(90, 8, [2, 3, 3]), Limits(), replace(SETTINGS, min_samples=5))
    assert decision.code == "WithinBand"


# -- against a toy plant -----------------------------------------------------------------------------------------

ETA = 4


class Plant:
    """A job whose balance follows the split: each engine produces `per_engine` samples/s, each trainer unit
    trains `per_trainer`. The faster side waits; staleness grows with the ratio, from 0 to η."""

    def __init__(self, per_engine: float, per_trainer: float):
        self.per_engine, self.per_trainer = per_engine, per_trainer
        self.at, self.samples, self.staleness_sum, self.wait, self.held = 0.0, 0, 0.0, 0.0, 0.0
        self.tokens, self.tokens_per_sample = 0, 100
        self.trained = 0.0  # samples trained, fractions included: a slow job still finishes one now and then

    def run(self, split: Split, seconds: float) -> Totals:
        produced, consumable = split.rollout * self.per_engine, split.trainer * self.per_trainer
        ratio = produced / consumable
        self.trained += min(produced, consumable) * seconds
        finished = int(self.trained) - self.samples
        self.samples += finished
        self.tokens += finished * self.tokens_per_sample
        self.staleness_sum += finished * ETA * ratio / (1 + ratio)
        self.wait += max(0.0, 1 - ratio) * seconds
        self.held += max(0.0, 1 - 1 / ratio) * seconds * split.rollout
        self.at += seconds
        return Totals(
            at=self.at,
            trained_samples=self.samples,
            trained_tokens=self.tokens,
            staleness_sum=self.staleness_sum,
            staleness_counts=(),
            trainer_wait_seconds=self.wait,
            held_by_staleness_seconds=self.held,
            accepted_groups=0,
            workers=split.rollout,
        )


def drive(plant: Plant, state: State, limits: Limits, policy: Settings, ticks: int) -> tuple[State, list[Split]]:
    visited = [state.split]
    for _ in range(ticks):
        state, decision = advance(state, plant.run(state.split, 10), limits, policy)
        if decision is not None and decision.split is not None:
            assert limits.allows(decision.split)
            visited.append(decision.split)
    return state, visited


rates = st.floats(min_value=0.05, max_value=5.0)
POLICY = Settings(band=(1.9, 2.1), window_seconds=30, cooldown_seconds=20)  # narrow: often between two splits
LIMITS = Limits(rollout_unit=1, trainer_unit=2, min_rollout=1, max_rollout=24, min_trainer=1, max_trainer=8, budget=32)


@settings(max_examples=150, deadline=None)
@given(per_engine=rates, per_trainer=rates, rollout=st.integers(1, 12), trainer=st.integers(1, 8))
def test_on_a_stationary_plant_the_split_never_turns_back(per_engine, per_trainer, rollout, trainer):
    start = Split(rollout, trainer)
    if not LIMITS.allows(start):
        return
    state, visited = drive(Plant(per_engine, per_trainer), State(start), LIMITS, POLICY, ticks=600)
    assert len(visited) == len(set(visited)), f"returned to a split it left: {visited}"
    _, later = drive(Plant(per_engine, per_trainer), state, LIMITS, POLICY, ticks=200)
    assert len(later) == 1, "still moving after it settled"


@settings(max_examples=100, deadline=None)
@given(per_engine=rates, per_trainer=rates, trainer=st.integers(1, 8))
def test_with_the_whole_budget_in_use_the_moves_trade_units_and_narrow_in_on_the_band(per_engine, per_trainer, trainer):
    start = Split(LIMITS.budget - trainer * LIMITS.trainer_unit, trainer)
    _, visited = drive(Plant(per_engine, per_trainer), State(start), LIMITS, POLICY, ticks=600)
    assert all(LIMITS.gpus(s) == LIMITS.budget for s in visited if s.trainer < LIMITS.max_trainer)  # trades, not growth

    # A move may overshoot the band, but never past a split already measured on its other side: each reversal
    # narrows the bracket, as a bisection does, so the split never goes back to where it was.
    def tilt(split: Split) -> float:  # the rollout side's share of the GPUs: every step toward training lowers it
        return split.rollout * LIMITS.rollout_unit / LIMITS.gpus(split)

    low, high = 0.0, 1.0
    for before, after in itertools.pairwise(visited):
        assert low < tilt(after) < high, f"left the bracket ({low:.3f}, {high:.3f}): {visited}"
        if tilt(after) < tilt(before):
            high = min(high, tilt(before))
        else:
            low = max(low, tilt(before))


@settings(max_examples=100, deadline=None)
@given(per_engine=rates, per_trainer=rates, slowdown=st.floats(min_value=1.5, max_value=4.0))
@example(per_engine=0.25, per_trainer=0.0546875, slowdown=3.0)  # a job slowed to under one sample per tick
def test_after_responses_grow_longer_it_settles_again_in_or_around_the_band(per_engine, per_trainer, slowdown):
    plant = Plant(per_engine, per_trainer)
    state, _ = drive(plant, State(Split(8, 4)), LIMITS, POLICY, ticks=600)
    plant.per_engine /= slowdown  # longer responses: every engine produces fewer samples per second
    plant.tokens_per_sample = round(plant.tokens_per_sample * slowdown)
    state, _ = drive(plant, state, LIMITS, POLICY, ticks=1200)
    _, after = drive(plant, state, LIMITS, POLICY, ticks=200)
    assert len(after) == 1, "still moving long after the change"
    mean = measured_mean(plant, state.split)
    if mean > POLICY.band[1]:
        assert (
            toward_training(state.split, LIMITS) is None
            or measured_mean(plant, toward_training(state.split, LIMITS)) < POLICY.band[0]
        )
    elif mean < POLICY.band[0]:
        assert (
            toward_rollout(state.split, LIMITS) is None
            or measured_mean(plant, toward_rollout(state.split, LIMITS)) > POLICY.band[1]
        )


def measured_mean(plant: Plant, split: Split) -> float:
    ratio = split.rollout * plant.per_engine / (split.trainer * plant.per_trainer)
    return ETA * ratio / (1 + ratio)


class LatencyPlant:
    """Long responses: every sample takes longer to generate than η training steps, so the admission bound is
    always full and every sample trains η versions old, whatever the split. An engine's decode step slows with the
    sequences it holds (`step_base` + `per_sequence` × the bound's samples over the engines), so more engines
    shorten the generation with diminishing returns; the trainer trains `per_trainer` samples/s per unit."""

    IN_FLIGHT, TOKENS = 5_000, 1_000  # samples the bound admits; tokens per response

    def __init__(self, step_base: float, per_sequence: float, per_trainer: float):
        self.step_base, self.per_sequence, self.per_trainer = step_base, per_sequence, per_trainer
        self.at, self.samples, self.staleness_sum, self.wait, self.held = 0.0, 0, 0.0, 0.0, 0.0

    def rates(self, split: Split) -> tuple[float, float]:
        step = self.step_base + self.per_sequence * self.IN_FLIGHT / split.rollout
        return self.IN_FLIGHT / (self.TOKENS * step), split.trainer * self.per_trainer

    def rate(self, split: Split) -> float:
        return min(self.rates(split))

    def run(self, split: Split, seconds: float) -> Totals:
        generated, trainable = self.rates(split)
        trained = min(generated, trainable) * seconds
        self.samples += int(trained)
        self.staleness_sum += int(trained) * ETA
        self.wait += (1 - min(generated, trainable) / trainable) * seconds
        self.held += (1 - min(generated, trainable) / generated) * seconds * split.rollout
        self.at += seconds
        return Totals(
            at=self.at,
            trained_samples=self.samples,
            trained_tokens=self.samples * self.TOKENS,
            staleness_sum=self.staleness_sum,
            staleness_counts=(),
            trainer_wait_seconds=self.wait,
            held_by_staleness_seconds=self.held,
            accepted_groups=0,
            workers=split.rollout,
        )


@settings(max_examples=100, deadline=None)
@given(
    step_base=st.floats(min_value=1e-3, max_value=0.05),
    per_sequence=st.floats(min_value=1e-6, max_value=1e-3),
    per_trainer=st.floats(min_value=0.5, max_value=50.0),
    trainer=st.integers(1, 8),
)
def test_latency_bound_it_settles_no_slower_than_it_started(step_base, per_sequence, per_trainer, trainer):
    plant, policy = LatencyPlant(step_base, per_sequence, per_trainer), replace(POLICY, max_staleness=ETA)
    start = Split(LIMITS.budget - trainer * LIMITS.trainer_unit, trainer)
    state, visited = drive(plant, State(start), LIMITS, policy, ticks=1200)
    _, later = drive(plant, state, LIMITS, policy, ticks=200)
    assert len(later) == 1, f"still moving after it settled: {visited} then {later}"
    # A probe that did not pay is undone, so the split it keeps trains at least about as fast as where it started
    assert plant.rate(state.split) >= plant.rate(start) * (1 - policy.gain_tolerance), visited
    assert len(visited) - len(set(visited)) <= 1, f"more than one step back: {visited}"
