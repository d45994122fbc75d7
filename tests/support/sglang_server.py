"""The real SGLang servers for tests (testing/areal_k8s_testing/sglang_server.py starts them).

`make sglang-env` builds their environment (scripts/sglang-cpu/build.py). Fixtures, registered in conftest.py:
  sglang_model    a tiny random Qwen2 with its tokenizer beside it (tests/support/tiny_models.py), one per session;
  sglang_servers  the session's servers (SERVERS), each launched, all together, when the first test that uses any
                  of them runs, and stopped once the last test that uses it is over;
  sglang_server   the plain one of them (SERVERS["server"]), which several modules share.
A test uses `sglang_server` by asking for it, and the others by the marker `sglang_servers("no-radix", ...)`.
Where the env is not built they skip, with the reason the build left; with AREAL_REQUIRE_SGLANG=1 (CI) they fail.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import pytest
from areal_k8s_testing.sglang_server import SGLANG_ENV, SGLangServer, missing_env_reason

KV_TOKENS = 1024  # a small KV pool: a dozen long requests do not fit, and SGLang retracts some of them
# The session's servers by name: SGLangServer's options (every one with the small KV pool).
SERVERS = {
    "server": {},
    "no-radix": {"extra_args": ("--disable-radix-cache",)},  # what `rollout.interrupt: retract` needs
    # one core per rank: SGLang's CPU rule
    "tp2": {"extra_args": ("--tp", "2"), "extra_env": {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}},
}
# A liveness bound, not a timing assertion: the servers start together, and each start-up shares the two cores.
LAUNCH_TIMEOUT_S = 600.0
LAUNCHER = pytest.StashKey["Launcher"]()


def skip_or_fail_without_env() -> None:
    """Skip the calling test where the env is missing; fail it instead under AREAL_REQUIRE_SGLANG=1."""
    reason = missing_env_reason()
    if reason is None:
        return
    if os.environ.get("AREAL_REQUIRE_SGLANG") == "1":
        pytest.fail(f"AREAL_REQUIRE_SGLANG=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def sglang_package() -> Path:
    """The sglang package installed in the env, for tests that read its source; skips (or fails) without the env."""
    skip_or_fail_without_env()
    (package,) = (SGLANG_ENV / "lib").glob("python3.*/site-packages/sglang")
    return package


@pytest.fixture(scope="session")
def sglang_model(tmp_path_factory) -> Path:
    """A tiny random Qwen2 checkpoint with its tokenizer beside it: SGLang serves it, our trainer trains it."""
    from support.tiny_models import build_tiny_qwen2  # torch and transformers: only for the sessions that use it

    return build_tiny_qwen2(tmp_path_factory.mktemp("sglang-model"))


def servers_used(item: pytest.Item) -> set[str]:
    """The servers of SERVERS a test runs against."""
    used = {"server"} if "sglang_server" in item.fixturenames else set()
    return used.union(*(marker.args for marker in item.iter_markers("sglang_servers")))


class Launcher:
    """The session's servers, each started on a thread of its own: launched together, a server's start-up (mostly
    processes importing SGLang) overlaps the others' instead of following them, and each test waits for its own.
    A server is stopped once the last selected test that uses it is over (the stops go on while the next tests run:
    each waits seconds for SGLang's own drain); `close`, at the session's end, waits for them."""

    def __init__(self, model_path: Path, tmp_path_factory, items: list[pytest.Item]):
        self.model_path, self.tmp_path_factory = model_path, tmp_path_factory
        self.users = {name: sum(name in servers_used(item) for item in items) for name in SERVERS}
        self.pool = ThreadPoolExecutor(len(SERVERS))
        self.servers: dict[str, SGLangServer] = {}
        self.starts: dict[str, Future] = {}
        for name, users in self.users.items():
            if users:
                self.launch(name)

    def launch(self, name: str) -> Future:
        if name not in self.starts:
            log = self.tmp_path_factory.mktemp(f"sglang-{name}") / "server.log"
            self.servers[name] = SGLangServer(self.model_path, log, max_total_tokens=KV_TOKENS, **SERVERS[name])
            self.starts[name] = self.pool.submit(self.servers[name].start, LAUNCH_TIMEOUT_S)
        return self.starts[name]

    def get(self, name: str) -> SGLangServer:
        return self.launch(name).result()

    def finished(self, item: pytest.Item) -> None:
        """`item` is over: stop the servers no test to come uses."""
        for name in servers_used(item):
            self.users[name] -= 1
            if self.users[name] <= 0 and name in self.starts:
                self.stop(name)

    def stop(self, name: str) -> None:
        start, server = self.starts.pop(name), self.servers.pop(name)
        self.pool.submit(lambda: (wait([start]), server.stop()))

    def close(self) -> None:
        for name in list(self.starts):
            self.stop(name)
        self.pool.shutdown(wait=True)


@pytest.fixture(scope="session")
def sglang_servers(request, sglang_model, tmp_path_factory) -> Launcher:
    skip_or_fail_without_env()
    launcher = Launcher(sglang_model, tmp_path_factory, request.session.items)
    request.config.stash[LAUNCHER] = launcher
    request.config.add_cleanup(launcher.close)  # at the end of the session, every server is stopped
    return launcher


@pytest.fixture(scope="session")
def sglang_server(sglang_servers) -> SGLangServer:
    """The plain server, shared: a test that changes its weights leaves them changed (test_sglang_server.py loads
    the checkpoint's again)."""
    return sglang_servers.get("server")


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    if launcher := item.config.stash.get(LAUNCHER, None):
        launcher.finished(item)
