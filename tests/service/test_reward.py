"""Reward service: verifiers, the scoring pool's failure handling, and the gRPC contract on a real server."""

import asyncio
import os
import re
import signal
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from areal_k8s.api.v1 import reward_pb2, reward_pb2_grpc
from areal_k8s.common import config
from areal_k8s.common.grpcutil import channel
from areal_k8s.reward import addition_verifier
from areal_k8s.reward.pool import ScoringItem, ScoringPool
from areal_k8s.reward.server import serve
from areal_k8s.reward.verifiers import BUILTIN_VERIFIERS, UnknownVerifier, math_reward, resolve

pytestmark = pytest.mark.timeout(60)

OK, TIMEOUT, ERROR = reward_pb2.ScoreResult.OK, reward_pb2.ScoreResult.TIMEOUT, reward_pb2.ScoreResult.ERROR


def fixture(name: str) -> str:
    return f"support.reward_fixtures:{name}"


# the custom verifiers the tests' job declares (those that fail to load included: the tests check why)
ALLOWED = [
    *(
        fixture(name)
        for name in (
            "weighted_length",
            "sleeps_forever",
            "kills_its_worker",
            "raises",
            "exits",
            "returns_nan",
            "returns_text",
            "two_arguments",
            "missing",
        )
    ),
    "no_such_module:f",
    "nosuch.module:fn",
]


def item(item_id: str, verifier: str, response: str = "", reference: str = "", **fields) -> reward_pb2.ScoreItem:
    return reward_pb2.ScoreItem(item_id=item_id, verifier=verifier, response=response, reference=reference, **fields)


@pytest.fixture
async def service():
    service = await serve("127.0.0.1:0", workers=2, timeout=10.0, allowed_verifiers=ALLOWED)
    yield service
    await service.stop(grace=1)


@pytest.fixture
async def stub(service):
    async with channel(f"127.0.0.1:{service.port}") as chan:
        yield reward_pb2_grpc.RewardStub(chan)


def request(*items: reward_pb2.ScoreItem, timeout: float = 0.0) -> reward_pb2.ScoreRequest:
    return reward_pb2.ScoreRequest(items=items, timeout_seconds=timeout)


async def score(stub, *items: reward_pb2.ScoreItem, timeout: float = 0.0) -> dict[str, reward_pb2.ScoreResult]:
    response = await stub.Score(request(*items, timeout=timeout))
    assert [result.item_id for result in response.results] == [i.item_id for i in items]
    return {result.item_id: result for result in response.results}


MATH_CASES = [
    # (response, reference, reward)
    (r"The answer is \boxed{42}.", "42", 1.0),
    (r"The answer is \boxed{41}.", "42", 0.0),
    ("42", "42", 1.0),
    (r"So $x = \frac{1}{2}$", "0.5", 1.0),
    (r"\boxed{\dfrac{2}{4}}", r"\frac{1}{2}", 1.0),
    (r"\boxed{0.3333}", "1/3", 0.0),
    (r"\boxed{3+2x}", "2x+3", 1.0),
    (r"\boxed{2}", "2x+3", 0.0),  # a bare reference is one expression, not its first number
    (r"$\frac{\sqrt{2}}{2}$", r"\frac{1}{\sqrt{2}}", 1.0),
    ("I have no idea.", "42", 0.0),
    (r"\boxed{42}", "", 0.0),
]


async def test_math_scores_equivalent_answers_1_and_others_0(stub):
    items = [item(f"m{i}", "math", response, reference) for i, (response, reference, _) in enumerate(MATH_CASES)]
    results = await score(stub, *items)
    for i, (response, reference, reward) in enumerate(MATH_CASES):
        result = results[f"m{i}"]
        assert (result.status, result.reward) == (OK, reward), (response, reference, result.message)


def test_math_verifier_works_off_the_main_thread():
    # math-verify's own SIGALRM timeouts would raise here; the service relies on the pool's timeout instead.
    rewards = []
    thread = threading.Thread(target=lambda: rewards.append(math_reward("", r"\boxed{7}", "7", {})))
    thread.start()
    thread.join()
    assert rewards == [1.0]


