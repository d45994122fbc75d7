"""The Kubernetes objects an RLJob owns, as a pure function of the checked job.

The operator applies these; `arealctl manifests` prints them. The wiring mirrors the local launcher
(services/areal_k8s/cli/launcher.py): the same modules, flags and ports, with Services in place of loopback addresses.
"""

from __future__ import annotations

import copy
import hashlib
import os

import yaml

from areal_k8s.common.config import reward_verifier_args
from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.validation import ENGINE_URL, ValidJob

CHILD_KINDS = {  # kind -> (apiVersion, plural): everything the operator creates
    "ConfigMap": ("v1", "configmaps"),
    "Service": ("v1", "services"),
    "Deployment": ("apps/v1", "deployments"),
    "StatefulSet": ("apps/v1", "statefulsets"),
    "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies"),
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
    ]


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


def config_text(job: ValidJob) -> str:
    return yaml.safe_dump(job.config.model_dump(mode="json"), sort_keys=False)


def config_hash(job: ValidJob) -> str:
    """Pods roll when the job configuration changes, but not when only the rollout pool is resized: the pool
    size in the file is informational (each worker registers with the controller on its own). The rebalancer's
    settings are the operator's alone: no pod reads them. The trainer's rank count reaches its pods as WORLD_SIZE
    (the trainer rolls with it, the other roles need not)."""
    stable = job.config.model_dump(
        mode="json", exclude={"rollout": {"workers", "engine_urls"}, "trainer": {"replicas"}, "rebalance": True}
    )
    return hashlib.sha256(yaml.safe_dump(stable, sort_keys=True).encode()).hexdigest()[:16]


def config_map(job: ValidJob) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(job, names.config_map_name(job.name), "config"),
        "data": {names.CONFIG_KEY: config_text(job)},
    }


def service(job: ValidJob, role: str, ports: list[tuple[str, int]], *, headless: bool = False) -> dict:
    spec: dict = {
        "selector": names.selector_labels(job.name, role),
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


def address(job: ValidJob, role: str, port: int) -> str:
    return f"{names.child_name(job.name, role)}:{port}"


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
    port: tuple[str, int],
    readiness: dict,
    mounts: list[dict],
    resource_block: dict,
    gpus: int = 0,
    metrics: bool = True,
    startup: dict | None = None,
) -> dict:
    """One service container. With `metrics` it serves Prometheus metrics on names.METRICS_PORT (the port named
    `metrics`, which the chart's PodMonitor scrapes)."""
    port_name, port_number = port
    ports = [{"name": port_name, "containerPort": port_number, "protocol": "TCP"}]
    if metrics:
        ports.append({"name": names.METRICS_PORT_NAME, "containerPort": names.METRICS_PORT, "protocol": "TCP"})
        env = [*env, metrics_env()]
    out = {
        "name": name,
        "image": image,
        "command": ["python", "-m", module],
        "args": args,
        "env": env,
        "ports": ports,
        "readinessProbe": {**readiness, "periodSeconds": 5},
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


# SGLang's /health runs a one-token generation and answers 503 itself after SGLANG_HEALTH_CHECK_TIMEOUT (20 s):
# the probe waits longer than that, so a busy engine is not taken for a dead one.
ENGINE_HEALTH_TIMEOUT_SECONDS = 30
ENGINE_STARTUP_SECONDS = 1800  # loading a large model from a network volume takes minutes
ENGINE_HEALTH_CHECK = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2]))"


def engine_health_probe() -> dict:
    """GET the engine's /health from inside its container. The engine listens on 127.0.0.1 only: its API (weight
    updates, pausing generation) is for the rollout agent beside it, and an httpGet probe, which the kubelet sends
    to the pod IP, would never reach it."""
    return {
        "exec": {
            "command": [
                "python",
                "-c",
                ENGINE_HEALTH_CHECK,
                f"{ENGINE_URL}/health",
                str(ENGINE_HEALTH_TIMEOUT_SECONDS - 5),
            ]
        },
        "timeoutSeconds": ENGINE_HEALTH_TIMEOUT_SECONDS,
    }


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


def pod_template(job: ValidJob, role: str, containers: list[dict], volumes: list[dict]) -> dict:
    block = job.spec["roles"][role]
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
    return {
        "metadata": {
            "labels": names.labels(job.name, role),
            "annotations": {names.CONFIG_HASH_ANNOTATION: config_hash(job)},
        },
        "spec": spec,
    }


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


# -- workloads ---------------------------------------------------------------------------------------------


