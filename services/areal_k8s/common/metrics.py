"""Prometheus metrics of every service: one catalogue, one naming scheme.

Every name starts with `areal_`, then the subsystem (controller, rollout, engine, reward, trainer, stream,
weight_sync, task, process), then what is measured in base units (seconds, bytes); counters end in `_total`. Every
series carries the labels `rljob` (the job's name) and `role` (the service), so one Prometheus can hold many jobs and a
dashboard can pick one. Each service builds its own `*Metrics` object over a private registry (its cores take it
as an argument, so they stay testable without a network) and serves it at `/metrics` on the port in
`AREAL_METRICS_PORT` (`--metrics-port`; 0 is off).

docs/observability.md's metric table is generated from this module (`python -m areal_k8s.common.metrics`, checked
by a test), and the dashboards (areal_k8s.observability.dashboards) may only query names listed here.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from areal_k8s.common.engine_load import engine_counters

JOB_LABELS = ("rljob", "role")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
# Staleness is a whole number of policy versions: one bucket per version up to 8, then coarser.
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32, 64)
# A response's length in tokens: powers of two, the long tail of a reasoning task up to 32k tokens
LENGTH_BUCKETS = tuple(2**k for k in range(3, 16))

TRAINER_PHASES = ("wait", "prepare", "recompute", "forward_backward", "optimizer", "weight_push", "checkpoint", "eval")
REWARD_STATUSES = ("ok", "timeout", "error")
GROUP_RESULTS = ("accepted", "filtered", "failed", "requeued", "dropped", "lost")
ADMISSION_BLOCKS = ("staleness", "concurrency", "stale_engine")
HOLD_REASONS = ("staleness", "concurrency", "no_work_left", "starting")  # what a long poll for work waits out


class Family:
    """A metric with its job and role labels bound; `labels(...)` binds the rest and returns the series."""

    def __init__(self, metric, bound: dict[str, str]):
        self.metric, self.bound = metric, bound

    def labels(self, **extra: str):
        return self.metric.labels(**self.bound, **extra)


class ProcessCPU(Collector):
    """CPU seconds of this process, with the job labels (the client's process collector has no labels)."""

    def __init__(self, bound: dict[str, str]):
        self.bound = bound

    def collect(self) -> Iterator[CounterMetricFamily]:
        name, _kind, documentation, _extra = PROCESS_CPU
        family = CounterMetricFamily(name.removesuffix("_total"), documentation, labels=list(JOB_LABELS))
        family.add_metric([self.bound[k] for k in JOB_LABELS], time.process_time())
        yield family


# The CPU engine's own counters, as its rollout worker exports them (name, /areal/load's key, meaning)
ENGINE_METRICS = (
    ("areal_engine_decode_steps_total", "decode_steps", "Decode steps the engine ran."),
    (
        "areal_engine_decode_rows_total",
        "decode_rows",
        "Sequences decoded, summed over decode steps (/ steps: the batch).",
    ),
    (
        "areal_engine_decode_context_positions_total",
        "decode_context_positions",
        "Tokens the decoded sequences attended to, summed over decode steps.",
    ),
    ("areal_engine_decode_seconds_total", "decode_seconds", "Wall time in decode steps."),
    ("areal_engine_decode_cpu_seconds_total", "decode_cpu_seconds", "CPU time of the engine's decode steps."),
    ("areal_engine_prefill_tokens_total", "prefill_tokens", "Positions prefill passes computed."),
    ("areal_engine_prefill_seconds_total", "prefill_seconds", "Wall time in prefill passes."),
    ("areal_engine_prefill_cpu_seconds_total", "prefill_cpu_seconds", "CPU time of the engine's prefill passes."),
    ("areal_engine_busy_seconds_total", "busy_seconds", "Wall time inside prefill and decode steps."),
    ("areal_engine_process_cpu_seconds_total", "process_cpu_seconds", "CPU time of the engine's process."),
)


class EngineCounters(Collector):
    """The engine's counters at every scrape, read from its /areal/load (a CPU engine's; none for one that does not
    answer in time, nor for SGLang, which exports its own sglang:* metrics)."""

    def __init__(self, bound: dict[str, str], url: str):
        self.bound, self.url = bound, url

    def families(self, counters: dict[str, float] | None) -> Iterator[CounterMetricFamily]:
        for name, key, documentation in ENGINE_METRICS:
            family = CounterMetricFamily(name.removesuffix("_total"), documentation, labels=list(JOB_LABELS))
            if counters is not None:
                family.add_metric([self.bound[k] for k in JOB_LABELS], counters[key])
            yield family

    def describe(self) -> Iterator[CounterMetricFamily]:  # the names, without asking the engine
        return self.families(None)

    def collect(self) -> Iterator[CounterMetricFamily]:
        if (counters := engine_counters(self.url)) is not None:
            yield from self.families(counters)


class CountedHistogram(Collector):
    """A histogram of whole numbers fed a distribution at a time: `add(counts)`, index s counting the items of value
    s. A step's trained tokens by staleness are thousands of observations; this takes them in one call."""

    def __init__(self, name: str, documentation: str, bound: dict[str, str], buckets: tuple[float, ...]):
        self.name, self.documentation, self.bound, self.buckets = name, documentation, bound, buckets
        self.counts: list[int] = []
        self.lock = threading.Lock()  # collected from the HTTP server's thread

    def add(self, counts: list[int]) -> None:
        with self.lock:
            self.counts += [0] * (len(counts) - len(self.counts))
            for value, count in enumerate(counts):
                self.counts[value] += count

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self.lock:
            counts = list(self.counts)
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(JOB_LABELS))
        buckets = [
            (floatToGoString(edge), sum(n for value, n in enumerate(counts) if value <= edge)) for edge in self.buckets
        ]
        family.add_metric(
            [self.bound[k] for k in JOB_LABELS],
            [*buckets, ("+Inf", sum(counts))],
            sum(value * n for value, n in enumerate(counts)),
        )
        yield family


