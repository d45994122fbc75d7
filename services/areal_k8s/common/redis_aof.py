"""Redis's append-only file read as writes, and cut back: what a Redis whose machine crashed comes back with.

With `appendfsync everysec` Redis writes each command to the file's page cache before it answers, and syncs the file
each second; while a sync lags it answers first and writes up to 2 s later. So a killed server loses at most the
writes of a lagging sync, and a machine that goes away loses up to about the last second or two of writes.
Every write is one unit of the file: a command, or a MULTI ... EXEC block (a Lua script's effects, applied at once).
`cut_back` drops the last units of the newest part of the file (Redis 7 keeps a multi-part file in `appendonlydir`:
a base, then the increments named by its manifest), so a server started on it has lost exactly those writes, and
everything before them is as it was: the state of a moment in the past.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

AOF_DIR = "appendonlydir"  # redis-server's default `appenddirname`


@dataclass(frozen=True)
class Write:
    """One unit Redis applies at once: its commands (each a list of arguments) and where it lies in the file."""

    start: int
    end: int
    commands: list[list[bytes]]


def newest_increment(data_dir: Path) -> Path:
    """The increment file the server appends to: the last one its manifest names."""
    folder = Path(data_dir) / AOF_DIR
    manifests = list(folder.glob("*.manifest"))
    if len(manifests) != 1:
        raise FileNotFoundError(f"no append-only file manifest (or more than one) in {folder}")
    increments = [line.split() for line in manifests[0].read_text().splitlines() if line.split()[-1:] == ["i"]]
    if not increments:
        raise FileNotFoundError(f"the manifest {manifests[0]} names no increment file")
    return folder / increments[-1][1]  # "file <name> seq <n> type i", in seq order


def _command(data: bytes, at: int) -> tuple[list[bytes], int]:
    """The RESP array at offset `at` (`*<n>` then n `$<len>` strings) and the offset after it."""
    line_end = data.index(b"\r\n", at)
    if data[at : at + 1] != b"*":
        raise ValueError(f"not a command at byte {at} of the append-only file")
    count, at = int(data[at + 1 : line_end]), line_end + 2
    args = []
    for _ in range(count):
        line_end = data.index(b"\r\n", at)
        length = int(data[at + 1 : line_end])
        at = line_end + 2
        args.append(data[at : at + length])
        at += length + 2
    return args, at


def read_writes(path: Path) -> list[Write]:
    """The file's writes in order. A torn write at the end (a crash mid-append) is left out, as Redis leaves it."""
    data, at, writes = Path(path).read_bytes(), 0, []
    block: list[list[bytes]] | None = None  # the commands of an open MULTI
    start = 0
    while at < len(data):
        try:
            args, after = _command(data, at)
        except (ValueError, IndexError):
            break
        if after > len(data):
            break
        name = args[0].upper()
        if block is None:
            start = at
            if name == b"MULTI":
                block = []
            else:
                writes.append(Write(start, after, [args]))
        elif name == b"EXEC":
            writes.append(Write(start, after, block))
            block = None
        else:
            block.append(args)
        at = after
    return writes


def cut_back(data_dir: Path, drop: int) -> list[Write]:
    """Drop the last `drop` writes of the server's newest increment (all of it, if it holds fewer): the server must
    be stopped. Returns the writes dropped, oldest first."""
    path = newest_increment(data_dir)
    writes = read_writes(path)
    kept, dropped = writes[: max(len(writes) - drop, 0)], writes[max(len(writes) - drop, 0) :]
    with path.open("r+b") as f:
        f.truncate(kept[-1].end if kept else 0)
    return dropped
