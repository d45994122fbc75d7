"""The staleness rebalancer's policy: which rollout/trainer split holds the measured staleness in its band.

Pure functions over plain values, shared by every caller (the operator, the local launcher, the simulator):
`observe` turns two snapshots of the controller's running totals into a `Window`; `decide` turns a window at a
split into a `Decision`; `advance` runs both over time with the state a caller keeps between calls (the operator
keeps it in the RLJob's status).

Why staleness tells the split: with admission bounded by η, a rollout pool faster than the trainer fills the
window ahead of it, so samples wait and arrive old (and the pool is held by the bound); a slower pool leaves the
trainer waiting for fresh samples. The mean staleness over a window is therefore a monotone signal of the
balance, and the band is where the two sides keep pace. The idle figures must agree with it before anything moves.

Where it does not: when one response takes longer to generate than several training steps (long reasoning, a
long tail of lengths), samples arrive old however fast the trainer is, and the trainer still waits for them. The
staleness then measures the generation's latency, not the balance. More engines shorten that latency only as far
as an engine's decode step slows with its batch, so in that regime the policy climbs the measured throughput
instead: one unit at a time, kept only while it raises the samples trained per second by `gain_tolerance`.

Rules, in order (each decision names its rule in `code`):
- too few samples trained in the window: hold (`CollectingData`);
- mean staleness inside the band: hold (`WithinBand`);
- below the band while the rollout pool is held by the bound and the trainer is busy: hold (`SignalsDisagree`);
- the trainer waiting for data while samples arrive above the band, or while the bound holds the pool back (below
  it: the engines' queues hold the whole admission window, as when a worker takes more groups than its engine runs
  at once), or samples about η old (the bound full): the staleness reads the generation's latency, not the
  balance, so the samples trained per second decide (`by_throughput`): a split remembered faster by
  `gain_tolerance` is taken; else one unit toward the side the other waits for, unless that split was measured
  already; else hold (`LatencyBound`: a larger η or shorter responses help, not the split);
- above the band: toward training (`MovedToTraining`); below: toward rollout (`MovedToRollout`). A move corrects
  `step_fraction` of the imbalance the window measured (the surplus the bound held back, or the shortfall the
  trainer waited for), in single-unit steps, at least one;
- no such split within the bounds and the budget: hold (`AtLimit`);
- the split a first step would reach asked for the opposite move when it was measured: the balance lies between
  the two splits, so stay (`BandBetweenSplits`); a longer move stops before such a split. Memory of past splits is
  dropped when the workload drifts: the responses' measured length moves by more than `length_tolerance`, or the
  current split's measurement moves by more than `drift_tolerance` or asks for another move; old verdicts then no
  longer hold.
After a change, `cooldown_seconds` of measurements are discarded while the pools settle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from areal_k8s.api.v1 import controller_pb2
from areal_k8s.common.config import JobConfig

ABOVE, INSIDE, BELOW = "above", "inside", "below"
TRAINING, ROLLOUT = "training", "rollout"  # the move a measured split asks for


@dataclass(frozen=True)
class Split:
    rollout: int  # rollout units: inference engines (a pod and its GPUs; locally a worker and its engine)
    trainer: int  # trainer units: data-parallel replicas (tp × pp GPUs each; locally ranks of `trainer.threads` cores)

    def __str__(self) -> str:
        return f"{self.rollout} rollout / {self.trainer} trainer"


@dataclass(frozen=True)
class Limits:
    """What each side may hold. GPUs in the cluster; cores on one machine."""

    rollout_unit: int = 1  # GPUs one rollout unit holds
    trainer_unit: int = 1  # GPUs one trainer unit holds
    min_rollout: int = 1
    max_rollout: int | None = None
    min_trainer: int = 1
    max_trainer: int | None = None
    budget: int | None = None  # GPUs the two sides may hold together; None: only the bounds apply

    def gpus(self, split: Split) -> int:
        return split.rollout * self.rollout_unit + split.trainer * self.trainer_unit

    def allows(self, split: Split) -> bool:
        return (
            self.min_rollout <= split.rollout
            and (self.max_rollout is None or split.rollout <= self.max_rollout)
            and self.min_trainer <= split.trainer
            and (self.max_trainer is None or split.trainer <= self.max_trainer)
            and (self.budget is None or self.gpus(split) <= self.budget)
        )


@dataclass(frozen=True)
class Settings:
    band: tuple[float, float]  # the mean staleness to hold, in versions: [low, high]
    window_seconds: float = 300.0  # how long each measurement runs
    cooldown_seconds: float = 600.0  # after a change, how long measurements are discarded while the pools settle
    trainer_idle_threshold: float = 0.2  # trainer waiting more than this share of the window: it waits for data
    rollout_held_threshold: float = 0.2  # workers held by the bound more than this share of their time (1: never)
    min_samples: int = 1  # fewer trained samples than this in a window: no verdict
    step_fraction: float = 0.5  # the share of the measured imbalance one decision corrects (at least one unit)
    length_tolerance: float = 0.2  # responses this much longer or shorter (relative): the workload drifted
    drift_tolerance: float | None = None  # versions; None: half the band's width (at least 0.25)
    gain_tolerance: float = 0.05  # latency-bound: a move toward rollout must raise samples/s by this share to go on
    max_staleness: int | None = None  # η: a mean within `saturation_margin` of it says the bound is full
    saturation_margin: float = 0.5

    @property
    def tolerance(self) -> float:
        if self.drift_tolerance is not None:
            return self.drift_tolerance
        return max((self.band[1] - self.band[0]) / 2, 0.25)


def settings_for(job: JobConfig) -> Settings:
    """The policy's settings from a job's `rebalance` section and its staleness band (which it must have)."""
    r, band = job.rebalance, job.algorithm.staleness_target
    return Settings(
        band=(band.min, band.max),
        window_seconds=r.window_seconds,
        cooldown_seconds=r.cooldown_seconds,
        trainer_idle_threshold=r.trainer_idle_threshold,
        rollout_held_threshold=r.rollout_held_threshold,
        min_samples=r.min_samples,
        step_fraction=r.step_fraction,
        max_staleness=job.algorithm.max_staleness,
    )


@dataclass(frozen=True)
class Totals:
    """The controller's running totals at one moment (JobStatus fields of the same names)."""

    at: float  # seconds, on the controller's clock (JobStatus.updated_at)
    trained_samples: int
    trained_tokens: int
    staleness_sum: float
    staleness_counts: tuple[int, ...]
    trainer_wait_seconds: float
    held_by_staleness_seconds: float
    accepted_groups: int
    workers: int


