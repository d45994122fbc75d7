"""The agent example as an RLJob, its pods run by the kubelet harness (tests/support/kubelet.py): the rollout pod's
gateway behind the Service <job>-gateway, the runner Deployment serving the example's own program
(examples/agents/calculator.py, the openai SDK alone) in each of its slots, the claim token from the job's Secret.
Mid-run the rollout container (the worker and its gateway) is killed while agents hold sessions: those sessions end
on the agents' side without a trajectory, their groups are admitted again, and the job completes with every step and
every trajectory trained once. With AREAL_AGENT_PODS_SEED (`make bench-agent`, bench/agent_runs.py), the example's
own job on its own assets for that seed, as pods to the end, its held-out accuracy before and after written to
AREAL_AGENT_PODS_RESULTS: the example's learning as an RLJob."""

import asyncio
import contextlib
import json
import os
import re
import signal
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from support.e2e_jobs import TINY_AGENT_BUILD
from support.imports import ROOT
from test_pods import container_of, example_cluster, pod_of, run_to_the_end, the_example, trained_steps

from areal_k8s.demo.agent_build import build_agent_assets
from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.children import claim_token_secret
from areal_k8s.k8s_operator.validation import validate
from areal_k8s.trainer.checkpoint import latest_checkpoint, load_state

pytestmark = pytest.mark.e2e

# what the runner logs of an episode whose session did not end as a trajectory (runner.py): its program could not
# play it (given up), or the session was found gone when the runner settled it, or its gateway did not answer
NOT_ENDED = re.compile(r"episode (\S+)(?: \(attempt \d+\): the program .*; given up|: unknown session key|: gateway )")


@pytest.fixture(scope="module")
def agent_assets(tmp_path_factory) -> Path:
    assets = tmp_path_factory.mktemp("agent") / "assets"
    build_agent_assets(assets, seed=1, **TINY_AGENT_BUILD)
    for path in [assets, *assets.rglob("*")]:  # readable by the pods' user, as a build Job leaves a claim
        path.chmod(0o755 if path.is_dir() else 0o644)
    return assets


def the_agent_job(*, small: bool = True) -> dict:
    """The CPU example RLJob with examples/agent.yaml's task, recipe, workflow and agents (`small`: a short run of
    the tiny assets): the runners serve the example's program, which the pods find at the repository's path (the
    overlay's image is this machine's filesystem)."""
    rljob = the_example()
    example = yaml.safe_load((ROOT / "examples" / "agent.yaml").read_text())
    spec = rljob["spec"]
    spec["seed"] = example["seed"]
    spec["dataset"] = {"train": "/assets/train.jsonl", "eval": "/assets/eval.jsonl", "eval_limit": 4}
    spec["reward"], spec["sampling"] = example["reward"], example["sampling"]
    spec["algorithm"] = {k: v for k, v in example["algorithm"].items() if k != "max_staleness"}
    spec["staleness"]["eta"] = example["algorithm"]["max_staleness"]
    spec["trainer"].update(example["trainer"])
    spec["rollout"].update({k: v for k, v in example["rollout"].items() if k != "workers"})
    spec["agents"] = {**example["agents"], "working_dir": str(ROOT)}
    if small:  # a tiny model solves nothing: without dynamic sampling its all-zero groups are still trained
        spec["dataset"]["eval_limit"] = 4
        spec["algorithm"].update(batch_size=2, group_size=2, total_steps=8, lr_warmup_steps=1, dynamic_sampling=False)
        spec["rollout"]["groups_per_worker"] = 6
        spec["trainer"].update(eval_interval=8, checkpoint_interval=4)
        spec["agents"]["episodes_per_replica"] = 4
    else:
        spec["dataset"]["eval_limit"] = example["dataset"]["eval_limit"]
    return rljob


def family_of(pid: int) -> list[int]:
    """`pid` and every process under it (its programs run in sessions of their own: a process group misses them)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    family, frontier = [], [pid]
    while frontier:
        family += frontier
        frontier = [child for parent in frontier for child in parents.get(parent, [])]
    return family


def signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


async def open_sessions(cluster, pod) -> int:
    """Sessions the rollout pod's gateway issued that are neither ended nor closed, from its /metrics."""
    reply = await cluster.node_call("http_get", url=f"http://{pod.ip}:{names.METRICS_PORT}/metrics")
    events = {
        sample.labels["event"]: sample.value
        for family in text_string_to_metric_families(reply["body"])
        for sample in family.samples
        if sample.name == "areal_rollout_gateway_sessions_total"
    }
    return int(events["claimed"] - events["ended"] - events["closed"])


