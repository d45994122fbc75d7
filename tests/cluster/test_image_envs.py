"""images/*/Dockerfile, started without a Docker engine: every image that installs this package gets a virtual
environment built the way its Dockerfile builds /opt/areal (its own pip steps, read from the Dockerfile with
tests/cluster/test_images.py's parser, so a Dockerfile change is what runs here), and in that environment, with the
final stage's ENV, the image's import check imports and its ENTRYPOINT/CMD, and every command the operator runs from the
image for the examples, answer --help with exit code 0.

What differs from a real build, and why (each image's own list is in its failure messages):
- Python: this interpreter (3.11), not the images' 3.12: the only CPU torch wheel on this machine is for 3.11, and
  every other torch build pip could reach is a CUDA one of several GB.
- torch: PyTorch's own wheel index cannot be reached. Its `--index-url` is dropped and a constraint pins torch to
  `==<version>+cpu`, the wheel that a plain `pip install torch==2.13.0` takes here, so pip never resolves a CUDA
  build (for the trainer too, whose image has CUDA 13.0 wheels). The images that install torch share one copy of
  it (.cache/image-envs/torch-<hash>, on a .pth line in each environment): pip finds it installed and still
  resolves its dependencies into the environment, and a fresh clone's run needs one copy of the 760 MB, not three.
  Its console scripts (torchrun) are written into each environment's bin, as pip would have written them.
- megatron-core: releases after 0.16 require Python >= 3.12; on 3.11 the trainer's explicit pin is dropped and the
  package's `megatron` extra resolves it (0.16.x).
- pip: the environment is made without pip and this project's pip installs into it (`pip --python`), so the
  Dockerfiles' `pip install --upgrade pip` and `pip uninstall --yes pip` have nothing to do; pip's cache is used
  (the images set PIP_NO_CACHE_DIR, which changes no resolution), and pip writes no bytecode (`--no-compile`: the
  commands' imports compile what they load, and a fresh clone's builds take a minute less).
- apt-get, users and groups are the base image's, not the environment's: not run.
The sglang image is SGLang's own, with nothing of ours installed in it: skipped.

Environments live in .cache/image-envs/<image>-<hash of their inputs>: the Dockerfile's plan, the requirements files
it copies, the package wheel's requirements and extras, the interpreter and pip. They are built one at a time from
the session's start (tests/conftest.py), in the environment the session started with, and reused while those are
unchanged; a change of the package's code only swaps the new package wheel in. The wheel is
built once a run, from one snapshot of the build context, for every image. $AREAL_IMAGE_ENVS, when set, names
another cache folder (an empty one times a fresh clone's builds without emptying the shared cache).
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import distributions, version
from pathlib import Path, PurePosixPath

import pytest
import yaml
from support.operator_fixtures import EXAMPLES, ROOT
from test_images import DOCKERFILES, Dockerfile, dockerfile, dockerignore_admits, pyproject_requirements

from areal_k8s.k8s_operator.children import desired_children
from areal_k8s.k8s_operator.validation import validate

# From an empty cache the builds take minutes, more on a loaded machine; the first test waits for its image's.
pytestmark = pytest.mark.timeout(1800)
# resolved: a worktree whose .cache is a link writes the real path into the environments it builds
# the session's environment as collected: the builds run beside other tests, which may change os.environ meanwhile
ENVIRONMENT = dict(os.environ)
CACHE = Path(ENVIRONMENT.get("AREAL_IMAGE_ENVS") or ROOT / ".cache" / "image-envs").resolve()
SCRATCH = CACHE / "tmp"  # pip's and the commands' temporary files: nothing is written outside .cache and pip's cache
ENV_PATH = "/opt/areal"  # where every image that builds the package puts its environment
TORCH_PIN = pyproject_requirements()["torch"]
TORCH_CONSTRAINT = f"torch=={str(TORCH_PIN.specifier).removeprefix('==')}+cpu"
# Machine settings the commands keep: OpenBLAS needs the two on some processors here, and the tests share two cores.
PASSED_THROUGH = ("LANG", "OMP_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
BASE_PATH = "/usr/local/bin:/usr/bin:/bin"
GPU_ONLY = "Transformer Engine compiles against the CUDA toolkit and cuDNN of the trainer's build stage, for GPUs"
PIP_TIMEOUT, COMMAND_TIMEOUT = 900, 300
PIP_ERROR_LINES, PIP_ERROR_CHARS = 25, 4000


# -- the plan: what building and starting one image means here, read from its Dockerfile --------------------------


@dataclass
class Plan:
    image: str
    sources: dict[str, Path] = field(default_factory=dict)  # build-stage container path -> repository path
    workdir: str = "/"  # of the build stage, where `pip wheel .` runs
    steps: list[tuple[str, ...]] = field(default_factory=list)  # ("wheel" | "install", *pip arguments) or ("venv",)
    runtime_env: dict[str, str] = field(default_factory=dict)  # the final stage's ENV, container paths
    checks: dict[tuple[str, ...], str] = field(default_factory=dict)  # argv -> where it comes from
    differences: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return f"images/{self.image} as built here, unlike the image: " + "; ".join(self.differences)


def python_of(image: Dockerfile) -> str:
    """The images' Python, from their bases (python:3.12.x-slim) or the python3.12 the trainer installs."""
    text = " ".join(stage["base"] for stage in image.stages) + " " + " ".join(image.lines)
    return re.search(r"python:?(3\.\d+)", text)[1]


