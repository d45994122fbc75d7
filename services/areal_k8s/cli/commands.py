"""The command lines of a local run's processes: the modules and flags the operator gives the pods
(k8s_operator/workloads.py), with loopback addresses in place of Services."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from areal_k8s.common.config import JobConfig, reward_verifier_args


@dataclass
class Endpoints:
    controller: str
    reward: str
    trainer: str
    rollouts: list[str]
    engines: list[str]
    metrics: dict[str, str]  # service name -> host:port of its Prometheus /metrics
    gateways: list[str] = field(default_factory=list)  # workflow agent: each rollout worker's gateway, host:port


def port_of(address: str) -> str:
    return address.rsplit(":", 1)[1]


def controller_command(job_file: Path, host: str, ends: Endpoints, redis_url: str) -> list[str]:
    return [
        "areal_k8s.controller",
        *("--job", str(job_file), "--host", host),
        *("--port", port_of(ends.controller)),
        *("--redis-url", redis_url),
        *("--reward", ends.reward),
        *("--metrics-port", port_of(ends.metrics["controller"])),
    ]


def reward_command(job: JobConfig, host: str, ends: Endpoints) -> list[str]:
    return [
        "areal_k8s.reward",
        *("--host", host),
        *("--port", port_of(ends.reward)),
        *("--workers", str(job.reward.workers)),
        *("--timeout", str(job.reward.timeout_seconds)),
        *("--job-name", job.name),
        *("--metrics-port", port_of(ends.metrics["reward"])),
        *reward_verifier_args(job.reward),
    ]


def trainer_command(
    job_file: Path, host: str, port: str, ends: Endpoints, redis_url: str, metrics_port: str
) -> list[str]:
    """One rank of the trainer world, serving on `port` and exporting metrics on `metrics_port` (0: none)."""
    return [
        "areal_k8s.trainer",
        *("--job", str(job_file), "--host", host),
        *("--port", port),
        *("--controller", ends.controller),
        *("--redis-url", redis_url),
        *("--metrics-port", metrics_port),
    ]


def engine_command(job: JobConfig, host: str, ends: Endpoints, i: int) -> list[str]:
    """The CPU engine beside rollout worker `i`."""
    return ["areal_k8s.cpu_engine", *job.cpu_engine_args(host, int(port_of(ends.engines[i])))]


def rollout_command(job_file: Path, host: str, ends: Endpoints, i: int, redis_url: str) -> list[str]:
    return [
        "areal_k8s.rollout",
        *("--job", str(job_file)),
        *("--host", host),
        *("--port", port_of(ends.rollouts[i])),
        *("--worker-id", f"rollout-{i}"),
        *("--engine-url", ends.engines[i]),
        *("--controller", ends.controller),
        *("--reward", ends.reward),
        *("--redis-url", redis_url),
        *("--metrics-port", port_of(ends.metrics[f"rollout-{i}"])),
        *(("--gateway-port", port_of(ends.gateways[i])) if ends.gateways else ()),
    ]


def agent_runner_command(job_file: Path, ends: Endpoints, i: int) -> list[str]:
    """Agent runner `agent-<i>`, claiming from every rollout worker's gateway."""
    return [
        "areal_k8s.agent_runner",
        *("--job", str(job_file)),
        *("--name", f"agent-{i}"),
        *(arg for address in ends.gateways for arg in ("--gateway", f"http://{address}")),
    ]
