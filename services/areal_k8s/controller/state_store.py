"""The controller's durable state in Redis (durable.py says what it holds), written change by change.

Counters in one hash (the progress figures one field of it), a hash of leases, a hash of retry places, a set of
dead-lettered items, a set of dropped groups, a hash of accepted groups not yet trained, a set of lost groups (and
the twin links of the leases of backed-up groups, for the stream's write script; controller/backups.py): each
write is one Lua script that applies the counters and the records that changed, settles the written-set entries of
the leases it removes, and appends the dead letters of items newly dead-lettered, all at once. A write carries a
sequence number and is applied only if it is newer than the last one applied, so a write sent again (its answer lost
to a Redis restart) or a late one changes nothing. The records are the state itself: there is no log to replay or
compact, and a restart reads them back as they are.

A write also names the last one the controller saw applied: a store holding an older one lost acknowledged writes
(a Redis whose machine crashed comes back without about its last second), and the script refuses to apply changes
on top of it; the controller writes its whole state instead, and looks for the groups the stream lost.

`StateWriter` is the one writer: calls that changed the state wait for the write that carries their change, and
every change made while a write is under way goes in the next one (a group commit).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import asdict
from itertools import chain

import redis.asyncio as aioredis

from areal_k8s.common.store import DEAD_LETTER_RETENTION, JobKeys
from areal_k8s.controller.core import ControllerCore
from areal_k8s.controller.durable import (
    Changes,
    DurableState,
    decode_counters,
    decode_lease,
    decode_retry,
    encode_lease,
    encode_retry,
    from_snapshot,
    retry_entries,
)

log = logging.getLogger(__name__)

# KEYS: counters, leases, retry, dead items, dropped, dead letters, written groups, accepted groups, lost groups, twins.
# ARGV: the write's sequence number, the dead letters kept, the last write seen applied, 1 for a whole state (the
# state's keys are emptied first), then sections, each its count and its items: counters (field, value), leases
# written (group id, record), leases settled (group id; its twin link goes too), retry places written (place, record),
# retry places cleared (place), groups dropped (group id), dead letters (item index, then six field-value pairs), dead
# items (item index), accepted groups written (group id, item index), accepted groups removed (group id), groups lost
# (group id), groups no longer lost (group id), twin links (group id, its twin's). Returns 0, changing nothing, for a
# write no newer than the last one applied; -1, changing nothing, when the last one applied is older than the last one
# seen applied (the store lost writes).
_WRITE = """
local seq = tonumber(ARGV[1])
local stored = tonumber(redis.call('HGET', KEYS[1], 'seq') or '0')
if seq <= stored then return 0 end
if ARGV[4] == '1' then
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[8], KEYS[9], KEYS[10])
elseif stored < tonumber(ARGV[3]) then
  return -1
end
local i = 5
local function section(width)
  local first = i + 1
  i = first + tonumber(ARGV[i]) * width
  return first, i - 1
end
local a, b = section(2)
for j = a, b, 2 do redis.call('HSET', KEYS[1], ARGV[j], ARGV[j + 1]) end
a, b = section(2)
for j = a, b, 2 do redis.call('HSET', KEYS[2], ARGV[j], ARGV[j + 1]) end
a, b = section(1)
for j = a, b do
  redis.call('HDEL', KEYS[2], ARGV[j])
  redis.call('SREM', KEYS[7], ARGV[j])
  redis.call('HDEL', KEYS[10], ARGV[j])
end
a, b = section(2)
for j = a, b, 2 do redis.call('HSET', KEYS[3], ARGV[j], ARGV[j + 1]) end
a, b = section(1)
for j = a, b do redis.call('HDEL', KEYS[3], ARGV[j]) end
a, b = section(1)
for j = a, b do redis.call('SADD', KEYS[5], ARGV[j]) end
a, b = section(13)
for j = a, b, 13 do
  if redis.call('SADD', KEYS[4], ARGV[j]) == 1 then
    redis.call('XADD', KEYS[6], 'MAXLEN', ARGV[2], '*', unpack(ARGV, j + 1, j + 12))
  end
