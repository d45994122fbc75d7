"""The real SGLang server for tests (services/areal_k8s/common/sglang_server.py starts it).

`make sglang-env` builds its environment (scripts/sglang-cpu/build.py). Fixtures, registered in conftest.py:
  sglang_model   a tiny random Qwen2 with its tokenizer beside it (tests/tiny_models.py), one per session;
  sglang_server  one server for the whole session, shared by the tests that ask for it.
Where the env is not built they skip, with the reason the build left; with AREAL_REQUIRE_SGLANG=1 (CI) they fail.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from areal_k8s.common.sglang_server import SGLANG_ENV, SGLangServer, missing_env_reason


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
    from tiny_models import build_tiny_qwen2  # torch and transformers: only for the sessions that use it

    return build_tiny_qwen2(tmp_path_factory.mktemp("sglang-model"))


@pytest.fixture(scope="session")
def sglang_server(sglang_model, tmp_path_factory):
    """The real SGLang server on `sglang_model`, one for the session, shared: leave it serving, unpaused, and
    serving the checkpoint's weights (test_sglang_server.py compares its logprobs with them)."""
    skip_or_fail_without_env()
    with SGLangServer(sglang_model, tmp_path_factory.mktemp("sglang-server") / "server.log") as server:
        yield server
