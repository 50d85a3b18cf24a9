"""deploy/kubernetes, checked without a cluster and without kubectl.

Both the base and the example overlay are rendered (tests/support/kustomize.py: the subset of
kustomize they use, compared with `kubectl kustomize` where kubectl is installed), then every
built-in object is validated strictly against the Kubernetes OpenAPI schemas of a pinned version
(kubernetes-validate ships them), and every custom resource against its CRD's schema, vendored
from the project that publishes it (tests/data/crd_schemas, each file naming its source). Then
the wiring: commands that parse with our CLI, ports and names that agree, secrets as files only.
"""
from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from splitmoe.cli import build_parser
from tests.support.kustomize import render
from tests.support.processes import REPO

K8S_VERSION = "1.34.0"  # the oldest minor the three big managed services all still offer
DEPLOY = REPO / "deploy"
CRD_SCHEMAS = REPO / "tests" / "data" / "crd_schemas"
CRD_FILES = {("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
             ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-monitoring-v1.json",
             ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-gateway-v1.json"}
SECRET_DIR = "/var/run/secrets/splitmoe"


def copy_with_secrets(dest: Path) -> Path:
    """deploy/ copied under `dest`, with the two secret files the overlay's README steps make."""
    shutil.copytree(DEPLOY, dest / "deploy")
    secrets = dest / "deploy" / "kubernetes" / "overlays" / "example" / "secrets"
    (secrets / "cluster-token").write_text("test-cluster-token-0123456789abcdef\n")
    (secrets / "api-key").write_text("test-api-key-0123456789")
    return dest / "deploy" / "kubernetes"


@pytest.fixture(scope="module")
def kustomize_dirs(tmp_path_factory) -> dict[str, Path]:
    root = copy_with_secrets(tmp_path_factory.mktemp("k8s"))
    return {"base": root / "base", "example": root / "overlays" / "example"}


@pytest.fixture(scope="module", params=["base", "example"])
def rendered(request, kustomize_dirs) -> list[dict]:
    return render(kustomize_dirs[request.param])


def one(objects: list[dict], kind: str, name: str) -> dict:
    hits = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} objects"
    return hits[0]


def pod(objects: list[dict], name: str) -> dict:
    return one(objects, "Deployment", name)["spec"]["template"]["spec"]


def container(objects: list[dict], name: str) -> dict:
    (c,) = pod(objects, name)["containers"]
    return c


def parse_args(c: dict):
    """The container's args as our CLI parses them, $(VAR) references filled from its env names."""
    argv = [re.sub(r"\$\((\w+)\)", r"/from-env/\1", a) for a in c["args"]]
    try:
        return build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"`splitmoe {' '.join(c['args'])}` does not parse (exit {e.code})")


def config_value(objects: list[dict], key: str) -> str:
    return one(objects, "ConfigMap", "splitmoe-config")["data"][key]


# ---- schemas ----

def test_every_built_in_object_passes_the_pinned_kubernetes_openapi_schema(rendered):
    built_in = [o for o in rendered if (o["apiVersion"], o["kind"]) not in CRD_FILES]
    assert {o["kind"] for o in built_in} >= {"ConfigMap", "Service", "Deployment", "NetworkPolicy"}
    for obj in built_in:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {'/'.join(map(str, e.path))}: {e.message}")


def test_every_custom_resource_passes_its_crd_schema_with_no_unknown_field(rendered):
    custom = [o for o in rendered if (o["apiVersion"], o["kind"]) in CRD_FILES]
    assert {o["kind"] for o in custom} == {"ServiceMonitor", "PrometheusRule", "HTTPRoute"}
    for obj in custom:
        schema = json.loads((CRD_SCHEMAS / CRD_FILES[(obj["apiVersion"], obj["kind"])]).read_text())
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in jsonschema.Draft7Validator(schema).iter_errors(obj)]
        # The API server prunes fields a structural schema does not name: a misspelt field would
        # vanish silently there, so it fails here.
        errors += unknown_fields(obj, schema, obj["kind"])
        assert errors == [], f"{obj['kind']}/{obj['metadata']['name']}"


def unknown_fields(value, schema: dict, path: str) -> list[str]:
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(value, dict):
        props = schema.get("properties")
        if props is None:
            extra = schema.get("additionalProperties")
            return [e for k, v in value.items() for e in unknown_fields(v, extra, f"{path}/{k}")] \
                if isinstance(extra, dict) else []
        out = [f"{path}/{k}: not in the CRD's schema" for k in value if k not in props]
        return out + [e for k, v in value.items() if k in props for e in unknown_fields(v, props[k], f"{path}/{k}")]
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [e for i, v in enumerate(value) for e in unknown_fields(v, schema["items"], f"{path}[{i}]")]
    return []


def test_the_unknown_field_check_catches_a_misspelt_field():
    schema = json.loads((CRD_SCHEMAS / CRD_FILES[("monitoring.coreos.com/v1", "ServiceMonitor")]).read_text())
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "x"},
               "spec": {"selector": {}, "endpoints": [{"port": "http", "intervall": "15s"}]}}
    assert unknown_fields(monitor, schema, "ServiceMonitor") == [
        "ServiceMonitor/spec/endpoints[0]/intervall: not in the CRD's schema"]


@pytest.mark.stack
def test_the_renderer_matches_kubectl_kustomize_where_kubectl_is_installed(kustomize_dirs):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the tests' renderer is not compared with kustomize here")
    for name, directory in kustomize_dirs.items():
        done = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        theirs = [d for d in yaml.safe_load_all(done.stdout) if d]
        key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
        assert sorted(render(directory), key=key) == sorted(theirs, key=key), name


# ---- the wiring ----

def test_every_command_parses_with_our_cli_and_listens_where_its_service_points(rendered):
    expert = parse_args(container(rendered, "splitmoe-expert"))
    attention = parse_args(container(rendered, "splitmoe-attention"))
    gateway = parse_args(container(rendered, "splitmoe-gateway"))
    for args in (expert, attention, gateway):
        assert args.host == "0.0.0.0"
    services = {name: one(rendered, "Service", f"splitmoe-{name}")["spec"]["ports"][0]
                for name in ("expert", "attention", "gateway")}
    for name, args in (("expert", expert), ("attention", attention), ("gateway", gateway)):
        port = container(rendered, f"splitmoe-{name}")["ports"][0]
        assert port["containerPort"] == args.port == services[name]["port"]
        assert services[name]["targetPort"] == port["name"]
    assert attention.expert_services == (f"splitmoe-expert:{services['expert']['port']}",)  # every pod
    # the experts' second port: /metrics, the autoscaler's signal
    metrics = container(rendered, "splitmoe-expert")["ports"][1]
    service_metrics = one(rendered, "Service", "splitmoe-expert")["spec"]["ports"][1]
    assert metrics["name"] == service_metrics["targetPort"] == "metrics"
    assert metrics["containerPort"] == expert.metrics_port == service_metrics["port"]
    assert gateway.attention == f"splitmoe-attention:{services['attention']['port']}"


def test_experts_start_unassigned_behind_a_headless_service_that_selects_them(rendered):
    service = one(rendered, "Service", "splitmoe-expert")["spec"]
    assert service["clusterIP"] == "None"  # DNS answers with every ready pod's address
    assert not service.get("publishNotReadyAddresses")
    labels = one(rendered, "Deployment", "splitmoe-expert")["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= labels.items()
    args = parse_args(container(rendered, "splitmoe-expert"))
    assert args.unassigned
    # scaled while serving: a new pod joins before an old one drains, and the kubelet waits out the drain
    deployment = one(rendered, "Deployment", "splitmoe-expert")["spec"]
    assert deployment["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert deployment["template"]["spec"]["terminationGracePeriodSeconds"] > args.drain_timeout_s


def test_the_attention_pod_waits_for_as_many_experts_as_the_deployment_runs(rendered):
    replicas = one(rendered, "Deployment", "splitmoe-expert")["spec"]["replicas"]
    assert int(config_value(rendered, "EXPERT_REPLICAS")) == replicas
    (wait,) = pod(rendered, "splitmoe-attention")["initContainers"]
    assert '"splitmoe-expert"' in wait["args"][0]
    assert wait["env"][0]["valueFrom"]["configMapKeyRef"] == {"name": "splitmoe-config", "key": "EXPERT_REPLICAS"}


@pytest.mark.stack
def test_the_wait_for_experts_script_waits_for_enough_addresses(kustomize_dirs):
    """The init container's script, run here with `localhost` (one address) for the Service's name."""
    (wait,) = pod(render(kustomize_dirs["base"]), "splitmoe-attention")["initContainers"]
    script = wait["args"][0].replace('"splitmoe-expert"', '"localhost"')
    run = [sys.executable, *wait["command"][1:], script]
    done = subprocess.run(run, env={"EXPERT_REPLICAS": "1"}, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "expert pods ready: 1 of 1" in done.stdout, done.stderr
    with pytest.raises(subprocess.TimeoutExpired):  # one address of two: it keeps waiting
        subprocess.run(run, env={"EXPERT_REPLICAS": "2"}, capture_output=True, text=True, timeout=3)


def test_secrets_reach_the_services_as_files_only(rendered):
    for name in ("splitmoe-expert", "splitmoe-attention", "splitmoe-gateway"):
        c, spec = container(rendered, name), pod(rendered, name)
        args = parse_args(c)
        assert str(args.cluster_token_file) == f"{SECRET_DIR}/cluster-token", name
        assert not any(e["name"] in ("SPLITMOE_CLUSTER_TOKEN", "SPLITMOE_API_KEY") for e in c.get("env", [])), name
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == SECRET_DIR)
        assert mount["readOnly"]
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        secret_files = secret_items(volume)
        assert secret_files["cluster-token"] == ("splitmoe-cluster-token", "cluster-token"), name
        assert ("api-key" in secret_files) == (name == "splitmoe-gateway"), name  # only the gateway has it
    gateway = parse_args(container(rendered, "splitmoe-gateway"))
    assert str(gateway.api_key_file) == f"{SECRET_DIR}/api-key" and gateway.api_key is None
    assert not gateway.public_metrics  # Prometheus brings the key (the ServiceMonitor)


def secret_items(volume: dict) -> dict[str, tuple[str, str]]:
    """file name in the mount -> (Secret, key), for a secret or projected volume."""
    sources = [s["secret"] for s in volume["projected"]["sources"]] if "projected" in volume else [
        {"name": volume["secret"]["secretName"], "items": volume["secret"]["items"]}]
    return {item["path"]: (s["name"], item["key"]) for s in sources for item in s["items"]}


def test_the_overlay_generates_both_secrets_from_its_files_and_they_never_enter_git(kustomize_dirs):
    objects = render(kustomize_dirs["example"])
    token = one(objects, "Secret", "splitmoe-cluster-token")["data"]["cluster-token"]
    assert base64.b64decode(token).decode().strip() == "test-cluster-token-0123456789abcdef"
    assert "api-key" in one(objects, "Secret", "splitmoe-api-key")["data"]
    ignored = (DEPLOY / "kubernetes" / "overlays" / "example" / "secrets" / ".gitignore").read_text().split()
    assert ignored == ["*", "!.gitignore"]


def test_probes_use_the_open_grpc_health_check_and_the_gateways_health(rendered):
    for name in ("splitmoe-expert", "splitmoe-attention"):
        c = container(rendered, name)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": parse_args(c).port}, (name, probe)
    gateway = container(rendered, "splitmoe-gateway")
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "tcpSocket" in gateway["livenessProbe"]  # an attention service down is no reason to restart it


def test_dev_shm_is_memory_backed_where_torch_runs(rendered):
    for name in ("splitmoe-expert", "splitmoe-attention"):
        mount = next(m for m in container(rendered, name)["volumeMounts"] if m["mountPath"] == "/dev/shm")
        volume = next(v for v in pod(rendered, name)["volumes"] if v["name"] == mount["name"])
        assert volume["emptyDir"]["medium"] == "Memory" and volume["emptyDir"]["sizeLimit"]


def test_network_policies_admit_only_the_next_hop(rendered):
    labels = {name: one(rendered, "Deployment", f"splitmoe-{name}")["spec"]["template"]["metadata"]["labels"]
              for name in ("expert", "attention", "gateway")}

    def admitted(target: str, port: int) -> set[str]:
        (policy,) = [p for p in rendered if p["kind"] == "NetworkPolicy"
                     and p["spec"]["podSelector"]["matchLabels"].items() <= labels[target].items()]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        callers = set()
        for rule in policy["spec"]["ingress"]:
            if port not in {p["port"] for p in rule["ports"]}:
                continue
            if "from" not in rule:
                return {"anyone"}
            for peer in rule["from"]:
                callers |= {n for n, pod_labels in labels.items()
                            if peer["podSelector"]["matchLabels"].items() <= pod_labels.items()}
        return callers

    assert admitted("expert", 50061) == {"attention"}
    assert admitted("expert", 9061) == {"anyone"}  # Prometheus: /metrics, counts only
    assert admitted("attention", 50051) == {"gateway"}
    assert admitted("gateway", 8000) == {"anyone"}  # the Gateway API proxies and Prometheus


def test_the_route_and_the_service_monitor_point_at_the_gateway_service(rendered):
    service = one(rendered, "Service", "splitmoe-gateway")
    (port,) = service["spec"]["ports"]
    (rule,) = one(rendered, "HTTPRoute", "splitmoe")["spec"]["rules"]
    assert rule["backendRefs"] == [{"name": "splitmoe-gateway", "port": port["port"]}]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1/"}}]  # /metrics stays inside
    monitor = one(rendered, "ServiceMonitor", "splitmoe-gateway")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"
    assert endpoint["authorization"]["credentials"] == {"name": "splitmoe-api-key", "key": "api-key"}


def test_the_prometheus_rule_carries_the_rule_files_groups(rendered):
    rule_file = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    assert one(rendered, "PrometheusRule", "splitmoe")["spec"]["groups"] == rule_file["groups"]
    alerts = {r["alert"] for g in rule_file["groups"] for r in g["rules"]}
    assert {"SplitMoEExpertServiceDown", "SplitMoEKVCacheNearlyFull", "SplitMoEQueueBacklog",
            "SplitMoEEndToEndLatencyHigh", "SplitMoEExpertHopSlow"} <= alerts


def test_the_example_overlay_puts_the_attention_service_on_a_gpu_node(kustomize_dirs):
    objects = render(kustomize_dirs["example"])
    spec = pod(objects, "splitmoe-attention")
    c = container(objects, "splitmoe-attention")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert spec["nodeSelector"] and spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert parse_args(c).device == "cuda"
    for name in ("splitmoe-attention", "splitmoe-expert"):
        c = container(objects, name)
        assert config_value(objects, "MODEL").startswith("/models/")
        assert any(m["mountPath"] == "/models" and m["readOnly"] for m in c["volumeMounts"]), name
    assert all(o["metadata"].get("namespace") == "splitmoe" for o in objects if o["kind"] != "Namespace")
    assert all(not c["image"].endswith(":latest") and ":" in c["image"]
               for name in ("splitmoe-attention", "splitmoe-expert", "splitmoe-gateway")
               for c in pod(objects, name)["containers"])


# ---- docs/deploy.md, as written ----

@pytest.mark.stack
def test_the_deploy_docs_kubernetes_steps_render_and_validate(tmp_path):
    """docs/deploy.md's Kubernetes block, run in a copy of deploy/ (no cluster: `kubectl apply` is left out; with
    no kubectl here its `kubectl kustomize` is the tests' renderer instead)."""
    readme = (REPO / "docs" / "deploy.md").read_text()
    section = readme[readme.index("## Kubernetes"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    shutil.copytree(DEPLOY, tmp_path / "deploy")
    render_cmd = "kubectl kustomize" if shutil.which("kubectl") else \
        f"{sys.executable} -c 'import sys, yaml; from tests.support.kustomize import render; " \
        f"from pathlib import Path; print(yaml.safe_dump_all(render(Path(sys.argv[1]))))'"
    validate = f"{sys.executable} -m kubernetes_validate"  # the one beside this interpreter, not a shim
    lines = [line for line in block.splitlines() if not line.startswith("kubectl apply")]
    script = "\n".join(lines)
    script = re.sub(r"^splitmoe ", f"{sys.executable} -m splitmoe ", script, flags=re.M)
    script = re.sub(r"^python ", f"{sys.executable} ", script, flags=re.M)
    script = script.replace("kubectl kustomize", render_cmd).replace("kubernetes-validate", validate)
    assert "kubernetes-validate" in block and "kubectl kustomize" in block
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    passed = re.findall(r"passed for resource (\S+)", done.stdout + done.stderr)
    assert {"deployment/splitmoe-attention", "deployment/splitmoe-expert", "secret/splitmoe-api-key"} <= set(passed)
    assert "ERROR" not in done.stdout + done.stderr


def test_the_autoscaler_scales_the_experts_on_a_metric_they_export_and_waits_out_a_drain(rendered, demo_gguf):
    from splitmoe.expert_service.hops import HopHandler
    from splitmoe.expert_service.metrics import ExpertMetrics
    from splitmoe.expert_service.shard import HostedShard
    from splitmoe.modelfile.gguf_file import GGUFFile

    hpa = one(rendered, "HorizontalPodAutoscaler", "splitmoe-expert")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "splitmoe-expert"}
    (metric,) = hpa["metrics"]
    adapter = yaml.safe_load((REPO / "deploy/kubernetes/prometheus-adapter/values.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == rule["name"]["as"]
    series = rule["seriesQuery"].split("{")[0]
    hosted = HostedShard(GGUFFile(demo_gguf), layers=(), experts=())
    exported = {s.name for family in ExpertMetrics(hosted, HopHandler(hosted), lambda: False).collect()
                for s in family.samples}
    assert series in exported  # the adapter reads a series the expert services really export
    monitor = one(rendered, "ServiceMonitor", "splitmoe-expert")["spec"]
    assert [e["port"] for e in monitor["endpoints"]] == ["metrics"]
    # scaling down: one pod at a time, each period longer than the drain its pod takes
    drain_s = parse_args(container(rendered, "splitmoe-expert")).drain_timeout_s
    (down,) = hpa["behavior"]["scaleDown"]["policies"]
    assert down == {"type": "Pods", "value": 1, "periodSeconds": down["periodSeconds"]}
    assert down["periodSeconds"] > drain_s
