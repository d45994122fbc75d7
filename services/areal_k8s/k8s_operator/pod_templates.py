"""What every child workload is built of: object metadata, containers (environment, probes, security contexts,
scratch space), volumes and pod templates."""

from __future__ import annotations

import copy
import hashlib
import os

import yaml

from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.pod_settings import add_pod_settings
from areal_k8s.k8s_operator.valid_job import ValidJob

# -- metadata ----------------------------------------------------------------------------------------------


def metadata(job: ValidJob, name: str, role: str) -> dict:
    meta = {"name": name, "namespace": job.namespace, "labels": names.labels(job.name, role)}
    if job.uid:  # garbage collection deletes the children with the RLJob
        meta["ownerReferences"] = [
            {
                "apiVersion": names.API_VERSION,
                "kind": names.KIND,
                "name": job.name,
                "uid": job.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    return meta


def config_hash(job: ValidJob) -> str:
    """Pods roll when the job configuration changes, but not when only the rollout pool is resized: the pool
    size in the file is informational (each worker registers with the controller on its own). The rebalancer's
    settings are the operator's alone: no pod reads them. The trainer's rank count reaches its pods as WORLD_SIZE
    (the trainer rolls with it, the other roles need not)."""
    stable = job.config.model_dump(
        mode="json", exclude={"rollout": {"workers", "engine_urls"}, "trainer": {"replicas"}, "rebalance": True}
    )
    return hashlib.sha256(yaml.safe_dump(stable, sort_keys=True).encode()).hexdigest()[:16]


# -- containers --------------------------------------------------------------------------------------------


def plain_env(values: dict[str, str]) -> list[dict]:
    return [{"name": k, "value": v} for k, v in values.items()]


def field_env(name: str, field_path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def process_env(threads: int) -> list[dict]:
    """As the launcher's child_env: unbuffered logs without progress bars and one thread pool size for torch and the
    BLAS. HOME (and so every cache below it: Hugging Face, Triton, FlashInfer) is on the writable scratch volume, and
    USER is set because the pod's user may have no passwd entry in an image the spec names (getpass needs one or the
    other)."""
    return plain_env(
        {
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "HOME": names.HOME_DIR,
            "USER": "areal",
        }
    )


def redis_env(job: ValidJob) -> dict:
    redis = job.spec["redis"]
    if "urlSecretRef" in redis:
        ref = redis["urlSecretRef"]
        return {"name": "AREAL_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref["key"]}}}
    return {"name": "AREAL_REDIS_URL", "value": redis["url"]}


def claim_token_env(job: ValidJob) -> dict:
    """Workflow agent: the token the rollout pods' gateways take an episode's claim with, and the runners give, from
    the Secret the operator makes once per job (handlers.py): nothing else in the cluster can claim the job's
    episodes, whose session keys the claim answers."""
    ref = {"name": names.claim_token_secret_name(job.name), "key": names.CLAIM_TOKEN_KEY}
    return {"name": "AREAL_CLAIM_TOKEN", "valueFrom": {"secretKeyRef": ref}}


def tracking_env(job: ValidJob) -> list[dict]:
    """The experiment trackers' API keys from the Secrets the spec's tracking section names, as the variables their
    libraries read (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN); only the trainer logs."""
    return [
        {"name": variable, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
        for variable, ref in job.config.tracking.secrets.items()
    ]


def resources(block: dict, gpus: int = 0) -> dict:
    out = {kind: dict(block[kind]) for kind in ("requests", "limits") if block.get(kind)}
    if gpus:  # extended resources are requested through limits (requests default to them)
        out.setdefault("limits", {})[names.GPU_RESOURCE] = gpus
    return out


# Every container: no privilege escalation, no capabilities, a read-only root filesystem (scratch space is the
# areal-tmp volume). The pod-level half (non-root user, seccomp) is POD_SECURITY_CONTEXT.
CONTAINER_SECURITY_CONTEXT = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
POD_SECURITY_CONTEXT = {
    "runAsNonRoot": True,
    "runAsUser": names.RUN_AS_USER,
    "runAsGroup": names.RUN_AS_GROUP,
    "fsGroup": names.RUN_AS_GROUP,  # the checkpoint claim becomes writable by the pod's user
    "fsGroupChangePolicy": "OnRootMismatch",
    "seccompProfile": {"type": "RuntimeDefault"},
}


def metrics_env() -> dict:
    return {"name": names.METRICS_PORT_ENV, "value": str(names.METRICS_PORT)}


def scratch_mounts(gpus: int) -> list[dict]:
    """/tmp on the scratch volume; with GPUs also a memory-backed /dev/shm (NCCL and SGLang need more than 64 MiB)."""
    mounts = [{"name": names.TMP_VOLUME, "mountPath": names.TMP_DIR}]
    if gpus:
        mounts.append({"name": names.SHM_VOLUME, "mountPath": "/dev/shm"})
    return mounts


def container(
    name: str,
    image: str,
    module: str,
    args: list[str],
    *,
    block: dict,
    env: list[dict],
    port: tuple[str, int] | None,
    readiness: dict | None,
    mounts: list[dict],
    resource_block: dict,
    gpus: int = 0,
    metrics: bool = True,
    startup: dict | None = None,
) -> dict:
    """One service container. With `metrics` it serves Prometheus metrics on names.METRICS_PORT (the port named
    `metrics`, which the chart's PodMonitor scrapes). Without `port` it serves nothing (an agent runner)."""
    ports = [{"name": port[0], "containerPort": port[1], "protocol": "TCP"}] if port else []
    if metrics:
        ports.append({"name": names.METRICS_PORT_NAME, "containerPort": names.METRICS_PORT, "protocol": "TCP"})
        env = [*env, metrics_env()]
    out = {
        "name": name,
        "image": image,
        "command": ["python", "-m", module],
        "args": args,
        "env": env,
        **({"ports": ports} if ports else {}),
        **({"readinessProbe": {**readiness, "periodSeconds": 5}} if readiness else {}),
        **({"startupProbe": startup} if startup else {}),
        "volumeMounts": [*mounts, *scratch_mounts(gpus)],
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
    }
    if block.get("imagePullPolicy"):
        out["imagePullPolicy"] = block["imagePullPolicy"]
    limits = resources(resource_block, gpus)
    if limits:
        out["resources"] = limits
    return out


def grpc_readiness(port: int, service_name: str) -> dict:
    return {"grpc": {"port": port, "service": service_name}}


def user_mounts(job: ValidJob) -> tuple[list[dict], list[dict]]:
    """(volumes, volumeMounts) for spec.mounts."""
    volumes, mounts = [], []
    for mount in job.spec.get("mounts", []):
        if "persistentVolumeClaim" in mount:
            source = {
                "persistentVolumeClaim": {
                    "claimName": mount["persistentVolumeClaim"]["claimName"],
                    "readOnly": mount["readOnly"],
                }
            }
        else:
            image = mount["image"]
            source = {
                "image": {
                    "reference": image["reference"],
                    **({"pullPolicy": image["pullPolicy"]} if "pullPolicy" in image else {}),
                }
            }
        volumes.append({"name": mount["name"], **source})
        volume_mount = {"name": mount["name"], "mountPath": mount["mountPath"], "readOnly": mount["readOnly"]}
        if "subPath" in mount:
            volume_mount["subPath"] = mount["subPath"]
        mounts.append(volume_mount)
    return volumes, mounts


def config_volume(job: ValidJob) -> tuple[dict, dict]:
    return (
        {"name": names.CONFIG_VOLUME, "configMap": {"name": names.config_map_name(job.name)}},
        {"name": names.CONFIG_VOLUME, "mountPath": names.CONFIG_DIR, "readOnly": True},
    )


def scratch_volumes(containers: list[dict]) -> list[dict]:
    volumes = [{"name": names.TMP_VOLUME, "emptyDir": {}}]
    if any(m["name"] == names.SHM_VOLUME for c in containers for m in c["volumeMounts"]):
        volumes.append({"name": names.SHM_VOLUME, "emptyDir": {"medium": "Memory"}})
    return volumes


def pod_template(
    job: ValidJob, role: str, containers: list[dict], volumes: list[dict], block: dict | None = None
) -> dict:
    """The pod of `role`, with its block's pod settings (default: spec.roles.<role>)."""
    block = job.spec["roles"][role] if block is None else block
    spec: dict = {
        "containers": containers,
        "volumes": [*volumes, *scratch_volumes(containers)],
        "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
        # Service links would put <SERVICE>_PORT variables into the environment; a Service named `areal` would set
        # AREAL_PORT, which the services read as their port.
        "enableServiceLinks": False,
        # The services never call the Kubernetes API, and the reward pods run verifier code: no token.
        "automountServiceAccountToken": False,
    }
    runtime_class = block.get("runtimeClassName") or (
        os.environ.get(names.REWARD_RUNTIME_CLASS_ENV) if role == "reward" else None
    )
    if runtime_class:
        spec["runtimeClassName"] = runtime_class
    for profile in (
        "seccompProfile",
        "appArmorProfile",
    ):  # reward's and rollout's: their sandboxes need user namespaces
        if profile in block:
            spec["securityContext"][profile] = block[profile]
    if block.get("nodeSelector"):
        spec["nodeSelector"] = block["nodeSelector"]
    if block.get("tolerations"):
        spec["tolerations"] = block["tolerations"]
    template = {
        "metadata": {
            "labels": names.labels(job.name, role),
            "annotations": {names.CONFIG_HASH_ANNOTATION: config_hash(job)},
        },
        "spec": spec,
    }
    return add_pod_settings(role, block, template)


def image_of(job: ValidJob, role: str) -> str:
    return job.spec["roles"][role].get("image") or names.default_image(role)


def deployment(job: ValidJob, role: str, replicas: int, template: dict, *, recreate: bool = False) -> dict:
    spec = {
        "replicas": replicas,
        "selector": {"matchLabels": names.selector_labels(job.name, role)},
        "template": template,
    }
    if recreate:
        spec["strategy"] = {"type": "Recreate"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(job, names.child_name(job.name, role), role),
        "spec": spec,
    }
