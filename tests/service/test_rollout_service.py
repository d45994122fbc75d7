"""The rollout service's gRPC shell on loopback: bad requests are refused with INVALID_ARGUMENT before they reach
the engine, and an engine that cannot be reached is reported as UNAVAILABLE, never as a crash."""

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from areal_k8s_testing.byte_tokenizer import build_tokenizer
from support.jobs import job_config

from areal_k8s.api.v1 import common_pb2, controller_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from areal_k8s.common.grpcutil import channel, start_server
from areal_k8s.common.sglang import SGLangClient, UnfitEngine, token_versions, weight_group_ranks
from areal_k8s.common.store import TrajectoryStore, connect
from areal_k8s.controller.core import ControllerCore
from areal_k8s.controller.polls import MAX_HOLD_SECONDS
from areal_k8s.controller.server import serve
from areal_k8s.data.dataset import DatasetItem
from areal_k8s.rollout.clients import ControllerClient
from areal_k8s.rollout.controller_link import AcquireRequest, Registration
from areal_k8s.rollout.server import RolloutServicer
from areal_k8s.rollout.worker import RolloutWorker

JOB = job_config("rollout-svc", "m")


@pytest.fixture
async def rollout(redis_url, unused_tcp_port):
    # Nothing listens on the engine's port: only requests that pass validation can notice.
    engine = SGLangClient(f"http://127.0.0.1:{unused_tcp_port}", control_timeout=5)
    worker = RolloutWorker(
        job=JOB,
        worker_id="w0",
        address="127.0.0.1:0",
        controller=None,
        scorer=None,
        engine=engine,
        store=TrajectoryStore(connect(redis_url), JOB.name),
        tokenizer=build_tokenizer(),
    )
    server, port, _ = await start_server(
        [(rollout_pb2_grpc.add_RolloutServicer_to_server, RolloutServicer(worker), "areal.v1.Rollout")], "127.0.0.1:0"
    )
    client = channel(f"127.0.0.1:{port}")
    yield rollout_pb2_grpc.RolloutStub(client)
    await client.close()
    await server.stop(None)
    await engine.close()


def valid_group(**changes) -> common_pb2.PromptGroup:
    group = common_pb2.PromptGroup(group_id="g0", prompt="1+1=", verifier="addition", n_samples=2)
    group.sampling.max_new_tokens = 8
    group.sampling.temperature = 1.0
    group.sampling.top_p = 1.0
    for name, value in changes.items():
        target, field = (group.sampling, name[len("sampling_") :]) if name.startswith("sampling_") else (group, name)
        setattr(target, field, value)
    return group


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"group_id": ""}, "group_id"),
        ({"prompt": ""}, "prompt"),
        ({"n_samples": 0}, "n_samples"),
        ({"sampling_max_new_tokens": 0}, "max_new_tokens"),
        ({"sampling_temperature": -1.0}, "temperature"),
        ({"sampling_top_p": 1.5}, "top_p"),
    ],
)
async def test_generate_refuses_an_invalid_group_naming_the_field(rollout, changes, named):
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await rollout.Generate(rollout_pb2.GenerateRequest(group=valid_group(**changes)))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in raised.value.details()


async def test_weight_update_with_mismatched_metadata_is_invalid(rollout):
    request = rollout_pb2.UpdateWeightsFromDistributedRequest(names=["a", "b"], dtypes=["float32"], shapes=[])
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await rollout.UpdateWeightsFromDistributed(request)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "equal lengths" in raised.value.details()


