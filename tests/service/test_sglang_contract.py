"""SGLang's HTTP contract, read from the pinned version's own source with `ast` (no server, no import of SGLang).

Every route our client calls (common/sglang.py ROUTES) is served by that version and not retired; every field we
send is a field of the request type SGLang parses the body into; every field we read is one it writes; the
sampling parameters we send are SGLang's; our CPU engine serves no route SGLang does not (except under /areal/)
and answers /v1/loads in SGLang's shape; the server arguments a job may pass (common/sglang_server_args.json) are
the ones SGLang's own parser has. A version bump in images/sglang shows up here first: the source read is the one
`make sglang-env` installed, and its version must be the one the Dockerfile pins.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml
from areal_k8s_testing.sglang_arguments import READ_ARGUMENTS, render
from areal_k8s_testing.sglang_server import SGLANG_PYTHON
from support.sglang_server import sglang_package
from support.tiny_models import build_tiny_qwen2

from areal_k8s.common.sglang import READS, ROUTES, SAMPLING_PARAMS, SGLANG_VERSION, token_load
from areal_k8s.common.sglang_args import ARGUMENTS_FILE
from areal_k8s.cpu_engine.engine import CpuEngine
from areal_k8s.cpu_engine.requests import SamplingParams
from areal_k8s.cpu_engine.server import create_app
from areal_k8s.k8s_operator.children import desired_children
from areal_k8s.k8s_operator.validation import validate

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def srt() -> Path:
    return sglang_package() / "srt"


@cache
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def classes(module: ast.Module) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in module.body if isinstance(node, ast.ClassDef)}


def class_fields(module: ast.Module, name: str) -> set[str]:
    """Annotated fields of a class and of the classes it derives from in the same module (dataclasses, msgspec)."""
    classes_ = classes(module)
    fields, todo = set(), [name]
    while todo:
        node = classes_[todo.pop()]
        fields |= {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
        todo += [base.id for base in node.bases if isinstance(base, ast.Name) and base.id in classes_]
    return fields


def string_keys(node: ast.AST) -> set[str]:
    return {key.value for key in node.keys if isinstance(key, ast.Constant) and isinstance(key.value, str)}


def keys_written_to(module: ast.AST, variable: str) -> set[str]:
    """Keys a module stores into dicts named `variable`: `v = {...}`, `v["k"] = ...`, `v.update({...})`."""
    keys = set()
    for node in ast.walk(module):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Dict)
            and any(isinstance(t, ast.Name) and t.id == variable for t in node.targets)
        ):
            keys |= string_keys(node.value)
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (
                    isinstance(target, ast.Subscript)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == variable
                ) and isinstance(target.slice, ast.Constant):
                    keys.add(target.slice.value)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "update"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == variable
        ):
            keys |= {k for arg in node.args if isinstance(arg, ast.Dict) for k in string_keys(arg)}
    return keys


def included_routers(srt: Path) -> list[Path]:
    """The modules whose `router` http_server.py includes into its app (`from sglang.srt.entrypoints.m import router
    as r` ... `app.include_router(r)`): /v1/loads is served that way."""
    server = parse(srt / "entrypoints" / "http_server.py")
    included = {
        node.args[0].id
        for node in ast.walk(server)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "include_router"
        and node.args
        and isinstance(node.args[0], ast.Name)
    }
    return [
        srt.parent / Path(*node.module.split(".")[1:]).with_suffix(".py")
        for node in ast.walk(server)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sglang.srt.entrypoints.")
        for alias in node.names
        if alias.name == "router" and (alias.asname or alias.name) in included
    ]


def http_routes(srt: Path) -> dict[tuple[str, str], ast.AsyncFunctionDef]:
    """(method, path) -> handler, from the decorators of sglang/srt/entrypoints/http_server.py (`app`) and of the
    routers it includes (`router`)."""
    routes = {}
    sources = [(srt / "entrypoints" / "http_server.py", "app")] + [(p, "router") for p in included_routers(srt)]
    for path, owner in sources:
        routes |= _decorated_routes(parse(path), owner)
    return routes


def _decorated_routes(module: ast.Module, owner: str) -> dict[tuple[str, str], ast.AsyncFunctionDef]:
    routes = {}
    for node in module.body:
        if not isinstance(node, ast.AsyncFunctionDef):
            continue
        for decorator in node.decorator_list:
            if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)):
                continue
            if not (isinstance(decorator.func.value, ast.Name) and decorator.func.value.id == owner):
                continue
            verb = decorator.func.attr
            if not decorator.args or not isinstance(decorator.args[0], ast.Constant):
                continue
            path = decorator.args[0].value
            if verb == "api_route":
                methods = next(ast.literal_eval(k.value) for k in decorator.keywords if k.arg == "methods")
            elif verb in ("get", "post", "put", "delete"):
                methods = [verb.upper()]
            else:
                continue
            for method in methods:
                routes[method, path] = node
    return routes


def body_type(handler: ast.AsyncFunctionDef) -> str | None:
    """The request type a handler's body is parsed into: `obj: T` or `obj: Annotated[T, Body()]`."""
    for arg in handler.args.args:
        annotation = arg.annotation
        if (
            isinstance(annotation, ast.Subscript)
            and isinstance(annotation.value, ast.Name)
            and annotation.value.id == "Annotated"
        ):
            annotation = annotation.slice.elts[0]
        if (
            isinstance(annotation, ast.Subscript)
            and isinstance(annotation.value, ast.Name)
            and annotation.value.id == "Optional"
        ):
            annotation = annotation.slice
        if isinstance(annotation, ast.Name) and annotation.id.endswith(("ReqInput", "Req")):
            return annotation.id
    return None