def exec_form(image: Dockerfile, keyword: str) -> list[str]:
    lines = [line for line in image.final["lines"] if line.split(None, 1)[0].upper() == keyword]
    return json.loads(image.expand(lines[-1].split(None, 1)[1])) if lines else []


def copy_destinations(plan: Plan, arguments: str, workdir: str) -> None:
    *sources, destination = shlex.split(arguments)
    target = PurePosixPath(workdir) / destination
    for source in sources:
        into_directory = destination.endswith("/") or len(sources) > 1
        plan.sources[str(target / Path(source).name if into_directory else target)] = ROOT / source


def pip_install_arguments(image: Dockerfile, arguments: list[str], plan: Plan) -> list[str]:
    """The Dockerfile's `pip install` arguments with what cannot be had here substituted (each noted)."""
    out, rest = [], iter(arguments)
    for argument in rest:
        if argument == "--find-links" and next(rest) == "/wheelhouse":
            plan.differences.append("torch's wheelhouse (images/wheelhouse) -> the local wheel (pip's constraint)")
        elif argument in ("--index-url", "-i", "--extra-index-url"):
            url = next(rest)
            if url != image.args.get("TORCH_INDEX_URL"):
                raise ValueError(f"images/{plan.image}/Dockerfile: an index this test cannot stand in for: {url}")
            plan.differences.append(f"torch from {url} -> the local {TORCH_CONSTRAINT} wheel (pip's constraint)")
        elif argument.startswith("megatron-core==") and sys.version_info < (3, 12):
            plan.differences.append(
                f"{argument}: megatron-core 0.17 and newer require Python >= 3.12; the package's "
                "megatron extra resolves it here (0.16.x)"
            )
        else:
            out.append(argument)
    return out