class ServiceMetrics:
    """The metrics one service exports. Subclasses declare theirs in `__init__`."""

    role = ""

    def __init__(self, job_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.bound = {"rljob": job_name, "role": self.role}
        self.registry.register(ProcessCPU(self.bound))
        self.port: int | None = None
        self.declared: list[tuple[str, str, str, tuple[str, ...]]] = []  # (name, type, help, extra labels)

    def _make(self, kind, name: str, documentation: str, extra: tuple[str, ...], **options):
        metric = kind(name, documentation, [*JOB_LABELS, *extra], registry=self.registry, **options)
        self.declared.append((name, kind._type, documentation, extra))
        return Family(metric, self.bound) if extra else metric.labels(**self.bound)

    def counter(self, name: str, documentation: str, extra: tuple[str, ...] = ()):
        return self._make(Counter, name, documentation, extra)

    def gauge(self, name: str, documentation: str, extra: tuple[str, ...] = ()):
        return self._make(Gauge, name, documentation, extra)

    def histogram(self, name: str, documentation: str, buckets=LATENCY_BUCKETS, extra: tuple[str, ...] = ()):
        return self._make(Histogram, name, documentation, extra, buckets=buckets)

    def counted_histogram(self, name: str, documentation: str, buckets: tuple[float, ...]) -> CountedHistogram:
        histogram = CountedHistogram(name, documentation, self.bound, buckets)
        self.registry.register(histogram)
        self.declared.append((name, "histogram", documentation, ()))
        return histogram

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (0 when absent): for status RPCs and tests."""
        return self.registry.get_sample_value(name, {**self.bound, **labels}) or 0.0

    def serve(self, host: str, port: int) -> int | None:
        """Serve /metrics over HTTP on host:port (port 0: off). Returns the port, or None when off."""
        if port <= 0:
            return None
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = server.server_port
        return self.port


def metrics_port(default: int = 0) -> int:
    return int(os.environ.get("AREAL_METRICS_PORT", default) or 0)


class ControllerMetrics(ServiceMetrics):
    role = "controller"

    def __init__(self, job_name: str, registry: CollectorRegistry | None = None):
        super().__init__(job_name, registry)
        self.policy_version = self.gauge(
            "areal_controller_policy_version", "Policy version live on every rollout engine."
        )
        self.admission_capacity = self.gauge(
            "areal_controller_admission_capacity", "Prompt groups the staleness bound lets start now."
        )
        self.held_seconds = self.counter(
            "areal_controller_held_seconds_total",
            "Worker-seconds that requests for work waited, by what held them (staleness bound, concurrency cap, no "
            "work left, start-up checks): rollout capacity idle for that reason.",
            extra=("reason",),
        )
        self.running_groups = self.gauge(
            "areal_controller_running_groups", "Prompt groups admitted and not yet settled."
        )
        self.admission_blocks = self.counter(
            "areal_controller_admission_blocks_total",
            "Requests for work answered with nothing, by what held it back (staleness bound, concurrency cap, an "
            "engine still on an older version).",
            extra=("reason",),
        )
        self.groups = self.counter(
            "areal_controller_groups_total",
            "Prompt groups settled, by result (accepted, filtered, failed, requeued; then dropped, lost).",
            extra=("result",),
        )
        self.backups = self.counter(
            "areal_controller_backups_total",
            "Backups of the stragglers the trainer waited on, by event (started; won: written before its original).",
            extra=("event",),
        )
        self.dead_lettered = self.counter(
            "areal_controller_dead_lettered_items_total",
            "Dataset items dead-lettered: their group failed rollout.max_group_failures times in a row; they are never "
            "admitted again (each has an entry with its last reason in the job's dead-letter stream).",
        )
        self.workers = self.gauge("areal_controller_workers", "Rollout workers registered.")
        self.staleness_bound = self.gauge("areal_controller_staleness_bound", "η: the most versions a sample may lag.")
        self.staleness_target = self.gauge(
            "areal_controller_staleness_target",
            "The band the mean staleness should stay in (edge min or max).",
            extra=("edge",),
        )
        self.stream_length = self.gauge("areal_stream_length", "Trajectory stream entries kept in Redis.")
        self.stream_pending = self.gauge(
            "areal_stream_pending_entries", "Stream entries delivered to the trainer and not yet acknowledged."
        )
        self.stream_lag = self.gauge("areal_stream_lag_entries", "Stream entries written and not yet delivered.")
        self.stream_oldest_unacked_age = self.gauge(
            "areal_stream_oldest_unacked_age_seconds", "Age of the oldest delivered, unacknowledged stream entry."
        )
        for result in GROUP_RESULTS:
            self.groups.labels(result=result)
        for event in ("started", "won"):
            self.backups.labels(event=event)
        for reason in ADMISSION_BLOCKS:
            self.admission_blocks.labels(reason=reason)
        for reason in HOLD_REASONS:
            self.held_seconds.labels(reason=reason)


class RolloutMetrics(ServiceMetrics):
    role = "rollout"

    def __init__(self, job_name: str, registry: CollectorRegistry | None = None):
        super().__init__(job_name, registry)
        self.generated_tokens = self.counter("areal_rollout_generated_tokens_total", "Tokens generated.")
        self.generated_samples = self.counter("areal_rollout_generated_samples_total", "Responses generated.")
        self.inflight_requests = self.gauge("areal_rollout_inflight_requests", "Generation requests in the engine.")
        self.inflight_groups = self.gauge("areal_rollout_inflight_groups", "Prompt groups this worker is generating.")
        self.interruptions = self.counter(
            "areal_rollout_interruptions_total",
            "Requests interrupted by a weight update (aborted or retracted) and resumed from their prefix.",
        )
        self.generation_latency = self.histogram(
            "areal_rollout_generation_latency_seconds", "Time from a response's first request to its last token."
        )
        self.engine_weight_version = self.gauge(
            "areal_rollout_engine_weight_version", "Policy version the engine serves."
        )
        self.idle_seconds = self.counter(
            "areal_rollout_idle_seconds_total", "Time with no generation request in the engine."
        )
        self.paused_seconds = self.counter(
            "areal_rollout_paused_seconds_total", "Time generation was paused for weight updates."
        )
        self.pause_lapses = self.counter(
            "areal_rollout_pause_lapses_total",
            "Pauses for a weight push the worker ended itself: no word from the trainer within twice its weight-sync "
            "deadline (its continue_generation lost).",
        )
        # the `agent` workflow's gateway (rollout/gateway/)
        self.gateway_calls = self.counter(
            "areal_rollout_gateway_calls_total",
            "Chat completion calls to the agent gateway, by outcome: ok, or the error code it was refused with.",
            extra=("outcome",),
        )
        self.gateway_sessions = self.counter(
            "areal_rollout_gateway_sessions_total",
            "Agent sessions by event: offered, claimed, ended (by the agent: a trajectory), closed (time ran out or "
            "withdrawn: offered again or given up).",
            extra=("event",),
        )
        self.gateway_limits = self.counter(
            "areal_rollout_gateway_limit_hits_total",
            "Agent sessions that reached a limit of rollout.agent: calls, tokens or seconds.",
            extra=("limit",),
        )
        for limit in ("calls", "tokens", "seconds"):
            self.gateway_limits.labels(limit=limit)
        self.declared += [(name, "counter", documentation, ()) for name, _, documentation in ENGINE_METRICS]
        for event in ("offered", "claimed", "ended", "closed"):
            self.gateway_sessions.labels(event=event)
        self.gateway_calls.labels(outcome="ok")

    def watch_engine(self, url: str) -> None:
        """Export the engine's own counters (a CPU engine's, at `url`) with this worker's metrics."""
        self.registry.register(EngineCounters(self.bound, url))


