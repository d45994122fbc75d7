"""A controller service over real gRPC on loopback, persisting to a real Redis, as the service and e2e tests drive it:
restartable against the same Redis, with the job and items most of them use."""

from grpc_health.v1 import health_pb2_grpc

from areal_k8s.api.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from areal_k8s.common.grpcutil import channel
from areal_k8s.common.store import TrajectoryStore, connect
from areal_k8s.common.trajectory import Trajectory
from areal_k8s.controller.core import ControllerCore
from areal_k8s.controller.server import serve
from areal_k8s.data.dataset import DatasetItem
from support.jobs import job_config

ITEMS = [DatasetItem(id=f"p{i}", prompt=f"{i}+{i}=", reference=str(2 * i), verifier="addition") for i in range(6)]
JOB = job_config(
    "svc",
    "m",
    dataset={"shuffle": False},
    algorithm={"batch_size": 2, "group_size": 2, "max_staleness": 1, "total_steps": 5},
    sampling={"max_new_tokens": 16, "temperature": 0.7},
)


class Controller:
    """A controller service plus a client, restartable against the same Redis."""

    def __init__(self, redis_url, job=JOB, items=ITEMS):
        self.redis_url, self.job, self.items = redis_url, job, items

    async def start(self, lease_seconds=60.0, reward=None, address="127.0.0.1:0"):
        """Serve on `address` (a restarted controller on its predecessor's address: `self.address`)."""
        self.redis = connect(self.redis_url)
        self.store = TrajectoryStore(self.redis, self.job.name)
        core = ControllerCore(self.job, self.items, lease_seconds=lease_seconds)
        self.server, port, self.servicer, self.reaper = await serve(
            core, self.store, address, reap_interval=3600, reward=reward
        )
        self.address = f"127.0.0.1:{port}"
        self.channel = channel(self.address)
        self.stub = controller_pb2_grpc.ControllerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        return self

    async def stop(self):
        self.reaper.cancel()
        await self.channel.close()
        await self.server.stop(None)
        await self.redis.aclose()


def trajectory(group: common_pb2.PromptGroup, i: int) -> Trajectory:
    return Trajectory(
        trajectory_id=f"{group.group_id}-{i}",
        group_id=group.group_id,
        token_ids=[1, 2],
        prompt_length=1,
        logprobs=[0, -1],
        versions=[-1, group.admitted_version],
        loss_mask=[False, True],
        admitted_version=group.admitted_version,
        ticket=group.ticket,
    )


async def acquire(stub, n, version=0, worker="w0"):
    return await stub.AcquireGroups(
        controller_pb2.AcquireGroupsRequest(worker_id=worker, max_groups=n, engine_version=version)
    )


def outcome(group, result: str) -> controller_pb2.GroupOutcome:
    """A group's outcome by its result's name (ACCEPTED, FILTERED, FAILED, ...)."""
    return controller_pb2.GroupOutcome(group_id=group.group_id, result=getattr(controller_pb2.GroupOutcome, result))


def register(worker: str) -> controller_pb2.RegisterWorkerRequest:
    return controller_pb2.RegisterWorkerRequest(worker_id=worker, address="127.0.0.1:9")
