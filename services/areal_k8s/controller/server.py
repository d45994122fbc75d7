"""Controller gRPC shell: validates requests, calls the core, writes what changed to Redis before answering
(state_store.py), holds long polls until there is room for them (polls.py), reaps dead workers.

At start it asks the reward service whether it can load every verifier the job uses (the job's own, or each
dataset item's): the controller is the one service that reads the dataset, and the reward pods hold no job file.
Nothing is admitted until the reward service answers; a verifier it cannot load fails the job at once (status
FAILED, one line naming the verifier and the import error) rather than failing its groups one by one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Sequence

import grpc

from areal_k8s.api.v1 import controller_pb2, controller_pb2_grpc, reward_pb2, reward_pb2_grpc
from areal_k8s.common.config import JobConfig
from areal_k8s.common.grpcutil import Aborted, FailedPrecondition, InvalidArgument, require, rpc, start_server
from areal_k8s.common.store import TrajectoryStore
from areal_k8s.controller.admit import AdmitStream, prompt_group
from areal_k8s.controller.core import ControllerCore
from areal_k8s.controller.durable import Changes
from areal_k8s.controller.polls import HeldPolls, acquire_when_room
from areal_k8s.controller.state_store import ControllerStateStore, StateWriter
from areal_k8s.controller.workers import UnknownWorker
from areal_k8s.data.dataset import DatasetItem

log = logging.getLogger(__name__)

CHECK_RETRY_SECONDS = 1.0  # between attempts to reach a reward service that is not up yet
CHECK_TIMEOUT_SECONDS = 60.0  # one check: the reward service imports each custom verifier's module

_RESULTS = {
    controller_pb2.GroupOutcome.ACCEPTED: "accepted",
    controller_pb2.GroupOutcome.FILTERED: "filtered",
    controller_pb2.GroupOutcome.FAILED: "failed",
    controller_pb2.GroupOutcome.REQUEUED: "requeued",
}


def job_verifiers(job: JobConfig, *item_lists: Sequence[DatasetItem]) -> list[str]:
    """Every verifier the job can ask the reward service for: the job's own, else each dataset item's."""
    if job.reward.verifier:
        return [job.reward.verifier]
    return sorted({item.verifier for items in item_lists for item in items})


class ControllerServicer(controller_pb2_grpc.ControllerServicer):
    def __init__(self, core: ControllerCore, store: TrajectoryStore):
        self.core = core
        self.store = store
        self.state = ControllerStateStore(store.client, store.keys)
        self.writer = StateWriter(core, self.state, seq=0)
        self.polls = HeldPolls(core.admissible, lambda: core.version, core.job.rollout.placement)
        self.unverified: set[str] = set()  # groups leased when Redis restarted: their writes may be among those lost
        self.stall_logged_at = -math.inf
        self.redis_run_id: str | None = None  # the Redis server's run id: a new one means it restarted

    def room_may_have_opened(self) -> None:
        """After a change that can open admission room: wake as many held polls as there is room for (all of them
        once the job is over, to tell them)."""
        if self.core.over:
            self.polls.open_all()
            self.tell_attached()
        else:
            self.polls.open()

    async def restore(self) -> None:
        """Carry on from the state the last controller of this job wrote, or from an older controller's snapshot."""
        if loaded := await self.state.load():
            self.writer.seq, state = loaded
            self.writer.applied = self.writer.seq
            self.core.restore(state)
        elif legacy := await self.state.load_legacy():
            state, version = legacy
            self.core.restore(state)
            if version is not None:
                self.core.announce_version(version, restored=True)
            self.writer.seq = self.writer.applied = 1
            await self.state.write(self.writer.seq, Changes.everything(self.core.durable_state()))
            await self.state.forget_legacy()
        else:
            return
        log.info("restored controller state: version %d, %d groups in flight", self.core.version, self.core.running)

    async def reap_dead_workers(self) -> int:
        """Revoke the groups of workers that went silent."""
        expired = self.core.expired_leases()
        await self.revoke(expired, "its worker went silent")
        if expired:
            await self.writer.written()
        return len(expired)

    async def reconcile_lost_writes(self) -> list[str]:
        """After Redis restarted: find what it lost, if it came back without its last acknowledged writes (its
        machine crashed before it synced them). Each accepted group not yet trained whose stream entries are gone is
        counted as lost and its prompt admitted again; the groups leased now are checked as their workers report
        them written; a store older than the controller's last write gets the controller's whole state again.
        Returns the groups lost.

        Every restart is checked, not only one that lost a controller's write: the writes lost may be a worker's
        alone (a group written, not yet reported). The candidates are taken before the stream is read: each was
        written before the read began (a worker reports a group accepted once it is written), and a group trained
        meanwhile was reported before its entries were acknowledged and trimmed (the core then no longer counts it
        as accepted-untrained)."""
        applied = self.writer.applied  # (taken before the read: a write applied after it is newer)
        run_id, known = await self.store.server_run_id(), self.redis_run_id
        self.redis_run_id = run_id
        went_back = self.writer.lost_writes or await self.state.last_applied() < applied
        if not went_back and run_id == (known or run_id):
            return []
        self.writer.lost_writes = False
        # Taken together, with no await between: a group accepted from here on has its lease in `unverified`.
        candidates, self.unverified = list(self.core.accepted_groups), set(self.core.leases)
        lost = self.core.reconcile(candidates, await self.store.groups_in_stream())
        if went_back:
            self.writer.rewrite()
        await self.writer.written()
        log.log(
            logging.WARNING if lost or went_back else logging.INFO,
            "Redis restarted%s; of the %d accepted groups not yet trained, %d were lost from the stream, their prompts "
            "admitted again%s",
            " without its last acknowledged writes (the controller's state is written again)" if went_back else "",
            len(candidates),
            len(lost),
            f": {', '.join(lost)}" if lost else "",
        )
        if lost:
            self.room_may_have_opened()
        return lost

    async def revoke(self, group_ids: list[str], why: str) -> None:
        """Settle groups whose worker is gone: a group already written counts as accepted, the others are
        re-queued (not counted against their prompt: it was not at fault); a late write by the old worker is
        refused. The caller writes the change."""
        holders = {lease.worker_id for gid in group_ids if (lease := self.core.leases.get(gid)) is not None}
        for group_id in group_ids:
            already_written = await self.store.revoke_group(group_id)
            self.core.complete(group_id, "accepted" if already_written else "requeued", why)
            log.warning("group %s: %s, %s", group_id, why, "already written" if already_written else "re-queued")
        await self.revoke_superseded()
        if group_ids:
            self.room_may_have_opened()
            self.room_for(holders)

    def room_for(self, worker_ids) -> None:
        """Leases of these workers settled: those attached by a stream have room again, in the order."""
        for worker_id in worker_ids:
            if (attachment := self.core.attachments.get(worker_id)) is not None:
                self.place(attachment)

    def place(self, attachment) -> None:
        """An attached worker waits for room in the held polls' order (counted in the holds while a bound holds it),
        and is served at once if there is room."""
        self.core.begin_stream_hold(attachment)
        self.polls.place(attachment)

    def tell_attached(self) -> None:
        """The job's end: every attached worker's stream says so."""
        for attachment in self.core.attachments.values():
            attachment.notify()

    async def revoke_superseded(self) -> None:
        """Revoke the copies of backed-up groups whose twin was written first: the write script refused them already
        while the twin link stands, and the revocation keeps refusing them once the change settling them removes it.
        Their workers learn it on their next poll (its answer's `revoked`). The caller writes the change."""
        superseded, self.core.superseded = self.core.superseded, []
        for group_id in superseded:
            await self.store.revoke_group(group_id)
            log.info("group %s: its twin was written first; revoked", group_id)

    def log_stall(self) -> None:
        """Once per progress deadline while no step comes: what the run waits for."""
        now, deadline = self.core.clock(), self.core.job.trainer.progress_deadline_seconds
        if now - self.stall_logged_at >= deadline and (stalled := self.core.stalled()):
            self.stall_logged_at = now
            log.warning("%s (trainer.progress_deadline_seconds: %d)", stalled, deadline)

    async def observe_stream(self) -> None:
        stream, m = await self.store.stream_stats(), self.core.metrics
        m.stream_length.set(stream["length"])
        m.stream_pending.set(stream["pending"])
        m.stream_lag.set(stream["lag"])
        m.stream_oldest_unacked_age.set(stream["oldest_unacked_age"])

    @rpc
    async def RegisterWorker(self, request, context):
        require(bool(request.worker_id), "worker_id is required")
        require(bool(request.address), "address (host:port of the worker's Rollout service) is required")
        require(request.engine_ranks >= 0, f"engine_ranks must be >= 0, got {request.engine_ranks}")
        orphaned = self.core.register(
            request.worker_id,
            request.address,
            request.engine_version,
            max(request.engine_ranks, 1),
            request.engine_dtype,
        )
        # Read now: while the write below waits (a slow or cut-off Redis), the worker may register again or be
        # reaped as silent, and the answer must name the incarnation this call made.
        incarnation = self.core.workers[request.worker_id].incarnation
        if (attachment := self.core.attachments.get(request.worker_id)) is not None:  # an earlier process's stream
            self.polls.unplace(attachment)
            self.core.detach(attachment, f"superseded by incarnation {incarnation}, registered since")
        log.info(
            "worker %s registered at %s (engine version %d, %d weight-group ranks)",
            request.worker_id,
            request.address,
            request.engine_version,
            max(request.engine_ranks, 1),
        )
        await self.revoke(orphaned, "its worker restarted")
        await self.writer.written()  # its incarnation's number is never handed out again
        return controller_pb2.RegisterWorkerResponse(
            version=self.core.version,
            job=self.core.job.name,
            incarnation=incarnation,
        )

    @rpc
    async def UnregisterWorker(self, request, context):
        require(bool(request.worker_id), "worker_id is required")
        held = self.core.unregister(request.worker_id, request.incarnation)
        if held is None:
            return controller_pb2.UnregisterWorkerResponse()
        if (attachment := self.core.attachments.get(request.worker_id)) is not None:
            self.polls.unplace(attachment)
            self.core.detach(attachment, "the worker left")
        log.info("worker %s left (%s)", request.worker_id, request.reason or "no reason given")
        await self.revoke(held, f"its worker left ({request.reason or 'no reason given'})")
        await self.writer.written()
        return controller_pb2.UnregisterWorkerResponse(requeued=len(held))

    @rpc
    async def AcquireGroups(self, request, context):
        require(bool(request.worker_id), "worker_id is required")
        require(request.max_groups >= 0, f"max_groups must be >= 0, got {request.max_groups}")
        engine_load = request.engine_load if request.HasField("engine_load") else None
        require(
            engine_load is None or engine_load >= 0,  # NaN fails too
            f"engine_load must be a token load >= 0 (or unset when unknown), got {engine_load}",
        )
        if why := self.core.workers.superseded(request.worker_id, request.incarnation):
            raise Aborted(why)
        revoked, gone = [], []
        if request.reports_holding:  # before the hold: what is leased from here on is not in the worker's list
            revoked = self.core.leases.unheld(request.worker_id, set(request.holding))
            await self.revoke(revoked, "its answer never reached the worker")
            gone = self.core.leases.not_held(request.worker_id, request.holding)
        try:
            admitted, capacity = await acquire_when_room(
                self.core,
                self.polls,
                request.worker_id,
                request.max_groups,
                request.engine_version,
                request.wait_ms,
                engine_load,
            )
        except UnknownWorker as exc:
            raise FailedPrecondition(f"{exc}: call RegisterWorker first") from None
        if admitted or revoked:
            await self.writer.written()
        return controller_pb2.AcquireGroupsResponse(
            groups=[prompt_group(self.core.job, a) for a in admitted],
            version=self.core.version,
            finished=self.core.over,
            capacity=capacity,
            revoked=gone,
        )

    @rpc
    async def CompleteGroups(self, request, context):
        return controller_pb2.CompleteGroupsResponse(unknown=await self.complete_groups(request))

    async def complete_groups(self, request: controller_pb2.CompleteGroupsRequest) -> int:
        """Settle a worker's reported outcomes (by CompleteGroups or on its admission stream); returns how many named
        groups no longer tracked. Answers once the change is durable."""
        require(bool(request.worker_id), "worker_id is required")
        if why := self.core.workers.superseded(request.worker_id, request.incarnation):
            raise Aborted(why)
        for outcome in request.outcomes:
            require(bool(outcome.group_id), "every outcome needs a group_id")
            require(
                outcome.result in _RESULTS,
                f"group {outcome.group_id}: result must be ACCEPTED, FILTERED, FAILED or REQUEUED",
            )
        unknown = 0
        for outcome in request.outcomes:
            result, group_id = _RESULTS[outcome.result], outcome.group_id
            if result in ("failed", "requeued") and await self.store.revoke_group(group_id):
                result = "accepted"  # its trajectories reached the stream before the worker gave up on it
            elif (
                result == "accepted"
                and self.core.leases.running_twin(group_id) is not None
                and not await self.store.written_groups([group_id])
            ):
                result = "requeued"  # a backed-up group's copy whose twin was written first: it leaves, unwritten
            # A group leased before Redis lost writes may have been written among them: it must be in the written set.
            lost = (
                result == "accepted" and group_id in self.unverified and not await self.store.written_groups([group_id])
            )
            self.unverified.discard(group_id)
            unknown += not self.core.complete(group_id, result, outcome.reason)
            if lost and group_id in self.core.accepted_groups:  # (not when trained already)
                log.warning("group %s was reported written and is not in the stream: Redis lost it", group_id)
                self.core.lose(group_id)
        await self.revoke_superseded()
        self.room_may_have_opened()  # an accepted group opens none: it moves from running to accepted
        self.room_for([request.worker_id])  # its own stream, if it has one, has room for its next group
        await self.writer.written()  # (also for outcomes known already: a first attempt's write may be under way)
        return unknown

    @rpc
    async def DropGroups(self, request, context):
        for group in request.groups:
            require(
                bool(group.group_id) and bool(group.prompt_id), "every dropped group needs a group_id and a prompt_id"
            )
        dropped = [g for g in request.groups if self.core.drop(g.group_id, g.prompt_id)]
        for group in dropped:
            log.warning(
                "group %s dropped by the trainer (%s); prompt %s admitted again",
                group.group_id,
                group.reason,
                group.prompt_id,
            )
        if dropped:
            self.room_may_have_opened()
        await self.writer.written()
        return controller_pb2.DropGroupsResponse(dropped=len(dropped))

    @rpc
    async def ListWorkers(self, request, context):
        return controller_pb2.ListWorkersResponse(workers=worker_infos(self.core))

    @rpc
    async def AnnounceVersion(self, request, context):
        require(request.version >= 0, f"version must be >= 0, got {request.version}")
        new = request.restored or request.version != self.core.version  # (else a push to newcomers, announced again)
        try:
            self.core.announce_version(request.version, request.restored)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        # The engines the push reached serve it: their workers keep their places in the order (one out of it is placed
        # again), all of them before any is served, so the order, not the names' order, chooses. They are not told:
        # their streams need not say it either.
        named = self.core.engines_serve(request.version, dict(request.engines))
        for attachment in named:
            if attachment.key is None:
                self.polls.place(attachment, serve=False)
        # The new version's room, and the polls from engines behind it answered at once.
        if new:
            self.polls.open_all()
        else:
            self.polls.open()
        self.core.begin_stream_holds(named)  # those the room did not reach wait on the bound again
        await self.writer.written()
        log.info("version %d is live%s", request.version, " (restored)" if request.restored else "")
        return controller_pb2.AnnounceVersionResponse(version=self.core.version)

    @rpc
    async def GetOutstanding(self, request, context):
        if self.core.wait_on(request.waited_on):  # a backup for each straggler the trainer waits on, to the held polls
            self.room_may_have_opened()
        return controller_pb2.GetOutstandingResponse(running=self.core.outstanding())

    @rpc
    async def ReportTrainStep(self, request, context):
        require(request.version >= 0, f"version must be >= 0, got {request.version}")
        require(request.samples >= 0 and request.tokens >= 0, "samples and tokens must be >= 0")
        require(
            request.max_observed_staleness >= 0,
            f"max_observed_staleness must be >= 0, got {request.max_observed_staleness}",
        )
        self.core.trained(list(request.group_ids))
        recorded = record_step_report(self.core, request)
        if not recorded:
            log.info("step %d was already recorded (a retried report); nothing changes", request.version)
        elif request.finished:  # a step report lifts no bound (AnnounceVersion does); the end of the job answers polls
            self.polls.open_all()
            self.tell_attached()
        await self.writer.written()
        return controller_pb2.ReportTrainStepResponse()

    @rpc
    async def Admit(self, request_iterator, context):
        await AdmitStream(self, context).run()

    @rpc
    async def GetJobStatus(self, request, context):
        return job_status(self.core, await self.store.stream_stats())


def job_status(core: ControllerCore, stream: dict) -> controller_pb2.JobStatus:
    """The job's status message: the core's figures, its phase, and the trajectory stream's `stream_stats`."""
    status = core.status()
    if status["finished"]:
        phase = controller_pb2.JobStatus.COMPLETED
    elif status["failure_reason"]:
        phase = controller_pb2.JobStatus.FAILED
    elif status["workers"] or status["consumed"]:
        phase = controller_pb2.JobStatus.RUNNING
    else:
        phase = controller_pb2.JobStatus.PENDING
    fields = {k: v for k, v in status.items() if k != "finished"}
    return controller_pb2.JobStatus(
        job=core.job.name,
        phase=phase,
        queue_depth=int(stream["pending"] + stream["lag"]),
        stream_length=int(stream["length"]),
        **fields,
    )


def worker_infos(core: ControllerCore) -> list[controller_pb2.WorkerInfo]:
    """The registered workers, by id, with the groups each holds."""
    leases = core.leases
    return [
        controller_pb2.WorkerInfo(
            worker_id=w.worker_id,
            address=w.address,
            engine_version=w.engine_version,
            last_seen=w.last_seen,
            running_groups=len(leases.held_by(w.worker_id)),
            engine_ranks=w.engine_ranks,
            registered_at=w.registered_at,
            engine_dtype=w.engine_dtype,
            incarnation=w.incarnation,
        )
        for w in sorted(core.workers.values(), key=lambda w: w.worker_id)
        if w.address  # placeholders for lease holders that have not re-registered since a restart
    ]


def record_step_report(core: ControllerCore, request: controller_pb2.ReportTrainStepRequest) -> bool:
    """Record a reported step in the core; False for a step already recorded."""
    return core.record_step(
        version=request.version,
        groups=len(request.group_ids),
        samples=request.samples,
        tokens=request.tokens,
        max_observed_staleness=request.max_observed_staleness,
        mean_staleness=request.mean_staleness,
        reward_mean=request.reward_mean,
        eval_accuracy=request.eval_accuracy,
        base_evaluation=request.base_evaluation,
        finished=request.finished,
        staleness_counts=request.staleness_counts,
        wait_seconds=request.wait_seconds,
        token_staleness_counts=request.token_staleness_counts,
        checkpoint_error=request.checkpoint_error,
    )


async def check_verifiers(
    core: ControllerCore, polls: HeldPolls, reward: reward_pb2_grpc.RewardStub, verifiers: list[str]
) -> None:
    """Hold admission until the reward service can load every verifier in `verifiers`; fail the job if it cannot."""
    core.wait_for(f"waiting for the reward service to check the job's verifiers ({', '.join(verifiers)})")
    request = reward_pb2.CheckVerifiersRequest(verifiers=verifiers)
    for attempt in itertools.count():
        try:
            await reward.CheckVerifiers(request, timeout=CHECK_TIMEOUT_SECONDS)
            log.info("the reward service loads every verifier of the job: %s", ", ".join(verifiers))
            break
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                core.fail("VerifierUnavailable", f"the reward service cannot load the job's verifiers: {exc.details()}")
                log.error("job failed: %s", core.failure.message)
                break
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # an older reward service: it checks on each Score
                log.warning("the reward service cannot check verifiers in advance; admitting without the check")
                break
            if attempt == 0:
                log.info(
                    "the reward service cannot check the verifiers yet (%s); retrying until it can", exc.code().name
                )
        await asyncio.sleep(CHECK_RETRY_SECONDS)
    core.ready()
    polls.open_all()
    for attachment in core.attachments.values():  # a job failed by the check: their streams say it is over
        attachment.notify()


async def serve(
    core: ControllerCore,
    store: TrajectoryStore,
    address: str,
    *,
    reap_interval: float = 2.0,
    reward: reward_pb2_grpc.RewardStub | None = None,
    verifiers: list[str] | None = None,
):
    """Start the controller on `address`; with `reward`, check `verifiers` (default: the training items') with it
    before admitting anything. Returns (server, port, servicer, background task: the state's writer, the check and
    the reaper)."""
    servicer = ControllerServicer(core, store)
    if reward is not None:
        core.wait_for("waiting for the reward service to check the job's verifiers")  # from the first status on
    await servicer.restore()
    await store.ensure_consumer_group()
    writer = asyncio.create_task(servicer.writer.run())
    server, port, _health = await start_server(
        [(controller_pb2_grpc.add_ControllerServicer_to_server, servicer, "areal.v1.Controller")], address
    )

    async def reaper() -> None:
        while True:
            await asyncio.sleep(reap_interval)
            try:
                await servicer.reconcile_lost_writes()
                await servicer.reap_dead_workers()
                servicer.log_stall()
                await servicer.observe_stream()
            except Exception:  # Redis blip: try again next round
                log.exception("reaping dead workers or reading the stream failed")

    async def background() -> None:
        checks = (
            [check_verifiers(core, servicer.polls, reward, verifiers or job_verifiers(core.job, core.items))]
            if reward
            else []
        )
        try:
            await asyncio.gather(reaper(), *checks)
        finally:
            writer.cancel()

    return server, port, servicer, asyncio.create_task(background())
