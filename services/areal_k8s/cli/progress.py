"""Live progress of a run: a rich view on a terminal, a plain line every few seconds otherwise."""

from __future__ import annotations

import sys
import time

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from areal_k8s.api.v1 import controller_pb2
from areal_k8s.cli.monitor import MetricsRecorder
from areal_k8s.common.metrics import ADMISSION_BLOCKS, TRAINER_PHASES


def _accuracy(value: float) -> str:
    return "—" if value < 0 else f"{100 * value:.1f}%"


def status_line(s: controller_pb2.JobStatus) -> str:
    return (
        f"step {s.version}/{s.total_steps} | reward {s.reward_mean:.3f} | held-out {_accuracy(s.base_accuracy)} → "
        f"{_accuracy(s.eval_accuracy)} | staleness {s.last_max_staleness} (max {s.max_staleness_seen}, η={s.eta}) | "
        f"{s.samples_per_second:.2f} samples/s {s.tokens_per_second:.0f} tokens/s | queue {s.queue_depth} | "
        f"running {s.running} workers {s.workers}" + (f" | dead-lettered {s.dead_lettered}" if s.dead_lettered else "")
    )


def metric_rows(m: MetricsRecorder) -> list[tuple[str, str]]:
    """The services' own metrics (the dashboards' figures): rates over the last scrape interval, totals so far."""

    def rate(name: str) -> str:
        value = m.rate(name)
        return "…" if value is None else f"{value:.0f}" if value >= 10 else f"{value:.2f}"

    phases = {p: m.rate("areal_trainer_phase_seconds_total", phase=p) or 0.0 for p in TRAINER_PHASES}
    busy = sum(phases.values())
    split = ", ".join(f"{p} {100 * v / busy:.0f}%" for p, v in phases.items() if busy and v / busy >= 0.01) or "…"
    pushes = m.total("areal_weight_sync_duration_seconds_count")
    push_mean = m.total("areal_weight_sync_duration_seconds_sum") / pushes if pushes else 0.0
    failures = sum(m.total("areal_reward_scored_items_total", status=s) for s in ("timeout", "error"))
    blocks = ", ".join(
        f"{r} {m.total('areal_controller_admission_blocks_total', reason=r):.0f}" for r in ADMISSION_BLOCKS
    )
    return [
        (
            "generation",
            f"{rate('areal_rollout_generated_tokens_total')} tokens/s, "
            f"{m.total('areal_rollout_inflight_requests'):.0f} requests in flight, "
            f"{m.total('areal_rollout_interruptions_total'):.0f} interrupted",
        ),
        ("trainer time", split),
        (
            "weight sync",
            f"{pushes:.0f} pushes, {push_mean:.3f} s each, {m.total('areal_weight_sync_bytes_total') / 2**20:.0f} MiB",
        ),
        ("reward", f"{rate('areal_reward_scored_items_total')} items/s, {failures:.0f} timeouts or errors"),
        (
            "stream",
            f"pending {m.total('areal_stream_pending_entries'):.0f}, lag {m.total('areal_stream_lag_entries'):.0f}, "
            f"oldest unacked {m.total('areal_stream_oldest_unacked_age_seconds'):.1f} s",
        ),
        ("admission blocks", blocks),
    ]


def status_table(s: controller_pb2.JobStatus, recorder: MetricsRecorder | None = None) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold cyan")
    table.add_column()
    table.add_column(style="bold cyan")
    table.add_column()
    table.add_row("policy version", str(s.version), "reward (last batch)", f"{s.reward_mean:.3f}")
    table.add_row(
        "held-out accuracy",
        f"{_accuracy(s.base_accuracy)} → {_accuracy(s.eval_accuracy)}",
        "throughput",
        f"{s.samples_per_second:.2f} samples/s, {s.tokens_per_second:.0f} tokens/s",
    )
    table.add_row(
        "staleness",
        f"last ≤ {s.last_max_staleness}, max {s.max_staleness_seen}, mean {s.mean_staleness:.2f} (η = {s.eta})",
        "groups",
        f"admitted {s.admitted}: running {s.running}, accepted {s.accepted}, filtered {s.filtered}, "
        f"failed {s.failed}, re-queued {s.requeued} (capacity {s.capacity}, dropped past η {s.dropped}, lost by Redis "
        f"{s.lost}, dead-lettered {s.dead_lettered}; backups of stragglers {s.backups_started}, "
        f"{s.backups_won} won)",
    )
    table.add_row("trajectory stream", f"queue {s.queue_depth}, kept {s.stream_length}", "workers", str(s.workers))
    if s.stalled:  # past trainer.progress_deadline_seconds without a step: what the run waits for
        table.add_row("not progressing", s.stalled)
    if s.checkpoint_error:  # the trainer trains on; a restart would resume from the checkpoint before
        table.add_row("checkpoint failed", s.checkpoint_error)
    if recorder and recorder.snapshots:
        rows = metric_rows(recorder)
        for left, right in zip(rows[::2], rows[1::2]):
            table.add_row(*left, *right)
    return table


class ProgressView:
    def __init__(self, job_name: str, total_steps: int, console: Console | None = None, plain_every: float = 10.0):
        self.console = console or Console(stderr=True)
        self.interactive = self.console.is_terminal and sys.stderr.isatty()
        self.plain_every = plain_every
        self._last_plain = 0.0
        self.progress = Progress(
            TextColumn(f"[bold]{job_name}[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps"),
            TimeElapsedColumn(),
            console=self.console,
        )
        self.task = self.progress.add_task("train", total=total_steps)
        self.live = (
            Live(Group(self.progress, Table.grid()), console=self.console, refresh_per_second=4)
            if self.interactive
            else None
        )
        self.recorder: MetricsRecorder | None = None  # the run's metrics scrapes, when there are any

    def __enter__(self) -> ProgressView:
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self.live.__exit__(*exc)

    def update(self, status: controller_pb2.JobStatus) -> None:
        if self.live:
            self.progress.update(self.task, completed=status.version)
            self.live.update(Group(self.progress, status_table(status, self.recorder)))
        elif (
            time.monotonic() - self._last_plain >= self.plain_every
            or status.phase == controller_pb2.JobStatus.COMPLETED
        ):
            self._last_plain = time.monotonic()
            self.console.print(status_line(status), highlight=False, soft_wrap=True)