@dataclass(frozen=True)
class Window:
    """What happened between two snapshots of the totals."""

    seconds: float
    samples: int
    mean_staleness: float
    within_band: float  # share of the window's samples whose staleness lies in the band
    trainer_idle: float  # share of the window the trainer waited for data
    rollout_held: float  # share of the workers' time they were held by the staleness bound
    trained_per_second: float  # samples
    accepted_groups_per_second: float
    tokens_per_sample: float = 0.0  # the responses' length: what a drift of the workload changes

    def describe(self) -> str:
        return (
            f"mean staleness {self.mean_staleness:.2f} over {self.samples} samples, trainer idle "
            f"{self.trainer_idle:.0%}, rollout held by the bound {self.rollout_held:.0%}"
        )


def totals_of(report: controller_pb2.JobStatus | Mapping) -> Totals:
    """The totals of a JobStatus read from the controller, or of the controller core's own status (the same fields
    as a dict: the simulator drives a core without its gRPC shell)."""
    value = report.__getitem__ if isinstance(report, Mapping) else report.__getattribute__
    return Totals(
        at=value("updated_at"),
        trained_samples=value("trained_samples"),
        trained_tokens=value("trained_tokens"),
        staleness_sum=value("staleness_sum"),
        staleness_counts=tuple(value("staleness_counts")),
        trainer_wait_seconds=value("trainer_wait_seconds"),
        held_by_staleness_seconds=value("held_by_staleness_seconds"),
        accepted_groups=value("accepted"),
        workers=value("workers"),
    )