class RewardMetrics(ServiceMetrics):
    role = "reward"

    def __init__(self, job_name: str, registry: CollectorRegistry | None = None):
        super().__init__(job_name, registry)
        self.scored_items = self.counter(
            "areal_reward_scored_items_total",
            "Items scored, by verifier and status (ok, timeout, error).",
            extra=("verifier", "status"),
        )
        self.scoring_latency = self.histogram(
            "areal_reward_scoring_latency_seconds",
            "Time to score one item, from the moment a worker is free for it.",
            extra=("verifier",),
        )
        self.pool_tasks = self.counter(
            "areal_reward_pool_tasks_total",
            "Tasks sent to scoring workers: chunk (a request's items together) or item (one alone: a single-item "
            "chunk, or the retry of a chunk that timed out or lost its worker).",
            extra=("kind",),
        )
        for kind in ("chunk", "item"):
            self.pool_tasks.labels(kind=kind)

    def declare_verifier(self, verifier: str) -> None:
        """Export zeros for a verifier before its first item, so its failure rate is 0 rather than missing."""
        for status in REWARD_STATUSES:
            self.scored_items.labels(verifier=verifier, status=status)
        self.scoring_latency.labels(verifier=verifier)


class TrainerMetrics(ServiceMetrics):
    role = "trainer"

    def __init__(self, job_name: str, registry: CollectorRegistry | None = None):
        super().__init__(job_name, registry)
        self.policy_version = self.gauge("areal_trainer_policy_version", "Version of the trainer's policy.")
        self.steps = self.counter("areal_trainer_steps_total", "Training steps done.")
        self.step_duration = self.histogram(
            "areal_trainer_step_duration_seconds", "Wall time of a step: waiting for data to the version announced."
        )
        self.phase_seconds = self.counter(
            "areal_trainer_phase_seconds_total",
            "Trainer wall time by phase: wait (for data), prepare (advantages, batching), recompute (proximal or "
            "reference logprobs), forward_backward, optimizer, weight_push, checkpoint, eval.",
            extra=("phase",),
        )
        self.trained_samples = self.counter("areal_trainer_trained_samples_total", "Samples trained on.")
        self.trained_tokens = self.counter("areal_trainer_trained_tokens_total", "Response tokens trained on.")
        self.loss = self.gauge("areal_trainer_loss", "Policy loss of the last step.")
        self.kl = self.gauge(
            "areal_trainer_kl", "Approximate KL between the proximal and the updated policy, last step."
        )
        self.clip_fraction = self.gauge("areal_trainer_clip_fraction", "Fraction of tokens whose ratio was clipped.")
        self.importance_weight_mean = self.gauge(
            "areal_trainer_importance_weight_mean", "Mean behaviour importance weight π_prox/π_behav, last step."
        )
        self.importance_weight_capped_fraction = self.gauge(
            "areal_trainer_importance_weight_capped_fraction", "Fraction of tokens the importance-weight cap acted on."
        )
        self.grad_norm = self.gauge("areal_trainer_grad_norm", "Gradient norm before clipping, last step.")
        self.learning_rate = self.gauge("areal_trainer_learning_rate", "Learning rate of the last step.")
        self.sample_staleness = self.histogram(
            "areal_trainer_sample_staleness",
            "Per-sample staleness at consumption: trainer version minus the oldest version among its tokens.",
            buckets=STALENESS_BUCKETS,
        )
        self.response_tokens = self.histogram(
            "areal_trainer_response_tokens",
            "Length in tokens of each response trained on: its tail is the stragglers the trainer waits for.",
            buckets=LENGTH_BUCKETS,
        )
        self.token_staleness = self.counted_histogram(
            "areal_trainer_token_staleness",
            "Per-token staleness at consumption: trainer version minus the version of the policy that generated the "
            "token (a long response spans several versions).",
            buckets=STALENESS_BUCKETS,
        )
        self.weight_sync_duration = self.histogram(
            "areal_weight_sync_duration_seconds", "One weight push, from pausing generation to resuming it."
        )
        self.weight_sync_bytes = self.counter("areal_weight_sync_bytes_total", "Bytes of weights broadcast.")
        self.weight_sync_buckets = self.counter("areal_weight_sync_buckets_total", "Weight buckets broadcast.")
        self.weight_sync_failures = self.counter(
            "areal_weight_sync_failures_total",
            "Weight pushes that failed twice (a worker gone or hung); its engines get the weights at the next push.",
        )
        self.reward_mean = self.gauge("areal_task_reward_mean", "Mean reward of the last trained batch.")
        self.heldout_accuracy = self.gauge("areal_task_heldout_accuracy", "Greedy held-out accuracy, as last measured.")
        for phase in TRAINER_PHASES:
            self.phase_seconds.labels(phase=phase)