end
a, b = section(1)
for j = a, b do redis.call('SADD', KEYS[4], ARGV[j]) end
a, b = section(2)
for j = a, b, 2 do redis.call('HSET', KEYS[8], ARGV[j], ARGV[j + 1]) end
a, b = section(1)
for j = a, b do redis.call('HDEL', KEYS[8], ARGV[j]) end
a, b = section(1)
for j = a, b do redis.call('SADD', KEYS[9], ARGV[j]) end
a, b = section(1)
for j = a, b do redis.call('SREM', KEYS[9], ARGV[j]) end
a, b = section(2)
for j = a, b, 2 do redis.call('HSET', KEYS[10], ARGV[j], ARGV[j + 1]) end
redis.call('HSET', KEYS[1], 'seq', seq)
return 1
"""


def write_arguments(seq: int, changes: Changes, applied: int = 0) -> list[object]:
    """The script's ARGV for one write; `applied`: the last write seen applied."""
    counters = [(name, json.dumps(value)) for name, value in changes.counters.items()]
    if changes.progress is not None:
        counters.append(("progress", json.dumps(changes.progress)))
    leases = [(gid, encode_lease(lease)) for gid, lease in changes.leases.items() if lease is not None]
    settled = [gid for gid, lease in changes.leases.items() if lease is None]
    places = [(place, encode_retry(entry)) for place, entry in changes.retry.items() if entry is not None]
    cleared = [place for place, entry in changes.retry.items() if entry is None]
    letters = [[letter.item_index, *chain.from_iterable(asdict(letter).items())] for letter in changes.dead_letters]
    accepted = [(gid, item) for gid, item in changes.accepted_groups.items() if item is not None]
    unaccepted = [gid for gid, item in changes.accepted_groups.items() if item is None]
    lost = [gid for gid, is_lost in changes.lost_groups.items() if is_lost]
    found = [gid for gid, is_lost in changes.lost_groups.items() if not is_lost]
    twins = [(gid, lease.twin) for gid, lease in changes.leases.items() if lease is not None and lease.twin]
    args: list[object] = [seq, DEAD_LETTER_RETENTION, applied, int(changes.whole)]
    sections = (counters, leases, settled, places, cleared, changes.dropped_groups, letters, changes.dead_items)
    for section in (*sections, accepted, unaccepted, lost, found, twins):
        args.append(len(section))
        for item in section:
            args.extend(item if isinstance(item, list | tuple) else [item])
    return args


class ControllerStateStore:
    def __init__(self, client: aioredis.Redis, keys: JobKeys):
        self.client, self.keys = client, keys
        self._write = client.register_script(_WRITE)

    async def write(self, seq: int, changes: Changes, applied: int = 0) -> int:
        """Apply one write: 1; 0 if a write numbered `seq` or later was applied already; -1, applying nothing, if
        the last write applied is older than `applied` (the last one seen applied: the store lost writes)."""
        k = self.keys
        keys = [
            k.controller_counters,
            k.controller_leases,
            k.controller_retry,
            k.controller_dead_items,
            k.controller_dropped,
            k.dead_letters,
            k.written,
            k.controller_accepted,
            k.controller_lost,
            k.controller_twins,
        ]
        return int(await self._write(keys=keys, args=write_arguments(seq, changes, applied)))

    async def last_applied(self) -> int:
        """The sequence number of the last write the store holds (0: none)."""
        return int(await self.client.hget(self.keys.controller_counters, "seq") or 0)

    async def load(self) -> tuple[int, DurableState] | None:
        """The last write's sequence number and the state, or None when no controller of this job wrote any."""
        k = self.keys
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hgetall(k.controller_counters)
            pipe.hgetall(k.controller_leases)
            pipe.hgetall(k.controller_retry)
            pipe.smembers(k.controller_dead_items)
            pipe.smembers(k.controller_dropped)
            pipe.hgetall(k.controller_accepted)
            pipe.smembers(k.controller_lost)
            counters, leases, retry, dead_items, dropped, accepted, lost = await pipe.execute()
        if not counters:
            return None
        fields = {name.decode(): value.decode() for name, value in counters.items()}
        counters = decode_counters(fields)
        places = {int(place): decode_retry(record.decode()) for place, record in retry.items()}
        return int(fields["seq"]), DurableState(
            counters=counters,
            progress=json.loads(fields["progress"]),
            leases=sorted(
                (decode_lease(gid.decode(), record.decode()) for gid, record in leases.items()),
                key=lambda lease: lease.ticket,
            ),
            retry=retry_entries(int(counters["retry_head"]), places),
            dead_items={int(item) for item in dead_items},
            dropped_groups={gid.decode() for gid in dropped},
            accepted_groups={gid.decode(): int(item) for gid, item in accepted.items()},
            lost_groups={gid.decode() for gid in lost},
        )

    async def load_legacy(self) -> tuple[DurableState, int | None] | None:
        """The state an older controller kept as one snapshot, and the version it last announced (written before its
        snapshot, so it may be newer); None when there is none."""
        snapshot, version = await self.client.mget(self.keys.legacy_snapshot, self.keys.legacy_version)
        if snapshot is None:
            return None
        return from_snapshot(json.loads(snapshot)), None if version is None else int(version)

    async def forget_legacy(self) -> None:
        await self.client.delete(self.keys.legacy_snapshot, self.keys.legacy_version)