def observe(start: Totals, end: Totals, band: tuple[float, float]) -> Window:
    seconds = max(end.at - start.at, 1e-9)
    samples = end.trained_samples - start.trained_samples
    counts = [
        after - (start.staleness_counts[s] if s < len(start.staleness_counts) else 0)
        for s, after in enumerate(end.staleness_counts)
    ]
    in_band = sum(n for s, n in enumerate(counts) if band[0] <= s <= band[1])
    return Window(
        seconds=seconds,
        samples=samples,
        mean_staleness=(end.staleness_sum - start.staleness_sum) / samples if samples > 0 else 0.0,
        within_band=in_band / samples if samples > 0 else 0.0,
        trainer_idle=min(max((end.trainer_wait_seconds - start.trainer_wait_seconds) / seconds, 0.0), 1.0),
        rollout_held=min(
            max(
                (end.held_by_staleness_seconds - start.held_by_staleness_seconds) / (seconds * max(end.workers, 1)), 0.0
            ),
            1.0,
        ),
        trained_per_second=samples / seconds,
        accepted_groups_per_second=(end.accepted_groups - start.accepted_groups) / seconds,
        tokens_per_sample=(end.trained_tokens - start.trained_tokens) / samples if samples > 0 else 0.0,
    )


@dataclass(frozen=True)
class Verdict:
    """How a split measured, remembered to recognise a band that lies between two splits."""

    split: Split
    side: str  # above | inside | below
    mean_staleness: float
    tokens_per_sample: float = 0.0  # the workload it was measured under (0: unknown)
    latency_bound: bool = False  # the trainer waited for data, above the band or with the pool held back
    trained_per_second: float = 0.0  # samples

    @property
    def wants(self) -> str | None:
        """The move this measurement asked for: toward training, toward rollout, or none."""
        if self.side == BELOW or self.latency_bound:
            return ROLLOUT
        return TRAINING if self.side == ABOVE else None


@dataclass(frozen=True)
class Decision:
    split: Split | None  # the split to move to; None: stay
    code: str  # CamelCase: the rule that decided
    message: str
    window: Window | None = None


def side_of(mean: float, band: tuple[float, float]) -> str:
    return ABOVE if mean > band[1] else BELOW if mean < band[0] else INSIDE


