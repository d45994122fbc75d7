"""Versioned trajectories on Redis Streams, and the job's other shared state in Redis.

One stream per job. Rollout workers append a whole group atomically (a Lua script that refuses groups the
controller has revoked, so a re-issued group is never trained twice). The trainer reads through a consumer
group, acknowledges entries only after the step that used them is checkpointed, reclaims the pending entries
of a dead consumer with XAUTOCLAIM, and trims what nobody needs any more (bounded retention). Prompts whose
groups keep failing go to a second, capped stream, the job's dead letters, which the controller writes with its own
state (controller/state_store.py; its keys are named here with the others).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ResponseError

from areal_k8s.api.v1 import common_pb2
from areal_k8s.common.trajectory import Trajectory
from areal_k8s.common.wire import trajectory_message, trajectory_record

CONSUMER_GROUP = "trainer"
# Entries kept in a job's dead-letter stream; the oldest go first. Nothing consumes it: it is there to be read.
DEAD_LETTER_RETENTION = 10_000

# KEYS: stream, written, revoked, twins. ARGV: group_id, then per trajectory: trajectory_id, min_version, max_version,
# admitted_version, ticket, payload. Returns the entry ids; none for a group written already (a write sent again after
# a lost answer adds nothing); false for a revoked group, and for a copy of a backed-up group whose twin (its backup,
# or its original) is written: the first copy written is the group, the other is never trained.
_WRITE_GROUP = """
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 then return false end
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then return {} end
local twin = redis.call('HGET', KEYS[4], ARGV[1])
if twin and redis.call('SISMEMBER', KEYS[2], twin) == 1 then return false end
local ids = {}
for i = 2, #ARGV, 6 do
  ids[#ids + 1] = redis.call('XADD', KEYS[1], '*',
    'trajectory_id', ARGV[i], 'group_id', ARGV[1], 'min_version', ARGV[i + 1], 'max_version', ARGV[i + 2],
    'admitted_version', ARGV[i + 3], 'ticket', ARGV[i + 4], 'payload', ARGV[i + 5])
end
redis.call('SADD', KEYS[2], ARGV[1])
return ids
"""

# KEYS: written, revoked. ARGV: group_id. Returns 1 if the group was already written (it counts as accepted; it stays
# in the written set until the controller's write that settles its lease takes it out), else marks it revoked so a
# late write by its old worker is refused. Asked again, it answers the same.
_REVOKE_GROUP = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 1 end
redis.call('SADD', KEYS[2], ARGV[1])
return 0
"""


class JobKeys:
    """Every Redis key of one job. The hash tag keeps them in one cluster slot, so scripts may touch several."""

    def __init__(self, job: str):
        self.prefix = f"areal:{{{job}}}"
        self.stream = f"{self.prefix}:trajectories"
        self.written = f"{self.prefix}:written-groups"
        self.revoked = f"{self.prefix}:revoked-groups"
        self.dead_letters = f"{self.prefix}:dead-letters"
        # the controller's durable state (controller/state_store.py): counters, a record per lease and per retry place,
        # the items dead-lettered, the groups dropped, the accepted groups not yet trained and the groups lost; and the
        # links between the copies of backed-up groups, which the stream's write script reads
        self.controller_counters = f"{self.prefix}:controller:counters"
        self.controller_leases = f"{self.prefix}:controller:leases"
        self.controller_retry = f"{self.prefix}:controller:retry"
        self.controller_dead_items = f"{self.prefix}:controller:dead-items"
        self.controller_dropped = f"{self.prefix}:controller:dropped"
        self.controller_accepted = f"{self.prefix}:controller:accepted"
        self.controller_lost = f"{self.prefix}:controller:lost"
        self.controller_twins = f"{self.prefix}:controller:twins"  # each copy of a backed-up group -> the other
        # what an older controller kept: its whole state as one JSON document, and the version it last announced
        self.legacy_snapshot = f"{self.prefix}:controller"
        self.legacy_version = f"{self.prefix}:version"


@dataclass(frozen=True)
class StreamEntry:
    entry_id: str
    group_id: str
    min_version: int
    max_version: int
    admitted_version: int
    ticket: int
    trajectory: Trajectory


def policy_versions(trajectory: Trajectory) -> tuple[int, int]:
    """(oldest, newest) policy version among the generated tokens."""
    generated = [v for v in trajectory.versions if v >= 0]
    if not generated:
        raise ValueError(f"trajectory {trajectory.trajectory_id} has no generated tokens")
    return min(generated), max(generated)


def decode_entry(entry_id: bytes, fields: dict[bytes, bytes]) -> StreamEntry:
    trajectory = trajectory_record(common_pb2.Trajectory.FromString(fields[b"payload"]))
    return StreamEntry(
        entry_id=entry_id.decode(),
        group_id=fields[b"group_id"].decode(),
        min_version=int(fields[b"min_version"]),
        max_version=int(fields[b"max_version"]),
        admitted_version=int(fields[b"admitted_version"]),
        ticket=int(fields[b"ticket"]),
        trajectory=trajectory,
    )


