"""images/: one Dockerfile per image the chart, the operator and the examples reference, all on one tag scheme,
multi-stage, pinned, non-root, with nothing that builds in the final stage, and the slim images install what their
code imports, checked as text (the container tests, tests/cluster/test_containers.py, run the images themselves).
"""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from support.operator_fixtures import EXAMPLES, ROOT

from areal_k8s.k8s_operator import names

IMAGES = ROOT / "images"
CHART = ROOT / "charts" / "areal"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
DOCKERFILES = {path.parent.name: path for path in sorted(IMAGES.glob("*/Dockerfile"))}
# The images that build the package install it without its dependencies plus exactly these lists.
SLIM_IMAGES = {
    "operator": ["areal_k8s.k8s_operator.__main__", "areal_k8s.k8s_operator.handlers"],
    "controller": ["areal_k8s.controller.__main__", "areal_k8s.controller.server", "areal_k8s.data.dataset"],
    "reward": [
        "areal_k8s.reward.__main__",
        "areal_k8s.reward.server",
        "areal_k8s.reward.pool",
        "areal_k8s.reward.addition_verifier",
    ],
}
# Imported only when installed (as in this test environment), never needed by the images: the import probe
# hides them, as an image without them would.
OPTIONAL_IMPORTS = {
    "grpc_tools": "grpc loads protos at run time with grpcio-tools only if it is installed",
    "kubernetes_validate": "kubernetes.dynamic validates with it only if it is installed",
    # installed here by the tracking extra's libraries (in the test extra)
    "opentelemetry": "redis traces with it only if it is installed",
    "xxhash": "redis's client-side cache hashes with it only if it is installed",
    "cryptography": "google-auth (kubernetes' config loader) signs with it only if it is installed",
    "_cffi_backend": "cryptography's, hidden with it",
}
STARTUP_HOOKS = {"setuptools"}  # _distutils_hack, loaded by a .pth file of every virtual environment
BUILD_TOOLS = re.compile(r"\b(build-essential|gcc|g\+\+|clang|make|cmake|ninja-build|git|[\w.+-]+-dev)\b")


def pyproject_requirements() -> dict[str, Requirement]:
    lines = PYPROJECT["project"]["dependencies"] + [
        r for extra in PYPROJECT["project"]["optional-dependencies"].values() for r in extra
    ]
    return {canonicalize_name(Requirement(line).name): Requirement(line) for line in lines}


# -- Dockerfiles as data --------------------------------------------------------------------------------------


class Dockerfile:
    def __init__(self, path: Path):
        text = re.sub(r"\\\n", " ", path.read_text())
        self.lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
        self.args = {}
        for line in self.lines:
            if match := re.fullmatch(r"ARG (\w+)=(.*)", line):
                self.args.setdefault(match[1], match[2].strip('"'))
        self.stages: list[dict] = []  # {"base", "name", "lines"}
        for line in self.lines:
            if match := re.fullmatch(r"FROM (\S+)(?: AS (\S+))?", line, re.IGNORECASE):
                self.stages.append({"base": self.expand(match[1]), "name": match[2], "lines": []})
            elif self.stages:
                self.stages[-1]["lines"].append(line)

    def expand(self, text: str) -> str:
        # ${NAME:+word}: the word where the build argument is set and not empty, else nothing
        text = re.sub(r"\$\{(\w+):\+([^}]*)\}", lambda m: m[2] if self.args.get(m[1]) else "", text)
        return re.sub(r"\$\{?(\w+)\}?", lambda m: self.args.get(m[1], m[0]), text)

    @property
    def final(self) -> dict:
        return self.stages[-1]

    def stage(self, name: str) -> dict:
        return next(stage for stage in self.stages if stage["name"] == name)

    def copy_sources(self) -> list[str]:
        out = []
        for stage in self.stages:
            for line in stage["lines"]:
                if line.startswith("COPY ") and "--from=" not in line:
                    out.extend(line.split()[1:-1])
                # a context folder bound at build time (RUN --mount=type=bind,source=...)
                out.extend(re.findall(r"^RUN --mount=type=bind,source=([^,\s]+)", line))
        return out


def dockerfile(name: str) -> Dockerfile:
    return Dockerfile(DOCKERFILES[name])


# -- the tag scheme --------------------------------------------------------------------------------------------


