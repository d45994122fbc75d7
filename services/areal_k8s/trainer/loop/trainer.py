"""The trainer: consume trajectories, step the policy, checkpoint, push weights, announce the version.

`Trainer.run` is the whole loop in one readable method; the pieces it calls are small and separately tested (the
policy it starts from in loop/resume.py, the batches it takes in loop/intake.py). The loop knows no training backend:
the policy is a `TrainBackend` (backends/backend.py) chosen by `trainer.backend`, which the step (step/train_step.py)
hands packed micro-batches and a backend-free loss function. Rank 0 of the trainer world (world.py) reads the
stream, picks each batch, talks to the controller, pushes the weights and checkpoints; it sends each batch to the
other ranks, which `follow`: every rank trains its share of every minibatch, and the gradients add up over the
ranks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from areal_k8s.common.config import JobConfig
from areal_k8s.common.final_model import FINAL_DIR, export_model
from areal_k8s.common.metrics import TrainerMetrics
from areal_k8s.common.store import TrajectoryStore
from areal_k8s.data.dataset import DatasetItem
from areal_k8s.trainer.backends.backend import TrainBackend, make_backend
from areal_k8s.trainer.checkpoint import (
    CheckpointWriteError,
    TrainerState,
    entries_to_train_again,
    latest_checkpoint,
    save_checkpoint,
)
from areal_k8s.trainer.controller_link import Controller, StepReport, WeightVersion
from areal_k8s.trainer.evaluation import Evaluator
from areal_k8s.trainer.loop.intake import next_batch, settle_dropped
from areal_k8s.trainer.loop.resume import load_policy
from areal_k8s.trainer.step.batching import BatchAssembler, Group
from areal_k8s.trainer.step.record import StepLog, StepRecord
from areal_k8s.trainer.step.train_step import TrainStep
from areal_k8s.trainer.tracking import Trackers, step_figures
from areal_k8s.trainer.weights.publisher import WeightPublisher
from areal_k8s.trainer.weights.worker_target import ConnectWorker
from areal_k8s.trainer.world import COMMIT, STOP, TRAIN, World

log = logging.getLogger(__name__)

FINAL_CHECKPOINT_RETRY_SECONDS = 5.0  # the last step's checkpoint is the final model's: tried until it is written


class Trainer:
    def __init__(
        self,
        *,
        job: JobConfig,
        store: TrajectoryStore,
        controller: Controller,
        tokenizer,
        eval_items: list[DatasetItem],
        consumer: str,
        master_address: str = "127.0.0.1",
        metrics: TrainerMetrics | None = None,
        world: World | None = None,
        connect_worker: ConnectWorker | None = None,
    ):
        """`connect_worker` reaches a rollout worker for weight pushes and evaluation (the entry point passes the
        gRPC client, weights/targets.py); None for a trainer that pushes no weights (a rank other than 0)."""
        self.job = job
        self.store = store
        self.controller = controller
        self.tokenizer = tokenizer
        self.eval_items = eval_items
        self.consumer = consumer
        self.world = world or World()  # formed (joined) before the engines are made: they read their rank from it
        self.run_dir = Path(job.run_dir)
        self.checkpoints = self.run_dir / "checkpoints"
        self.steps_log = StepLog(self.run_dir / "trainer" / "steps.jsonl")
        self.checkpoint_error = ""  # why the last checkpoint could not be written ("" once one is)
        self.backend: TrainBackend = make_backend(job)
        # The KL penalty's reference is the initial model, frozen.
        self.reference: TrainBackend | None = make_backend(job, trainable=False) if job.algorithm.kl_coef > 0 else None
        self.step = TrainStep(job, self.backend, self.reference, tokenizer, self.world.size)
        self.assembler = BatchAssembler(
            store,
            consumer,
            controller,
            batch_size=job.algorithm.batch_size,
            group_size=job.algorithm.group_size,
            staleness=job.algorithm.staleness,
        )
        self.unacked: list = []  # stream entries trained on but not yet covered by a checkpoint
        self.phase = "starting"
        self.lock = asyncio.Lock()  # a checkpoint never interleaves with a step
        self.state = TrainerState(version=0)
        self.last: StepRecord | None = None
        self.metrics = metrics or TrainerMetrics(job.name)
        self.metrics.policy_version.set_function(lambda: self.version)
        self.publisher = WeightPublisher(job, controller, master_address, self.metrics, connect_worker)
        self.evaluator = Evaluator(
            job, eval_items, targets=lambda: list(self.publisher.targets.values()), catch_up=self.bring_engines_in
        )
        self.trackers = Trackers(job)  # W&B, MLflow, TensorBoard (tracking.py); the entry point closes them

    @property
    def version(self) -> int:
        return self.state.version

    # -- the loop ------------------------------------------------------------------------------------------

    async def run(self) -> None:
        await self.resume()
        if not self.world.leads:
            return await self.follow()
        total = self.job.algorithm.total_steps
        checkpointed = 0.0  # seconds the last step's checkpoint took: counted in the next step's record
        while self.version < total:
            self.phase = "waiting_for_data"
            waited = time.monotonic()
            groups = await next_batch(self.assembler, self.version, self.publisher, self.push_weights)
            # Held to the step's checkpoint: an on-demand one (loop/handoff.py) falls between steps, never on an
            # unreported one.
            async with self.lock:
                self.phase = "training"
                await asyncio.to_thread(self.world.send, TRAIN, groups)
                record = await asyncio.to_thread(self.train_step, groups)
                dropped = await settle_dropped(
                    self.assembler, self.controller, self.version, self.job.algorithm.staleness.wait_bound
                )
                self.unacked += [e for g in dropped for e in g.entries]
                record.dropped_groups = [g.group_id for g in dropped]
                record.seconds["wait"] = time.monotonic() - waited - record.seconds["train"]
                record.seconds["checkpoint"], checkpointed = checkpointed, 0.0
                self.state.version += 1
                self.unacked += [e for g in groups for e in g.entries]
                self.phase = "pushing_weights"
                pushed = time.monotonic()
                record.weight_push, record.weights_verified = await self.push_weights()
                record.pushed_at = time.time()
                self.metrics.phase_seconds.labels(phase="weight_push").inc(time.monotonic() - pushed)
                if self.evaluation_due():
                    self.phase = "evaluating"
                    evaluated = time.monotonic()
                    record.eval_accuracy = await self.evaluate()
                    record.seconds["eval"] = time.monotonic() - evaluated
                record.finished_at = time.time()
                self.observe(record, step_seconds=time.monotonic() - waited)
                await self.report(record)
                self.last = record
                # Last: a step is done once its checkpoint is (a trainer killed before it trains the step again from
                # the previous one, its report counted as a step re-done).
                if self.version % self.job.trainer.checkpoint_interval == 0 or self.version == total:
                    checkpointed = await self.commit()
                    while self.version == total and (self.checkpoint_error or self.steps_log.waiting):
                        await asyncio.sleep(FINAL_CHECKPOINT_RETRY_SECONDS)
                        checkpointed += await self.commit()
                    self.metrics.phase_seconds.labels(phase="checkpoint").inc(checkpointed)
        await asyncio.to_thread(self.world.send, STOP)
        self.phase = "writing_final_model"
        await asyncio.to_thread(self.write_final_model)
        # The job is finished once its final model is written (from the last step's checkpoint, tried until it is):
        # a full volume holds its completion, never completes it without the model. Sent again by a trainer
        # restarted after the last step.
        await self.controller.report_step(StepReport(version=self.version, eval_accuracy=-1.0, finished=True))
        self.phase = "finished"

    async def resume(self) -> None:
        """Start, or recover after a restart: the policy from the newest checkpoint on every rank (loop/resume.py);
        then rank 0 takes over the stream entries the previous trainer read and did not checkpoint, brings the engines
        to its version and announces it. A first start evaluates the base model."""
        async with self.lock:  # an on-demand checkpoint (its collectives included) waits for the model
            checkpoint, self.state = await load_policy(
                world=self.world,
                backend=self.backend,
                reference=self.reference,
                model=self.job.model,
                checkpoints=self.checkpoints,
                state=self.state,
            )
        if not self.world.leads:
            return
        await self.store.ensure_consumer_group()
        pending = await entries_to_train_again(self.store, self.consumer, self.state)
        self.assembler.add(pending)
        if pending:
            log.info("reclaimed %d pending stream entries", len(pending))
        self.phase = "pushing_weights"
        # (restored either way: a trainer killed before its first checkpoint restarts at 0, behind steps it reported)
        await self.push_weights(restored=True)
        if checkpoint is None:
            self.phase = "evaluating"
            self.state.base_accuracy = await self.evaluate()
            await self.controller.report_step(
                StepReport(version=0, eval_accuracy=self.state.base_accuracy, base_evaluation=True)
            )
            log.info("base model held-out accuracy %.3f", self.state.base_accuracy)

    def write_final_model(self) -> Path:
        """The model to take home: the last checkpoint as a Hugging Face model directory in RUN_DIR/final (written
        again, the same, by a trainer restarted after the last step)."""
        final = export_model(
            latest_checkpoint(self.checkpoints), self.run_dir / FINAL_DIR, job=self.job, tokenizer=self.tokenizer
        )
        log.info("final model written to %s", final)
        return final

    async def follow(self) -> None:
        """The loop of a rank other than 0: run rank 0's commands until it sends `STOP`."""
        while True:
            self.phase = "waiting_for_data"
            command, *payload = await asyncio.to_thread(self.world.receive)
            if command == STOP:
                break
            if command == TRAIN:
                self.phase = "training"
                self.last = await asyncio.to_thread(self.train_step, *payload)
                self.state.version += 1
                log.info("rank %d trained its share of version %d", self.world.rank, self.version)
            elif command == COMMIT:  # rank 0 writes the checkpoint; the backend's shards of it go there
                await asyncio.to_thread(self.backend.save_checkpoint, None)
                await asyncio.to_thread(self.world.barrier)
        self.phase = "finished"

    # -- one step ------------------------------------------------------------------------------------------

    def train_step(self, groups: list[Group]) -> StepRecord:
        """The step from the current version (step/train_step.py), counted in the trainer's state."""
        record = self.step.train(groups, self.version)
        self.state.trained_samples += record.samples
        self.state.trained_tokens += record.tokens
        return record

    async def commit(self) -> float:
        """Checkpoint, then acknowledge the entries the checkpoint covers once every rank is past the steps that
        trained them (the barrier). Returns the seconds it took."""
        started = time.monotonic()
        delivered_again, self.assembler.delivered_again = self.assembler.delivered_again, []
        self.state.unacked_entries = [e.entry_id for e in self.unacked] + delivered_again
        await asyncio.to_thread(self.world.send, COMMIT)
        try:
            await asyncio.to_thread(
                save_checkpoint, self.checkpoints, self.backend, self.state, self.job.trainer.keep_checkpoints
            )
            failure = ""
        except CheckpointWriteError as exc:  # training goes on from the previous checkpoint's point of view
            failure = str(exc)
        await asyncio.to_thread(self.world.barrier)
        if failure:  # nothing acknowledged: a trainer restored from the previous checkpoint trains these again
            self.assembler.delivered_again[:0] = delivered_again
            log.warning("%s; training goes on, the latest checkpoint stays the previous one", failure)
        else:
            await self.store.ack(self.state.unacked_entries)
            self.assembler.forget(self.state.unacked_entries)
            self.unacked = []
            self.steps_log.flush()  # a step's record that waited for room is written with its checkpoint
        if failure != self.checkpoint_error:  # the job status says so (the RLJob's Degraded condition)
            self.checkpoint_error = failure
            await self.controller.report_step(
                StepReport(version=self.version, eval_accuracy=-1.0, checkpoint_error=failure)
            )
        return time.monotonic() - started

    async def save_now(self) -> Path:
        if not self.world.leads:
            raise RuntimeError(f"rank 0 of the trainer world writes the checkpoints, not rank {self.world.rank}")
        async with self.lock:
            await self.commit()
        if self.checkpoint_error:
            raise CheckpointWriteError(self.checkpoint_error)
        return latest_checkpoint(self.checkpoints)

    # -- weights -------------------------------------------------------------------------------------------

    async def push_weights(self, restored: bool = False) -> tuple[dict, dict[str, bool]]:
        """The current weights to every rollout engine (weights/publisher.py), then the version announced with the
        engines the push reached: every push is announced, so no worker need tell the controller its engine's
        version (`restored`: a trainer that (re)started announces its checkpoint's version)."""
        pushed = await self.publisher.push(self.backend.named_weights_for_push, self.version)
        await self.controller.announce_version(
            WeightVersion(
                version=self.version, published_at=time.time(), restored=restored, engines=self.publisher.reached
            )
        )
        return pushed

    # -- evaluation and reporting --------------------------------------------------------------------------

    def evaluation_due(self) -> bool:
        interval = self.job.trainer.eval_interval
        return bool(self.eval_items) and (
            self.version == self.job.algorithm.total_steps or (interval and self.version % interval == 0)
        )

    async def evaluate(self) -> float:
        """Greedy held-out accuracy of the current version, on the rollout engines (evaluation.py)."""
        if not self.eval_items:
            return -1.0
        accuracy = await self.evaluator.accuracy(self.version)
        if accuracy >= 0:
            self.metrics.heldout_accuracy.set(accuracy)
        return accuracy

    async def bring_engines_in(self) -> None:
        """While no engine serves the version to evaluate: push it to the workers outside the weight-update group."""
        if self.publisher.retry_due() and await self.publisher.outsiders():
            await self.push_weights()

    def observe(self, record: StepRecord, step_seconds: float) -> None:
        """Export a finished step (its weight-push time was counted as it happened)."""
        m = self.metrics
        m.steps.inc()
        m.step_duration.observe(step_seconds)
        for phase, seconds in {**record.train_seconds, **record.seconds}.items():
            if phase not in ("train", "checkpoint"):  # train: exported as its split; checkpoint: as it happens
                m.phase_seconds.labels(phase=phase).inc(seconds)
        m.trained_samples.inc(record.samples)
        m.trained_tokens.inc(record.tokens)
        for name, value in (
            ("loss", record.loss),
            ("kl", record.approx_kl),
            ("clip_fraction", record.clip_fraction),
            ("importance_weight_mean", record.behaviour_weight_mean),
            ("importance_weight_capped_fraction", record.capped_fraction),
            ("grad_norm", record.grad_norm),
            ("learning_rate", record.learning_rate),
            ("reward_mean", record.reward_mean),
        ):
            getattr(m, name).set(value)
        for lag in record.staleness:
            m.sample_staleness.observe(lag)
        m.token_staleness.add(record.token_staleness_counts)
        for length in record.response_tokens:
            m.response_tokens.observe(length)
        self.trackers.log(record.version, step_figures(record, step_seconds))

    async def report(self, record: StepRecord) -> None:
        self.steps_log.append(record)
        await self.controller.report_step(record.report(checkpoint_error=self.checkpoint_error))
        log.info(
            "version %d: reward %.3f loss %.4f staleness ≤ %d%s",
            record.version,
            record.reward_mean,
            record.loss,
            max(record.staleness),
            f" eval {record.eval_accuracy:.3f}" if record.eval_accuracy >= 0 else "",
        )