async def test_an_unreachable_engine_is_unavailable_and_the_service_keeps_serving(rollout):
    request = rollout_pb2.InitWeightsUpdateGroupRequest(
        master_address="127.0.0.1", master_port=29500, rank_offset=1, world_size=2, group_name="g", backend="gloo"
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await rollout.InitWeightsUpdateGroup(request)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert raised.value.details().startswith("engine:")
    with pytest.raises(grpc.aio.AioRpcError) as again:  # still answering, with a precise status
        await rollout.Generate(rollout_pb2.GenerateRequest(group=valid_group(prompt="")))
    assert again.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def engine_answer(
    tokens: list[int], finish: str, weight_version: str, spans: list[tuple[str, int]] | None = None, **extra
) -> dict:
    """A /generate answer as SGLang 0.5.20 gives it; `spans` as (version, end) runs of the output tokens."""
    meta = {
        "id": "r",
        "finish_reason": {"type": finish},
        "weight_version": weight_version,
        "output_token_logprobs": [[-0.5, t, None] for t in tokens],
        "num_retractions": 0,
        **extra,
    }
    if spans is not None:
        starts = [0] + [end for _, end in spans[:-1]]
        meta["weight_versions"] = [{"version": v, "start": s, "end": e} for (v, e), s in zip(spans, starts)]
    return {"output_ids": tokens, "meta_info": meta}


def test_answers_are_recorded_with_the_version_of_every_token():
    from areal_k8s.rollout.generation import Sample, record_answer

    sample = Sample()
    assert not record_answer(sample, engine_answer([4, 5], "abort", "3", [("3", 2)]), budget=8)  # aborted: resubmit
    retracted = engine_answer([6, 7, 8], "stop", "5", [("4", 2), ("5", 3)], num_retractions=1)
    assert record_answer(sample, retracted, budget=8)
    assert sample.output_ids == [4, 5, 6, 7, 8] and sample.versions == [3, 3, 4, 4, 5]
    assert sample.interruptions == 2 and sample.finish_reason == "stop"


def test_a_retraction_under_memory_pressure_with_unchanged_weights_is_not_a_failure():
    """SGLang retracts requests on its own when the KV cache runs full; the weights did not change, the spans say
    so, and the request is simply recorded (it used to fail the whole group, again and again)."""
    from areal_k8s.rollout.generation import Sample, record_answer

    sample = Sample()
    assert record_answer(sample, engine_answer([1, 2, 3], "length", "7", [("7", 3)], num_retractions=2), budget=3)
    assert sample.versions == [7, 7, 7] and sample.finish_reason == "length"
    # A server that sends no spans had one version for the whole request.
    assert record_answer(plain := Sample(), engine_answer([9], "stop", "2", num_retractions=1), budget=3)
    assert plain.versions == [2]


@pytest.mark.parametrize(
    "spans",
    [
        [{"version": "1", "start": 1, "end": 3}],
        [{"version": "1", "start": 0, "end": 2}],
        [{"version": "1", "start": 0, "end": 4}],
    ],
)
def test_spans_that_do_not_cover_the_output_are_refused(spans):
    meta = {"weight_version": "1", "weight_versions": spans, "output_token_logprobs": [[-1.0, 5, None]] * 3}
    with pytest.raises(ValueError, match="spans"):
        token_versions(meta)


def test_an_engine_is_checked_for_what_the_job_needs_and_takes_its_tensor_parallel_ranks():
    assert weight_group_ranks({"tp_size": 2, "pp_size": 1, "disable_radix_cache": False}, "abort") == 2
    assert weight_group_ranks({"tp_size": 4, "pp_size": 1, "disable_radix_cache": True}, "retract") == 4
    with pytest.raises(UnfitEngine, match="--disable-radix-cache"):
        weight_group_ranks({"tp_size": 1, "pp_size": 1, "disable_radix_cache": False}, "retract")
    with pytest.raises(UnfitEngine, match="pipeline-parallel"):
        weight_group_ranks({"tp_size": 1, "pp_size": 2, "disable_radix_cache": True}, "abort")


def test_a_group_lost_with_its_engine_is_told_apart_from_a_failed_one():
    """Unreachable, or sampled with weights older than the group's admission (a restarted engine): the engine's
    doing, and the group goes back unfailed. An engine that answered with an error: the group failed."""
    from areal_k8s.common.sglang import EngineError
    from areal_k8s.rollout.worker import EngineWentBack, engine_went_away, oldest_token_version
    from areal_k8s.rollout.workflows import Episode

    assert engine_went_away(EngineError("http://e/generate", None, "ClientConnectorError: refused"))
    assert engine_went_away(EngineWentBack("sampled with version 0"))
    assert not engine_went_away(EngineError("http://e/generate", 400, "bad sampling params"))
    assert not engine_went_away(ValueError("spans do not cover the output"))

    def episode(versions: list[int]) -> Episode:  # a 2-token prompt (version -1), then the model's tokens
        return Episode(
            [0] * (2 + len(versions)),
            2,
            [0.0] * (2 + len(versions)),
            [-1, -1, *versions],
            [False, False] + [True] * len(versions),
        )

    assert oldest_token_version([episode([3, 4]), episode([2, 5])]) == 2
    assert oldest_token_version([episode([])]) is None


async def test_the_controller_client_trades_records_and_raises_the_errors_the_worker_reacts_to(
    redis_url, unused_tcp_port
):
    """ControllerClient over a real controller on loopback: groups arrive as PromptGroup records, outcomes leave as
    plain ones, and the refusals the worker reacts to arrive as NotRegistered (FAILED_PRECONDITION), Superseded
    (ABORTED) and ControllerUnavailable (anything else: here, nothing listening)."""
    from areal_k8s.common.trajectory import PromptGroup
    from areal_k8s.rollout.controller_link import ControllerUnavailable, GroupOutcome, NotRegistered, Result, Superseded

    def poll(incarnation: int) -> AcquireRequest:
        return AcquireRequest(
            worker_id="w0",
            max_groups=1,
            engine_version=0,
            wait_ms=0,
            holding=[],
            reports_holding=False,
            incarnation=incarnation,
        )

    items = [DatasetItem(id="p0", prompt="1+1=", reference="2", verifier="addition")]
    redis_client = connect(redis_url)
    server, port, _, reaper = await serve(
        ControllerCore(JOB, items, lease_seconds=60), TrajectoryStore(redis_client, JOB.name), "127.0.0.1:0"
    )
    client_channel = channel(f"127.0.0.1:{port}")
    client = ControllerClient(controller_pb2_grpc.ControllerStub(client_channel))
    try:
        with pytest.raises(NotRegistered) as unknown:
            await client.acquire_groups(poll(0))
        assert unknown.value.status == "FAILED_PRECONDITION"
        registration = Registration(
            worker_id="w0", address="127.0.0.1:9", engine_version=0, engine_ranks=1, engine_dtype=""
        )
        old = await client.register(registration)
        acquired = await client.acquire_groups(poll(old))
        [group] = acquired.groups
        assert isinstance(group, PromptGroup) and group.prompt == "1+1=" and not acquired.finished
        new = await client.register(registration)
        with pytest.raises(Superseded, match=f"incarnation {old} was superseded by incarnation {new}"):
            await client.complete_groups("w0", [GroupOutcome(group.group_id, Result.ACCEPTED)], old)
        await client.unregister("w0", new, "test over")
    finally:
        reaper.cancel()
        await client_channel.close()
        await server.stop(None)
        await redis_client.aclose()
    async with channel(f"127.0.0.1:{unused_tcp_port}") as nothing:
        with pytest.raises(ControllerUnavailable) as unreachable:
            await ControllerClient(controller_pb2_grpc.ControllerStub(nothing)).acquire_groups(poll(0))
    assert unreachable.value.status == "UNAVAILABLE"


@contextlib.asynccontextmanager
async def worker_of_a_served_controller(
    core: ControllerCore, redis_url: str, engine_port: int, **worker_args
) -> AsyncIterator[RolloutWorker]:
    """Worker w0 of `core`'s job, talking to `core` served over gRPC on loopback (Redis at `redis_url`); nothing
    listens on its engine's port."""
    redis_client = connect(redis_url)
    store = TrajectoryStore(redis_client, core.job.name)
    server, port, _, background = await serve(core, store, "127.0.0.1:0")
    client_channel = channel(f"127.0.0.1:{port}")
    engine = SGLangClient(f"http://127.0.0.1:{engine_port}", control_timeout=5)
    try:
        yield RolloutWorker(
            job=core.job,
            worker_id="w0",
            address="127.0.0.1:0",
            controller=ControllerClient(controller_pb2_grpc.ControllerStub(client_channel)),
            scorer=None,
            engine=engine,
            store=store,
            tokenizer=build_tokenizer(),
            **worker_args,
        )
    finally:
        background.cancel()
        await client_channel.close()
        await server.stop(None)
        await engine.close()
        await redis_client.aclose()


async def test_a_stopped_worker_cancels_the_poll_the_controller_holds_and_leaves(redis_url, unused_tcp_port):
    """A worker stopped while the controller holds its poll (here on the concurrency bound) cancels the poll rather
    than wait it out, and leaves: the controller never answers it (an answer would count the bound's refusal)."""
    job = JOB.model_copy(update={"algorithm": JOB.algorithm.model_copy(update={"max_concurrent_rollouts": 1})})
    items = [DatasetItem(id=f"p{i}", prompt="1+1=", reference="2", verifier="addition") for i in range(2)]
    core = ControllerCore(job, items, lease_seconds=60)
    core.register("busy", "127.0.0.1:9", engine_version=0)
    assert core.acquire("busy", 1, engine_version=0)  # the one group the job runs at a time
    # no group comes, so the engine is only asked for its load (unknown)
    async with worker_of_a_served_controller(core, redis_url, unused_tcp_port, hold_seconds=MAX_HOLD_SECONDS) as worker:
        worker.engine_version = 0  # it serves the current version, as the trainer's first push would have it
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        while not core.holds.waiting and not running.done():  # until the controller holds the worker's poll
            await asyncio.sleep(0.01)
        stop.set()
        await running
        assert "w0" not in core.workers  # it left
        assert core.metrics.value("areal_controller_admission_blocks_total", reason="concurrency") == 0
        assert not core.holds.waiting


async def test_a_group_whose_outcome_a_newer_incarnation_made_stale_ends_quietly(redis_url, unused_tcp_port):
    """A worker process that another registered under its name since (a restart it did not see) finishes a group:
    the controller refuses the outcome (Superseded), which the group's task takes as said, not as an exception
    nobody retrieves; the group went back to the queue when the newer incarnation registered."""
    items = [DatasetItem(id="p0", prompt="1+1=", reference="2", verifier="addition")]
    core = ControllerCore(JOB, items, lease_seconds=60)
    async with worker_of_a_served_controller(core, redis_url, unused_tcp_port) as worker:  # its engine is gone
        controller = worker.controller
        await worker.register()
        acquired = await controller.acquire_groups(
            AcquireRequest("w0", 1, 0, 0, holding=[], reports_holding=False, incarnation=worker.incarnation)
        )
        [group] = acquired.groups
        newer = await controller.register(
            Registration(worker_id="w0", address="127.0.0.1:9", engine_version=0, engine_ranks=1, engine_dtype="")
        )
        assert newer > worker.incarnation and core.leases.held_by("w0") == []  # revoked at the new registration
        requeued = core.requeued

        await worker.process_group(group)  # raised Superseded before

        assert core.leases.held_by("w0") == [] and core.requeued == requeued  # the refused outcome changed nothing


async def test_an_outcome_refused_while_the_worker_registers_again_is_reported_under_its_new_registration(
    redis_url, unused_tcp_port
):
    """The controller restarted (its state restored: the worker's lease kept, the worker not yet back) and the worker
    registers again while a group of its ends: the outcome, sent under the old registration, reaches the controller
    after the new one and is refused as superseded, by this very process. It is reported again under the new
    registration and settles the lease, which was left running for good (the trainer of an e2e run then waited on a
    group it had trained)."""
    from areal_k8s.rollout.controller_link import GroupOutcome, Result

    items = [DatasetItem(id="p0", prompt="1+1=", reference="2", verifier="addition")]
    before = ControllerCore(JOB, items, lease_seconds=60)
    before.register("w0", "127.0.0.1:9", 0, 1, "")
    [admitted] = before.acquire("w0", 1, 0)
    restored = ControllerCore(JOB, items, lease_seconds=60)
    restored.restore(before.durable_state())
    async with worker_of_a_served_controller(restored, redis_url, unused_tcp_port) as worker:
        worker.incarnation = before.workers["w0"].incarnation  # the registration of before the restart
        answered, register = asyncio.Event(), worker.controller.register

        async def register_answered_late(registration: Registration) -> int:
            incarnation = await register(registration)  # the controller took it...
            await answered.wait()  # ...and its answer is still on its way to the worker
            return incarnation

        worker.controller.register = register_answered_late
        registering = asyncio.create_task(worker.register())
        while not restored.workers.is_live("w0"):
            await asyncio.sleep(0.01)
        requeued = restored.requeued
        reporting = asyncio.create_task(worker.report([GroupOutcome(admitted.lease.group_id, Result.REQUEUED)]))
        await asyncio.sleep(0.2)  # sent under the old registration
        answered.set()
        await asyncio.wait_for(asyncio.gather(registering, reporting), timeout=30)

        assert worker.incarnation == restored.workers["w0"].incarnation != before.workers["w0"].incarnation
        assert restored.leases.held_by("w0") == [] and restored.requeued == requeued + 1


async def test_a_worker_stops_generating_a_group_the_controller_settled_without_it(redis_url, unused_tcp_port):
    """A group the worker holds that is no longer leased to it (its lease expired, or the other copy of a backed-up
    group was written first) comes back in the poll's `revoked`: the worker cancels its task, whose write would be
    refused."""
    items = [DatasetItem(id="p0", prompt="1+1=", reference="2", verifier="addition")]
    core = ControllerCore(JOB, items, lease_seconds=60)
    async with worker_of_a_served_controller(core, redis_url, unused_tcp_port) as worker:
        await worker.register()

        def poll(holding: list[str], max_groups: int = 0) -> AcquireRequest:
            return AcquireRequest(
                "w0", max_groups, 0, 0, holding=holding, reports_holding=True, incarnation=worker.incarnation
            )

        [group] = (await worker.controller.acquire_groups(poll([], max_groups=1))).groups
        generating = asyncio.create_task(asyncio.Event().wait())  # stands in for the group's generation
        worker.in_flight[generating] = group
        assert (await worker.controller.acquire_groups(poll([group.group_id]))).revoked == []
        core.complete(group.group_id, "requeued")  # settled without the worker
        reply = await worker.controller.acquire_groups(poll([group.group_id]))
        assert reply.revoked == [group.group_id]
        worker.stop_revoked(reply.revoked)
        await asyncio.gather(generating, return_exceptions=True)
        assert generating.cancelled()
