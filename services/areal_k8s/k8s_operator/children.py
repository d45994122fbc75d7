"""The Kubernetes objects an RLJob owns, as a pure function of the checked job.

The operator applies these; `arealctl manifests` prints them. Besides the job file's ConfigMap and the Services
here, they are the workloads of workloads.py, built of pod_templates.py's parts.
"""

from __future__ import annotations

import base64
import os

import yaml

from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.pod_templates import metadata
from areal_k8s.k8s_operator.valid_job import ValidJob
from areal_k8s.k8s_operator.workloads import (
    agents_deployment,
    controller_deployment,
    reward_deployment,
    reward_network_policy,
    rollout_deployment,
    trainer_statefulset,
)

CHILD_KINDS = {  # kind -> (apiVersion, plural): everything the operator creates
    "ConfigMap": ("v1", "configmaps"),
    "Secret": ("v1", "secrets"),  # workflow agent: the claim token, created once (claim_token_secret)
    "Service": ("v1", "services"),
    "Deployment": ("apps/v1", "deployments"),
    "StatefulSet": ("apps/v1", "statefulsets"),
    "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies"),
    "Workload": (names.KUEUE_API, "workloads"),  # with a queue: kueue.py
}


def desired_children(
    job: ValidJob, *, running: bool, rollout_replicas: int | None = None, trainer_replicas: int | None = None
) -> list[dict]:
    """Every child of `job`; with `running` false (suspended or finished) the workloads have no pods.
    `rollout_replicas` and `trainer_replicas` (the staleness rebalancer's) replace roles.rollout/trainer.replicas."""
    return [
        config_map(job),
        service(job, "controller", [("grpc", names.CONTROLLER_PORT)]),
        service(job, "reward", [("grpc", names.REWARD_PORT)]),
        # Headless: stable per-pod DNS names for the trainer ranks' rendezvous, resolvable before they are ready.
        service(
            job, "trainer", [("grpc", names.TRAINER_PORT), ("rendezvous", names.TORCH_RENDEZVOUS_PORT)], headless=True
        ),
        controller_deployment(job, running),
        reward_deployment(job, running),
        rollout_deployment(job, running, rollout_replicas),
        trainer_statefulset(job, running, trainer_replicas),
        *([reward_network_policy(job)] if os.environ.get(names.NETWORK_POLICIES_ENV) == "1" else []),
        *agent_children(job, running),
    ]


def agent_children(job: ValidJob, running: bool) -> list[dict]:
    """Workflow agent: the Service in front of the rollout pods' gateways, and the job's agent runners if it has any
    (without them the job's agents are the user's own, reaching that Service)."""
    if job.config.rollout.workflow != "agent":
        return []
    gateway = service(job, "gateway", [("gateway", names.GATEWAY_PORT)], selector_role="rollout")
    return [gateway, *([agents_deployment(job, running)] if job.config.agents else [])]


def claim_token_secret(job: ValidJob, token: str) -> dict | None:
    """Workflow agent: the Secret the rollout pods and the agent runners read the job's claim token from. Not one of
    `desired_children`, which are a function of the job: the token is random, made once and never rewritten
    (apply.create_once), so the pods holding it keep agreeing. None for another workflow."""
    if job.config.rollout.workflow != "agent":
        return None
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(job, names.claim_token_secret_name(job.name), "gateway"),
        "type": "Opaque",
        "data": {names.CLAIM_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


class _ReadableDumper(yaml.SafeDumper):
    """Multi-line strings (the job file in the ConfigMap) as literal blocks, for people reading the output; no
    anchors and aliases where containers share a mount."""

    def ignore_aliases(self, data) -> bool:
        return True


_ReadableDumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


def to_yaml(objects: list[dict]) -> str:
    return yaml.dump_all(objects, Dumper=_ReadableDumper, sort_keys=False)


def config_text(job: ValidJob) -> str:
    return yaml.safe_dump(job.config.model_dump(mode="json"), sort_keys=False)


def config_map(job: ValidJob) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(job, names.config_map_name(job.name), "config"),
        "data": {names.CONFIG_KEY: config_text(job)},
    }


def service(
    job: ValidJob, role: str, ports: list[tuple[str, int]], *, headless: bool = False, selector_role: str | None = None
) -> dict:
    spec: dict = {
        "selector": names.selector_labels(job.name, selector_role or role),
        "ports": [{"name": name, "port": port, "targetPort": port, "protocol": "TCP"} for name, port in ports],
    }
    if headless:
        spec.update(clusterIP="None", publishNotReadyAddresses=True)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(job, names.child_name(job.name, role), role),
        "spec": spec,
    }
