"""Names the CRD, the operator and the child manifests agree on: API coordinates, labels, ports, object names."""

from __future__ import annotations

import hashlib
import os
from importlib.metadata import PackageNotFoundError, version

GROUP = "areal-k8s.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ["rlj"]
CRD_NAME = f"{PLURAL}.{GROUP}"

ROLES = ("controller", "reward", "rollout", "trainer")

# The StatefulSet `<name>-trainer` must stay within 52 characters (its pods' controller-revision-hash label adds
# 11 and must fit in 63), and the job key `<name>-<6 hex>` within JobConfig's 48: 40 satisfies both.
MAX_NAME_LENGTH = 40

# Ports the services listen on inside their pods (their own defaults, see each service's __main__).
CONTROLLER_PORT = 50051
ROLLOUT_PORT = 50052
REWARD_PORT = 50053
TRAINER_PORT = 50054
ENGINE_PORT = 30000
GATEWAY_PORT = 50055  # workflow agent: each rollout pod's agent gateway (OpenAI API), behind the Service <job>-gateway
AGENTS = "agents"  # the agent runners' component: not one of `roles`, its settings are the job file's `agents`
TORCH_RENDEZVOUS_PORT = 29500
# Prometheus metrics (/metrics over HTTP, env AREAL_METRICS_PORT) of the controller, reward, rollout agent and
# trainer containers, in a container port of this name; the chart's PodMonitor scrapes that port by name.
METRICS_PORT = 9400
METRICS_PORT_NAME = "metrics"
METRICS_PORT_ENV = "AREAL_METRICS_PORT"

CONFIG_DIR = "/etc/areal"
CONFIG_KEY = "job.yaml"
CLAIM_TOKEN_KEY = "token"  # in the Secret <job>-claim-token: what the agent runners claim episodes with
JOB_FILE = f"{CONFIG_DIR}/{CONFIG_KEY}"
GPU_RESOURCE = "nvidia.com/gpu"

# Volumes the operator adds itself; user mounts may not take these names.
RESERVED_VOLUME_PREFIX = "areal-"
CONFIG_VOLUME = "areal-config"
CHECKPOINT_VOLUME = "areal-checkpoint"
TMP_VOLUME = "areal-tmp"  # the containers' root filesystems are read-only: scratch space, caches and HOME live here
SHM_VOLUME = "areal-shm"  # /dev/shm in memory for GPU pods (NCCL, SGLang): the runtime's default is 64 MiB
TMP_DIR = "/tmp"
HOME_DIR = f"{TMP_DIR}/home"

# Every pod the operator creates runs as this non-root user (the images' own user, see images/), with a read-only
# root filesystem, no capabilities, no privilege escalation and the runtime's default seccomp profile; fsGroup
# makes the checkpoint claim writable by it.
RUN_AS_USER = 10001
RUN_AS_GROUP = 10001

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
APP_NAME = "areal-k8s"
MANAGER = "areal-k8s-operator"
FINALIZER = f"{GROUP}/redis-cleanup"
LAST_APPLIED_ANNOTATION = f"{GROUP}/last-applied"
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"
# The StatefulSet controller labels each pod with its ordinal (Kubernetes >= 1.28): the trainer's node rank.
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"

# Images: `<repository>/<component>:<tag>`, built from images/<component>/Dockerfile (`make images`). The tag is
# the package version, which is also the chart's appVersion (tests/cluster/test_images.py keeps the three in step).
IMAGE_REPOSITORY = "ghcr.io/areal-k8s"
IMAGE_COMPONENTS = ("operator", "controller", "reward", "rollout", "sglang", "trainer", "cpu")
# The chart sets these on the operator (values `jobImages.repository`/`jobImages.tag`), e.g. for a registry mirror.
IMAGE_REPOSITORY_ENV = "AREAL_IMAGE_REPOSITORY"
IMAGE_TAG_ENV = "AREAL_IMAGE_TAG"
REWARD_RUNTIME_CLASS_ENV = "AREAL_REWARD_RUNTIME_CLASS"  # the chart's jobs.rewardRuntimeClassName
NETWORK_POLICIES_ENV = "AREAL_NETWORK_POLICIES"  # "1": the chart's networkPolicy.enabled (each job's reward policy)

# Kueue (kubernetes-sigs/kueue): an RLJob with a queue waits as a Workload of this API until Kueue admits it
KUEUE_API = "kueue.x-k8s.io/v1beta2"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def operator_version() -> str:
    try:
        return version("areal-k8s")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "latest"


def default_image(component: str) -> str:
    """The image of a role a spec leaves unset: the operator's own version, unless the environment overrides it."""
    repository = os.environ.get(IMAGE_REPOSITORY_ENV) or IMAGE_REPOSITORY
    tag = os.environ.get(IMAGE_TAG_ENV) or operator_version()
    return f"{repository.rstrip('/')}/{component}:{tag}"


def child_name(job: str, role: str) -> str:
    return f"{job}-{role}"


def config_map_name(job: str) -> str:
    return f"{job}-config"


def claim_token_secret_name(job: str) -> str:
    return f"{job}-claim-token"


def job_key(namespace: str, name: str) -> str:
    """The JobConfig name, which scopes the job's Redis keys (`areal:{key}:...`).

    A shared Redis may serve RLJobs of equal names in different namespaces: the namespace's digest keeps their
    keys apart, so one job's finalizer never deletes another's stream.
    """
    return f"{name}-{hashlib.sha256(namespace.encode()).hexdigest()[:6]}"


def selector_labels(job: str, role: str) -> dict[str, str]:
    return {LABEL_NAME: APP_NAME, LABEL_INSTANCE: job, LABEL_COMPONENT: role}


def labels(job: str, role: str) -> dict[str, str]:
    return {**selector_labels(job, role), LABEL_MANAGED_BY: MANAGER}


def job_selector(job: str) -> str:
    """A label selector (string form) for every pod of the job."""
    return f"{LABEL_NAME}={APP_NAME},{LABEL_INSTANCE}={job}"


def role_selector(job: str, role: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(job, role).items())
