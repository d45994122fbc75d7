"""`arealctl run`: the four services (and N rollout engines) as local processes on loopback.

Same binaries, flags (commands.py) and gRPC contracts as the pods in a cluster; Redis is embedded when the job names
none.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from areal_k8s.api.v1 import controller_pb2, controller_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from areal_k8s.cli.commands import (
    Endpoints,
    agent_runner_command,
    controller_command,
    engine_command,
    port_of,
    reward_command,
    rollout_command,
    trainer_command,
)
from areal_k8s.cli.measurements import RunMeasurements
from areal_k8s.cli.monitor import LocalPrometheus, MetricsRecorder
from areal_k8s.cli.rebalance import LocalRebalancer, TrainerMoveRefused
from areal_k8s.cli.run_files import write_endpoints
from areal_k8s.cli.supervisor import RedisService, RestartBudgetSpent, RestartPolicy, Service, Supervisor, how_it_ended
from areal_k8s.common import histograms
from areal_k8s.common.config import JobConfig
from areal_k8s.common.grpcutil import CHANNEL_OPTIONS
from areal_k8s.common.ports import free_port
from areal_k8s.common.prompts import check_model_dir, check_tokenizer_dir
from areal_k8s.common.redis_server import EmbeddedRedis
from areal_k8s.common.sglang_args import sglang_flags


class LaunchError(RuntimeError):
    """A run that could not start or did not finish; the message is one readable line."""


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false"
    )
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # progress bars are noise in log files
    return env


def trainer_world(name: str) -> str | None:
    """The trainer's ranks (`trainer`, `trainer-<rank>`) form one torch.distributed world."""
    return "trainer" if name == "trainer" or name.startswith("trainer-") else None


def job_failure(status: controller_pb2.JobStatus) -> str:
    return f"job {status.job} failed ({status.failure_reason}): {status.message}"


def poll_until(service: Service, deadline: float, pending: Callable[[], str | None]) -> None:
    """Call `pending` every 0.2 s until it returns None; it names what is still awaited otherwise. Raise LaunchError
    if `service` exits first or `deadline` passes."""
    while True:
        if (code := service.exit_code) is not None:
            ended = how_it_ended(service.name, code, service.log_path)
            raise LaunchError(f"{ended} (while starting; log: {service.log_path})")
        if (waiting := pending()) is None:
            return
        if time.monotonic() > deadline:
            raise LaunchError(f"{service.name} is not ready in time: {waiting} (log: {service.log_path})")
        time.sleep(0.2)


def wait_serving(service: Service, address: str, deadline: float) -> None:
    """Block until the standard gRPC health service at `address` reports SERVING."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = health_pb2_grpc.HealthStub(ch)

        def pending() -> str | None:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
            except grpc.RpcError as exc:
                return f"gRPC health {exc.code().name}"
            return None if status == health_pb2.HealthCheckResponse.SERVING else f"gRPC health {status}"

        poll_until(service, deadline, pending)


def wait_ready(controller: Service, address: str, deadline: float) -> None:
    """Block until the controller's start-up checks pass (the reward service loads the job's verifiers); a job
    they fail is reported before anything else starts."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = controller_pb2_grpc.ControllerStub(ch)

        def pending() -> str | None:
            try:
                status = stub.GetJobStatus(controller_pb2.GetJobStatusRequest(), timeout=5)
            except grpc.RpcError as exc:  # e.g. Redis busy for a moment; a dead controller is caught by poll_until
                return f"answering GetJobStatus ({exc.code().name})"
            if status.phase == controller_pb2.JobStatus.FAILED:
                raise LaunchError(job_failure(status))
            return None if status.ready else status.message

        poll_until(controller, deadline, pending)


