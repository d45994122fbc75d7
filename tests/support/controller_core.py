"""The controller core as the unit tests build it: a job and a core with one worker, on a clock the test moves."""

from areal_k8s.controller.core import ControllerCore
from areal_k8s.data.dataset import DatasetItem
from support.clock import Clock
from support.jobs import job_config


def make_job(**algorithm):
    algorithm = {"batch_size": 2, "group_size": 1, "max_staleness": 1, "total_steps": 50, **algorithm}
    return job_config("t", "m", train="x.jsonl", dataset={"shuffle": False}, algorithm=algorithm)


def make_core(clock=None, items=5, **algorithm):
    dataset = [DatasetItem(id=f"p{i}", prompt=f"q{i}", reference=str(i), verifier="exact") for i in range(items)]
    core = ControllerCore(make_job(**algorithm), dataset, lease_seconds=30, clock=clock or Clock())
    core.register("w", "127.0.0.1:1", 0)
    return core
