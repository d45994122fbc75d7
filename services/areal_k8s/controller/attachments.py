"""Admission streams: a rollout worker attached to the controller by one long-lived stream (the Admit call) instead of
polling it. The core's side of it, plain Python: what each attached worker holds room for, the groups granted to it
and not yet sent, and the stream as its heartbeat (an attached worker is live while its stream is open; once it
closes, its leases expire as a silent poller's do). The placement order the attached workers wait in is the held
polls' own (polls.py `HeldPolls.place`), so a worker that streams and one that polls are served in one order; the
shell (server.py) sends what an attachment collects once the change granting it is durable.

A worker's room is its slots less the leases it holds, counted here from the leases themselves, not from what the
worker last said: a grant in flight on the stream is already counted, so a state the worker sent before the grant
reached it cannot make room twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from areal_k8s.common.metrics import HOLD_REASONS
from areal_k8s.controller.backups import backup_candidates
from areal_k8s.controller.workers import UnknownWorker


@dataclass(eq=False)
class Attachment:
    """One worker's open admission stream, as the controller keeps it."""

    worker_id: str
    incarnation: int
    slots: int  # groups the worker generates at once
    engine_version: int
    engine_load: float | None  # its engine's token load (None: the engine cannot say), its place in the order
    notify: Callable[[], None]  # the shell's sender: something new to send
    take: Callable[[int], int] = lambda share: 0  # grant up to `share` groups now; returns how many (set by attach)
    wanted: Callable[[], int] = lambda: 0  # the groups it has room for now (set by attach)
    granted: list = field(default_factory=list)  # the core's Admitted leased to it, not yet sent
    revoked: list[str] = field(default_factory=list)  # groups it named that are no longer its, not yet sent
    version_seen: int = -1  # the controller version last sent
    closed: str = ""  # why the controller ended it (a newer incarnation registered); "" while open
    key: int | None = None  # its entry among the waiting (polls.py); None while it waits for nothing
    hold: int | None = None  # the hold it counts in (holds.py) while a bound keeps it waiting


