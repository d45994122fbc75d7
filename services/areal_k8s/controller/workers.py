"""The rollout workers the controller knows: each registration numbered (its incarnation), and when each last
called in."""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass


class UnknownWorker(LookupError):
    pass


@dataclass
class Worker:
    worker_id: str
    address: str
    engine_version: int
    last_seen: float
    engine_ranks: int = 1  # ranks its engine takes in the weight-update group (the engine's tensor-parallel size)
    registered_at: float = 0.0
    incarnation: int = 0  # this registration's; 0 for a placeholder restored from a snapshot
    engine_dtype: str = ""  # the dtype its engine serves weights in ("" when the worker did not say)
    attached: bool = False  # its admission stream is open: it is live without calling (controller/attachments.py)


class WorkerRegistry(MutableMapping[str, Worker]):
    """The workers by id. A placeholder (no address) stands for a lease holder restored from a snapshot until it
    registers again."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.next_incarnation = 0  # numbers every worker registration; kept across restarts, never reused
        self._workers: dict[str, Worker] = {}

    def __getitem__(self, worker_id: str) -> Worker:
        return self._workers[worker_id]

    def __setitem__(self, worker_id: str, worker: Worker) -> None:
        self._workers[worker_id] = worker

    def __delitem__(self, worker_id: str) -> None:
        del self._workers[worker_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._workers)

    def __len__(self) -> int:
        return len(self._workers)

    def is_live(self, worker_id: str) -> bool:
        """Registered by a process of its own (not a placeholder from a snapshot)."""
        worker = self._workers.get(worker_id)
        return worker is not None and bool(worker.address)

    def register(self, worker_id: str, address: str, engine_version: int, engine_ranks: int, engine_dtype: str) -> None:
        now = self.clock()
        self.next_incarnation += 1
        self[worker_id] = Worker(
            worker_id,
            address,
            engine_version,
            now,
            engine_ranks,
            registered_at=now,
            incarnation=self.next_incarnation,
            engine_dtype=engine_dtype,
        )

    def hold_place(self, worker_id: str, now: float) -> None:
        """A placeholder for the holder of a restored lease, unless it is known."""
        self._workers.setdefault(worker_id, Worker(worker_id, "", -1, now))

    def registered(self, worker_id: str) -> Worker:
        """The worker, if it registered; UnknownWorker otherwise."""
        worker = self._workers.get(worker_id)
        if worker is None or not worker.address:  # no address: a lease holder restored from a snapshot
            raise UnknownWorker(f"worker {worker_id!r} is not registered")
        return worker

    def heard_from(self, worker_id: str, engine_version: int) -> None:
        """The worker called in, its engine serving `engine_version`."""
        worker = self._workers[worker_id]
        worker.last_seen = self.clock()
        worker.engine_version = engine_version

    def superseded(self, worker_id: str, incarnation: int) -> str | None:
        """Why a call from `incarnation` of a worker is refused: the worker registered again since (None: it is
        the current one, or the call names none)."""
        worker = self._workers.get(worker_id)
        if incarnation and worker is not None and worker.incarnation and worker.incarnation != incarnation:
            return (
                f"worker {worker_id!r} incarnation {incarnation} was superseded by incarnation {worker.incarnation}, "
                f"registered since: an earlier registration's calls are refused"
            )
        return None
