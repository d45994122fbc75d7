"""Ports for the servers a run starts on one machine, and starts again at the same address.

A port from bind(0) comes from the kernel's ephemeral range (`net.ipv4.ip_local_port_range`, 32768-60999 by
default), the range the kernel also gives every outgoing connection its local port from. A server started again at
its old port (the launcher restarts a process with the same flags; a trainer world handed off starts again at its
address) then races every connection opened meanwhile: one that took the port as its local end fails the bind with
EADDRINUSE. Seen: a resized trainer world's new rank 0, after its other ranks had opened their connections. So the
ports are drawn from below that range, which the kernel never hands a connection, each checked free by binding it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default, where the file cannot be read
LOWEST = 10000  # above the well-known ports and the registered ones servers most often hold (databases, 8080, 9090)
TRIES = 200

_draw = random.Random()  # its own: a test seeding the module's generator must not make two runs draw alike


def ephemeral_range(path: Path = EPHEMERAL_RANGE) -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections, inclusive."""
    try:
        low, high = (int(field) for field in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high


def bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", ephemeral: tuple[int, int] | None = None) -> int:
    """A port free on `host` now and outside the ephemeral range (`ephemeral`, default the kernel's), so that no
    connection takes it meanwhile; where that range leaves no room, one the kernel picks."""
    low, high = ephemeral or ephemeral_range()
    below, above = range(LOWEST, low), range(max(high + 1, LOWEST), 65536)
    room = len(below) + len(above)
    if room >= TRIES:
        for _ in range(TRIES):
            n = _draw.randrange(room)
            port = below[n] if n < len(below) else above[n - len(below)]
            if bindable(host, port):
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