def retired(handler: ast.AsyncFunctionDef) -> bool:
    """A handler kept only to answer 404 (SGLang keeps removed routes that way, e.g. /get_weight_version)."""
    statements = [s for s in handler.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(statements) != 1 or not isinstance(statements[0], ast.Raise):
        return False
    raised = statements[0].exc
    return isinstance(raised, ast.Call) and any(
        k.arg == "status_code" and getattr(k.value, "value", None) == 404 for k in raised.keywords
    )


def test_the_source_read_is_the_version_the_image_pins(srt):
    pinned = re.search(r"lmsysorg/sglang:v([\w.]+)@", (ROOT / "images" / "sglang" / "Dockerfile").read_text())[1]
    assert pinned == SGLANG_VERSION
    (metadata,) = srt.parent.parent.glob("sglang-*.dist-info/METADATA")  # the installed distribution's
    assert re.search(r"^Version: (.+)$", metadata.read_text(), re.MULTILINE)[1] == SGLANG_VERSION


def test_every_route_we_call_is_served_and_not_retired(srt):
    routes = http_routes(srt)
    for name, route in ROUTES.items():
        handler = routes.get((route.method, route.path))
        assert handler is not None, f"{name}: SGLang {SGLANG_VERSION} has no {route.method} {route.path}"
        assert not retired(handler), f"{name}: {route.path} only answers 404 in SGLang {SGLANG_VERSION}"
        if route.request is not None:
            assert body_type(handler) == route.request, f"{name}: SGLang parses {route.path} into {body_type(handler)}"


def test_every_field_we_send_is_a_field_of_sglangs_request_type(srt):
    io_struct = parse(srt / "managers" / "io_struct.py")
    for name, route in ROUTES.items():
        if route.request is not None:
            missing = set(route.sends) - class_fields(io_struct, route.request)
            assert not missing, f"{name}: {route.request} has no field(s) {sorted(missing)}"
    sampling = class_fields(parse(srt / "sampling" / "sampling_params.py"), "SamplingParams")
    assert set(SAMPLING_PARAMS) <= sampling


def test_every_field_we_read_is_one_sglang_writes(srt):
    tokenizer_manager = parse(srt / "managers" / "tokenizer_manager.py")
    weight_versions = parse(srt / "utils" / "weight_versions.py")
    meta_info = keys_written_to(tokenizer_manager, "meta_info") | keys_written_to(weight_versions, "meta_info")
    assert set(READS["generate.meta_info"]) <= meta_info
    spans = next(
        string_keys(node.elt)
        for node in ast.walk(weight_versions)
        if isinstance(node, ast.ListComp) and isinstance(node.elt, ast.Dict)
    )
    assert set(READS["generate.meta_info.weight_versions[]"]) <= spans
    model_info = http_routes(srt)["GET", "/model_info"]
    assert set(READS["model_info"]) <= keys_written_to(model_info, "result")
    # /server_info spreads the server arguments: tp_size and pp_size are arguments of that version
    arguments = set()
    for path in (srt / "arg_groups" / "fields").glob("*.py"):
        arguments |= {
            n.target.id
            for n in ast.walk(parse(path))
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        }
    assert set(READS["server_info"]) <= arguments
    loads = http_routes(srt)["GET", "/v1/loads"]
    assert set(READS["loads"]) <= returned_keys(loads)
    assert set(READS["loads.loads[]"]) <= load_snapshot_fields(srt)


def returned_keys(handler: ast.AsyncFunctionDef) -> set[str]:
    return {
        k
        for node in ast.walk(handler)
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Dict)
        for k in string_keys(node.value)
    }


