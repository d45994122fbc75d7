"""The project's images run as the operator runs them: the pods of RLJobs as real containers (support/kubelet.py with
`containers=True`: podman with runc), from the images `make python-images` builds, each with the pod's own security
context (uid/gid 10001, fsGroup, read-only root, no capabilities, no privilege escalation, seccomp RuntimeDefault),
env, memory limits and volumes (HOME, the /tmp emptyDir, the assets and checkpoint claims, the job's ConfigMap).

- The CPU example (every role on the cpu image) trains to completion; its trainer container is SIGKILLed mid-run and
  its restart policy brings it back in the same pod, with nothing lost or trained twice; the trainer runs the image's
  package, the reward pod's code sandbox starts in its container; the final model is read back from the trainer's
  checkpoint claim.
- A job on the role images (controller, reward, rollout with its CPU engine; the trainer on the cpu image, the
  trainer image being CUDA's) starts every entrypoint and each answers its readiness probe; the reward image's code
  sandbox (bubblewrap inside the container) scores a correct program 1, and a fork bomb and a program looking for
  the pod's files and network 0, the service living on.
- The reward sandbox under a runtime default as strict about namespaces as containerd's and CRI-O's
  (support/seccomp_profiles.py): the verifier check fails naming the pod's seccomp profile, and passes under that
  profile plus exactly the calls the chart's README says a cluster must allow (SANDBOX_SYSCALLS).
The chart's Redis runs on the host's image (its Valkey image cannot be pulled here). Skipped with the reason where
podman cannot run or the images are missing or older than the code (make python-images); failed instead under
AREAL_REQUIRE_CONTAINERS=1 (CI)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess

import pytest
from support.e2e_jobs import final_history
from support.kubelet import Cluster
from support.kubelet_podman import missing as podman_missing
from support.kubelet_podman import podman, podman_env
from support.kubelet_runtime import REPOSITORY
from support.seccomp_profiles import allowing, stricter_default
from test_images import dockerfile
from test_pods import (  # the example as test_pods.py runs it in the overlay runtime
    condition,
    demo_assets,  # noqa: F401 (a fixture)
    example_cluster,
    no_leftover_namespaces,  # noqa: F401 (an autouse fixture)
    reconcile,
    run_to_the_end,
    the_example,
    trained_steps,
)
from transformers import AutoModelForCausalLM

from areal_k8s.api.v1 import reward_pb2
from areal_k8s.common.final_model import FINAL_DIR
from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.children import desired_children
from areal_k8s.k8s_operator.validation import validate

pytestmark = pytest.mark.e2e

IMAGES = ("operator", "controller", "reward", "rollout", "cpu")
LOCAL_BASE = "localhost/areal-k8s/python-base:bookworm"  # make base-image's
PINNED_BASE = dockerfile("controller").args["PYTHON_IMAGE"]  # the Python images' pinned base
TOTAL_STEPS, CHECKPOINT_INTERVAL, KILL_AFTER = 16, 4, 6  # the trainer dies between two checkpoints
STARTUP_SECONDS = 300  # for every pod of a job to be ready (the images' imports take long on a loaded machine)
# the calls bubblewrap makes to build its sandbox, which a stricter runtime default refuses a container without
# CAP_SYS_ADMIN: charts/areal/README.md lists them for a Localhost profile
SANDBOX_SYSCALLS = ("clone", "unshare", "mount", "pivot_root", "umount2")
ADD_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"
ADD_STDIO = [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6"}]
FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
# what a program could want of the pod: the system's files, the service's environment, a service account's token,
# the network (the node's DNS)
ESCAPE = (
    "import socket\n"
    "for path in ('/etc/passwd', '/opt/areal/bin/python', '/var/run/secrets/kubernetes.io/serviceaccount/token'):\n"
    "    try:\n        open(path).read()\n        print('read', path)\n"
    "    except OSError as exc:\n        print(type(exc).__name__)\n"
    "try:\n    socket.create_connection(('10.244.0.1', 53), timeout=1)\n    print('connected')\n"
    "except OSError as exc:\n    print(type(exc).__name__)\n"
)


def image(name: str) -> str:
    return f"{names.IMAGE_REPOSITORY}/{name}:{names.operator_version()}"


@pytest.fixture(scope="module")
def images() -> None:
    """The images are on this machine and as new as the code (images/build.sh CHECK=1), else skip or fail."""
    why = podman_missing()
    if why is None:
        checked = subprocess.run(
            ["bash", "images/build.sh"],
            cwd=REPOSITORY,
            env={**podman_env(), "DOCKER": "podman", "CHECK": "1", "IMAGES": " ".join(IMAGES)},
            capture_output=True,
            text=True,
        )
        if checked.returncode:
            why = f"images missing or older than the code ({' '.join(checked.stdout.split())}): make python-images"
    if why and os.environ.get("AREAL_REQUIRE_CONTAINERS") == "1":
        pytest.fail(f"containers are required (AREAL_REQUIRE_CONTAINERS=1): {why}")
    if why:
        pytest.skip(why)


def ready_pods(cluster: Cluster, ready: bool = True) -> dict:
    """The live pods by role (with `ready`, only those ready)."""
    return {
        p.labels[names.LABEL_COMPONENT]: p for p in cluster.pods.values() if (p.ready or not ready) and not p.deleted
    }


def code_item(item_id: str, program: str) -> reward_pb2.ScoreItem:
    return reward_pb2.ScoreItem(
        item_id=item_id, verifier="code", response=f"```python\n{program}\n```", reference=json.dumps(ADD_STDIO)
    )


async def score(cluster: Cluster, address: str, *items) -> dict[str, reward_pb2.ScoreResult]:
    request = reward_pb2.ScoreRequest(items=items)
    reply = await cluster.grpc_call(address, "/areal.v1.Reward/Score", request, reward_pb2.ScoreResponse)
    return {result.item_id: result for result in reply.results}


async def check_code_verifier(cluster: Cluster, address: str) -> None:
    """The check the controller has the reward service run at a job's start, for the `code` verifier: its sandbox
    runs a trivial program (raises ConnectionError with the reason where it cannot)."""
    request = reward_pb2.CheckVerifiersRequest(verifiers=["code"])
    await cluster.grpc_call(address, "/areal.v1.Reward/CheckVerifiers", request, reward_pb2.CheckVerifiersResponse)


@pytest.mark.timeout(480)
async def test_the_cpu_example_runs_as_containers_to_completion(tmp_path, demo_assets, images):  # noqa: F811
    rljob = the_example()
    rljob["spec"]["algorithm"]["total_steps"] = TOTAL_STEPS
    rljob["spec"]["trainer"].update(checkpoint_interval=CHECKPOINT_INTERVAL, eval_interval=0)
    job = validate(rljob)
    algorithm = job.config.algorithm
    killed: dict = {}
    async with example_cluster(tmp_path, demo_assets, containers=True) as cluster:

        async def the_pods_run_the_image() -> str:
            """Once they are ready: the reward pod's sandbox starts, the trainer runs the image's package."""
            pods = await cluster.wait_for(
                lambda: {"trainer", "reward"} <= ready_pods(cluster).keys() and ready_pods(cluster),
                "the trainer and reward pods",
                STARTUP_SECONDS,
            )
            await check_code_verifier(cluster, f"{pods['reward'].ip}:{names.REWARD_PORT}")
            trainer = pods["trainer"].containers[0]
            code, output = await trainer.runtime.exec(
                trainer, ["python", "-c", "import areal_k8s; print(areal_k8s.__file__)"], 60
            )
            assert code == 0, output
            return output.strip()

        image_checks = asyncio.create_task(the_pods_run_the_image())

        def kill_the_trainer_once(status: dict) -> None:
            if image_checks.done():
                image_checks.result()  # a check that failed fails the test now
            trained = max((s["version"] for s in trained_steps(cluster, job)), default=0)
            if "at" not in killed and trained >= KILL_AFTER:
                killed["at"] = trained
                Cluster.kill_group(ready_pods(cluster, ready=False)["trainer"].containers[0])

        try:
            statuses, described = await run_to_the_end(
                cluster, job, timeout=STARTUP_SECONDS + 120, each=kill_the_trainer_once
            )
        finally:
            if not image_checks.done():
                image_checks.cancel()
        package = await image_checks
        steps = trained_steps(cluster, job)
        claim = cluster.claims[f"{names.CHECKPOINT_VOLUME}-{names.child_name(job.name, 'trainer')}-0"]
    assert condition(statuses[-1], "Complete") == ("True", "TrainingFinished"), described
    assert package.startswith("/opt/areal/lib/python3.") and package.endswith("/areal_k8s/__init__.py"), package
    # the trainer was killed mid-run and came back in its pod (its restart policy); the operator counted it once
    assert KILL_AFTER <= killed.get("at", 0) < TOTAL_STEPS, killed
    assert max(s.get("replicas", {}).get("trainer", {}).get("restarts", 0) for s in statuses) == 1, described
    # nothing lost or trained twice in the history: each step once, every group and entry once, all within η; what
    # was trained again is at most what followed the last checkpoint before the kill
    _, redone = final_history(
        steps,
        total_steps=TOTAL_STEPS,
        batch_size=algorithm.batch_size,
        group_size=algorithm.group_size,
        max_staleness=algorithm.max_staleness,
        checkpoint_interval=CHECKPOINT_INTERVAL,
        context=described,
    )
    assert redone <= CHECKPOINT_INTERVAL, (redone, killed)
    # the model the job hands over, read back from the trainer's checkpoint claim
    model = AutoModelForCausalLM.from_pretrained(claim / job.config.name / FINAL_DIR)
    assert model.config.num_hidden_layers == 1


def role_images_job(reward_seccomp: dict | None = None) -> dict:
    """The example on each role's own image (the trainer on the cpu image: the trainer image is CUDA's)."""
    rljob = the_example()
    roles = rljob["spec"]["roles"]
    for role, name in (("controller", "controller"), ("reward", "reward"), ("rollout", "rollout"), ("trainer", "cpu")):
        roles[role]["image"] = image(name)
    if reward_seccomp:
        roles["reward"]["seccompProfile"] = reward_seccomp
    return rljob


@pytest.mark.timeout(420)
async def test_each_image_runs_its_role_as_the_operator_runs_it(tmp_path, demo_assets, images):  # noqa: F811
    job = validate(role_images_job())
    async with example_cluster(tmp_path, demo_assets, containers=True) as cluster:
        status: dict = {}
        deadline = asyncio.get_running_loop().time() + STARTUP_SECONDS
        while condition(status, "Ready") != ("True", "AllReplicasReady"):
            assert asyncio.get_running_loop().time() < deadline, f"{status.get('conditions')}\n{cluster.describe()}"
            status = await reconcile(cluster, job, status)
            await asyncio.sleep(1)
        pods = ready_pods(cluster)
        assert {role: sorted(c.spec["image"] for c in pods[role].containers) for role in names.ROLES} == {
            "controller": [image("controller")],
            "reward": [image("reward")],
            "rollout": [image("rollout")] * 2,  # the agent and the CPU engine
            "trainer": [image("cpu")],
        }
        address = f"{pods['reward'].ip}:{names.REWARD_PORT}"
        await check_code_verifier(cluster, address)
        results = await score(
            cluster,
            address,
            code_item("correct", ADD_PROGRAM),
            code_item("bomb", FORK_BOMB),
            code_item("escape", ESCAPE),
        )
        reward = pods["reward"].containers[0]
        assert reward.ready and reward.restarts == 0 and "running" in reward.state, cluster.describe()
    assert (results["correct"].reward, results["correct"].message) == (1.0, "2/2 tests passed"), results
    assert results["bomb"].reward == 0.0 and "killed" in results["bomb"].message, results["bomb"]
    found = "FileNotFoundError\\nFileNotFoundError\\nFileNotFoundError\\nOSError\\n"
    assert results["escape"].reward == 0.0 and f"got '{found}'" in results["escape"].message, results["escape"]


@pytest.mark.timeout(300)
async def test_the_reward_sandbox_under_a_stricter_runtime_default(tmp_path, images):
    seccomp = tmp_path / "seccomp"  # the node's Localhost profiles
    seccomp.mkdir()
    strict = stricter_default()
    profiles = {"strict": strict, "strict-sandbox": allowing(strict, SANDBOX_SYSCALLS)}
    deployments = []
    for name, profile in profiles.items():
        (seccomp / f"{name}.json").write_text(json.dumps(profile))
        job = validate(role_images_job({"type": "Localhost", "localhostProfile": f"{name}.json"}))
        (reward,) = (
            child
            for child in desired_children(job, running=True)
            if child["kind"] == "Deployment" and child["metadata"]["labels"][names.LABEL_COMPONENT] == "reward"
        )
        deployments.append(copy.deepcopy(reward))
        deployments[-1]["metadata"]["name"] = f"reward-{name}"
    async with Cluster(tmp_path / "cluster", containers=True, seccomp_root=seccomp) as cluster:
        for deployment in deployments:
            cluster.apply(deployment)
        await cluster.wait_for(
            lambda: len(cluster.pods) == 2 and all(p.ready for p in cluster.pods.values()), "the reward pods", 240
        )
        address = {pod.owner[2]: f"{pod.ip}:{names.REWARD_PORT}" for pod in cluster.pods.values()}
        with pytest.raises(ConnectionError) as refused:
            await check_code_verifier(cluster, address["reward-strict"])
        await check_code_verifier(cluster, address["reward-strict-sandbox"])
        results = await score(cluster, address["reward-strict-sandbox"], code_item("correct", ADD_PROGRAM))
    assert "bubblewrap cannot start the sandbox" in str(refused.value), refused.value
    assert "runs under a seccomp filter (the pod's seccompProfile)" in str(refused.value), refused.value
    assert results["correct"].reward == 1.0, results


@pytest.mark.timeout(300)
def test_the_sglang_image_builds_its_own_steps_on_the_local_base(images):
    """The sglang image's Dockerfile, on the Python base the images here are built on in place of SGLang's (which
    only a registry has): it parses, its steps run, and the result runs as the operator runs it (uid 10001, HOME on
    the /tmp emptyDir, a read-only root). SGLang itself is not in it: its entrypoint is not run."""
    base = next(
        (ref for ref in (LOCAL_BASE, PINNED_BASE) if podman("image", "exists", ref, check=False).returncode == 0), None
    )
    assert base, f"neither {LOCAL_BASE} nor {PINNED_BASE} is on this machine, though the images are"
    tag = "localhost/areal-k8s/sglang-steps:test"
    built = podman(
        *("build", "--isolation", "chroot", "--network", "host", "--build-arg", f"SGLANG_IMAGE={base}"),
        *("-f", "images/sglang/Dockerfile", "-t", tag, "."),
        check=False,
        cwd=REPOSITORY,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    try:
        ran = podman(
            *("run", "--rm", "--network", "none", "--read-only", "--read-only-tmpfs=false", "--cap-drop", "ALL"),
            *("--security-opt", "no-new-privileges", "--tmpfs", "/tmp", "--entrypoint", "sh", tag),
            *("-c", 'id -u; id -g; echo "$HOME $HF_HUB_OFFLINE $TRITON_CACHE_DIR"; mkdir -p "$HOME" && echo writable'),
            check=False,
        )
    finally:
        podman("rmi", "--force", tag, check=False)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split("\n")[:4] == ["10001", "10001", "/tmp/home 1 /tmp/home/.triton", "writable"]