async def test_exact_compares_stripped_strings(stub):
    results = await score(stub, item("same", "exact", " yes\n", "yes"), item("different", "exact", "Yes", "yes"))
    assert (results["same"].status, results["same"].reward) == (OK, 1.0)
    assert (results["different"].status, results["different"].reward) == (OK, 0.0)


async def test_addition_uses_the_demo_task(stub):
    response, reference = "7+3+0=10,0+0+1=01|10.", "10"
    right, wrong = item("right", "addition", response, reference), item("wrong", "addition", response, "11")
    results = await score(stub, right, wrong)
    assert results["right"].reward == addition_verifier.score(response, reference)
    assert results["wrong"].reward == addition_verifier.score(response, "11")
    assert {results["right"].status, results["wrong"].status} == {OK}


async def test_running_sum_checks_the_work_of_the_long_tail_task(stub):
    prompt, reference = "417+1,02=", "419"
    worked, shortcut, wrong_work = "02,417+1=418,01,418+1=419|419.", "|419.", "02,417+1=418,02,418+1=419|419."
    results = await score(
        stub,
        item("worked", "running_sum", worked, reference, prompt=prompt),
        item("shortcut", "running_sum", shortcut, reference, prompt=prompt),
        item("wrong-work", "running_sum", wrong_work, reference, prompt=prompt),
    )
    assert {key: (result.status, result.reward) for key, result in results.items()} == {
        "worked": (OK, 1.0),
        "shortcut": (OK, 1.0),
        "wrong-work": (OK, 0.0),
    }


async def test_custom_verifier_gets_all_four_arguments(stub):
    custom = item("c", fixture("weighted_length"), "bb", "ccc", prompt="a", metadata={"weight": "0.5"})
    results = await score(stub, custom)
    assert (results["c"].status, results["c"].reward) == (OK, 3.0)


async def test_verifier_past_its_timeout_scores_0_and_service_keeps_serving(stub):
    results = await score(stub, item("slow", fixture("sleeps_forever")), item("fast", "exact", "a", "a"), timeout=0.5)
    assert (results["slow"].status, results["slow"].reward) == (TIMEOUT, 0.0)
    assert "timeout" in results["slow"].message
    assert (results["fast"].status, results["fast"].reward) == (OK, 1.0)
    results = await score(stub, *(item(f"after{i}", "math", r"\boxed{1}", "1") for i in range(3)))
    assert {(r.status, r.reward) for r in results.values()} == {(OK, 1.0)}


async def test_verifier_that_kills_its_worker_scores_error_and_later_items_score(stub):
    results = await score(stub, item("crash", fixture("kills_its_worker")), item("fine", "exact", "a", "a"))
    assert (results["crash"].status, results["crash"].reward) == (ERROR, 0.0)
    assert "killed its worker" in results["crash"].message
    assert (results["fine"].status, results["fine"].reward) == (OK, 1.0)
    results = await score(stub, *(item(f"after{i}", "exact", "a", "a") for i in range(3)))
    assert {(r.status, r.reward) for r in results.values()} == {(OK, 1.0)}


@pytest.mark.parametrize(
    ("verifier", "message"),
    [
        ("raises", "ValueError: cannot score 'boom'"),
        ("exits", "SystemExit: 3"),
        ("returns_nan", "returned nan, not a finite real number"),
        ("returns_text", "returned '1.0', not a finite real number"),
    ],
)
async def test_verifier_failure_scores_error_with_its_message(stub, verifier, message):
    results = await score(stub, item("bad", fixture(verifier), "boom"))
    assert (results["bad"].status, results["bad"].reward) == (ERROR, 0.0)
    assert message in results["bad"].message


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        pytest.param(request(), "items must not be empty", id="no-items"),
        pytest.param(request(item("", "exact")), "items[0].item_id must not be empty", id="empty-id"),
        pytest.param(
            request(item("a", "exact"), item("a", "exact")), "items[1].item_id 'a' is a duplicate", id="duplicate-id"
        ),
        pytest.param(
            request(item("a", "exact"), item("b", "nope")),
            "items[1] ('b').verifier: unknown verifier 'nope'",
            id="unknown-verifier",
        ),
        pytest.param(
            request(item("a", "no_such_module:f")),
            "items[0] ('a').verifier: cannot import verifier module 'no_such_module'",
            id="unimportable-verifier",
        ),
        pytest.param(
            request(item("a", fixture("two_arguments"))),
            "items[0] ('a').verifier: verifier 'support.reward_fixtures:two_arguments' must accept (prompt, response, "
            "reference, metadata)",
            id="wrong-signature",
        ),
        pytest.param(
            request(item("a", "exact"), timeout=-1),
            "timeout_seconds must be a finite number >= 0",
            id="negative-timeout",
        ),
    ],
)
async def test_invalid_request_is_rejected_naming_the_field(stub, request_, message):
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.Score(request_)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in raised.value.details()