def referenced_images() -> dict[str, str]:
    """Every image reference of the project's own images: reference -> where it comes from."""
    refs = {
        names.default_image(component): f"operator default for {component}"
        for component in ("controller", "reward", "rollout", "trainer", "sglang")
    }
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    refs[f"{values['operator']['image']['repository']}:{values['operator']['image']['tag'] or app_version}"] = (
        "chart operator image"
    )
    for values_file in sorted((CHART / "ci").glob("*-values.yaml")):
        image = (yaml.safe_load(values_file.read_text()).get("operator") or {}).get("image") or {}
        if image.get("repository", "").startswith(names.IMAGE_REPOSITORY + "/"):
            refs[f"{image['repository']}:{image.get('tag') or app_version}"] = values_file.name
    for example in EXAMPLES:
        text = example.read_text()
        for ref in re.findall(rf"{re.escape(names.IMAGE_REPOSITORY)}/[\w.-]+:[\w.-]+", text):
            refs[ref] = example.name
    script = (ROOT / "scripts" / "e2e-kind.sh").read_text()
    for ref in re.findall(rf"{re.escape(names.IMAGE_REPOSITORY)}/[\w.-]+:\$\{{VERSION\}}", script):
        refs[ref.replace("${VERSION}", VERSION)] = "scripts/e2e-kind.sh"
    return refs


def test_one_version_everywhere():
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"] == VERSION
    assert names.operator_version() == VERSION, "the installed package's version is the operator's image tag"
    assert re.search(r"^IMAGE_TAG=\$\{IMAGE_TAG:-\$\(sed -n 's/\^version = ", (IMAGES / "build.sh").read_text(), re.M)


def test_every_referenced_image_has_a_dockerfile_and_the_version_tag(monkeypatch):
    monkeypatch.delenv(names.IMAGE_REPOSITORY_ENV, raising=False)
    monkeypatch.delenv(names.IMAGE_TAG_ENV, raising=False)
    refs = referenced_images()
    components = set()
    for ref, where in refs.items():
        repository, _, tag = ref.rpartition(":")
        assert repository.startswith(names.IMAGE_REPOSITORY + "/"), (ref, where)
        component = repository.removeprefix(names.IMAGE_REPOSITORY + "/")
        components.add(component)
        assert component in DOCKERFILES, f"{ref} ({where}) has no images/{component}/Dockerfile"
        assert tag == VERSION, f"{ref} ({where}): the tag must be the package version {VERSION}"
    assert {"operator", "controller", "reward", "rollout", "sglang", "trainer", "cpu"} <= components
    assert set(DOCKERFILES) == set(names.IMAGE_COMPONENTS), (
        "images/ and names.IMAGE_COMPONENTS must name the same images"
    )
    build = (IMAGES / "build.sh").read_text()
    assert set(re.search(r'^ALL_IMAGES="([^"]+)"', build, re.M)[1].split()) == set(DOCKERFILES)


def test_the_readme_table_lists_every_image():
    table = (IMAGES / "README.md").read_text()
    for name in DOCKERFILES:
        assert f"| `{name}` |" in table, name


# -- how the Dockerfiles are built -----------------------------------------------------------------------------


def pinned(reference: str) -> bool:
    if "@sha256:" in reference:
        return bool(re.search(r"@sha256:[a-f0-9]{64}$", reference))
    name, _, tag = reference.rpartition(":")
    return bool(name) and "/" not in tag and tag != "latest" and bool(re.search(r"\d+\.\d+", tag))


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfiles_are_multi_stage_pinned_and_non_root(name):
    image = dockerfile(name)
    stage_names = set()
    for stage in image.stages:
        assert stage["base"] in stage_names or pinned(stage["base"]), f"{name}: unpinned base {stage['base']}"
        if stage["name"]:
            stage_names.add(stage["name"])
    final = image.final
    users = [line for line in final["lines"] if line.startswith("USER ")]
    assert users and users[-1] == f"USER {names.RUN_AS_USER}:{names.RUN_AS_GROUP}", (
        f"{name}: the final stage must run as uid 10001"
    )
    assert f"--uid {names.RUN_AS_USER}" in " ".join(final["lines"]), f"{name}: the user needs a passwd entry"
    if name == "sglang":  # a pinned upstream image, run as our user; nothing is built
        assert (
            len(image.stages) == 1
            and "@sha256:" in final["base"]
            and final["base"].startswith("docker.io/lmsysorg/sglang:v")
        )
        return
    assert len(image.stages) >= 2, f"{name}: multi-stage"
    for line in final["lines"]:
        assert not line.startswith(("COPY proto", "COPY services", "COPY pyproject")), (
            f"{name}: sources in the final stage"
        )
        assert "pip wheel" not in line and "pip install" not in line, f"{name}: installs in the final stage: {line}"
        if "apt-get install" in line:
            assert not BUILD_TOOLS.search(line), f"{name}: build tools in the final stage: {line}"
    assert any(line.startswith("COPY --from=build /opt/areal /opt/areal") for line in final["lines"])
    assert "pip uninstall --yes pip" in image.stage("build")["lines"][-1], f"{name}: pip stays in the environment"


PACKAGE_IMAGES = ("operator", "controller", "reward", "rollout", "cpu")  # those that install the package


def test_the_images_share_their_first_stages_layers():
    """What the builders' layer cache reuses across the images: the package wheel's stage is the same text in
    every image that installs the package (one `make images` builds the wheel once), and the cpu and rollout images
    install torch in the same first step of their build stage, before the package (a code change keeps it)."""
    wheels = {name: dockerfile(name).stages[0] for name in PACKAGE_IMAGES}
    assert {stage["name"] for stage in wheels.values()} == {"wheel"}
    assert len({json.dumps(stage["lines"]) for stage in wheels.values()}) == 1, wheels
    assert any("pip wheel --no-deps --wheel-dir /wheels ." in line for line in wheels["cpu"]["lines"])
    cpu, rollout = (dockerfile(name).stage("build")["lines"] for name in ("cpu", "rollout"))
    torch_step = next(i for i, line in enumerate(cpu) if "torch==" in line)
    assert cpu[: torch_step + 3] == rollout[: torch_step + 3], "their build stages part after the package"
    assert cpu[torch_step + 1] == "COPY --from=wheel /wheels /wheels"


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_images_run_python_3_12(name):
    image = dockerfile(name)
    bases = [stage["base"] for stage in image.stages]
    if name == "trainer":
        assert all("ubuntu24.04" in base for base in bases)  # whose python3 is 3.12
        assert any("python3.12" in line for line in image.final["lines"])
    elif name != "sglang":  # v0.5.20 is on Python 3.12 (its Dockerfile's base is Ubuntu 24.04)
        assert all(re.search(r"/python:3\.12\.\d+-slim", base) for base in bases), bases


def test_torch_and_megatron_pins_agree_with_pyproject():
    requirements = pyproject_requirements()
    torch_pin = str(requirements["torch"].specifier)
    assert torch_pin.startswith("==")
    for name in ("rollout", "cpu", "trainer"):
        image = dockerfile(name)
        assert f"=={image.args['TORCH_VERSION']}" == torch_pin, name
        assert image.args["TORCH_INDEX_URL"].startswith("https://download.pytorch.org/whl/")
    trainer = dockerfile("trainer")
    assert trainer.args["TORCH_INDEX_URL"].endswith("/cu130"), "the SGLang image's torch is +cu130: same NCCL"
    megatron = Version(trainer.args["MEGATRON_CORE_VERSION"])
    assert requirements["megatron-core"].specifier.contains(megatron)
    assert any("[megatron,tracking]" in line for line in trainer.stages[0]["lines"])


def dockerignore_admits(path: str) -> bool:
    """Whether the root .dockerignore (an allowlist: `*`, then `!path` lines, then exclusions) sends `path`."""
    admitted = False
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        if (
            fnmatch.fnmatch(path, pattern)
            or path.startswith(pattern + "/")
            or fnmatch.fnmatch(path, pattern.replace("**/", "*/"))
        ):
            admitted = negated
    return admitted


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_the_build_context_holds_what_the_dockerfiles_copy(name):
    for source in dockerfile(name).copy_sources():
        assert (ROOT / source).exists(), f"{name}: COPY {source}: no such file"
        probe = (
            source
            if (ROOT / source).is_file()
            else next(str(p.relative_to(ROOT)) for p in sorted((ROOT / source).rglob("*")) if p.is_file())
        )
        assert dockerignore_admits(probe), f"{name}: .dockerignore leaves {source} out of the context"
    assert not dockerignore_admits(".venv/bin/python") and not dockerignore_admits("runs/demo/summary.json")
    assert not dockerignore_admits("services/areal_k8s/api/v1/controller_pb2.py"), (
        "generated stubs are rebuilt, never copied"
    )


# -- the slim images ------------------------------------------------------------------------------------------


def listed_requirements(name: str) -> list[Requirement]:
    lines = (IMAGES / name / "requirements.txt").read_text().splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("name", sorted(SLIM_IMAGES))