def controller_deployment(job: ValidJob, running: bool) -> dict:
    block = job.spec["roles"]["controller"]
    config_vol, config_mount = config_volume(job)
    volumes, mounts = user_mounts(job)  # the controller reads the training prompts
    main = container(
        "controller",
        image_of(job, "controller"),
        "areal_k8s.controller",
        # with the reward service it checks that every verifier of the job loads before it admits any work
        [
            "--job",
            names.JOB_FILE,
            "--host",
            "0.0.0.0",
            "--port",
            str(names.CONTROLLER_PORT),
            "--reward",
            address(job, "reward", names.REWARD_PORT),
        ],
        block=block,
        env=[*process_env(1), redis_env(job)],
        port=("grpc", names.CONTROLLER_PORT),
        readiness=grpc_readiness(names.CONTROLLER_PORT, "areal.v1.Controller"),
        mounts=[config_mount, *mounts],
        resource_block=block.get("resources", {}),
    )
    # Recreate: two controllers would both admit prompt groups against the same Redis state.
    return deployment(
        job, "controller", int(running), pod_template(job, "controller", [main], [config_vol, *volumes]), recreate=True
    )


def reward_deployment(job: ValidJob, running: bool) -> dict:
    block, reward = job.spec["roles"]["reward"], job.config.reward
    main = container(
        "reward",
        image_of(job, "reward"),
        "areal_k8s.reward",
        [
            "--host",
            "0.0.0.0",
            "--port",
            str(names.REWARD_PORT),
            "--workers",
            str(reward.workers),
            "--timeout",
            str(reward.timeout_seconds),
            "--job-name",
            job.config.name,
            *reward_verifier_args(reward),
        ],
        block=block,
        env=process_env(1),
        port=("grpc", names.REWARD_PORT),
        readiness=grpc_readiness(names.REWARD_PORT, "areal.v1.Reward"),
        mounts=[],
        resource_block=block.get("resources", {}),
        gpus=block["gpusPerPod"],
    )
    return deployment(job, "reward", block["replicas"] if running else 0, pod_template(job, "reward", [main], []))


def reward_network_policy(job: ValidJob) -> dict:
    """The job's reward pods run untrusted programs: their scoring port admits the job's own pods only. Created
    where the chart's NetworkPolicies are on; the chart's per-namespace policy adds the metrics scrapers and takes
    away all egress (policies add up, so neither may admit more than it means to)."""
    own_pods = {names.LABEL_NAME: names.APP_NAME, names.LABEL_INSTANCE: job.name}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(job, names.child_name(job.name, "reward"), "reward"),
        "spec": {
            "podSelector": {"matchLabels": names.selector_labels(job.name, "reward")},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "ports": [{"port": names.REWARD_PORT, "protocol": "TCP"}],
                    "from": [{"podSelector": {"matchLabels": own_pods}}],
                }
            ],
        },
    }