async def test_list_verifiers_names_the_builtins_and_the_allowed_custom_ones(stub):
    response = await stub.ListVerifiers(reward_pb2.ListVerifiersRequest())
    assert list(response.verifiers) == sorted(["addition", "code", "exact", "math", "running_sum", *ALLOWED])


async def test_a_custom_verifier_the_job_does_not_declare_is_rejected_before_its_module_is_imported(stub):
    # the standard library's `this` prints the Zen of Python when imported: a module with an effect on import
    assert "this" not in sys.modules
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.Score(request(item("a", "exact", "x", "x"), item("b", "this:s")))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith("items[1] ('b').verifier: verifier 'this:s' is not allowed: this job runs")
    assert "reward.allowed_verifiers" in raised.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.CheckVerifiers(reward_pb2.CheckVerifiersRequest(verifiers=["math", "this:s", fixture("raises")]))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith("verifier 'this:s': verifier 'this:s' is not allowed")
    assert "this" not in sys.modules
    results = await score(stub, item("after", fixture("weighted_length"), "b", prompt="a", metadata={"weight": "1"}))
    assert (results["after"].status, results["after"].reward) == (OK, 2.0)


def test_the_job_schema_names_the_reward_services_builtin_verifiers():
    assert sorted(config.BUILTIN_VERIFIERS) == sorted(BUILTIN_VERIFIERS)


async def test_check_verifiers_accepts_loadable_ones_and_names_each_that_is_not_and_why(stub, service):
    await stub.CheckVerifiers(reward_pb2.CheckVerifiersRequest(verifiers=["math", fixture("weighted_length")]))
    # a checked custom verifier's failure rate starts at 0 rather than missing
    assert (
        service.pool.metrics.registry.get_sample_value(
            "areal_reward_scored_items_total",
            {"rljob": "", "role": "reward", "verifier": fixture("weighted_length"), "status": "ok"},
        )
        == 0
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.CheckVerifiers(
            reward_pb2.CheckVerifiersRequest(verifiers=["exact", "nosuch.module:fn", fixture("missing")])
        )
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == (
        "verifier 'nosuch.module:fn': cannot import verifier module 'nosuch.module': ModuleNotFoundError: No module "
        "named "
        "'nosuch'; verifier 'support.reward_fixtures:missing': verifier module 'support.reward_fixtures' has no "
        "'missing'"
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.CheckVerifiers(reward_pb2.CheckVerifiersRequest())
    assert raised.value.details() == "verifiers must not be empty"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (fixture("missing"), "verifier module 'support.reward_fixtures' has no 'missing'"),
        (fixture("not_a_function"), "is not a Python function"),
        ("math:", "unknown verifier 'math:'"),
    ],
)
def test_resolve_explains_why_a_name_is_unknown(name, message):
    with pytest.raises(UnknownVerifier, match=re.escape(message)):
        resolve(name)


async def test_pool_recovers_after_an_idle_worker_is_killed(caplog):
    pool = ScoringPool(max_workers=2, default_timeout=10.0)
    try:
        [pid] = await pool.score([ScoringItem("pid", fixture("worker_pid"))])
        os.kill(int(pid.reward), signal.SIGKILL)
        # pebble gives up on its whole pool when it sees a worker died while no task ran; wait until it has.
        async with asyncio.timeout(10):
            while pool._processes.active:
                await asyncio.sleep(0.05)
        outcomes = await pool.score([ScoringItem(f"after{i}", "exact", response="a", reference="a") for i in range(3)])
        assert [(o.status, o.reward) for o in outcomes] == [("ok", 1.0)] * 3
        assert "the scoring process pool broke; starting a new one" in caplog.text
    finally:
        await pool.close()


