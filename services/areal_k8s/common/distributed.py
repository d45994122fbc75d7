"""Side process groups for weight transfer, next to (or without) a process's default torch.distributed group.

The trainer's rank 0 and every inference engine form their own small "world" (trainer = rank 0, engine i =
rank_offset_i). The layout matches SGLang's `init_custom_process_group`: a TCP rendezvous, then the group's store is
`PrefixStore(group_name, store)` and the group is built by `_new_process_group_helper` with an empty rank list, which
makes it independent of any default group (Megatron's, say) the process may already have.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import Backend, PrefixStore, Store, TCPStore
from torch.distributed.distributed_c10d import _new_process_group_helper, _world
from torch.distributed.rendezvous import rendezvous


def create_rendezvous_store(master_address: str, master_port: int, world_size: int, timeout: float) -> TCPStore:
    """The rendezvous server rank 0 hosts; `master_port=0` binds a free port (read it back from `store.port`).

    Creating it before telling the peers the port avoids the race of "find a free port, close it, bind it again".
    """
    return TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
    )


def connect_to_rendezvous(master_address: str, master_port: int, world_size: int, timeout: float) -> TCPStore:
    """A client of the rendezvous server at `master_address:master_port`. Rank 0 joins through one, not through the
    server object itself, so that dropping the server ends every wait in the rendezvous, rank 0's included."""
    return TCPStore(master_address, master_port, world_size, is_master=False, timeout=timedelta(seconds=timeout))


def init_side_group(
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: float,
    *,
    store: Store | None = None,
) -> dist.ProcessGroup:
    """Join the group `group_name`; blocks until all `world_size` ranks have joined (or `timeout` seconds pass).

    `store` is a store already open on the rendezvous (rank 0's server from `create_rendezvous_store`, or a client
    from `connect_to_rendezvous`); without it the TCP rendezvous at `master_address:master_port` is done here
    (rank 0 then hosts the server). Collectives on the returned group
    use group ranks (`group_src=0`).
    """
    if not dist.is_backend_available(backend):
        raise RuntimeError(f"torch.distributed backend {backend!r} is not available in this build")
    if group_name in _world.pg_names.values():
        raise ValueError(f"a process group named {group_name!r} already exists in this process")
    if backend == Backend.NCCL:
        # SGLang's own update test calls these "very important": cuMem/NVLS buffers break a second NCCL world.
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    wait = timedelta(seconds=timeout)
    if store is None:
        url = f"tcp://{master_address}:{master_port}"
        store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=wait))
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        # Callers wait on each collective with `timeout` and abort the group when it passes; the group's own
        # timeout (NCCL's watchdog, which would take the process down) only backs that up.
        timeout=2 * wait,
    )
    # `destroy_process_group` and rank translation look the group up here; the helper leaves it to its callers.
    _world.pg_group_ranks[group] = {index: index for index in range(world_size)}
    return group


def destroy_side_group(group: dist.ProcessGroup, *, abort: bool = False) -> None:
    """Tear down a group made by `init_side_group`; the default group, if any, is untouched. `abort` first when a
    collective may still be pending on it (a failed or timed-out broadcast), so the teardown cannot wait on it."""
    if abort:
        group.abort()
    dist.destroy_process_group(group)


def broadcast_within(tensor: torch.Tensor, group: dist.ProcessGroup, timeout: float) -> None:
    """Broadcast from group rank 0 (sending or receiving) and wait until it is done, at most `timeout` seconds
    (raises otherwise). With NCCL a plain broadcast returns once queued on the stream; waiting on the work with a
    timeout blocks the host until the transfer is over."""
    work = dist.broadcast(tensor, group_src=0, group=group, async_op=True)
    work.wait(timedelta(seconds=timeout))


async def in_daemon_thread(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`call(*args, **kwargs)` in a thread of its own: for blocking group operations (joining, broadcasting), which may
    wait on
    a peer that is gone until their own timeout. Unlike `asyncio.to_thread`, the thread is a daemon outside the loop's
    executor, so a caller that gave up on it (a failed push) is not held up by it when the process shuts down."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any = None, error: BaseException | None = None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            result = call(*args, **kwargs)
        except BaseException as exc:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result)

    threading.Thread(target=run, name=f"collective-{getattr(call, '__name__', 'call')}", daemon=True).start()
    return await future