def engine_container(job: ValidJob, block: dict, mounts: list[dict]) -> dict:
    rollout, config = job.config.rollout, job.config
    engine_block, gpus = block["engine"], block["gpusPerPod"]
    if rollout.engine == "cpu":
        image = engine_block.get("image") or image_of(job, "rollout")
        module = "areal_k8s.rollout.cpu_engine"
        args = [
            "--model-path",
            config.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(names.ENGINE_PORT),
            "--max-batch-size",
            str(rollout.max_batch_size),
            "--threads",
            str(rollout.threads),
            "--seed",
            str(config.seed),
        ]
    else:
        image = engine_block.get("image") or names.default_image("sglang")
        module = "sglang.launch_server"
        args = [
            "--model-path",
            config.model,
            "--tokenizer-path",
            config.tokenizer_path,
            "--host",
            "127.0.0.1",
            "--port",
            str(names.ENGINE_PORT),
            "--tp-size",
            str(gpus),
            "--random-seed",
            str(config.seed),
        ]
        if rollout.interrupt == "retract":  # retracted requests wait in the queue, where the cache cannot be flushed
            args.append("--disable-radix-cache")
    # The engine is not one of the services: its metrics, if any, are the engine's own business.
    return container(
        "engine",
        image,
        module,
        args,
        block=block,
        env=process_env(rollout.threads),
        port=("http", names.ENGINE_PORT),
        readiness=engine_health_probe(),
        mounts=mounts,
        resource_block=engine_block.get("resources", {}),
        gpus=gpus,
        metrics=False,
        # readiness waits for the model to load; an engine that has not answered by then is restarted
        startup={**engine_health_probe(), "periodSeconds": 5, "failureThreshold": ENGINE_STARTUP_SECONDS // 5},
    )


def rollout_deployment(job: ValidJob, running: bool, replicas: int | None = None) -> dict:
    block = job.spec["roles"]["rollout"]
    config_vol, config_mount = config_volume(job)
    volumes, mounts = user_mounts(job)
    agent = container(
        "rollout",
        image_of(job, "rollout"),
        "areal_k8s.rollout",
        [
            "--job",
            names.JOB_FILE,
            "--host",
            "0.0.0.0",
            "--port",
            str(names.ROLLOUT_PORT),
            "--when-done",
            "wait",
            "--engine-url",
            ENGINE_URL,
            "--controller",
            address(job, "controller", names.CONTROLLER_PORT),
            "--reward",
            address(job, "reward", names.REWARD_PORT),
        ],
        block=block,
        env=[
            *process_env(1),
            redis_env(job),
            field_env("AREAL_WORKER_ID", "metadata.name"),
            field_env("POD_IP", "status.podIP"),
            # the trainer reaches each worker at its pod IP to drive weight updates
            {"name": "AREAL_ADVERTISE_ADDRESS", "value": f"$(POD_IP):{names.ROLLOUT_PORT}"},
        ],
        port=("grpc", names.ROLLOUT_PORT),
        readiness=grpc_readiness(names.ROLLOUT_PORT, "areal.v1.Rollout"),
        mounts=[config_mount, *mounts],
        resource_block=block.get("resources", {}),
    )
    template = pod_template(job, "rollout", [agent, engine_container(job, block, mounts)], [config_vol, *volumes])
    return deployment(job, "rollout", (block["replicas"] if replicas is None else replicas) if running else 0, template)


def trainer_statefulset(job: ValidJob, running: bool, replicas: int | None = None) -> dict:
    block, checkpoint = job.spec["roles"]["trainer"], job.spec["checkpoint"]
    parallel = block["parallelism"]
    name = names.child_name(job.name, "trainer")
    ranks_per_pod = max(block["gpusPerPod"], 1)
    pods = block["replicas"] if replicas is None else replicas  # the rebalancer's size, when it moves the trainer
    world_size = pods * ranks_per_pod
    config_vol, config_mount = config_volume(job)
    volumes, mounts = user_mounts(job)
    checkpoint_mount = {"name": names.CHECKPOINT_VOLUME, "mountPath": checkpoint["mountPath"]}
    env = [
        *process_env(job.config.trainer.threads),
        redis_env(job),
        field_env("POD_IP", "status.podIP"),
        # the rollout engines join the trainer's weight-update group at this address
        {"name": "AREAL_MASTER_ADDRESS", "value": "$(POD_IP)"},
        # torch.distributed rendezvous of the trainer ranks (torchrun's variables), through the headless Service
        *plain_env(
            {
                "MASTER_ADDR": f"{name}-0.{name}",
                "MASTER_PORT": str(names.TORCH_RENDEZVOUS_PORT),
                "NNODES": str(pods),
                "NPROC_PER_NODE": str(ranks_per_pod),
                "WORLD_SIZE": str(world_size),  # pods × ranks_per_pod
                "AREAL_TENSOR_PARALLEL_SIZE": str(parallel["tensor"]),
                "AREAL_PIPELINE_PARALLEL_SIZE": str(parallel["pipeline"]),
                "AREAL_DATA_PARALLEL_SIZE": str(world_size // (parallel["tensor"] * parallel["pipeline"])),
            }
        ),
        field_env("NODE_RANK", f"metadata.labels['{names.POD_INDEX_LABEL}']"),
    ]
    main = container(
        "trainer",
        image_of(job, "trainer"),
        "areal_k8s.trainer",
        [
            "--job",
            names.JOB_FILE,
            "--host",
            "0.0.0.0",
            "--port",
            str(names.TRAINER_PORT),
            "--when-done",
            "wait",
            "--controller",
            address(job, "controller", names.CONTROLLER_PORT),
        ],
        block=block,
        env=env,
        port=("grpc", names.TRAINER_PORT),
        readiness=grpc_readiness(names.TRAINER_PORT, "areal.v1.Trainer"),
        mounts=[config_mount, checkpoint_mount, *mounts],
        resource_block=block.get("resources", {}),
        gpus=block["gpusPerPod"],
    )
    if ranks_per_pod > 1:
        # one process per GPU, as the trainer requires: torchrun starts them (LOCAL_RANK, RANK) from the variables
        # above and hosts the world's rendezvous store on pod 0, which the ranks join (their world reads it)
        main["command"] = [
            "torchrun",
            "--nnodes=$(NNODES)",
            "--nproc-per-node=$(NPROC_PER_NODE)",
            "--node-rank=$(NODE_RANK)",
            "--master-addr=$(MASTER_ADDR)",
            "--master-port=$(MASTER_PORT)",
            "-m",
            "areal_k8s.trainer",
        ]
    if "claimName" in checkpoint:
        volumes.append(
            {"name": names.CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": checkpoint["claimName"]}}
        )
    spec: dict = {
        "replicas": pods if running else 0,
        "serviceName": name,
        "podManagementPolicy": "Parallel",  # every rank must be up for the rendezvous; no point starting them in turn
        "selector": {"matchLabels": names.selector_labels(job.name, "trainer")},
        "template": pod_template(job, "trainer", [main], [config_vol, *volumes]),
    }
    if "volumeClaimTemplate" in checkpoint:
        claim = checkpoint["volumeClaimTemplate"]
        claim_spec: dict = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": claim["size"]}}}
        if "storageClassName" in claim:
            claim_spec["storageClassName"] = claim["storageClassName"]
        spec["volumeClaimTemplates"] = [{"metadata": {"name": names.CHECKPOINT_VOLUME}, "spec": claim_spec}]
        # suspend scales to zero and keeps the claims (the checkpoints); deleting the job deletes them
        spec["persistentVolumeClaimRetentionPolicy"] = {"whenDeleted": "Delete", "whenScaled": "Retain"}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata(job, name, "trainer"), "spec": spec}
