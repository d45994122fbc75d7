"""How bench/control_plane_load.py measures (each process's CPU share and run-queue wait over the measured window,
nearest-rank percentiles and their spread, workers connected in waves) and the floor it measures against: the
workers' held polls against a Controller servicer that does nothing else, gRPC's own cost a poll.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections import Counter
from pathlib import Path

import grpc

from areal_k8s.api.v1 import controller_pb2, controller_pb2_grpc
from areal_k8s.common.grpcutil import channel, start_server

WAVE, WAVE_SECONDS = 256, 0.5  # workers connecting together, and the pause before the next ones


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile: a value that was measured."""
    ordered = sorted(values)
    return round(ordered[max(math.ceil(q / 100 * len(ordered)) - 1, 0)], 2)


def spread_ms(values) -> dict:
    """p50, p99 and max of figures in ms."""
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "max": round(max(values), 2)}


def process_seconds(pid: int) -> float:
    """CPU seconds (user + system) a process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def waited_seconds(pid: int) -> float:
    """Seconds the process's threads spent runnable but waiting for a core (the scheduler's run-queue delay): on a
    shared machine, how much of a measurement's latency was the host's other work."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
    return total / 1e9


class MeasuredWindow:
    """The measured window's CPU use and run-queue wait of each process, and the host's load average at its ends."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self.began = time.monotonic()
        self.cpu = {name: process_seconds(pid) for name, pid in pids.items()}
        self.waited = {name: waited_seconds(pid) for name, pid in pids.items()}
        self.load_average = [round(x, 2) for x in os.getloadavg()]

    def close(self) -> dict:
        wall = time.monotonic() - self.began
        return {
            "wall": wall,
            "cpu": {name: round((process_seconds(pid) - self.cpu[name]) / wall, 3) for name, pid in self.pids.items()},
            "waited_for_a_core": {
                name: round((waited_seconds(pid) - self.waited[name]) / wall, 3) for name, pid in self.pids.items()
            },
            "load_average": {"start": self.load_average, "end": [round(x, 2) for x in os.getloadavg()]},
        }


def memory_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


# -- the floor: what gRPC alone costs a poll -----------------------------------------------------------------------


class NullController(controller_pb2_grpc.ControllerServicer):
    """A Controller that holds each AcquireGroups as long as asked and answers nothing: the framework's own cost."""

    async def AcquireGroups(self, request, context):
        await asyncio.sleep(request.wait_ms / 1000)
        return controller_pb2.AcquireGroupsResponse()


async def serve_null(port: int) -> None:
    service = (controller_pb2_grpc.add_ControllerServicer_to_server, NullController(), "areal.v1.Controller")
    server, _port, _health = await start_server([service], f"127.0.0.1:{port}")
    await server.wait_for_termination()


async def in_waves(start, workers: int) -> list[asyncio.Future]:
    """`start(i)` for each worker as a task, a wave at a time: 4,096 connecting at once overflow the listen backlog."""
    tasks = []
    for first in range(0, workers, WAVE):
        tasks += [asyncio.ensure_future(start(i)) for i in range(first, min(first + WAVE, workers))]
        await asyncio.sleep(WAVE_SECONDS)
    return tasks


async def floor_load(args) -> dict:
    """N workers' held polls, one after another, against the null controller; its CPU per poll."""
    channels = [channel(args.controller) for _ in range(args.workers)]
    stop, calls = asyncio.Event(), Counter()

    async def poll(index: int) -> None:
        stub = controller_pb2_grpc.ControllerStub(channels[index])
        request = controller_pb2.AcquireGroupsRequest(
            worker_id=f"worker-{index}", max_groups=16, wait_ms=int(args.hold_seconds * 1000), reports_holding=True
        )
        while not stop.is_set():
            try:
                await stub.AcquireGroups(request)
                calls["polls"] += 1
            except grpc.aio.AioRpcError as exc:
                calls[f"AcquireGroups: {exc.code().name}"] += 1
                await asyncio.sleep(1.0)

    tasks = await in_waves(poll, args.workers)
    await asyncio.sleep(args.warmup)
    window, before = MeasuredWindow({"controller": args.controller_pid, "load": os.getpid()}), calls["polls"]
    await asyncio.sleep(args.window)
    measured = window.close()
    polls = (calls["polls"] - before) / measured["wall"]
    stop.set()
    await asyncio.gather(*tasks)
    for chan in channels:
        await chan.close()
    return {
        "workers": args.workers,
        "rpc_per_second": round(polls, 1),
        "errors": {what: n for what, n in calls.items() if what != "polls"},
        "cpu": measured["cpu"]["controller"],
        "waited_for_a_core": measured["waited_for_a_core"],
        "load_average": measured["load_average"],
    }