SERVICE_METRICS = (ControllerMetrics, RolloutMetrics, RewardMetrics, TrainerMetrics)
PROCESS_CPU = ("areal_process_cpu_seconds_total", "counter", "CPU time (user + system) of the service process.", ())


def catalogue() -> list[tuple[str, str, str, str, str]]:
    """(name, type, roles, extra labels, help) of every metric, in declaration order: the documented list."""
    rows: dict[str, list] = {}
    for cls in SERVICE_METRICS:
        for name, kind, documentation, extra in [PROCESS_CPU, *cls("catalogue").declared]:
            rows.setdefault(name, [name, kind, [], ", ".join(extra), documentation])[2].append(cls.role)
    return [(n, t, ", ".join(roles), labels, doc) for n, t, roles, labels, doc in rows.values()]


def catalogue_markdown() -> str:
    lines = [
        "| metric | type | exported by | labels (besides rljob, role) | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [f"| `{n}` | {t} | {roles} | {labels or '—'} | {doc} |" for n, t, roles, labels, doc in catalogue()]
    return "\n".join(lines) + "\n"


README_START, README_END = "<!-- metrics:start -->\n", "<!-- metrics:end -->"


def write_readme_table(path: Path) -> None:
    """Replace the metric table between the markers in `path` (docs/observability.md) with the generated one."""
    text = path.read_text()
    if README_START not in text or README_END not in text:
        raise SystemExit(f"{path}: no {README_START.strip()} ... {README_END} markers")
    head, rest = text.split(README_START, 1)
    path.write_text(head + README_START + catalogue_markdown() + README_END + rest.split(README_END, 1)[1])


if __name__ == "__main__":  # print the table, or `--write docs/observability.md`
    if sys.argv[1:2] == ["--write"]:
        write_readme_table(Path(sys.argv[2]))
    else:
        sys.stdout.write(catalogue_markdown())