@pytest.mark.timeout(420)
async def test_the_agent_example_runs_as_pods_and_a_gateway_killed_mid_episode_loses_nothing(tmp_path, agent_assets):
    job = validate(the_agent_job())
    kill: dict = {}

    async with example_cluster(tmp_path, agent_assets) as cluster:
        cluster.apply(claim_token_secret(job, "claim-token-for-tests"))  # what the operator creates first, once
        runner_log = cluster.root / "logs"

        async def kill_with_sessions_open() -> None:
            """Once two steps are trained: the runners frozen while the gateway holds sessions of theirs, the rollout
            container killed under them, the runners thawed once it is back."""
            while max((s["version"] for s in trained_steps(cluster, job)), default=0) < 2:
                await asyncio.sleep(0.2)
            rollout, agents = pod_of(cluster, job, "rollout"), pod_of(cluster, job, names.AGENTS)
            while True:
                runners = family_of(agents.containers[0].process.pid)
                signal_all(runners, signal.SIGSTOP)
                kill["open"] = await open_sessions(cluster, rollout)
                if kill["open"]:
                    break
                signal_all(runners, signal.SIGCONT)
                await asyncio.sleep(0.1)
            logs = sorted(runner_log.glob(f"{agents.name}_*.log"))
            kill["log_offset"] = {log: log.stat().st_size for log in logs}
            worker = container_of(cluster, job, "rollout", "rollout")
            restarts = worker.restarts
            cluster.kill_group(worker)
            while not (worker.restarts > restarts and worker.ready):
                await asyncio.sleep(0.2)
            signal_all(runners, signal.SIGCONT)
            kill["done"] = True

        killing = asyncio.create_task(kill_with_sessions_open())
        try:
            await run_to_the_end(cluster, job, timeout=360, context=lambda: f"kill: {kill}\n")
        finally:
            killing.cancel()
            await asyncio.gather(killing, return_exceptions=True)
        steps = trained_steps(cluster, job)
        after_kill = "".join(log.read_text()[offset:] for log, offset in kill["log_offset"].items())

    assert kill.get("done") and kill["open"] >= 1, kill
    # every session the dead gateway held ended on the agents' side without a trajectory (given up, or found gone)
    assert len(set(NOT_ENDED.findall(after_kill))) >= kill["open"], after_kill[-3000:]
    # the job went on past the kill and completed; its groups were admitted again, none trained twice or lost
    algorithm = job.config.algorithm
    assert [s["version"] for s in steps] == list(range(1, algorithm.total_steps + 1))
    entries = [e for s in steps for e in s["entries"]]
    assert len(entries) == algorithm.total_steps * algorithm.batch_size * algorithm.group_size == len(set(entries))
    assert max(x for s in steps for x in s["staleness"]) <= algorithm.max_staleness


@pytest.mark.skipif("AREAL_AGENT_PODS_SEED" not in os.environ, reason="a measurement: `make bench-agent` runs it")
@pytest.mark.timeout(1200)
async def test_the_agent_example_learns_as_an_rljob(tmp_path):
    """The example's own job (examples/agent.yaml's recipe) as an RLJob on freshly built assets for the seed, to the
    end: its base and final held-out accuracy, read from the trainer's checkpoint claim, to the results file."""
    seed = int(os.environ["AREAL_AGENT_PODS_SEED"])
    assets = tmp_path / "assets"
    manifest = build_agent_assets(assets, seed=seed)
    for path in [assets, *assets.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    rljob = the_agent_job(small=False)
    rljob["spec"]["seed"] = seed
    job = validate(rljob)
    started = asyncio.get_running_loop().time()
    async with example_cluster(tmp_path, assets) as cluster:
        cluster.apply(claim_token_secret(job, "claim-token-for-tests"))
        statuses, _ = await run_to_the_end(cluster, job, timeout=1100)
        steps = trained_steps(cluster, job)
        claim = cluster.claims[f"{names.CHECKPOINT_VOLUME}-{names.child_name(job.name, 'trainer')}-0"]
        state = load_state(latest_checkpoint(claim / job.config.name / "checkpoints"))
    final = [s["eval_accuracy"] for s in steps if s.get("eval_accuracy", -1) >= 0][-1]
    assert len(steps) == job.config.algorithm.total_steps and state.base_accuracy >= 0
    record = {
        "seed": seed,
        "weights_sha256": manifest["weights_sha256"],
        "base_accuracy": state.base_accuracy,
        "final_accuracy": final,
        "gain_points": round(100 * (final - state.base_accuracy), 2),
        "wall_seconds": round(asyncio.get_running_loop().time() - started, 1),
        "steps": len(steps),
        "phase": statuses[-1]["phase"],
    }
    with open(os.environ["AREAL_AGENT_PODS_RESULTS"], "a") as results:
        results.write(json.dumps(record) + "\n")
