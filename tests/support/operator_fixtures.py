"""Shared parts of the operator tests: an RLJob to start from, the committed CRD, kmock as the apiserver,
kopf running the real handlers in the test's event loop, and a real controller over gRPC on loopback.

kmock (a Kubernetes API emulator over real HTTP on 127.0.0.1) needs more for kopf: the bundled built-in
resources (kopf waits for CRD discovery), the RLJob resource itself, and the apiserver's bookkeeping of
resourceVersion, generation and generateName (ApiServer below; test modules select it with
`pytestmark = ON_API_SERVER`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import jsonpatch
import kmock
import kopf
import pytest
import yaml

from areal_k8s.api.v1 import controller_pb2_grpc
from areal_k8s.common.grpcutil import channel
from areal_k8s.common.store import TrajectoryStore, connect
from areal_k8s.controller.core import ControllerCore
from areal_k8s.controller.server import serve
from areal_k8s.data.dataset import DatasetItem
from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.handlers import Context, register
from areal_k8s.k8s_operator.kube import KubeApi
from areal_k8s.k8s_operator.validation import validate

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "operator" / "crd" / "rljobs.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("rljob*.yaml"))
RLJOBS = f"{names.GROUP}/{names.VERSION}/{names.PLURAL}"
NAMESPACE = "rl"
T = TypeVar("T")


class ApiServer(kmock.KubernetesEmulator):
    """kmock's emulator plus the apiserver's bookkeeping kopf relies on: a new metadata.resourceVersion on every
    write (kopf tells fresh watch events from stale ones by it), metadata.generation bumped by spec changes,
    names from metadata.generateName (kopf's Events), and 422 when a JSON patch's test fails."""

    versions = itertools.count(1)

    async def _handle(self, request):
        data, version = request.data, str(next(self.versions))
        if request.action == kmock.action.CREATE and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            if meta.get("generateName") and not meta.get("name"):
                meta["name"] = f"{meta['generateName']}{version}"
            meta.update(resourceVersion=version, generation=meta.get("generation", 1))
        elif request.action == kmock.action.UPDATE and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            meta["resourceVersion"] = version
            if "spec" in data and not request.subresource:
                current = self.objects[request.resource, request.namespace, request.name]
                meta["generation"] = current.get("metadata", {}).get("generation", 1) + 1
        elif request.action == kmock.action.UPDATE and isinstance(data, list):  # a JSON patch: kopf's finalizers
            data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as exc:  # kopf's resourceVersion guard: the apiserver answers 422
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from None


# Marks for a test module run against ApiServer; kmock reads its bundled resource list with a deprecated importlib call.
ON_API_SERVER = [
    pytest.mark.kmock(cls=ApiServer),
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),
]


def committed_crd() -> dict:
    return yaml.safe_load(CRD_FILE.read_text())


def rljob(name: str = "demo", *, redis_url: str = "redis://redis.rl.svc:6379/0", uid: str = "uid-1", **spec) -> dict:
    """A small valid CPU RLJob; keyword arguments replace top-level spec fields."""
    body = {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid},  # kmock assigns no uid
        "spec": {
            "model": "/assets/model",
            "dataset": {"train": "/assets/train.jsonl"},
            "algorithm": {"batch_size": 2, "group_size": 2, "total_steps": 3},
            "staleness": {"eta": 1},
            "reward": {"verifier": "addition", "workers": 1},
            "mounts": [{"name": "assets", "mountPath": "/assets", "persistentVolumeClaim": {"claimName": "assets"}}],
            "redis": {"url": redis_url},
            "roles": {
                "rollout": {
                    "replicas": 2,
                    "minReplicas": 1,
                    "maxReplicas": 4,
                    "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}},
                }
            },
        },
    }
    body["spec"].update(copy.deepcopy(spec))
    return body


def with_changes(body: dict, changes: dict) -> dict:
    """`body` with `changes` merged in, dict by dict (lists replaced, a None value removes its key)."""
    out = copy.deepcopy(body)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = (
                with_changes(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
            )
    return out


def resource_info(crd: dict) -> kmock.ResourceInfo:
    """What discovery says about the CRD's resource, from the CRD itself."""
    spec, served = crd["spec"], crd["spec"]["versions"][0]
    return kmock.ResourceInfo(
        kind=spec["names"]["kind"],
        singular=spec["names"]["singular"],
        namespaced=spec["scope"] == "Namespaced",
        shortnames=set(spec["names"]["shortNames"]),
        subresources=set(served["subresources"]),
        verbs={"list", "watch", "get", "patch", "create", "delete", "update"},
    )


async def eventually(check: Callable[[], T], what: str, timeout: float = 30.0) -> T:
    """Poll `check` until it returns something truthy; fail with `what` after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            result = check()
        except (KeyError, TypeError):  # the object is not there (yet)
            result = None
        if result:
            return result
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


class Cluster:
    """kmock's stored objects, read the way the tests need them."""

    def __init__(self, server: kmock.KubernetesEmulator):
        self.server = server

    def get(self, resource: str, name: str, namespace: str = NAMESPACE) -> dict | None:
        try:
            found = self.server.objects[resource, namespace, name]
        except KeyError:
            return None
        return None if found.deleted else copy.deepcopy(dict(found.raw))

    def rljob(self, name: str = "demo") -> dict | None:
        return self.get(RLJOBS, name)

    def condition(self, kind: str, name: str = "demo") -> dict | None:
        found = self.rljob(name)
        return next((c for c in (found or {}).get("status", {}).get("conditions", []) if c["type"] == kind), None)

    async def create(self, body: dict) -> None:
        meta = body["metadata"]
        response = await self.server.post(
            f"/apis/{RLJOBS.rsplit('/', 1)[0]}/namespaces/{meta['namespace']}/{names.PLURAL}", json=body
        )
        assert response.status < 300, await response.text()

    async def update_spec(self, name: str, spec_changes: dict) -> None:
        response = await self.server.patch(
            self.rljob_path(name), json={"spec": spec_changes}, headers={"Content-Type": "application/merge-patch+json"}
        )
        assert response.status < 300, await response.text()

    async def delete(self, path: str) -> None:
        response = await self.server.delete(path)
        assert response.status < 300, await response.text()

    @staticmethod
    def rljob_path(name: str) -> str:
        return f"/apis/{names.GROUP}/{names.VERSION}/namespaces/{NAMESPACE}/{names.PLURAL}/{name}"


@pytest.fixture
def cluster(kmock) -> Cluster:
    kmock.resources.load_bundled()  # kopf lists and watches nothing until apiextensions discovery is there
    kmock.resources[RLJOBS] = resource_info(committed_crd())
    return Cluster(kmock)


@dataclass
class LoopbackController:
    """A real controller service for the job, on 127.0.0.1, persisting to the real Redis."""

    address: str
    stub: controller_pb2_grpc.ControllerStub


@pytest.fixture
async def controller(redis_url):
    job = validate(rljob(redis_url=redis_url)).config  # the configuration the operator writes for `rljob()`
    items = [DatasetItem(id=f"p{i}", prompt=f"{i}+{i}=", reference=str(2 * i), verifier="addition") for i in range(8)]
    client = connect(redis_url)
    server, port, _servicer, reaper = await serve(
        ControllerCore(job, items), TrajectoryStore(client, job.name), "127.0.0.1:0", reap_interval=3600
    )
    grpc_channel = channel(f"127.0.0.1:{port}")
    yield LoopbackController(f"127.0.0.1:{port}", controller_pb2_grpc.ControllerStub(grpc_channel))
    reaper.cancel()
    await grpc_channel.close()
    await server.stop(None)
    await client.aclose()


@pytest.fixture
def operator_context(cluster) -> Context:
    """The production Context, pointed at kmock, reconciling every 0.2 s; tests replace what they need. No
    controller or trainer runs unless a test starts one: their addresses are a loopback port nothing listens on, so a
    status read or a hand-off is refused at once (a cluster DNS name would wait on this machine's resolver for as
    long as it takes to fail, inside the reconcile's lock)."""
    nobody = "127.0.0.1:1"
    return Context(
        kube=KubeApi.for_url(str(cluster.server.url)),
        interval=0.2,
        controller_address=lambda namespace, name: nobody,
        trainer_address=lambda namespace, name: nobody,
    )


@pytest.fixture
async def operator(cluster, operator_context):
    """kopf running the RLJob handlers against kmock until the test ends.

    It runs in a thread with its own event loop: on shutdown kopf cancels every task of its loop created after
    it started, which in the test's loop would include pytest's own teardown and kmock's request handlers.
    """
    registry = kopf.OperatorRegistry()
    register(registry, operator_context)

    @kopf.on.login(registry=registry)
    def login_to_kmock(**_):
        return kopf.ConnectionInfo(server=str(cluster.server.url).rstrip("/"))

    settings = kopf.OperatorSettings()
    settings.watching.reconnect_backoff = 0.1
    loop = asyncio.new_event_loop()
    kopf_task = loop.create_task(kopf.operator(registry=registry, settings=settings, clusterwide=True))

    def run_kopf() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(kopf_task)

    thread = threading.Thread(target=run_kopf, name="kopf", daemon=True)
    thread.start()
    yield operator_context
    # Cancelled rather than stopped by a stop flag, which waits 5 s for kopf's open watch requests.
    loop.call_soon_threadsafe(kopf_task.cancel)
    await asyncio.to_thread(thread.join, 30)
    assert not thread.is_alive(), "kopf did not stop"
    loop.close()