def build_step(image: Dockerfile, segment: str, shell: dict[str, str], plan: Plan) -> None:
    """One `&&`-separated command of a build-stage RUN: a step of the plan, or nothing the environment holds."""
    if match := re.fullmatch(r'(\w+)="\$\(ls (\S+)\)"', segment):
        shell[match[1]] = match[2]
        return
    segment = re.sub(r"\$\{?(\w+)\}?", lambda m: shell.get(m[1], m[0]), segment)
    if match := re.fullmatch(r'if \[ -n "(.*)" \]; then (.*); fi', segment):
        if match[1]:
            plan.differences.append(f"not installed: {match[2]} ({GPU_ONLY})")
        return  # the build argument is empty by default: the image has none either
    argv = shlex.split(segment)
    pip = f"{ENV_PATH}/bin/pip"
    match argv:
        case [python, "-m", "venv", target] if re.fullmatch(r"python3?(\.\d+)?", python) and target == ENV_PATH:
            plan.steps.append(("venv",))
        case [command, "wheel", *arguments] if command in ("pip", pip):
            plan.steps.append(("wheel", *arguments))
        case [command, "install", "--upgrade", "pip"] if command == pip:
            plan.differences.append("pip: this project's, not the newest release the image upgrades to")
        case [command, "install", *arguments] if command == pip:
            plan.steps.append(("install", *pip_install_arguments(image, arguments, plan)))
        case [command, "uninstall", "--yes", "pip"] if command == pip:
            pass  # the environment is made without pip
        case ["apt-get", *_] | ["rm", "-rf", "/var/lib/apt/lists/*"]:
            pass  # the base's system packages (the trainer's python3.12 and compilers): this machine's own
        case _:
            raise ValueError(f"images/{plan.image}/Dockerfile: a build command this test does not know: {segment}")


def runtime_step(segment: str, plan: Plan) -> None:
    argv = shlex.split(segment)
    if argv[0] in ("python", "torchrun"):
        plan.checks[tuple(argv)] = "the image's RUN check"
    elif argv[0] not in ("groupadd", "useradd", "mkdir", "apt-get", "rm"):  # users, folders, system packages
        raise ValueError(f"images/{plan.image}/Dockerfile: a final-stage command this test does not know: {segment}")


def plan_of(name: str) -> Plan | None:
    """How images/NAME builds /opt/areal and what it runs; None for an image that installs nothing of ours."""
    image = dockerfile(name)
    if not any(ENV_PATH in line for line in image.lines):
        return None
    plan = Plan(name)
    python = python_of(image)
    if python != f"{sys.version_info.major}.{sys.version_info.minor}":
        plan.differences.append(
            f"Python {python} -> {sys.version.split()[0]} (this interpreter, the local CPU torch wheel's)"
        )
    plan.differences.append("pip's cache is used (PIP_NO_CACHE_DIR is not), and pip writes no bytecode (--no-compile)")
    shell: dict[str, str] = {}
    for stage in image.stages[:-1]:
        workdir = "/"
        for line in stage["lines"]:
            keyword, _, arguments = line.partition(" ")
            arguments = image.expand(arguments)
            if keyword == "WORKDIR":
                workdir = str(PurePosixPath(workdir) / arguments)
            elif keyword == "COPY" and "--from=" not in arguments:
                copy_destinations(plan, arguments, workdir)
            elif keyword == "RUN":
                arguments = re.sub(r"^(--mount=\S+\s+)+", "", arguments.strip())  # a context folder bound: its files
                for segment in re.split(r"\s+&&\s+", arguments):
                    build_step(image, segment, shell, plan)
                    if plan.steps and plan.steps[-1][0] == "wheel":
                        plan.workdir = workdir  # the wheel stage's, not a later stage's
    for line in image.final["lines"]:
        keyword, _, arguments = line.partition(" ")
        if keyword == "ENV":
            plan.runtime_env.update(pair.split("=", 1) for pair in shlex.split(image.expand(arguments)))
        elif keyword == "RUN":
            for segment in re.split(r"\s+&&\s+", image.expand(arguments).strip()):
                runtime_step(segment, plan)
    entry = exec_form(image, "ENTRYPOINT") or exec_form(image, "CMD")
    plan.checks.setdefault(tuple(entry if "--help" in entry else [*entry, "--help"]), "the image's ENTRYPOINT/CMD")
    for command in sorted(OPERATOR_COMMANDS.get(name, ())):
        plan.checks.setdefault((*command, "--help"), "what the operator runs from it")
    return plan


