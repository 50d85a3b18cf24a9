"""compose.yaml and the Dockerfile, checked by reading: this machine has no Docker engine.

The compose file is validated twice: by `compose-spec` (a strict Rust parser: unknown keys, bad
durations, bad depends_on conditions fail) and by the Compose Specification's own JSON schema as
shipped inside `check-jsonschema`. Every command in it must parse with our CLI, so a renamed flag
breaks this test, not a deployment. The `healthcheck` command the containers run is tested live.
"""
from __future__ import annotations

import ast
import http.server
import importlib.resources
import json
import re
import threading
from concurrent import futures
from pathlib import Path

import compose_spec
import grpc
import jsonschema
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitmoe.cli import build_parser, main
from tests.support.processes import free_port

REPO = Path(__file__).resolve().parents[1]
OURS = ("expert", "attention", "gateway")  # built from our Dockerfile; the others are stock images
MONITORING = ("prometheus", "grafana")
ONE_SHOT = "cluster-secret"                 # ours too: writes the cluster secret, then exits
# Subcommands written alongside compose.yaml: until one is registered its command is skipped, named.
PENDING_SUBCOMMANDS = {"serve-experts", "serve-gateway"}
_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value, env: dict[str, str]):
    """Compose's variable interpolation (`$V`, `${V}`, `${V:-default}`, `${V-default}`, `$$`) on every string."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3) or ""
        if op in (":-", ":?"):
            return env.get(name) or (arg if op == ":-" else "")
        if op in ("-", "?"):
            return env.get(name, arg if op == "-" else "")
        if op == ":+":
            return arg if env.get(name) else ""
        if op == "+":
            return arg if name in env else ""
        return env.get(name, "")

    return _VARIABLE.sub(one, value)


@pytest.fixture(scope="module")
def compose() -> dict:
    """compose.yaml as `docker compose` sees it with no variables set (YAML merge keys applied)."""
    return interpolate(yaml.safe_load((REPO / "compose.yaml").read_text()), env={})


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (REPO / "Dockerfile").read_text()


@pytest.fixture(scope="module")
def console_scripts() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def subcommands() -> set[str]:
    actions = [a for a in build_parser()._actions if a.dest == "command"]
    return set(actions[0].choices)


def parse_cli(argv: list[str]):
    """Our CLI's parse of `splitmoe ARGV`; an unregistered pending subcommand skips, anything else fails."""
    if argv and argv[0] in PENDING_SUBCOMMANDS and argv[0] not in subcommands():
        pytest.skip(f"`splitmoe {argv[0]}` is not registered yet in splitmoe/cli.py")
    try:
        return build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"`splitmoe {' '.join(argv)}` does not parse (exit {e.code})")


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


# ---- the file is valid Compose ----

def test_compose_file_parses_under_the_strict_compose_spec_parser(compose):
    project = compose_spec.PyCompose.from_json(json.dumps(compose))  # raises ValueError on any violation
    project.validate()  # networks, volumes, configs, secrets referenced are defined
    assert set(project.service_names()) == {*OURS, ONE_SHOT, "jaeger", *MONITORING}


def test_compose_file_matches_the_official_compose_json_schema(compose):
    vendored = importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(vendored.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)  # the draft the schema declares
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert errors == []


def test_depends_on_waits_for_health_along_the_data_path(compose):
    services = compose["services"]
    for name, service in services.items():
        for target in service.get("depends_on", {}):
            assert target in services, f"{name} depends on {target}, which is not a service"
    assert services["gateway"]["depends_on"]["attention"]["condition"] == "service_healthy"
    assert services["attention"]["depends_on"]["expert"]["condition"] == "service_healthy"


def test_every_long_running_service_has_a_healthcheck(compose):
    for name, service in compose["services"].items():
        if name == ONE_SHOT:
            assert service["restart"] == "no"  # it exits when done; the others wait for that, not health
            continue
        test = service.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL"), f"{name} has no healthcheck"