# A restarting Redis server (it replays its append-only file) is waited for: each command is sent again on a
# connection error, with back-off, for about two minutes before the error reaches the service.
REDIS_RETRY = Retry(ExponentialWithJitterBackoff(base=0.2, cap=5.0), retries=30)


# A Redis whose node is lost sends no FIN: a blocking read (XREADGROUP BLOCK) would wait on its connection for ever.
# The kernel probes a connection silent for 10 s and drops it after 2 unanswered probes 5 s apart, or when data sent
# goes unacknowledged for 20 s (as gRPC's keepalive does, grpcutil.py); the command fails with a connection error,
# is retried, and reconnects (the Service names the new pod).
TCP_KEEPALIVE = {
    socket.TCP_KEEPIDLE: 10,
    socket.TCP_KEEPINTVL: 5,
    socket.TCP_KEEPCNT: 2,
    socket.TCP_USER_TIMEOUT: 20_000,
}


def connect(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url,
        decode_responses=False,
        health_check_interval=30,
        retry=REDIS_RETRY,
        socket_keepalive=True,
        socket_keepalive_options=TCP_KEEPALIVE,
    )


class TrajectoryStore:
    def __init__(self, client: aioredis.Redis, job: str):
        self.client = client
        self.keys = JobKeys(job)
        self._write_group = client.register_script(_WRITE_GROUP)
        self._revoke_group = client.register_script(_REVOKE_GROUP)

    # -- producers (rollout) -------------------------------------------------------------------------------

    async def write_group(self, trajectories: list[Trajectory]) -> list[str] | None:
        """Append one group's trajectories atomically and at most once. None: the controller revoked the group, or
        the group's other copy was written first (not written); an empty list: it was written already."""
        group_ids = {t.group_id for t in trajectories}
        if len(group_ids) != 1:
            raise ValueError(f"write_group needs trajectories of exactly one group, got {sorted(group_ids)}")
        args: list[object] = [group_ids.pop()]
        for t in trajectories:
            oldest, newest = policy_versions(t)
            args += [
                t.trajectory_id,
                oldest,
                newest,
                t.admitted_version,
                t.ticket,
                trajectory_message(t).SerializeToString(),
            ]
        keys = [self.keys.stream, self.keys.written, self.keys.revoked, self.keys.controller_twins]
        ids = await self._write_group(keys=keys, args=args)
        return None if ids is None else [i.decode() for i in ids]

    # -- controller ----------------------------------------------------------------------------------------

    async def revoke_group(self, group_id: str) -> bool:
        """Stop a group from being written later. True if it had already been written (nothing to redo).

        A written group stays in the written set until the controller settles its lease, whether or not it was
        trained already: a worker that dies after writing a group and before reporting it leaves a lease the
        controller later revokes, and the revocation must still see it written (else its prompt is generated and
        trained a second time). A controller that dies between this call and its write asks again, and is answered
        the same."""
        return bool(await self._revoke_group(keys=[self.keys.written, self.keys.revoked], args=[group_id]))

    async def server_run_id(self) -> str:
        """The Redis server's run id: a new one each time it starts."""
        return (await self.client.info("server"))["run_id"]

    async def written_groups(self, group_ids: list[str]) -> set[str]:
        """Those of `group_ids` in the written set (written, their leases not yet settled)."""
        found = await self.client.smismember(self.keys.written, group_ids)
        return {gid for gid, is_member in zip(group_ids, found) if is_member}

    async def groups_in_stream(self) -> set[str]:
        """The ids of the groups the stream holds entries of (read whole, in pages: for a rare check)."""
        groups, start = set(), "-"
        while page := await self.client.xrange(self.keys.stream, min=start, count=512):
            groups.update(fields[b"group_id"].decode() for _, fields in page)
            start = "(" + page[-1][0].decode()
            if len(page) < 512:
                break
        return groups

    async def read_dead_letters(self, count: int = 100) -> list[dict[str, str]]:
        """The newest `count` dead letters, oldest first, each with its stream entry id under `id`."""
        entries = await self.client.xrevrange(self.keys.dead_letters, count=count)
        return [
            {"id": entry_id.decode(), **{k.decode(): v.decode() for k, v in fields.items()}}
            for entry_id, fields in reversed(entries)
        ]

    # -- consumer (trainer) --------------------------------------------------------------------------------

    async def ensure_consumer_group(self) -> None:
        try:
            # From the start of the stream: groups written before the trainer first came up belong to it too.
            await self.client.xgroup_create(self.keys.stream, CONSUMER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def claim_pending(self, consumer: str, min_idle_ms: int = 0) -> int:
        """Move every pending entry idle for `min_idle_ms` (e.g. a dead trainer's) to `consumer`. Returns the count."""
        claimed, cursor = 0, "0-0"
        while True:
            cursor, entries, _deleted = await self.client.xautoclaim(
                self.keys.stream, CONSUMER_GROUP, consumer, min_idle_time=min_idle_ms, start_id=cursor, count=512
            )
            claimed += len(entries)
            if cursor in (b"0-0", "0-0"):
                return claimed

    async def read_pending(self, consumer: str) -> list[StreamEntry]:
        """Entries delivered to `consumer` and not yet acknowledged (what a restarted trainer must redo)."""
        out: list[StreamEntry] = []
        last = "0"
        while True:
            reply = await self.client.xreadgroup(CONSUMER_GROUP, consumer, {self.keys.stream: last}, count=512)
            entries = reply[0][1] if reply else []
            if not entries:
                return out
            for entry_id, fields in entries:
                if fields:  # an entry trimmed while pending comes back empty
                    out.append(decode_entry(entry_id, fields))
                last = entry_id

    async def pending_ids(self, consumer: str) -> list[str]:
        """The ids of the entries delivered to `consumer` and not yet acknowledged, without their trajectories."""
        ids: list[str] = []
        start = "-"
        while page := await self.client.xpending_range(
            self.keys.stream, CONSUMER_GROUP, min=start, max="+", count=512, consumername=consumer
        ):
            ids += [p["message_id"].decode() for p in page]
            if len(page) < 512:
                break
            start = "(" + ids[-1]
        return ids

    async def read_entries(self, entry_ids: Iterable[str]) -> list[StreamEntry]:
        """The entries with these ids, in that order; one trimmed from the stream is left out."""
        out: list[StreamEntry] = []
        for entry_id in entry_ids:
            out += [
                decode_entry(i, fields) for i, fields in await self.client.xrange(self.keys.stream, entry_id, entry_id)
            ]
        return out

    async def read_new(self, consumer: str, count: int, block_ms: int) -> list[StreamEntry]:
        reply = await self.client.xreadgroup(
            CONSUMER_GROUP, consumer, {self.keys.stream: ">"}, count=count, block=block_ms or None
        )
        return [decode_entry(entry_id, fields) for entry_id, fields in (reply[0][1] if reply else [])]

    async def ack(self, entry_ids: list[str]) -> None:
        """Acknowledge trained entries and trim the stream below the oldest entry still needed. Acknowledging an
        entry twice changes nothing."""
        if not entry_ids:
            return
        await self.client.xack(self.keys.stream, CONSUMER_GROUP, *entry_ids)
        await self.trim()

    async def trim(self) -> None:
        """Drop entries that are acknowledged: keep from the oldest pending entry, or from the last delivered one."""
        summary = await self.client.xpending(self.keys.stream, CONSUMER_GROUP)
        if summary["pending"]:
            keep_from = summary["min"]
        else:
            groups = await self.client.xinfo_groups(self.keys.stream)
            keep_from = next(
                g["last-delivered-id"] for g in groups if g["name"] in (CONSUMER_GROUP, CONSUMER_GROUP.encode())
            )
        await self.client.xtrim(self.keys.stream, minid=keep_from, approximate=False)

    # -- shared state --------------------------------------------------------------------------------------

    async def stream_stats(self) -> dict[str, float]:
        """length: entries kept; pending: delivered, unacknowledged; lag: written but not yet delivered;
        oldest_unacked_age: seconds since the oldest pending entry was written (0 when none is pending)."""
        length = await self.client.xlen(self.keys.stream)
        stats = {"length": length, "pending": 0, "lag": length, "oldest_unacked_age": 0.0}
        try:
            groups = await self.client.xinfo_groups(self.keys.stream)
        except ResponseError:  # no stream yet
            return stats
        group = next((g for g in groups if g["name"] in (CONSUMER_GROUP, CONSUMER_GROUP.encode())), None)
        if group is None:
            return stats
        stats.update(pending=int(group["pending"]), lag=int(group.get("lag") or 0))
        if stats["pending"]:
            summary = await self.client.xpending(self.keys.stream, CONSUMER_GROUP)
            oldest = summary.get("min")
            if oldest:  # an entry id starts with the Redis server's clock (ms) at the time it was written
                seconds, _ = await self.client.time()
                written_ms = int((oldest.decode() if isinstance(oldest, bytes) else oldest).split("-")[0])
                stats["oldest_unacked_age"] = max(0.0, seconds - written_ms / 1000)
        return stats

    async def delete_job(self) -> int:
        """Remove every key of the job (the operator's finalizer calls this)."""
        keys = [
            key
            async for key in self.client.scan_iter(
                match=f"{self.keys.prefix}:*".replace("{", "\\{").replace("}", "\\}")
            )
        ]
        return await self.client.delete(*keys) if keys else 0