def on_default_images(rljob: dict) -> dict:
    """The RLJob with every role (and engine) on the operator's default image: the CPU engine then runs from the
    rollout image."""
    out = copy.deepcopy(rljob)
    for role in out["spec"]["roles"].values():
        role.pop("image", None)
        if isinstance(role.get("engine"), dict):
            role["engine"].pop("image", None)
    return out


def operator_commands() -> dict[str, set[tuple[str, ...]]]:
    """image component -> the container commands the operator gives it, over every example RLJob as written and
    on the default images."""
    out = defaultdict(set)
    for example in EXAMPLES:
        rljob = yaml.safe_load(example.read_text())
        for job in (rljob, on_default_images(rljob)):
            for child in desired_children(validate(job), running=True):
                pod = child.get("spec", {}).get("template", {}).get("spec", {})
                for container in pod.get("initContainers", []) + pod.get("containers", []):
                    component = container["image"].rpartition("/")[2].partition(":")[0]
                    out[component].update(runnable_here(container["command"]))
    return out


def runnable_here(command: list[str]) -> list[tuple[str, ...]]:
    """A container command as it can be checked here: torchrun's options name the pod's variables (`$(NNODES)`), which
    only Kubernetes expands, so a torchrun command is checked as the launcher and the module it starts."""
    if command[0] != "torchrun":
        return [tuple(command)]
    return [("torchrun",), ("python", *command[command.index("-m") :])]


OPERATOR_COMMANDS = operator_commands()


def installs_torch(plan: Plan | None) -> bool:
    return plan is not None and any(
        a.startswith("torch==") for step in plan.steps if step[0] == "install" for a in step
    )


# image -> its plan, the ones that install torch (the longest builds) first: the order of the builds and the tests
PLANS = dict(sorted(((name, plan_of(name)) for name in DOCKERFILES), key=lambda item: not installs_torch(item[1])))
UPSTREAM_ONLY = "SGLang's own image: nothing of this project is installed in it"


# -- building: cached folders, the package wheel, the environments ------------------------------------------------


def context_snapshot(plan: Plan) -> dict[str, bytes]:
    """Every file the build stage copies that the root .dockerignore admits, read once (the services change while
    tests run; every image of a run builds from one snapshot): container path -> content."""
    out = {}
    for destination, source in plan.sources.items():
        files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
        for path in files:
            if dockerignore_admits(str(path.relative_to(ROOT))):
                out[str(PurePosixPath(destination) / path.relative_to(source))] = path.read_bytes()
    return out


def digest(*parts: object, files: dict[str, bytes] | None = None) -> str:
    sha = hashlib.sha256(repr(parts).encode())
    for name, content in sorted((files or {}).items()):
        sha.update(name.encode() + b"\0" + content + b"\0")
    return sha.hexdigest()[:16]