class StateWriter:
    """Writes the core's changes, one write at a time, in order. A call that changed the state awaits `written()`
    before it answers; the changes made while a write is under way go in the next one, so under load one round trip
    carries many calls' changes. A write that fails goes again with the next one (its records are absolute)."""

    def __init__(self, core: ControllerCore, store: ControllerStateStore, seq: int):
        self.core, self.store, self.seq = core, store, seq
        self.applied = seq  # the last write seen applied
        self.lost_writes = False  # a write found the store holding an older state: the servicer reconciles
        self._whole = False  # the next write carries the whole state
        self._next: asyncio.Future | None = None  # resolved when the changes made so far are written
        self._due = asyncio.Event()
        self._unwritten: Changes | None = None

    async def written(self) -> None:
        """Return once every change made so far is in Redis; raise the write's error if it failed."""
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
            self._due.set()
        error = await asyncio.shield(self._next)
        if error is not None:
            raise error

    def rewrite(self) -> None:
        """Write the whole state with the next write (the store lost some of the earlier ones)."""
        self._whole = True
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
            self._due.set()

    async def run(self) -> None:
        while True:
            await self._due.wait()
            self._due.clear()
            # Taken together, with no await between: a change made after this point waits for the next write.
            done, self._next = self._next, None
            changes = self.core.take_changes()
            if self._unwritten is not None:
                self._unwritten.absorb(changes)
                changes, self._unwritten = self._unwritten, None
            if self._whole:
                self._whole = False
                changes.absorb(Changes.everything(self.core.durable_state()))
            self.seq += 1
            try:
                if await self.store.write(self.seq, changes, self.applied) < 0:
                    log.warning(
                        "Redis holds an older state than the controller's write %d: it lost acknowledged writes; "
                        "writing the whole state again",
                        self.applied,
                    )
                    self.lost_writes = True
                    changes.absorb(Changes.everything(self.core.durable_state()))
                    self.seq += 1
                    await self.store.write(self.seq, changes)
                self.applied = self.seq
            except Exception as exc:  # Redis gone longer than the client's retries: the next write carries these
                log.exception("writing the controller's state failed; the next write carries its changes")
                self._unwritten = changes
                done.set_result(exc)
            else:
                done.set_result(None)
                for letter in changes.dead_letters:
                    log.warning(
                        "prompt %s (item %d) dead-lettered after %d failed groups in a row; the last, %s on %s: %s",
                        letter.prompt_id,
                        letter.item_index,
                        letter.attempts,
                        letter.group_id,
                        letter.worker_id,
                        letter.reason,
                    )
