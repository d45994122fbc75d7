"""Redis's append-only file cut back by its last writes, against a real server: what a Redis whose machine crashed
comes back with (common/redis_aof.py)."""

import redis

from areal_k8s.common.redis_aof import newest_increment, read_writes
from areal_k8s.common.redis_server import EmbeddedRedis

# A Lua script's effects are one MULTI ... EXEC unit of the file: cut back, it goes whole or not at all.
TWO_KEYS = "redis.call('SET', KEYS[1], ARGV[1]); redis.call('XADD', KEYS[2], '*', 'v', ARGV[1]); return 1"


def test_a_crash_loses_the_last_writes_whole_and_keeps_everything_before_them(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        client = redis.Redis(port=server.port)
        client.set("a", 1)
        for i in range(3):
            client.eval(TWO_KEYS, 2, f"k{i}", "s", i)
        client.set("last", 1)
        client.close()
        server.written()  # (answered is not yet written while a background fsync lags)
        writes = read_writes(newest_increment(server.data_dir))
        assert [len(w.commands) for w in writes[-4:]] == [2, 2, 2, 1]  # three scripts (SET + XADD), one SET
        lost = server.crash(lose=2)
        assert [w.commands[0][0].upper() for w in lost] == [b"SET", b"SET"]
        assert lost[0].commands[0][1] == b"k2" and lost[1].commands[0][1] == b"last"
        server.start()
        client = redis.Redis(port=server.port)
        assert client.get("a") == b"1" and client.get("k1") == b"1"
        assert client.get("k2") is None and client.get("last") is None
        assert [fields[b"v"] for _, fields in client.xrange("s")] == [b"0", b"1"]  # the lost script's XADD is gone
        client.close()
    finally:
        server.stop()