def run_summary(
    job: JobConfig,
    status: controller_pb2.JobStatus,
    interrupted: bool,
    *,
    wall_seconds: float,
    rollout_workers_at_end: int,
    trainer_ranks_at_end: int,
    restarts: dict[str, int],
) -> dict:
    """What summary.json says about a run: the job's status at its end and the run's own figures."""
    return {
        "job": job.name,
        "completed": status.phase == controller_pb2.JobStatus.COMPLETED and not interrupted,
        "interrupted": interrupted,
        "base_accuracy": status.base_accuracy,
        "final_accuracy": status.eval_accuracy,
        "accuracy_gain_points": round(100 * (status.eval_accuracy - status.base_accuracy), 2)
        if status.base_accuracy >= 0 and status.eval_accuracy >= 0
        else None,
        "steps": status.version,
        "total_steps": status.total_steps,
        "wall_seconds": wall_seconds,
        "max_staleness": job.algorithm.max_staleness,
        "max_staleness_seen": status.max_staleness_seen,
        "mean_staleness": round(status.mean_staleness, 3),
        # trained staleness: per sample (its oldest token's) and per token, p50/p99/max/mean
        "staleness": {
            "samples": histograms.summary(status.staleness_counts),
            "tokens": histograms.summary(status.token_staleness_counts),
        },
        "trajectories_produced": status.accepted * status.group_size,
        "trajectories_consumed": status.consumed * status.group_size,
        "steps_redone": status.steps_redone,
        # every group admitted, by how it was settled (those still running at the end are in none)
        "groups": {
            "admitted": status.admitted,
            "accepted": status.accepted,
            "filtered": status.filtered,
            "failed": status.failed,
            "requeued": status.requeued,
            "running": status.running,
            "dropped": status.dropped,
            "lost": status.lost,  # accepted, then lost by a Redis that forgot its last writes; admitted again
        },
        # stragglers generated a second time (each group is counted once above, whichever copy won)
        "backups": {"started": status.backups_started, "won": status.backups_won},
        "dead_lettered_items": status.dead_lettered,
        "samples_per_second": round(status.samples_per_second, 3),
        "tokens_per_second": round(status.tokens_per_second, 1),
        "rollout_workers": job.rollout.workers,
        "rollout_workers_at_end": rollout_workers_at_end,
        "trainer_ranks_at_end": trainer_ranks_at_end,
        "restarts": restarts,
    }


