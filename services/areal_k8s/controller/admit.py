"""The Admit stream's gRPC shell: one rollout worker attached for its life (controller/attachments.py says what the
core keeps of it). It reads the worker's messages (its state, its outcomes) and sends what the core collected for it
(grants, revocations, the version, the job's end) from one sender task per stream, woken by the core, never by a
timer. A grant is sent only once the write carrying its lease is applied (the group commit every call shares), so a
restarted controller knows every lease a worker was told of; one whose stream broke before it arrived is revoked when
the worker attaches again and does not name it.
"""

from __future__ import annotations

import asyncio
import logging
import math

import grpc

from areal_k8s.api.v1 import common_pb2, controller_pb2
from areal_k8s.common.config import JobConfig
from areal_k8s.common.grpcutil import Aborted, FailedPrecondition, InvalidArgument
from areal_k8s.controller.attachments import Attachment
from areal_k8s.controller.core import Admitted
from areal_k8s.controller.workers import UnknownWorker

log = logging.getLogger(__name__)


def prompt_group(job: JobConfig, admitted: Admitted) -> common_pb2.PromptGroup:
    lease, item, sampling = admitted.lease, admitted.item, job.sampling
    return common_pb2.PromptGroup(
        group_id=lease.group_id,
        prompt_id=item.id,
        prompt=item.prompt,
        reference=item.reference,
        verifier=job.reward.verifier or item.verifier,
        n_samples=job.algorithm.group_size,
        sampling=common_pb2.SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_new_tokens=sampling.max_new_tokens,
        ),
        admitted_version=lease.admitted_version,
        ticket=lease.ticket,
    )


def worker_state(state: controller_pb2.WorkerState) -> tuple[int, int, float | None]:
    """(slots, engine version, engine load) of a state message, checked."""
    load = state.engine_load if state.HasField("engine_load") else None
    if state.slots < 0:
        raise InvalidArgument(f"slots must be >= 0, got {state.slots}")
    if load is not None and not (load >= 0 and math.isfinite(load)):
        raise InvalidArgument(f"engine_load must be a token load >= 0 (or unset when unknown), got {load}")
    return state.slots, state.engine_version, load


class AdmitStream:
    """One Admit call: `run` serves it until the worker closes it or the controller ends it."""

    def __init__(self, servicer, context: grpc.aio.ServicerContext):
        self.servicer, self.core, self.context = servicer, servicer.core, context
        self.wake = asyncio.Event()
        self.completed: list[controller_pb2.Completed] = []  # taken and durable, not yet answered
        self.completions = 0  # the stream's completions read so far: the next one's id

    async def run(self) -> None:
        attachment = await self.attach()
        sender = asyncio.create_task(self.send(attachment))
        try:
            await self.read(attachment, sender)
        finally:
            sender.cancel()
            self.servicer.polls.unplace(attachment)
            self.core.detach(attachment)
        if attachment.closed.startswith("superseded"):
            raise Aborted(f"worker {attachment.worker_id!r}: {attachment.closed}")

    async def attach(self) -> Attachment:
        first = await self.context.read()
        if first is grpc.aio.EOF or not first.HasField("hello"):
            raise InvalidArgument("an Admit stream starts with a hello")
        hello = first.hello
        if not hello.worker_id:
            raise InvalidArgument("worker_id is required")
        slots, engine_version, load = worker_state(hello.state)
        if why := self.core.workers.superseded(hello.worker_id, hello.incarnation):
            raise Aborted(why)
        try:
            attachment, unheld, gone = self.core.attach(
                hello.worker_id, hello.incarnation, list(hello.holding), slots, engine_version, load, self.wake.set
            )
        except UnknownWorker as exc:
            raise FailedPrecondition(f"{exc}: call RegisterWorker first") from None
        if unheld:
            await self.servicer.revoke(unheld, "its grant never reached the worker")
            await self.servicer.writer.written()
        attachment.version_seen = self.core.version
        await self.context.write(
            controller_pb2.ControllerMessage(attached=controller_pb2.Attached(version=self.core.version, revoked=gone))
        )
        self.servicer.place(attachment)
        return attachment

    async def read(self, attachment: Attachment, sender: asyncio.Task) -> None:
        """The worker's messages until it closes the stream, the controller ends it, or the sender fails."""
        reading = None
        while not attachment.closed:
            reading = asyncio.ensure_future(self.context.read())
            await asyncio.wait({reading, sender}, return_when=asyncio.FIRST_COMPLETED)
            if sender.done():  # the write under a grant failed, or the stream broke
                reading.cancel()
                sender.result()
                return
            message = reading.result()
            if message is grpc.aio.EOF:
                return
            kind = message.WhichOneof("message")
            if kind == "state":
                slots, engine_version, load = worker_state(message.state)
                holding = list(message.state.holding)
                if gone := self.core.update_stream(attachment, slots, engine_version, load, holding):
                    attachment.revoked += gone
                    self.wake.set()
                self.servicer.place(attachment)
            elif kind == "complete":
                if message.complete.worker_id != attachment.worker_id:
                    raise InvalidArgument(f"outcomes on worker {attachment.worker_id}'s stream name another worker")
                completion_id, self.completions = self.completions, self.completions + 1
                unknown = await self.servicer.complete_groups(message.complete)
                self.completed.append(controller_pb2.Completed(id=completion_id, unknown=unknown))
                self.wake.set()
            else:
                raise InvalidArgument("a hello comes only first" if kind == "hello" else "an empty message")

    async def send(self, attachment: Attachment) -> None:
        """Whatever the core collected for the worker, each time it wakes this; the grants once durable."""
        core, write = self.core, self.context.write
        while True:
            await self.wake.wait()
            self.wake.clear()
            if attachment.granted:
                granted, attachment.granted = attachment.granted, []
                await self.servicer.writer.written()  # (a failed write ends the stream: the worker attaches again)
                groups = [prompt_group(core.job, admitted) for admitted in granted]
                granted_message = controller_pb2.Granted(groups=groups, version=core.version)
                await write(controller_pb2.ControllerMessage(granted=granted_message))
            if attachment.revoked:
                revoked, attachment.revoked = attachment.revoked, []
                await write(controller_pb2.ControllerMessage(revoked=controller_pb2.Revoked(group_ids=revoked)))
            while self.completed:
                await write(controller_pb2.ControllerMessage(completed=self.completed.pop(0)))
            if attachment.version_seen != core.version:
                attachment.version_seen = core.version
                await write(controller_pb2.ControllerMessage(version=core.version))
            if core.over:
                await write(controller_pb2.ControllerMessage(finished=True))
                log.info("worker %s: the job is over; its stream ends", attachment.worker_id)
                attachment.closed = attachment.closed or "finished"
            if attachment.closed:
                return