def toward_training(split: Split, limits: Limits) -> Split | None:
    """One trainer unit more, with the rollout pool cut to fit the budget; at the trainer's maximum, one engine
    less (it frees its GPUs). None when neither fits."""
    if limits.max_trainer is None or split.trainer < limits.max_trainer:
        rollout = split.rollout
        if limits.budget is not None:
            spare = limits.budget - (split.trainer + 1) * limits.trainer_unit
            rollout = min(rollout, spare // limits.rollout_unit)
        grown = Split(rollout, split.trainer + 1)
        if limits.allows(grown):
            return grown
    shrunk = Split(split.rollout - 1, split.trainer)
    return shrunk if limits.allows(shrunk) else None


def toward_rollout(split: Split, limits: Limits) -> Split | None:
    """One engine more when the budget has room for it; otherwise one trainer unit less and as many engines more
    as its GPUs pay for. None when neither fits or gains an engine."""
    grown = Split(split.rollout + 1, split.trainer)
    if limits.allows(grown):
        return grown
    if limits.budget is None:
        return None
    rollout = (limits.budget - (split.trainer - 1) * limits.trainer_unit) // limits.rollout_unit
    if limits.max_rollout is not None:
        rollout = min(rollout, limits.max_rollout)
    traded = Split(rollout, split.trainer - 1)
    return traded if rollout > split.rollout and limits.allows(traded) else None


def remember(
    memory: tuple[Verdict, ...], verdict: Verdict, tolerance: float, length_tolerance: float = 0.2
) -> tuple[Verdict, ...]:
    """`memory` with `verdict` in it. The workload drifted, and every verdict is forgotten but this one, when:
    - the responses' length moved more than `length_tolerance` (relative) from the memory's first verdict;
    - or this split measures unlike it first did (the other side of the band, or `tolerance` versions away).
    The first measurements stay the reference, so a slow drift adds up until it shows."""
    reference = next((v.tokens_per_sample for v in memory if v.tokens_per_sample > 0), 0.0)
    if reference and verdict.tokens_per_sample and abs(verdict.tokens_per_sample / reference - 1) > length_tolerance:
        return (verdict,)
    before = next((v for v in memory if v.split == verdict.split), None)
    if before is None:
        return (*memory, verdict)
    if (before.side, before.wants) != (verdict.side, verdict.wants) or abs(
        before.mean_staleness - verdict.mean_staleness
    ) > tolerance:
        return (verdict,)
    return memory


def decide(
    window: Window, split: Split, limits: Limits, settings: Settings, memory: tuple[Verdict, ...] = ()
) -> tuple[Decision, tuple[Verdict, ...]]:
    """The decision for one window measured at `split`, and the memory to keep for the next."""
    band = settings.band
    if window.samples < max(settings.min_samples, 1):
        return Decision(
            None,
            "CollectingData",
            f"{window.samples} samples trained in the window, fewer than {max(settings.min_samples, 1)}: no verdict",
            window,
        ), memory
    side = side_of(window.mean_staleness, band)
    held = window.rollout_held > settings.rollout_held_threshold
    # the trainer starves while samples arrive old, or while the pool may take no more work: either way responses
    # take long to come back, and only the throughput tells whether another engine shortens that
    latency_bound = window.trainer_idle > settings.trainer_idle_threshold and (
        side == ABOVE or (side == BELOW and held)
    )
    verdict = Verdict(
        split, side, window.mean_staleness, window.tokens_per_sample, latency_bound, window.trained_per_second
    )
    memory = remember(memory, verdict, settings.tolerance, settings.length_tolerance)
    seen = window.describe()
    band_text = f"[{band[0]:g}, {band[1]:g}]"
    if side == INSIDE:
        return Decision(None, "WithinBand", f"{seen}: inside the band {band_text}", window), memory
    if side == BELOW and held and not latency_bound:
        return Decision(
            None,
            "SignalsDisagree",
            f"{seen}: below the band {band_text}, but the staleness bound holds "
            "the rollout pool back and the trainer is busy, so more rollout would not be used",
            window,
        ), memory
    # (with the held check off, as a threshold of 1 turns it, there is no signal to climb by: the staleness rules)
    saturated = (
        side == ABOVE
        and settings.max_staleness is not None
        and settings.rollout_held_threshold < 1
        and window.mean_staleness >= settings.max_staleness - settings.saturation_margin
    )
    if saturated or latency_bound:
        return by_throughput(window, split, limits, settings, memory, latency_bound), memory
    wants = verdict.wants
    step = toward_training if wants == TRAINING else toward_rollout
    first = step(split, limits)
    if first is None:
        return Decision(
            None,
            "AtLimit",
            f"{seen}: {side} the band {band_text}, but no split with more {wants} "
            f"fits the bounds and the budget (at {split})",
            window,
        ), memory
    opposite = ROLLOUT if wants == TRAINING else TRAINING
    if any(v.split == first and v.wants == opposite for v in memory):
        return Decision(
            None,
            "BandBetweenSplits",
            f"{seen}: {side} the band {band_text} at {split}, and {first} "
            f"asked for more {opposite}: the balance lies between the two, staying",
            window,
        ), memory
    target = walk(split, first, step, limits, memory, opposite, gpus_to_move(window, split, limits, settings, side))
    code = "MovedToTraining" if wants == TRAINING else "MovedToRollout"
    return Decision(target, code, f"{seen}: {side} the band {band_text}; {split} -> {target}", window), memory


def by_throughput(
    window: Window, split: Split, limits: Limits, settings: Settings, memory: tuple[Verdict, ...], latency_bound: bool
) -> Decision:
    """Where the staleness reads the generation's latency, not the balance (the bound full: responses take longer
    to generate than η training steps; or the trainer waits while the pool may take no more work: the engines'
    queues hold the whole admission window), the samples trained per second decide, one unit at a time: a split
    measured faster
    under this workload is taken; otherwise the waiting side's partner grows (the trainer waits: rollout; the bound
    holds the pool: training), unless that split was measured already or the last unit moved that way did not
    raise the rate by `gain_tolerance`; with neither side waiting, it stays."""
    rate, gain = window.trained_per_second, 1 + settings.gain_tolerance
    seen = f"{window.describe()}, {rate:.3g} samples/s"
    advice = "the staleness comes from how long responses take: a larger max_staleness or shorter responses lower it"
    faster = max(
        (v for v in memory if v.split != split and limits.allows(v.split)),
        key=lambda v: v.trained_per_second,
        default=None,
    )
    if faster is not None and faster.trained_per_second > rate * gain:
        code = "MovedToRollout" if faster.split.rollout > split.rollout else "MovedToTraining"
        return Decision(
            faster.split,
            code,
            f"{seen}: {faster.split} trained faster "
            f"({faster.trained_per_second:.3g} samples/s); {split} -> {faster.split}",
            window,
        )
    if latency_bound:
        wants, step = ROLLOUT, toward_rollout
    elif window.rollout_held > settings.rollout_held_threshold:
        wants, step = TRAINING, toward_training
    else:
        return Decision(
            None,
            "LatencyBound",
            f"{seen}: samples train about η old with neither side waiting, so the "
            f"split is balanced and {advice}; staying",
            window,
        )
    first = step(split, limits)
    if first is None:
        return Decision(
            None, "AtLimit", f"{seen}: no split with more {wants} fits the bounds and the budget (at {split})", window
        )
    if (tried := next((v for v in memory if v.split == first), None)) is not None:
        return Decision(
            None,
            "LatencyBound",
            f"{seen}: {first} trained no faster ({tried.trained_per_second:.3g} "
            f"samples/s), so more {wants} does not pay and {advice}; staying",
            window,
        )

    def tilt(s: Split) -> float:  # the rollout side's share of the GPUs
        return s.rollout * limits.rollout_unit / limits.gpus(s)

    behind = [v for v in memory if (tilt(v.split) < tilt(split)) == (wants == ROLLOUT) and v.split != split]
    if (
        behind
        and rate < (came_from := min(behind, key=lambda v: abs(tilt(v.split) - tilt(split)))).trained_per_second * gain
    ):
        return Decision(
            None,
            "LatencyBound",
            f"{seen}: the last unit of {wants} did not pay ({came_from.split}: "
            f"{came_from.trained_per_second:.3g} samples/s), so {advice}; staying",
            window,
        )
    code = "MovedToTraining" if wants == TRAINING else "MovedToRollout"
    why = "the trainer waits for data" if latency_bound else "samples train about η old"
    return Decision(
        first, code, f"{seen}: {why}; one unit more {wants} to see whether it pays, {split} -> {first}", window
    )


def gpus_to_move(window: Window, split: Split, limits: Limits, settings: Settings, side: str) -> float:
    """How many rollout GPUs one decision moves: `step_fraction` of the imbalance the window measured.

    Above the band, the bound held the pool back `rollout_held` of its time: that share of it is surplus. Below, the
    trainer waited `trainer_idle` of the window for data: generation runs 1/(1 − idle) times too slow, so the pool
    lacks idle/(1 − idle) of itself (idle capped at 0.9)."""
    pool = split.rollout * limits.rollout_unit
    if side == ABOVE:
        return settings.step_fraction * pool * window.rollout_held
    idle = min(window.trainer_idle, 0.9)
    return settings.step_fraction * pool * idle / (1 - idle)


def walk(
    split: Split, first: Split, step, limits: Limits, memory: tuple[Verdict, ...], opposite: str, wanted: float
) -> Split:
    """Take single-unit steps from `split` (the first is `first`) until the rollout side has moved `wanted` GPUs, a
    bound stops it, or the next split asked for the `opposite` move when measured (never step onto it)."""
    current = first
    while abs(current.rollout - split.rollout) * limits.rollout_unit < wanted - 1e-9:  # (float noise)
        following = step(current, limits)
        if following is None or any(v.split == following and v.wants == opposite for v in memory):
            break
        current = following
    return current


@dataclass(frozen=True)
class State:
    """What a caller keeps between calls to `advance`."""

    split: Split
    window_start: Totals | None = None
    last_change_at: float | None = None
    memory: tuple[Verdict, ...] = field(default_factory=tuple)


def advance(state: State, totals: Totals, limits: Limits, settings: Settings) -> tuple[State, Decision | None]:
    """Feed the newest totals. Returns the next state, and a decision once a window is complete (else None).

    A decision that moves the split starts the cooldown; the caller applies `decision.split` and passes it back
    as `state.split`, which it already is in the returned state."""
    settled_at = state.last_change_at + settings.cooldown_seconds if state.last_change_at is not None else float("-inf")
    start = state.window_start
    # (Re)start the window here: at the first call, while the pools settle, after the controller lost its totals.
    if start is None or start.at < settled_at or totals.trained_samples < start.trained_samples:
        return replace(state, window_start=totals), None
    if totals.at - start.at < settings.window_seconds:
        return state, None
    window = observe(start, totals, settings.band)
    decision, memory = decide(window, state.split, limits, settings, state.memory)
    if decision.code == "CollectingData":  # keep the window open until it holds enough samples
        return state, decision
    if decision.split is None:
        return replace(state, window_start=totals, memory=memory), decision
    return State(split=decision.split, window_start=totals, last_change_at=totals.at, memory=memory), decision
