"""The code verifier and its sandbox, against the real bwrap, through a real reward service process over gRPC.

Every hostile program is scored in one request with a correct program after it, on a service with one worker:
the hostile one scores 0 with a reason, the correct one 1, and the service process is still running.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest

from areal_k8s.api.v1 import reward_pb2, reward_pb2_grpc
from areal_k8s.common import sandbox as sandbox_module
from areal_k8s.common.sandbox import NOBODY, Sandbox, SandboxError, SandboxLimits
from areal_k8s.reward.code_verifier import extract_program, normalised_lines, parse_tests

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
    ),
]

OK, ERROR = reward_pb2.ScoreResult.OK, reward_pb2.ScoreResult.ERROR
# The wall-clock limit is far above the CPU limit: on a loaded machine a program gets a fraction of a core, and a
# 3 s wall limit killed a busy loop (and once the interpreter's own start) before its 1 s of CPU was used.
LIMITS = {"wall_seconds": 12, "cpu_seconds": 1, "memory_mb": 256, "max_processes": 16, "max_output_kb": 64}
SECRET = "hunter2-service-token"

ADD_STDIO = [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6"}]
ADD_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"
ADD_ASSERTS = {"asserts": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]}
ADD_FUNCTION = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def service():
    """`python -m areal_k8s.reward` with one worker, a service secret in its environment, short sandbox limits."""
    env = {**os.environ, "AREAL_TEST_SECRET": SECRET}
    process = subprocess.Popen(
        [sys.executable, "-m", "areal_k8s.reward", "--port", "0", "--workers", "1", "--timeout", "60",
         "--code-config", json.dumps(LIMITS)],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    port = None
    for line in process.stderr:
        if "reward service listening on" in line:
            port = int(line.rsplit(":", 1)[1])
            break
    assert port, "the reward service exited before it was ready"
    with grpc.insecure_channel(f"127.0.0.1:{port}") as chan:
        yield process, reward_pb2_grpc.RewardStub(chan)
    process.send_signal(signal.SIGTERM)
    process.wait(20)


def code_item(item_id: str, program: str, tests, **metadata) -> reward_pb2.ScoreItem:
    response = f"Here is my solution:\n```python\n{program}\n```\n"
    return reward_pb2.ScoreItem(
        item_id=item_id, verifier="code", response=response, reference=json.dumps(tests), metadata=metadata
    )


def score(service, *items: reward_pb2.ScoreItem) -> dict[str, reward_pb2.ScoreResult]:
    process, stub = service
    results = {r.item_id: r for r in stub.Score(reward_pb2.ScoreRequest(items=items)).results}
    assert process.poll() is None, "the reward service died"
    return results


def assert_hostile_scores_0_and_the_next_item_1(service, program: str, tests, reason: str) -> str:
    results = score(service, code_item("hostile", program, tests), code_item("next", ADD_PROGRAM, ADD_STDIO))
    hostile, following = results["hostile"], results["next"]
    assert (hostile.status, hostile.reward) == (OK, 0.0), hostile
    assert reason in hostile.message, hostile.message
    assert (following.status, following.reward, following.message) == (OK, 1.0, "2/2 tests passed")
    return hostile.message


def sandbox_processes() -> int:
    """Processes running as the sandbox's uid on this machine (bwrap runs as nobody when the tests are root)."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as status:
                uid_line = next(line for line in status if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        count += int(uid_line.split()[1]) == NOBODY
    return count


# -- correct programs -------------------------------------------------------------------------------------


def test_correct_programs_score_1_in_both_test_shapes(service):
    results = score(
        service,
        code_item("stdio", ADD_PROGRAM, ADD_STDIO),
        code_item("stdio-columns", ADD_PROGRAM, {"inputs": ["1 1\n"], "outputs": ["2\n"]}),
        code_item("asserts", ADD_FUNCTION, ADD_ASSERTS),
    )
    assert [(r.status, r.reward) for r in results.values()] == [(OK, 1.0)] * 3
    assert results["asserts"].message == "3/3 tests passed"


def test_score_is_the_fraction_passed_or_all_or_nothing_with_the_first_failure_as_reason(service):
    wrong_at_zero = "def add(a, b):\n    return a + b if a else 1\n"
    results = score(
        service,
        code_item("fraction", wrong_at_zero, ADD_ASSERTS),
        code_item("all", wrong_at_zero, ADD_ASSERTS, scoring="all"),
    )
    assert results["fraction"].reward == pytest.approx(2 / 3)
    assert results["fraction"].message == "2/3 tests passed; test 2: AssertionError"
    assert (results["all"].reward, results["all"].message) == (0.0, "2/3 tests passed; test 2: AssertionError")


def test_stdout_is_compared_line_by_line_whitespace_normalised(service):
    tests = [{"input": "", "output": "1 2\n3\n"}]
    results = score(
        service,
        code_item("spaced", "print('  1   2 ')\nprint('3')\nprint()", tests),
        code_item("wrong", "print('1 2 3')", tests),
    )
    assert results["spaced"].reward == 1.0
    assert (results["wrong"].reward, results["wrong"].message) == (
        0.0,
        "0/1 tests passed; test 0: wrong output: expected '1 2\\n3\\n', got '1 2 3\\n'",
    )


def test_the_job_start_check_runs_a_program_in_the_sandbox(service):
    _, stub = service
    stub.CheckVerifiers(reward_pb2.CheckVerifiersRequest(verifiers=["code", "math"]))  # raises unless OK
    assert "code" in stub.ListVerifiers(reward_pb2.ListVerifiersRequest()).verifiers


def test_a_reference_that_is_not_tests_is_an_error_not_a_zero(service):
    results = score(service, reward_pb2.ScoreItem(item_id="bad", verifier="code", response="print(1)", reference="42"))
    assert results["bad"].status == ERROR
    assert "the code verifier's reference must be" in results["bad"].message


# -- hostile programs: one test each ----------------------------------------------------------------------


def test_infinite_loop_is_killed(service):
    # by its 1 s CPU limit (the wall-clock limit is far off)
    assert_hostile_scores_0_and_the_next_item_1(
        service, "while True:\n    pass", ADD_STDIO, "test 0: killed by SIGXCPU"
    )


def test_fork_bomb_is_contained_and_leaves_no_process_behind(service):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    assert_hostile_scores_0_and_the_next_item_1(service, bomb, ADD_STDIO, "test 0: killed")
    if os.geteuid() == 0:  # the kernel kills the namespace's processes as its init dies: give it a moment
        deadline = time.monotonic() + 5
        while sandbox_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sandbox_processes() == 0


def test_memory_hog_fails_at_its_address_space_limit(service):
    hog = "blocks = [bytearray(64 * 1024 * 1024) for _ in range(64)]\nprint(5)"
    assert_hostile_scores_0_and_the_next_item_1(service, hog, ADD_STDIO, "MemoryError")


def test_huge_print_is_killed_at_the_output_cap(service):
    assert_hostile_scores_0_and_the_next_item_1(
        service, "while True:\n    print('x' * 10000)", ADD_STDIO, "printed more than 65536 bytes"
    )


def test_reading_files_outside_its_directory_finds_nothing(service, tmp_path):
    secret = tmp_path / "token"
    secret.write_text(SECRET)
    secret.chmod(0o644)  # readable by anyone on the host: only the sandbox's mounts keep it out
    # the secret, the host's password files, the service's own code
    paths = [str(secret), "/etc/shadow", "/etc/passwd", sandbox_module.__file__]
    program = (
        f"for path in {paths!r}:\n    try:\n        print(open(path).read())\n"
        "    except OSError as exc:\n        print(type(exc).__name__)"
    )
    message = assert_hostile_scores_0_and_the_next_item_1(
        service, program, [{"input": "", "output": SECRET}], "wrong output"
    )
    assert message.endswith("got 'FileNotFoundError\\nFileNotFoundError\\nFileNotFoundError\\nFileNotFoundError\\n'"), (
        message
    )


def test_the_environment_holds_none_of_the_services_variables(service):
    program = "import os\nprint(sorted(os.environ))"
    results = score(service, code_item("env", program, [{"input": "", "output": "?"}]))
    assert "got \"['HOME', 'LANG', 'PATH', 'PWD']\\n\"" in results["env"].message
    assert SECRET not in results["env"].message


def test_writing_outside_its_directory_fails(service, tmp_path):
    target = tmp_path / "escaped"
    program = f"open({str(target)!r}, 'w').write('x')\nprint(5)"
    assert_hostile_scores_0_and_the_next_item_1(service, program, ADD_STDIO, "FileNotFoundError")
    assert not target.exists()
    program = "open('/usr/lib/planted.py', 'w').write('x')\nprint(5)"
    assert_hostile_scores_0_and_the_next_item_1(service, program, ADD_STDIO, "Read-only file system")
    assert not os.path.exists("/usr/lib/planted.py")


def test_opening_a_socket_reaches_nothing(service):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')\nprint(5)"
        assert_hostile_scores_0_and_the_next_item_1(service, program, ADD_STDIO, "test 0: exit code 1")
        listener.settimeout(0.5)
        with pytest.raises(TimeoutError):
            listener.accept()


def test_killing_its_parent_reaches_only_the_sandboxs_own_init(service):
    # Its parent is bwrap as the pid namespace's init (pid 1), which ignores signals from inside: the program
    # lives on to print its parent's pid, and neither the worker nor the service is touched.
    program = "import os, signal, time\nos.kill(os.getppid(), signal.SIGKILL)\ntime.sleep(0.3)\nprint(os.getppid())"
    assert_hostile_scores_0_and_the_next_item_1(service, program, ADD_STDIO, "got '1\\n'")


def test_sleeping_past_the_wall_limit_is_killed(service):
    assert_hostile_scores_0_and_the_next_item_1(
        service, "import time\ntime.sleep(600)", ADD_STDIO, "ran past the 12 s wall-clock limit"
    )


def test_os_exit_mid_test_earns_nothing(service):
    program = "import os\ndef add(a, b):\n    if a == 0:\n        os._exit(0)\n    return a + b"
    tests = {"asserts": ["assert add(2, 3) == 5", "assert add(0, 0) == 0", "assert add(1, 1) == 2"]}
    assert_hostile_scores_0_and_the_next_item_1(
        service, program, tests, "the run ended before the tests finished (exit code 0)"
    )


def test_a_fake_all_tests_passed_earns_nothing(service):
    # It prints the claims and writes pass lines (with a made-up token) to every descriptor it might guess.
    program = (
        "import os, sys\n"
        "for n in range(3):\n"
        "    print(f'0123456789abcdef0123456789abcdef pass {n}')\n"
        "print('All tests passed!')\n"
        "for fd in range(3, 20):\n"
        "    try:\n"
        "        os.write(fd, b''.join(b'0123456789abcdef0123456789abcdef %s\\n' % line for line in (b'pass 0', "
        "b'pass 1', b'pass 2', b'done')))\n"
        "    except OSError:\n"
        "        pass\n"
        "sys.exit(0)"
    )
    assert_hostile_scores_0_and_the_next_item_1(service, program, ADD_ASSERTS, "the program raised SystemExit: 0")
    assert_hostile_scores_0_and_the_next_item_1(service, "print('All tests passed!')", ADD_STDIO, "wrong output")


def test_a_program_that_replaces_the_harness_builtins_earns_nothing(service):
    # Were the harness to look these up after the program ran, every test would be a no-op that "passes".
    program = (
        "import builtins, os\nbuiltins.exec = lambda *args: None\nbuiltins.compile = lambda *args: None\n"
        "builtins.enumerate = lambda tests: [(i, 'pass') for i in range(3)]\nos.write = lambda *args: 0\n"
    )
    assert_hostile_scores_0_and_the_next_item_1(
        service, program, ADD_ASSERTS, "0/3 tests passed; test 0: NameError: name 'add' is not defined"
    )


# -- the sandbox and the verifier's parts, directly -------------------------------------------------------


def test_the_process_limit_stops_forks_at_the_sandboxs_own_count():
    sandbox = Sandbox(SandboxLimits(max_processes=8))
    program = (
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(5)\n"
        "            os._exit(0)\n        n += 1\nexcept OSError:\n    print(n)"
    )
    result = sandbox.run_program(program)
    assert result.returncode == 0, result.stderr
    assert 0 < int(result.stdout) < 8


def test_the_cpu_limit_kills_a_busy_loop_long_before_the_wall_clock():
    result = Sandbox(SandboxLimits(cpu_seconds=1, wall_seconds=60)).run_program("while True:\n    pass")
    assert not result.timed_out
    assert result.failure(SandboxLimits(cpu_seconds=1)) == "killed by SIGXCPU (the CPU limit is 1 s)"


def test_the_sandbox_has_no_network_interface_but_its_own_loopback():
    result = Sandbox().run_program("import socket\nprint(sorted(name for _, name in socket.if_nameindex()))")
    assert result.stdout == b"['lo']\n"


def test_the_program_is_the_last_fenced_block_or_the_whole_response():
    assert extract_program("```python\nprint(1)\n```\ntext\n```py\nprint(2)\n```") == "print(2)\n"
    assert extract_program("print(3)") == "print(3)"
    assert normalised_lines("\n a  b \n\nc\n\n") == ["a b", "", "c"]
    with pytest.raises(ValueError, match="inputs and outputs differ in length"):
        parse_tests('{"inputs": ["1"], "outputs": []}')


def test_a_sandbox_that_cannot_start_is_an_error_not_a_zero():
    # bwrap fails before the program exists (here: no such interpreter; in a pod: user namespaces refused)
    broken = Sandbox(python="/usr/bin/no-such-python3")
    with pytest.raises(
        SandboxError, match="bubblewrap cannot start the sandbox: bwrap: execvp /usr/bin/no-such-python3"
    ):
        broken.check()