@contextlib.contextmanager
def locked(prefix: str, keep: Path):
    """Holds .cache/image-envs/PREFIX.lock (threads and other test runs wait), then removes the folders of the
    prefix's other keys."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{prefix}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
        for stale in CACHE.glob(f"{prefix}-*"):
            if stale != keep and stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)


def build_once(folder: Path, build: Callable[[Path], None]) -> None:
    """Build `folder` unless a build of it completed; a build that fails leaves nothing behind."""
    if (folder / ".complete").exists():
        return
    shutil.rmtree(folder, ignore_errors=True)
    try:
        build(folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    (folder / ".complete").touch()


class StepFailed(Exception):
    pass


def run_pip(arguments: list[str], cwd: Path | None = None) -> None:
    environment = {**ENVIRONMENT, "TMPDIR": str(SCRATCH)}
    environment.pop("PIP_NO_CACHE_DIR", None)
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *arguments]
    done = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=environment, timeout=PIP_TIMEOUT)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-PIP_ERROR_LINES:])[-PIP_ERROR_CHARS:]
        raise StepFailed(f"{shlex.join(command)} exited {done.returncode}:\n{tail}")


def package_wheel(plan: Plan, arguments: tuple[str, ...], snapshot: dict[str, bytes]) -> Path:
    """The package wheel, built from a copy of the build context as the Dockerfile's `pip wheel` builds it, once
    for every image with the same context and arguments."""
    workdir = PurePosixPath(plan.workdir)
    sources = {
        str(PurePosixPath(name).relative_to(workdir)): content
        for name, content in snapshot.items()
        if PurePosixPath(name).is_relative_to(workdir)
    }

    def build(folder: Path) -> None:
        with tempfile.TemporaryDirectory(dir=SCRATCH) as context:
            for relative, content in sources.items():
                (Path(context) / relative).parent.mkdir(parents=True, exist_ok=True)
                (Path(context) / relative).write_bytes(content)
            run_pip(["wheel", *(str(folder) if a == "/wheels" else a for a in arguments)], cwd=Path(context))

    folder = CACHE / f"wheel-{digest(arguments, version('pip'), files=sources)}"
    with locked("wheel", keep=folder):
        build_once(folder, build)
    (wheel,) = folder.glob("*.whl")
    return wheel


def resolution_inputs(wheel: Path | None) -> list[str]:
    """What of the package wheel decides what pip installs with it: its metadata's requirements and extras (its
    code does not, so a change of the services swaps the package in a reused environment)."""
    if wheel is None:
        return []
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    return [
        line
        for line in metadata.splitlines()
        if line.startswith(("Requires-Dist:", "Requires-Python:", "Provides-Extra:"))
    ]


def host_argument(argument: str, plan: Plan, wheel: Path | None) -> str:
    """A `pip install` argument with its container paths made this machine's."""
    if argument in plan.sources:
        return str(plan.sources[argument])
    if match := re.match(r"/wheels/(\S+?\.whl)", argument):
        assert wheel and wheel.match(match[1]), f"{argument}: the package wheel is {wheel}"
        return str(wheel) + argument[match.end() :]
    return argument


def torch_constraint() -> Path:
    """The constraints file that keeps pip on the local CPU torch: named by its content, written whole."""
    path = CACHE / f"constraint-{digest(TORCH_CONSTRAINT)}.txt"
    if not path.exists():
        with tempfile.NamedTemporaryFile("w", dir=SCRATCH, delete=False) as partial:
            partial.write(TORCH_CONSTRAINT + "\n")
        os.replace(partial.name, path)
    return path


def pip_install(venv: Path, arguments: list[str]) -> None:
    run_pip(
        [
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--progress-bar",
            "off",
            "--no-compile",
            "--constraint",
            str(torch_constraint()),
            *arguments,
        ]
    )


def shared_torch() -> Path:
    """One copy of the local CPU torch, without its dependencies, for every environment that installs torch."""
    folder = CACHE / f"torch-{digest(TORCH_CONSTRAINT, sys.version, version('pip'))}"
    with locked("torch", keep=folder):
        build_once(
            folder,
            lambda target: run_pip(
                [
                    "install",
                    "--progress-bar",
                    "off",
                    "--no-compile",
                    "--no-deps",
                    "--target",
                    str(target),
                    "--constraint",
                    str(torch_constraint()),
                    TORCH_CONSTRAINT.replace("+cpu", ""),
                ]
            ),
        )
    return folder


