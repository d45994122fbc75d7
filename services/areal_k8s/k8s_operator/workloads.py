"""The RLJob's workloads, one per service, and the reward pods' NetworkPolicy. The wiring mirrors the local
launcher's (services/areal_k8s/cli/commands.py): the same modules, flags and ports, with Services in place of
loopback addresses."""

from __future__ import annotations

from areal_k8s.common.config import reward_verifier_args
from areal_k8s.common.sglang_args import sglang_flags
from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.pod_templates import (
    claim_token_env,
    config_volume,
    container,
    deployment,
    field_env,
    grpc_readiness,
    image_of,
    metadata,
    plain_env,
    pod_template,
    process_env,
    redis_env,
    tracking_env,
    user_mounts,
)
from areal_k8s.k8s_operator.valid_job import ENGINE_URL, ValidJob


def address(job: ValidJob, role: str, port: int) -> str:
    return f"{names.child_name(job.name, role)}:{port}"


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


# the job's pods but the agent runners: they run the user's programs, and reach the rollout pods' gateway only
NOT_AGENTS = {"key": names.LABEL_COMPONENT, "operator": "NotIn", "values": [names.AGENTS]}


def reward_network_policy(job: ValidJob) -> dict:
    """The job's reward pods run untrusted programs: their scoring port admits the job's own pods only, its agent
    runners excepted. Created where the chart's NetworkPolicies are on; the chart's per-namespace policy adds the
    metrics scrapers and takes away all egress (policies add up, so neither may admit more than it means to)."""
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
                    "from": [{"podSelector": {"matchLabels": own_pods, "matchExpressions": [NOT_AGENTS]}}],
                }
            ],
        },
    }


def engine_container(job: ValidJob, block: dict, mounts: list[dict]) -> dict:
    rollout, config = job.config.rollout, job.config
    engine_block, gpus = block["engine"], block["gpusPerPod"]
    if rollout.engine == "cpu":
        image = engine_block.get("image") or image_of(job, "rollout")
        module = "areal_k8s.cpu_engine"
        args = config.cpu_engine_args("127.0.0.1", names.ENGINE_PORT)
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
        args += sglang_flags(rollout.sglang_args)  # checked against the pinned SGLang's arguments
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
    # workflow agent: the gateway on a fixed port; a claim through the Service <job>-gateway reaches any pod, and the
    # session's base URL it answers is the pod's own, where the session lives
    gateway = job.config.rollout.workflow == "agent"
    gateway_args = ["--gateway-port", str(names.GATEWAY_PORT)] if gateway else []
    gateway_env = (
        [{"name": "AREAL_GATEWAY_ADVERTISE", "value": f"$(POD_IP):{names.GATEWAY_PORT}"}, claim_token_env(job)]
        if gateway
        else []
    )
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
            *gateway_args,
        ],
        block=block,
        env=[
            *process_env(1),
            redis_env(job),
            field_env("AREAL_WORKER_ID", "metadata.name"),
            field_env("POD_IP", "status.podIP"),
            # the trainer reaches each worker at its pod IP to drive weight updates
            {"name": "AREAL_ADVERTISE_ADDRESS", "value": f"$(POD_IP):{names.ROLLOUT_PORT}"},
            *gateway_env,
        ],
        port=("grpc", names.ROLLOUT_PORT),
        readiness=grpc_readiness(names.ROLLOUT_PORT, "areal.v1.Rollout"),
        mounts=[config_mount, *mounts],
        resource_block=block.get("resources", {}),
    )
    if gateway:
        agent["ports"].append({"name": "gateway", "containerPort": names.GATEWAY_PORT, "protocol": "TCP"})
    template = pod_template(job, "rollout", [agent, engine_container(job, block, mounts)], [config_vol, *volumes])
    return deployment(job, "rollout", (block["replicas"] if replicas is None else replicas) if running else 0, template)


def agents_deployment(job: ValidJob, running: bool) -> dict:
    """The agent runners (`spec.agents`): each claims episodes through the Service <job>-gateway and runs the
    user's program (in `agents.image`, with the job's mounts) per episode. They serve nothing."""
    agents = job.config.agents
    block = {"resources": agents.resources}  # its pod settings are the job file's agents section
    config_vol, config_mount = config_volume(job)
    volumes, mounts = user_mounts(job)
    main = container(
        "agent-runner",
        agents.image or image_of(job, "rollout"),
        "areal_k8s.agent_runner",
        ["--job", names.JOB_FILE, "--gateway", f"http://{address(job, 'gateway', names.GATEWAY_PORT)}"],
        block=block,
        env=[*process_env(1), field_env("AREAL_RUNNER_NAME", "metadata.name"), claim_token_env(job)],
        port=None,
        readiness=None,
        mounts=[config_mount, *mounts],
        resource_block=agents.resources,
        metrics=False,
    )
    template = pod_template(job, names.AGENTS, [main], [config_vol, *volumes], block)
    return deployment(job, names.AGENTS, agents.replicas if running else 0, template)


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
        *tracking_env(job),
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
        # suspend scales to zero and keeps the claims (the checkpoints); deleting the job keeps them unless the
        # spec says `retention: Delete` (the model to take home is on them)
        spec["persistentVolumeClaimRetentionPolicy"] = {"whenDeleted": checkpoint["retention"], "whenScaled": "Retain"}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata(job, name, "trainer"), "spec": spec}