def test_slim_image_requirements_carry_the_pyproject_specifiers(name):
    declared = pyproject_requirements()
    for requirement in listed_requirements(name):
        key = canonicalize_name(requirement.name)
        assert key in declared, (
            f"images/{name}/requirements.txt: {requirement.name} is not a dependency in pyproject.toml"
        )
        assert requirement.specifier == declared[key].specifier, (
            f"{requirement} differs from pyproject's {declared[key]}"
        )
    assert "--no-deps /wheels/areal_k8s-*.whl" in " ".join(dockerfile(name).stage("build")["lines"])


def closure(requirements: list[Requirement]) -> set[str]:
    """The distributions the requirements install: themselves and their dependencies, transitively."""
    seen: set[str] = set()
    todo = [canonicalize_name(r.name) for r in requirements]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            dependencies = requires(name) or []
        except PackageNotFoundError:
            continue
        for line in dependencies:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(requirement.name))
    return seen


IMPORT_PROBE = f"""
import importlib, json, sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {sorted(OPTIONAL_IMPORTS)!r}:
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Hide())
for module in sys.argv[1:]:
    importlib.import_module(module)
print(json.dumps(sorted(sys.modules)))
"""


def imported_modules(modules: list[str]) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE, *modules], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_slim_images_install_everything_their_code_imports():
    with ThreadPoolExecutor(len(SLIM_IMAGES)) as pool:
        imported = dict(zip(SLIM_IMAGES, pool.map(imported_modules, SLIM_IMAGES.values())))
    distributions = packages_distributions()
    for name, modules in imported.items():
        installed = closure(listed_requirements(name)) | STARTUP_HOOKS
        tops = {m.split(".")[0] for m in modules} - set(sys.stdlib_module_names) - {"areal_k8s"}
        missing = {
            top: distributions[top]
            for top in tops
            if top in distributions and not {canonicalize_name(d) for d in distributions[top]} & installed
        }
        assert missing == {}, f"images/{name}/requirements.txt misses what its code imports: {missing}"
        assert "torch" not in tops, f"the {name} image has no torch"


# -- make images, make e2e-kind -------------------------------------------------------------------------------


def test_make_targets_and_scripts():
    makefile = (ROOT / "Makefile").read_text()
    phony = re.search(r"^\.PHONY: (.*)$", makefile, re.M)[1].split()
    assert {"images", "python-images", "base-image", "e2e-kind"} <= set(phony)
    assert re.search(r"^images:\n\tbash images/build\.sh$", makefile, re.M)
    assert re.search(r"^python-images:\n\tbash images/python-images\.sh$", makefile, re.M)
    assert re.search(r"^base-image:\n\tbash images/base/build\.sh$", makefile, re.M)
    assert re.search(r"^e2e-kind:\n\tbash scripts/e2e-kind\.sh$", makefile, re.M)
    scripts = [IMAGES / "build.sh", IMAGES / "python-images.sh", IMAGES / "base" / "build.sh", IMAGES / "builder.sh"]
    for script in (*scripts, ROOT / "scripts" / "e2e-kind.sh"):
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    e2e = (ROOT / "scripts" / "e2e-kind.sh").read_text()
    for needed in (
        "charts/areal/ci/kind-values.yaml",
        "examples/rljob-demo-cpu.yaml",
        "charts/areal/crds/",
        "kind load docker-image",
        "helm test",
        ".status.policyVersion",
        "examples/k8s/demo-assets.yaml",
    ):
        assert needed in e2e, needed
    kind_values = yaml.safe_load((CHART / "ci" / "kind-values.yaml").read_text())
    assert kind_values["operator"]["image"]["repository"] == f"{names.IMAGE_REPOSITORY}/cpu"
    demo = yaml.safe_load(next(p for p in EXAMPLES if p.name == "rljob-demo-cpu.yaml").read_text())
    assert {role["image"] for role in demo["spec"]["roles"].values()} == {f"{names.IMAGE_REPOSITORY}/cpu:{VERSION}"}
    claim = demo["spec"]["mounts"][0]["persistentVolumeClaim"]["claimName"]
    # the assets Job (the docs' quickstart applies the same file): the image the RLJob runs, onto the claim it mounts
    claim_doc, job = yaml.safe_load_all((ROOT / "examples" / "k8s" / "demo-assets.yaml").read_text())
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"{names.IMAGE_REPOSITORY}/cpu:{VERSION}"
    assert container["command"][:3] == ["python", "-m", "areal_k8s.demo.build"]
    assert claim_doc["metadata"]["name"] == claim
    assert job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim
    for doc in (claim_doc, job):
        kubernetes_validate.validate(doc, "1.30", strict=True)