def test_every_service_reads_the_cluster_secret_the_one_shot_writes_from_a_read_only_volume(compose):
    services = compose["services"]
    writer = services[ONE_SHOT]
    secret_file = parse_cli(writer["command"]).path
    assert f"cluster-secret:{secret_file.parent}" in writer["volumes"]  # the only writable mount
    assert "cluster-secret" in compose["volumes"]
    for name in OURS:
        service = services[name]
        assert parse_cli(service["command"]).cluster_token_file == secret_file, name
        assert f"cluster-secret:{secret_file.parent}:ro" in service["volumes"], name
        assert service["depends_on"][ONE_SHOT]["condition"] == "service_completed_successfully", name
        assert "SPLITMOE_CLUSTER_TOKEN" not in service["environment"], name  # the file, not the environment


def test_expert_service_scales_and_starts_unassigned(compose):
    expert = compose["services"]["expert"]
    assert "container_name" not in expert and "ports" not in expert  # both would clash with --scale
    assert "--unassigned" in expert["command"]


def test_traces_go_where_the_environment_says_and_jaeger_is_in_the_observability_profile(compose):
    services = compose["services"]
    for name in OURS:  # the core stack runs without a collector: none by default
        assert services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "", name
        assert not any(d in services[name].get("depends_on", {}) for d in ("jaeger", "prometheus", "grafana"))
    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one:")
    assert "4317" in jaeger["expose"] and any(p.endswith(":16686") for p in jaeger["ports"])
    assert "http://jaeger:4317 docker compose --profile observability up" in (REPO / "compose.yaml").read_text()
    for name in ("jaeger", "prometheus", "grafana"):
        assert services[name]["profiles"] == ["observability"], name


def test_published_ports_bind_loopback_only_and_the_file_runs_on_compose_v1_too(compose):
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)
    assert "name" not in compose  # Compose v1 (Debian's docker-compose 1.29) refuses a top-level name


def test_the_model_comes_from_one_mounted_directory_or_the_baked_demo(compose, dockerfile):
    services = compose["services"]
    model = services["attention"]["command"][1]
    assert services["expert"]["command"][1] == model  # both sides must open the same file
    assert f"shutil.copy(trained_model_path(), '{model}')" in dockerfile  # the demo that answers in words
    for name in ("expert", "attention"):
        assert any(v.endswith(":/models:ro") for v in services[name]["volumes"]), name


# ---- every command is a real entry point ----

@pytest.mark.parametrize("name", OURS)
def test_service_command_parses_with_our_cli(compose, name):
    args = parse_cli(compose["services"][name]["command"])
    assert args.host == "0.0.0.0"  # reachable from the other containers


@pytest.mark.parametrize("name", OURS)
def test_healthcheck_is_our_console_script_probing_the_service_port(compose, console_scripts, name):
    service = compose["services"][name]
    kind, script, *argv = service["healthcheck"]["test"]
    assert kind == "CMD" and script in console_scripts
    target = parse_cli(argv).target
    service_args = parse_cli(service["command"])
    assert port_of(target.removesuffix("/health")) == service_args.port


def test_services_address_each_other_on_the_ports_they_listen_on(compose):
    services = compose["services"]
    expert = parse_cli(services["expert"]["command"])
    attention = parse_cli(services["attention"]["command"])
    gateway = parse_cli(services["gateway"]["command"])
    assert attention.expert_services == (f"expert:{expert.port}",)  # the DNS name of every replica
    assert gateway.attention == f"attention:{attention.port}"
    assert services["gateway"]["ports"] == [f"127.0.0.1:8000:{gateway.port}"]


# ---- the Dockerfile ----

def _instruction(dockerfile: str, name: str) -> list[str]:
    """The exec (JSON) form of the last NAME instruction."""
    lines = re.findall(rf"^{name}\s+(\[.*\])\s*$", dockerfile, flags=re.MULTILINE)
    assert lines, f"the Dockerfile has no exec-form {name}"
    return json.loads(lines[-1])


def test_dockerfile_entrypoint_is_the_splitmoe_console_script(dockerfile, console_scripts):
    assert _instruction(dockerfile, "ENTRYPOINT") == ["splitmoe"]
    assert console_scripts["splitmoe"] == "splitmoe.cli:main"


def test_dockerfile_default_command_parses(dockerfile):
    assert parse_cli(_instruction(dockerfile, "CMD")).command == "up"


def test_dockerfile_builds_cpu_torch_on_python_slim_as_non_root(dockerfile):
    # by default: python:3.11-slim and PyTorch's CPU index; both replaceable (a local base, a wheel directory)
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim\s*$", dockerfile, flags=re.MULTILINE)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}\s*$", dockerfile, flags=re.MULTILINE)
    assert re.search(r'^ARG TORCH_PIP_ARGS="--index-url https://download\.pytorch\.org/whl/cpu"$', dockerfile,
                     flags=re.MULTILINE)
    assert re.search(r'^RUN pip install \$\{TORCH_PIP_ARGS\} "torch==', dockerfile, flags=re.MULTILINE)
    users = re.findall(r"^USER\s+(\S+)", dockerfile, flags=re.MULTILINE)
    assert users and users[-1] not in ("root", "0")


def test_dockerfile_copies_every_package_that_pip_installs(dockerfile):
    tree = ast.parse((REPO / "setup.py").read_text())
    product = next(ast.literal_eval(node.value) for node in tree.body
                   if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "PRODUCT")
    copied = set(re.findall(r"^COPY\s+(\w+)/\s", dockerfile, flags=re.MULTILINE))
    assert {"splitmoe", *product} <= copied, f"not copied into the image: {sorted({'splitmoe', *product} - copied)}"


# ---- the healthcheck command, against live servers ----

@pytest.fixture
def grpc_health_server():
    port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


def test_healthcheck_follows_grpc_health_status(grpc_health_server):
    address, servicer = grpc_health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert main(["healthcheck", address]) == 1
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert main(["healthcheck", address]) == 0


def test_healthcheck_fails_on_nothing_listening_and_on_a_bad_target():
    assert main(["healthcheck", f"127.0.0.1:{free_port()}", "--timeout-s", "1"]) == 1
    assert main(["healthcheck", "no-port-here"]) == 1


class _StatusFromPath(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # /200 answers 200, /503 answers 503
        self.send_response(int(self.path.strip("/")))
        self.end_headers()

    def log_message(self, *args):
        pass


def test_healthcheck_over_http_wants_200():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StatusFromPath)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert main(["healthcheck", f"{base}/200"]) == 0
        assert main(["healthcheck", f"{base}/503"]) == 1
    finally:
        server.shutdown()
        server.server_close()


def test_attention_serves_the_fast_path_by_default(compose):
    assert parse_cli(compose["services"]["attention"]["command"]).dtype == "bfloat16"


def test_dockerfile_checks_import_what_pip_installs(dockerfile):
    """Its build-time checks run outside the source tree (`cd /`), where only the installed
    `splitmoe` package is: every module they import must be importable as the install names it."""
    import importlib.util

    snippets = re.findall(r'python -c "([^"]*)"', dockerfile)
    modules = [m for code in snippets for m in re.findall(r"(?:^|;)\s*(?:import|from) ([\w.]+)", code)]
    ours = [m for m in modules if m.split(".")[0] in ("splitmoe", "kernels", "attention_service", "expert_service",
                                                       "gateway", "modelfile", "proto", "bench")]
    assert ours, f"the Dockerfile's checks import none of ours: {modules}"
    for module in ours:
        assert module.startswith("splitmoe."), f"{module}: only `splitmoe` is installed into site-packages"
        assert importlib.util.find_spec(module) is not None, module