class LocalRun:
    def __init__(
        self,
        job: JobConfig,
        *,
        host: str = "127.0.0.1",
        restarts: RestartPolicy | None = None,
        on_restart: Callable[[str], None] = lambda line: print(f"arealctl: {line}", file=sys.stderr, flush=True),
        measure_every: float = 1.0,  # seconds between two lines of RUN_DIR/measurements.jsonl
        planned: str = "",  # why it starts with its rollout workers (`run --calibrate`): the rebalancer records it
    ):
        self.job, self.planned = job, planned
        self.supervisor = Supervisor(restarts or RestartPolicy(), on_restart, world_of=trainer_world)
        self.notify = on_restart
        self.rebalancer: LocalRebalancer | None = None
        self.last_status: controller_pb2.JobStatus | None = None
        self.started_controller: str | None = None  # its address once its process is started
        self.host = host
        self.run_dir = Path(job.run_dir)
        self.redis: EmbeddedRedis | None = None
        self.services: list[Service] = []
        self.started_at = time.time()
        self.recorder: MetricsRecorder | None = None
        self.measure_every = measure_every
        self.measurements: RunMeasurements | None = None  # the engines' counters and the services' CPU
        self.prometheus: LocalPrometheus | None = None
        self.taken_ports: set[int] = set()
        # the token the run's agent runners claim episodes with, from its rollout workers' gateways only
        self.claim_env = {"AREAL_CLAIM_TOKEN": secrets.token_urlsafe(24)}

    # -- start ---------------------------------------------------------------------------------------------

    def prepare_run_dir(self, mode: str) -> None:
        """`new` refuses an existing run, `fresh` wipes it, `resume` carries on from its checkpoint and Redis."""
        exists = self.run_dir.exists() and any(self.run_dir.iterdir())
        if exists and mode == "new":
            raise LaunchError(
                f"run directory {self.run_dir} already holds a run: pass --resume to continue it or --fresh to start "
                "over"
            )
        if exists and mode == "fresh":
            shutil.rmtree(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "summary.json").unlink(missing_ok=True)

    def start(self, mode: str = "new", timeout: float = 300.0, prometheus: str | None = None) -> Endpoints:
        """Start every service; with `prometheus` (a scrape interval such as "5s") a Prometheus server first.
        Raises ModelDirectoryError before anything starts if the model or tokenizer directory cannot be opened."""
        check_model_dir(self.job.model)
        check_tokenizer_dir(self.job.tokenizer_path)
        if self.job.rebalance.enabled and self.job.rollout.engine != "cpu":
            raise LaunchError(
                "rebalance.enabled in a local run needs rollout.engine: cpu (it starts and stops the engines; "
                "external SGLang engines in rollout.engine_urls are not its to start)"
            )
        if self.job.agents is not None and self.job.rebalance.enabled:
            raise LaunchError(
                "agents in a local run claim from the rollout workers it starts with; rebalance.enabled would add "
                "workers they do not know: leave one of them out"
            )
        if self.job.rollout.sglang_args:
            raise LaunchError(
                "rollout.sglang_args reach the SGLang engines areal starts (an RLJob's rollout pods); a local run uses "
                "the servers at rollout.engine_urls as they are: start them with "
                f"{' '.join(sglang_flags(self.job.rollout.sglang_args))} and leave sglang_args out"
            )
        self.prepare_run_dir(mode)
        job_file = self.run_dir / "job.yaml"
        job_file.write_text(yaml.safe_dump(self.job.model_dump(mode="json"), sort_keys=False))
        redis_url = self.job.redis.url
        if redis_url is None:
            self.redis = EmbeddedRedis(self.run_dir / "redis").start()
            self.supervisor.watch(RedisService(self.redis))
            redis_url = self.redis.url

        if self.redis:
            self.taken_ports.add(self.redis.port)
        address = self.free_address

        workers = self.job.rollout.workers
        ends = Endpoints(
            controller=address(),
            reward=address(),
            trainer=address(),
            rollouts=[address() for _ in range(workers)],
            engines=self.job.rollout.engine_urls or [f"http://{address()}" for _ in range(workers)],
            metrics={
                name: address()
                for name in ("controller", "reward", *(f"rollout-{i}" for i in range(workers)), "trainer")
            },
            gateways=[address() for _ in range(workers)] if self.job.rollout.workflow == "agent" else [],
        )
        self.recorder = MetricsRecorder(ends.metrics, self.run_dir / "metrics.jsonl")
        self.measurements = RunMeasurements(
            self.run_dir, lambda: (list(ends.engines), self.live_pids()), self.measure_every
        )
        self.measurements.start()
        if prometheus:
            self.start_prometheus(ends, prometheus)
        write_endpoints(self.run_dir, ends, prometheus=self.prometheus and self.prometheus.url)
        logs = self.run_dir / "logs"
        deadline = time.monotonic() + timeout
        controller = self.spawn("controller", controller_command(job_file, self.host, ends, redis_url), logs, 1)
        self.started_controller = ends.controller
        reward = self.spawn("reward", reward_command(self.job, self.host, ends), logs, 1)
        wait_serving(controller, ends.controller, deadline)
        wait_serving(reward, ends.reward, deadline)
        wait_ready(controller, ends.controller, deadline)
        self.endpoints, self.redis_url = ends, redis_url
        for i in range(workers):
            self.start_rollout(i)
        for i in range(self.job.agents.replicas if self.job.agents else 0):
            self.spawn(f"agent-{i}", agent_runner_command(job_file, ends, i), logs, 1, self.claim_env)
        if self.job.rebalance.enabled:
            self.rebalancer = LocalRebalancer(self.job, self, self.run_dir / "rebalance.jsonl", self.notify)
            if self.planned:
                self.rebalancer.started_as_planned(self.planned)
        self.start_trainer(self.job.trainer.replicas)
        return ends

    def start_trainer(self, ranks: int) -> None:
        """`ranks` processes forming one torch.distributed world, as torchrun would start them: rank 0 (`trainer`)
        serves the endpoints the run knows; ranks 1.. (`trainer-<rank>`) serve on ports of their own and export no
        metrics (rank 0's are the step's)."""
        ends, job_file, rendezvous = self.endpoints, self.run_dir / "job.yaml", self.free_address()
        for rank in range(ranks):
            world = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(ranks),
                "MASTER_ADDR": self.host,
                "MASTER_PORT": port_of(rendezvous),
            }
            port, metrics = (ends.trainer, ends.metrics["trainer"]) if rank == 0 else (self.free_address(), ":0")
            self.spawn(
                "trainer" if rank == 0 else f"trainer-{rank}",
                trainer_command(job_file, self.host, port_of(port), ends, self.redis_url, port_of(metrics)),
                self.run_dir / "logs",
                self.job.trainer.threads,
                world,
            )

    def start_rollout(self, i: int) -> None:
        """Rollout worker `rollout-<i>` and, with the CPU engine, its engine `engine-<i>`."""
        ends, logs, job_file = self.endpoints, self.run_dir / "logs", self.run_dir / "job.yaml"
        if self.job.rollout.engine == "cpu":
            self.spawn(f"engine-{i}", engine_command(self.job, self.host, ends, i), logs, self.job.rollout.threads)
        self.spawn(f"rollout-{i}", rollout_command(job_file, self.host, ends, i, self.redis_url), logs, 1,
                   self.claim_env)  # fmt: skip

    # -- the pools, resized while the job runs (the staleness rebalancer) ---------------------------------

    def trainer_ranks(self) -> int:
        return sum(1 for s in self.services if trainer_world(s.name))

    def resize_trainer(self, ranks: int, timeout: float = 600.0) -> int:
        """Start the trainer world again with `ranks` ranks, at the step it reached. Rank 0 hands off (a checkpoint
        between two steps, then its other ranks exit); the ranks are stopped, out of the supervisor's sight (a move
        is no crash), and the new world resumes from that checkpoint: same version, optimizer state and RNG, and the
        entries read but not trained are still pending in the stream for its rank 0 to claim. Raises
        TrainerMoveRefused when the trainer is not between two steps of the run. Returns the version it handed
        off at."""
        if self.service("trainer").exit_code is not None:
            raise TrainerMoveRefused("the trainer's rank 0 is not running")
        with grpc.insecure_channel(self.endpoints.trainer, options=CHANNEL_OPTIONS) as ch:
            try:  # (it waits for the step in progress, its weight push and evaluation included)
                handed = trainer_pb2_grpc.TrainerStub(ch).SaveCheckpoint(
                    trainer_pb2.SaveCheckpointRequest(hand_off=True), timeout=timeout
                )
            except grpc.RpcError as exc:
                # not between two steps, or not serving yet (a world still forming): nothing was stopped
                if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE):
                    raise TrainerMoveRefused(f"{exc.code().name}: {exc.details()}") from None
                raise LaunchError(f"the trainer did not hand off ({exc.code().name}: {exc.details()})") from None
        old = [s for s in self.services if trainer_world(s.name)]
        for service in sorted(old, key=lambda s: s.name == "trainer"):  # rank 0 last: the others are exiting already
            self.supervisor.forget(service.name)
            self.services.remove(service)
            service.stop()
        self.notify(
            f"trainer world handed off at version {handed.version} ({handed.path}): {len(old)} -> {ranks} ranks"
        )
        self.start_trainer(
            ranks
        )  # (the supervisor restarts its ranks if they die; the next move waits for it to serve)
        return handed.version

    def rollout_workers(self) -> list[int]:
        """Indices of the rollout workers running now, oldest first."""
        return sorted(int(s.name.split("-")[1]) for s in self.services if s.name.startswith("rollout-"))

    def add_rollout(self) -> str:
        """Start one more rollout worker and engine, under a name never used in this run. It registers with the
        controller as any worker does; the controller gives it no work until the trainer has pushed it the current
        weights (the trainer does so for every engine that joins)."""
        ends = self.endpoints
        i = len(ends.rollouts)
        ends.rollouts.append(self.free_address())
        ends.engines.append(f"http://{self.free_address()}")
        ends.metrics[f"rollout-{i}"] = self.free_address()  # the recorder scrapes it from its next tick
        self.start_rollout(i)
        write_endpoints(self.run_dir, ends, prometheus=self.prometheus and self.prometheus.url)
        if self.prometheus:
            self.prometheus.refresh()
        return f"rollout-{i}"

    def remove_rollout(self) -> str:
        """Stop the newest rollout worker, then its engine. The worker hands back the groups it is generating
        (re-queued, not charged to their prompts) and unregisters, so the next weight push leaves it out."""
        name = f"rollout-{self.rollout_workers()[-1]}"
        for process in (name, name.replace("rollout-", "engine-")):
            if (service := next((s for s in self.services if s.name == process), None)) is not None:
                self.supervisor.forget(process)
                self.services.remove(service)
                service.stop()
        return name

    def free_address(self) -> str:
        # The kernel may hand the same free port out twice in a row: every service gets its own.
        while (port := free_port(self.host)) in self.taken_ports:
            pass
        self.taken_ports.add(port)
        return f"{self.host}:{port}"

    def start_prometheus(self, endpoints: Endpoints, scrape_interval: str = "5s") -> str:
        """A real Prometheus scraping every service of the run; returns its URL."""
        self.prometheus = LocalPrometheus(
            self.run_dir / "prometheus", endpoints.metrics, self.free_address(), scrape_interval
        )
        return self.prometheus.start()

    def spawn(self, name: str, args: list[str], logs: Path, threads: int, env: dict[str, str] | None = None) -> Service:
        service = Service(name, args, logs / f"{name}.log", {**child_env(threads), **(env or {})})
        service.start()
        self.services.append(service)
        self.supervisor.watch(service)
        return service

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    # -- watch ---------------------------------------------------------------------------------------------

    def wait(
        self,
        controller: str,
        on_status: Callable[[controller_pb2.JobStatus], None],
        poll: float = 1.0,
        timeout: float | None = None,
    ) -> controller_pb2.JobStatus:
        """Poll the job status until the trainer finishes, restarting processes that die; raise LaunchError when
        the job fails, the restart budget is spent or time runs out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with grpc.insecure_channel(controller, options=CHANNEL_OPTIONS) as ch:
            stub = controller_pb2_grpc.ControllerStub(ch)
            status = controller_pb2.JobStatus()
            while True:
                # every rank: a follower may still be finishing its share of the last checkpoint when rank 0 is done
                trainer_done = all(s.exit_code == 0 for s in self.services if trainer_world(s.name))
                if self.recorder:
                    self.recorder.tick()
                try:
                    status = stub.GetJobStatus(controller_pb2.GetJobStatusRequest(), timeout=5)
                    self.last_status = status
                    on_status(status)
                    if self.rebalancer:
                        self.rebalancer.observe(status)
                except grpc.RpcError:
                    pass  # the controller is busy or restarting; a dead one is caught below
                if trainer_done and status.phase == controller_pb2.JobStatus.COMPLETED:
                    return status
                if status.phase == controller_pb2.JobStatus.FAILED:
                    raise LaunchError(job_failure(status))
                try:
                    self.supervisor.tick()
                except RestartBudgetSpent as exc:
                    raise LaunchError(str(exc)) from None
                if trainer_done:
                    raise LaunchError(
                        f"the trainer exited before the job completed (log: {self.service('trainer').log_path})"
                    )
                if deadline is not None and time.monotonic() > deadline:
                    raise LaunchError(
                        f"the job did not complete within {timeout:.0f}s (step {status.version}/{status.total_steps})"
                    )
                time.sleep(poll)

    def live_pids(self) -> dict[str, int]:
        return {s.name: s.process.pid for s in self.services if s.process is not None and s.process.poll() is None}

    def current_status(self) -> controller_pb2.JobStatus | None:
        """The job's status now if the controller answers, else the last one `wait` saw."""
        if self.started_controller is None:
            return self.last_status
        with grpc.insecure_channel(self.started_controller, options=CHANNEL_OPTIONS) as ch:
            try:
                return controller_pb2_grpc.ControllerStub(ch).GetJobStatus(
                    controller_pb2.GetJobStatusRequest(), timeout=5
                )
            except grpc.RpcError:
                return self.last_status

    # -- stop ----------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop in reverse start order (the trainer first, Redis last) so nothing writes into a closed store."""
        if self.measurements:
            self.measurements.stop()
        for service in reversed(self.services):
            service.stop()
        if self.redis:
            self.redis.stop()
        if self.prometheus:
            self.prometheus.stop()

    def write_summary(self, status: controller_pb2.JobStatus | None, interrupted: bool) -> dict:
        """summary.json from the job's status (None: the controller never answered; the counts are then zero)."""
        summary = run_summary(
            self.job,
            status or controller_pb2.JobStatus(job=self.job.name),
            interrupted,
            wall_seconds=round(time.time() - self.started_at, 1),
            rollout_workers_at_end=len(self.rollout_workers()),
            trainer_ranks_at_end=self.trainer_ranks(),
            restarts=dict(self.supervisor.restarts),
        )
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary
