"""The ports a run's servers listen on: free, and never from the range the kernel hands outgoing connections, so a
server restarted at its old port does not find it taken by a connection opened meanwhile."""

import contextlib
import socket

from areal_k8s.common import ports
from areal_k8s.common.ports import LOWEST, TRIES, ephemeral_range, free_port


def test_a_port_is_free_and_outside_the_kernels_ephemeral_range():
    low, high = ephemeral_range()
    for _ in range(50):
        port = free_port()
        assert LOWEST <= port < low or high < port <= 65535, (port, low, high)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free: it binds


def test_a_port_held_by_another_socket_is_never_handed_out():
    """Every port of the room left below a (made-up) ephemeral range is held: the draw finds none free and falls
    back to the kernel's pick, never a held port."""
    room = range(LOWEST, LOWEST + TRIES)
    with contextlib.ExitStack() as held:
        for port in room:
            sock = held.enter_context(socket.socket())
            with contextlib.suppress(OSError):  # held by someone else already: as good
                sock.bind(("127.0.0.1", port))
        for _ in range(5):
            assert free_port(ephemeral=(LOWEST + TRIES, 65535)) not in room


def test_without_room_outside_the_range_the_kernel_picks():
    port = free_port(ephemeral=(1024, 65535))
    assert 1024 <= port <= 65535
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_the_range_is_read_from_the_kernel_or_defaults(tmp_path):
    table = tmp_path / "ip_local_port_range"
    table.write_text("40000\t50000\n")
    assert ephemeral_range(table) == (40000, 50000)
    table.write_text("garbled\n")
    assert ephemeral_range(table) == ports.DEFAULT_EPHEMERAL
    assert ephemeral_range(tmp_path / "absent") == ports.DEFAULT_EPHEMERAL