def write_shared_torch_scripts(venv: Path) -> None:
    """The console scripts pip writes when it installs torch (torchrun), for an environment that shares the copy:
    each runs its entry point with the environment's python."""
    for distribution in distributions(path=[str(shared_torch())]):
        for entry in distribution.entry_points.select(group="console_scripts"):
            script = venv / "bin" / entry.name
            script.write_text(
                f"#!{venv / 'bin' / 'python'}\nimport sys\nfrom {entry.module} import {entry.attr}\n"
                f"sys.exit({entry.attr}())\n"
            )
            script.chmod(0o755)


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def build_environment(plan: Plan, wheel: Path | None, venv: Path) -> None:
    for step in plan.steps:
        if step[0] == "venv":
            subprocess.run(
                [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=COMMAND_TIMEOUT
            )
            if installs_torch(plan):
                (site_packages(venv) / "areal_shared_torch.pth").write_text(f"{shared_torch()}\n")
        elif step[0] == "install":
            pip_install(venv, [host_argument(a, plan, wheel) for a in step[1:]])
        # "wheel": built before (package_wheel), since the environment's key holds its metadata
    (venv / ".package").write_text(str(wheel))


def environment_of(plan: Plan, snapshot: dict[str, bytes]) -> Path:
    """.cache/image-envs/IMAGE-KEY, built as planned, or reused with this run's package wheel swapped in."""
    wheel_steps = [step[1:] for step in plan.steps if step[0] == "wheel"]
    wheel = package_wheel(plan, wheel_steps[0], snapshot) if wheel_steps else None
    outside_context = {
        name: content for name, content in snapshot.items() if not PurePosixPath(name).is_relative_to(plan.workdir)
    }  # the requirements files
    key = digest(
        plan.steps, sys.version, version("pip"), TORCH_CONSTRAINT, resolution_inputs(wheel), files=outside_context
    )
    venv, package = CACHE / f"{plan.image}-{key}", CACHE / f"{plan.image}-{key}" / ".package"
    with locked(plan.image, keep=venv):
        build_once(venv, lambda folder: build_environment(plan, wheel, folder))
        if installs_torch(plan):
            write_shared_torch_scripts(venv)
        if package.read_text() != str(wheel):
            pip_install(venv, ["--no-deps", "--force-reinstall", str(wheel)])
            package.write_text(str(wheel))
    return venv


# -- starting: the final stage's environment and commands ---------------------------------------------------------


def runtime_environment(plan: Plan, venv: Path, scratch: Path) -> dict[str, str]:
    """The final stage's ENV over a clean environment, /opt/areal and /tmp (the operator's emptyDir) mapped here."""
    out = {"PATH": BASE_PATH, "HOME": str(scratch), "TMPDIR": str(scratch)}
    out |= {k: ENVIRONMENT[k] for k in PASSED_THROUGH if k in ENVIRONMENT}
    mapped = {ENV_PATH: str(venv), "/tmp": str(scratch)}
    # One pass: a mapped path may itself start with /tmp (a checkout under /tmp), and must not be mapped again.
    image_paths = re.compile(rf"(?<![\w/])({'|'.join(map(re.escape, mapped))})(?=/|:|$)")
    for key, value in plan.runtime_env.items():
        value = value.replace("$PATH", BASE_PATH).replace("${PATH}", BASE_PATH)
        out[key] = image_paths.sub(lambda match: mapped[match[1]], value)
    return out


@dataclass
class Started:
    plan: Plan
    error: str = ""  # the step that failed, with pip's last lines
    distributions: dict[str, str] = field(default_factory=dict)
    runs: dict[tuple[str, ...], subprocess.CompletedProcess] = field(default_factory=dict)


INSTALLED = (
    "import importlib.metadata as m, json; "
    "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
)


def start(plan: Plan, snapshot: dict[str, bytes]) -> Started:
    """Build (or reuse) the image's environment, then run its checks in it."""
    started = Started(plan)
    SCRATCH.mkdir(parents=True, exist_ok=True)
    try:
        venv = environment_of(plan, snapshot)
    except StepFailed as failure:
        started.error = str(failure)
        return started
    with tempfile.TemporaryDirectory(dir=SCRATCH, prefix=f"{plan.image}-") as scratch:
        environment = runtime_environment(plan, venv, Path(scratch))
        listed = subprocess.run(
            ["python", "-c", INSTALLED], capture_output=True, text=True, env=environment, timeout=COMMAND_TIMEOUT
        )
        started.distributions = (
            json.loads(listed.stdout) if listed.returncode == 0 else {"(listing failed)": listed.stderr}
        )
        for argv in plan.checks:
            started.runs[argv] = subprocess.run(
                list(argv), capture_output=True, text=True, cwd=scratch, env=environment, timeout=COMMAND_TIMEOUT
            )
    return started


# -- the tests ------------------------------------------------------------------------------------------------------


class Builds:
    """The environments of the images the session's selected tests use, built one at a time from the session's
    start (tests/conftest.py starts them once the tests are collected): most of a fresh clone's build is pip on one
    core while the tests before this module run, so this module seldom waits for it."""

    started: Builds | None = None  # the session's

    def __init__(self, items: list[pytest.Item]):
        wanted = {item.callspec.params["image"] for item in items if item.path.name == Path(__file__).name}
        plans = [plan for name, plan in PLANS.items() if plan and name in wanted]
        snapshots = {plan.image: context_snapshot(plan) for plan in plans}  # the build context as the session began
        self.pool = ThreadPoolExecutor(1)
        self.futures: dict[str, Future] = {
            plan.image: self.pool.submit(start, plan, snapshots[plan.image]) for plan in plans
        }

    @classmethod
    def start(cls, session: pytest.Session) -> None:
        cls.started = cls(session.items)
        session.config.add_cleanup(cls.started.close)

    def close(self) -> None:
        for future in self.futures.values():
            future.cancel()
        self.pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def started(request) -> dict[str, Future]:
    """image -> its Started (the session's builds, or, where they were not started, this module's)."""
    if Builds.started is None:
        Builds.start(request.session)
    return Builds.started.futures


def images_to_start() -> list:
    return [
        pytest.param(name, marks=pytest.mark.skip(reason=UPSTREAM_ONLY)) if PLANS[name] is None else name
        for name in PLANS
    ]


def checks_to_run() -> list:
    out = []
    for name, plan in PLANS.items():
        if plan is None:
            out.append(pytest.param(name, (), id=name, marks=pytest.mark.skip(reason=UPSTREAM_ONLY)))
        else:
            out.extend(pytest.param(name, argv, id=f"{name}-{check_id(argv)}") for argv in plan.checks)
    return out


def check_id(argv: tuple[str, ...]) -> str:
    if argv[:2] == ("python", "-m"):
        return argv[2]
    return "import-check" if argv[:2] == ("python", "-c") else argv[0]


@pytest.mark.parametrize("image", images_to_start())
def test_the_image_environment_installs(image, started):
    result: Started = started[image].result()
    assert not result.error, f"{result.plan.describe()}\n{result.error}"
    cuda = sorted(name for name in result.distributions if name.lower().startswith(("nvidia-", "triton")))
    assert not cuda, f"images/{image}: CUDA wheels installed: {cuda}"
    if installs_torch(result.plan):
        assert result.distributions.get("torch") == TORCH_CONSTRAINT.partition("==")[2], result.plan.describe()
    else:
        assert "torch" not in result.distributions, f"images/{image} installs no torch, yet its requirements bring it"
    assert "areal-k8s" in result.distributions, sorted(result.distributions)


@pytest.mark.parametrize("image, argv", checks_to_run())
def test_the_image_command_runs(image, argv, started):
    result: Started = started[image].result()
    assert not result.error, f"images/{image} did not install:\n{result.error}"
    done = result.runs[argv]
    where = f"images/{image}: `{shlex.join(argv)}` ({result.plan.checks[argv]})"
    assert done.returncode == 0, f"{where} exited {done.returncode}\n{done.stderr[-3000:]}\n{result.plan.describe()}"
    if "--help" in argv:
        assert done.stdout.lstrip().lower().startswith("usage:"), f"{where} printed no usage:\n{done.stdout[:1000]}"