async def test_pool_counts_outcomes_by_verifier():
    pool = ScoringPool(max_workers=2, default_timeout=0.5)
    try:
        await pool.score(
            [
                ScoringItem("ok", "exact", response="a", reference="a"),
                ScoringItem("slow", fixture("sleeps_forever")),
                ScoringItem("bad", fixture("raises")),
            ]
        )

        def scored(verifier: str, status: str) -> float:
            return pool.metrics.value("areal_reward_scored_items_total", verifier=verifier, status=status)

        assert (scored("exact", "ok"), scored("exact", "timeout"), scored("exact", "error")) == (1, 0, 0)
        assert scored(fixture("sleeps_forever"), "timeout") == 1
        assert scored(fixture("raises"), "error") == 1
        assert pool.metrics.value("areal_reward_scoring_latency_seconds_count", verifier="exact") == 1
    finally:
        await pool.close()


def pool_tasks(pool: ScoringPool) -> dict[str, float]:
    return {kind: pool.metrics.value("areal_reward_pool_tasks_total", kind=kind) for kind in ("chunk", "item")}


async def test_a_request_goes_to_the_workers_as_one_chunk_each():
    pool = ScoringPool(max_workers=2, default_timeout=10.0)
    try:
        items = [ScoringItem(f"i{k}", "exact", response="a", reference="a" if k % 2 else "b") for k in range(5)]
        outcomes = await pool.score(items)
        assert [(o.item_id, o.status, o.reward) for o in outcomes] == [(f"i{k}", "ok", float(k % 2)) for k in range(5)]
        assert pool_tasks(pool) == {"chunk": 2, "item": 0}
    finally:
        await pool.close()


@pytest.mark.parametrize(
    ("verifier", "status", "message"),
    [("sleeps_forever", "timeout", "ran past the 0.5 s timeout"), ("kills_its_worker", "error", "killed its worker")],
)
async def test_a_chunk_that_fails_as_a_whole_is_scored_again_item_by_item(verifier, status, message):
    pool = ScoringPool(max_workers=1, default_timeout=0.5)
    try:
        items = [
            ScoringItem("before", "exact", response="a", reference="a"),
            ScoringItem("bad", fixture(verifier)),
            ScoringItem("after", "exact", response="a", reference="a"),
        ]
        before, bad, after = await pool.score(items)
        assert [(o.status, o.reward) for o in (before, after)] == [("ok", 1.0)] * 2
        assert (bad.status, bad.reward) == (status, 0.0) and message in bad.message
        assert pool_tasks(pool) == {"chunk": 1, "item": 3}
        assert pool.metrics.value("areal_reward_scored_items_total", verifier="exact", status="ok") == 2
    finally:
        await pool.close()


async def read_ready_port(stderr: asyncio.StreamReader) -> int:
    while line := (await stderr.readline()).decode():
        if match := re.search(r"reward service listening on 127\.0\.0\.1:(\d+)", line):
            return int(match.group(1))
    raise AssertionError("the reward service exited before it was ready")


async def test_launcher_serves_health_and_scores_then_stops_on_sigterm():
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "areal_k8s.reward", "--port", "0", "--workers", "1",
        "--allow-verifier", fixture("weighted_length"), "--code-config", '{"scoring": "all"}',
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        port = await asyncio.wait_for(read_ready_port(process.stderr), 30)
        async with channel(f"127.0.0.1:{port}") as chan:
            health_check = health_pb2.HealthCheckRequest(service="areal.v1.Reward")
            health = await health_pb2_grpc.HealthStub(chan).Check(health_check)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            results = await score(reward_pb2_grpc.RewardStub(chan), item("one", "math", r"\boxed{1/2}", "0.5"))
            assert (results["one"].status, results["one"].reward) == (OK, 1.0)
            listed = await reward_pb2_grpc.RewardStub(chan).ListVerifiers(reward_pb2.ListVerifiersRequest())
            assert fixture("weighted_length") in listed.verifiers
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 20) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