class Attachments:
    """ControllerCore's methods on the attached workers (a mixin: the state is the core's `attachments`)."""

    def attach(
        self,
        worker_id: str,
        incarnation: int,
        holding: list[str],
        slots: int,
        engine_version: int,
        engine_load: float | None,
        notify: Callable[[], None],
    ) -> tuple[Attachment, list[str], list[str]]:
        """Attach a registered worker's new stream (its earlier one, if any, is replaced: the worker opened this one
        after it saw that one fail). Returns the attachment, the worker's leases its `holding` does not name (their
        grant went out on a stream that broke before it arrived: the shell revokes them) and the groups of `holding`
        no longer its (it stops them). UnknownWorker when it has not registered."""
        worker = self.workers.registered(worker_id)
        if (earlier := self.attachments.get(worker_id)) is not None:
            self.detach(earlier)
        incarnation = incarnation or worker.incarnation
        if incarnation == worker.incarnation:
            # A hello read before a push can arrive after the announcement naming the engine (as a state can, in
            # update_stream): within a registration the engine's version only grows.
            engine_version = max(engine_version, worker.engine_version)
        attachment = Attachment(worker_id, incarnation, slots, engine_version, engine_load, notify)
        attachment.take = lambda share: self.grant_stream(attachment, share)
        attachment.wanted = lambda: self.stream_room(attachment)
        self.attachments[worker_id] = attachment
        worker.attached = True
        self.workers.heard_from(worker_id, engine_version)
        held = set(holding)
        return attachment, self.leases.unheld(worker_id, held), self.leases.not_held(worker_id, holding)

    def current(self, attachment: Attachment) -> bool:
        """The worker's stream now, from the worker's current incarnation (a newer one registered: it is not)."""
        worker = self.workers.get(attachment.worker_id)
        return (
            self.attachments.get(attachment.worker_id) is attachment
            and worker is not None
            and worker.incarnation == attachment.incarnation
        )

    def detach(self, attachment: Attachment, why: str = "") -> None:
        """The stream closed (`why`: the controller closes it, for that reason): from now on the worker is heard from
        as a poller is, and its leases expire `lease_seconds` after this if it does not come back."""
        self.end_stream_hold(attachment)
        attachment.closed = attachment.closed or why or "detached"
        if self.attachments.get(attachment.worker_id) is attachment:
            del self.attachments[attachment.worker_id]
            if (worker := self.workers.get(attachment.worker_id)) is not None:
                worker.attached = False
                worker.last_seen = self.clock()
        attachment.notify()

    def update_stream(
        self,
        attachment: Attachment,
        slots: int,
        engine_version: int,
        engine_load: float | None,
        holding: list[str],
    ) -> list[str]:
        """The attached worker's new state; returns the groups of `holding` no longer leased to it (it stops them).
        Its leases that `holding` does not name are not revoked here, as the hello's are: their grant may be on its
        way to the worker."""
        # A state sent before a push can arrive after the announcement naming its engine: within a registration an
        # engine's version only grows, except where a restored trainer rewinds it, and its announcement sets that.
        engine_version = max(engine_version, attachment.engine_version)
        attachment.slots, attachment.engine_version, attachment.engine_load = slots, engine_version, engine_load
        self.workers.heard_from(attachment.worker_id, engine_version)
        return self.leases.not_held(attachment.worker_id, holding)

    def engines_serve(self, version: int, engines: dict[str, int]) -> list[Attachment]:
        """The trainer pushed `version` to these engines (worker id -> the incarnation its push reached) before it
        announced it: their version now, without a word from their workers. An engine of another registration (its
        worker registered again since) is left as its worker says. Returns the attached workers it names: the shell
        serves the version's room in the order among them (server.py AnnounceVersion)."""
        named = []
        for worker_id, incarnation in engines.items():
            worker = self.workers.get(worker_id)
            if worker is None or worker.incarnation != incarnation:
                continue
            worker.engine_version = version
            attachment = self.attachments.get(worker_id)
            if attachment is not None and attachment.incarnation == incarnation:
                attachment.engine_version = version
                named.append(attachment)
        return named

    def stream_room(self, attachment: Attachment) -> int:
        """Groups the attached worker has room for now: its slots less the leases it holds (granted ones in flight
        included)."""
        return max(attachment.slots - len(self.leases.held_by(attachment.worker_id)), 0)

    def grant_stream(self, attachment: Attachment, share: int) -> int:
        """Admit up to `share` groups for the attached worker now (the held polls' order chose it); they wait in the
        attachment for the shell to send once durable. Returns how many were granted."""
        self.end_stream_hold(attachment)
        if not self.current(attachment) or share <= 0:
            return 0
        try:
            admitted = self.acquire(attachment.worker_id, share, attachment.engine_version)
        except UnknownWorker:  # reaped or unregistered meanwhile
            return 0
        if admitted:
            attachment.granted += admitted
            attachment.notify()
        self.begin_stream_hold(attachment)  # room it still has waits on
        return len(admitted)

    def begin_stream_hold(self, attachment: Attachment) -> None:
        """Count the attached worker's wait in the holds (the held-by-staleness figure the rebalancer reads), as a held
        poll's, while a bound admits nothing for it."""
        self.end_stream_hold(attachment)
        wanted = self.stream_room(attachment)
        try:
            refusal = self.refusal(attachment.worker_id, wanted, attachment.engine_version)
        except UnknownWorker:
            return
        if wanted > 0 and refusal in HOLD_REASONS:
            attachment.hold = self.begin_hold(refusal)

    def begin_stream_holds(self, attachments: list[Attachment]) -> None:
        """begin_stream_hold for the attached workers an announcement names, at once, once its room was served: their
        engines serve the version, so one refusal holds for each with room (unless a backup is due: each asks its
        own), and a hold that keeps its reason goes on as it is (thousands of workers wait on the staleness bound
        across a version)."""
        if not attachments:
            return
        if backup_candidates(self.waited_on, self.leases):
            for attachment in attachments:
                self.begin_stream_hold(attachment)
            return
        refusal = self.refusal(attachments[0].worker_id, 1, self.version)
        held = refusal in HOLD_REASONS
        for attachment in attachments:
            if held and attachment.hold is not None and self.holds.waiting[attachment.hold][0] == refusal:
                continue  # (held, so it had room; a grant since would have ended its hold)
            self.end_stream_hold(attachment)
            if held and self.stream_room(attachment) > 0:
                attachment.hold = self.begin_hold(refusal)

    def end_stream_hold(self, attachment: Attachment) -> None:
        if attachment.hold is not None:
            self.end_hold(attachment.hold)
            attachment.hold = None