def load_snapshot_fields(srt: Path) -> set[str]:
    """The fields /v1/loads gives for each rank (its `core` section: LoadSnapshot's scalars)."""
    return class_fields(parse(srt / "managers" / "load_snapshot.py"), "LoadSnapshot")


def test_the_cpu_engines_v1_loads_has_sglangs_shape(srt, tmp_path):
    """Its envelope has SGLang's keys, each rank's fields are LoadSnapshot's with their types, and `token_load` reads
    it as it reads SGLang's."""
    engine = CpuEngine(build_tiny_qwen2(tmp_path), max_batch_size=4)
    try:
        answer = engine.loads()
    finally:
        engine.shutdown()
    assert set(answer) == returned_keys(http_routes(srt)["GET", "/v1/loads"])
    (rank,) = answer["loads"]
    snapshot = classes(parse(srt / "managers" / "load_snapshot.py"))["LoadSnapshot"]
    types = {s.target.id: ast.unparse(s.annotation) for s in snapshot.body if isinstance(s, ast.AnnAssign)}
    assert set(rank) <= set(types), f"fields SGLang's LoadSnapshot lacks: {sorted(set(rank) - set(types))}"
    assert {name: type(value).__name__ for name, value in rank.items()} == {name: types[name] for name in rank}
    assert token_load(answer) == 0  # idle


def test_the_cpu_engine_serves_only_sglangs_routes_and_parameters(srt):
    served = {
        (route.method, route.resource.canonical) for route in create_app(CpuEngine.__new__(CpuEngine)).router.routes()
    }
    sglang = {route for route, handler in http_routes(srt).items() if not retired(handler)}
    ours = {(method, path) for method, path in served if method != "HEAD" and not path.startswith("/areal/")}
    assert ours <= sglang, f"the CPU engine serves routes SGLang {SGLANG_VERSION} does not: {sorted(ours - sglang)}"
    assert {(r.method, r.path) for r in ROUTES.values()} <= served  # and everything our client calls
    sglang_sampling = class_fields(parse(srt / "sampling" / "sampling_params.py"), "SamplingParams")
    assert set(SamplingParams.__dataclass_fields__) <= sglang_sampling


def test_the_server_arguments_a_job_may_pass_are_the_pinned_sglangs_and_its_parser_takes_the_engine_command(srt):
    """Runs SGLang's own parser (ServerArgs.add_cli_args) in the SGLang env: its argument list (the names, the fields
    they set and how many values they take) is the committed one, and it parses the command the operator gives a
    rollout pod's engine, with arguments of every shape, into the values the job asked for."""
    body = yaml.safe_load((ROOT / "examples" / "rljob-gsm8k.yaml").read_text())
    body["spec"]["rollout"]["sglang_args"] = {
        "mem_fraction_static": 0.75,
        "enable_torch_compile": True,
        "cuda_graph_bs_decode": [1, 2, 4],
        "json_model_override_args": {"rope_scaling": None},
    }
    (rollout,) = [
        c for c in desired_children(validate(body), running=True) if c["metadata"]["name"].endswith("-rollout")
    ]
    (engine,) = [c for c in rollout["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"]
    parse = f"print(json.dumps(vars(parser.parse_args({engine['args']!r})), default=str))"
    done = subprocess.run(
        [str(SGLANG_PYTHON), "-c", READ_ARGUMENTS + parse], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    arguments, parsed = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert render(arguments) == ARGUMENTS_FILE.read_text(), (
        "common/sglang_server_args.json is stale: run python -m areal_k8s_testing.sglang_arguments --write"
    )
    assert (parsed["mem_fraction_static"], parsed["enable_torch_compile"], parsed["cuda_graph_bs_decode"]) == (
        0.75,
        True,
        [1, 2, 4],
    )
    assert json.loads(parsed["json_model_override_args"]) == {"rope_scaling": None}
    assert (parsed["model_path"], parsed["tp_size"]) == (
        body["spec"]["model"],
        body["spec"]["roles"]["rollout"]["gpusPerPod"],
    )
