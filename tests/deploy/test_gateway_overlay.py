"""The `gateway` overlay (GIE's InferencePool, its endpoint picker, an HTTPRoute): it renders;
the Kubernetes objects pass the schemas offline; the Gateway API Inference Extension's objects
pass a structural check written from GIE's published API reference for
inference.networking.k8s.io/v1 (api/v1/inferencepool_types.go, v1.0); and the pieces point at
each other: the pool selects the planserve pods on their HTTP port, the picker reads metric names
planserve exports, the route sends to the pool."""

from __future__ import annotations

import pytest
import yaml
from _deploy import INSTALL_HINT, K8S_VERSIONS, env_of, expand, one, render, role

from scheduler_service.metrics import Metrics

OVERLAY = "overlays/gateway"
GIE_GROUP = "inference.networking.k8s.io"
CUSTOM = {"InferencePool", "HTTPRoute"}


def _check_fields(obj: dict, allowed: set[str], required: set[str], where: str) -> None:
    assert isinstance(obj, dict), f"{where}: must be an object"
    unknown, missing = set(obj) - allowed, required - set(obj)
    assert not unknown, f"{where}: fields not in the v1 API: {sorted(unknown)}"
    assert not missing, f"{where}: required fields missing: {sorted(missing)}"


def check_inference_pool_v1(pool: dict) -> None:
    """InferencePool as inference.networking.k8s.io/v1 defines it (strict: no unknown field)."""
    assert pool["apiVersion"] == f"{GIE_GROUP}/v1"
    _check_fields(pool, {"apiVersion", "kind", "metadata", "spec", "status"}, {"spec"}, "pool")
    spec = pool["spec"]
    _check_fields(
        spec,
        {"selector", "targetPorts", "endpointPickerRef"},
        {"selector", "targetPorts", "endpointPickerRef"},
        "spec",
    )
    # LabelSelector: matchLabels only, a map of label name -> value (1 to 64 entries).
    _check_fields(spec["selector"], {"matchLabels"}, {"matchLabels"}, "spec.selector")
    labels = spec["selector"]["matchLabels"]
    assert 1 <= len(labels) <= 64
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())
    # targetPorts: one Port {number in [1, 65535]}.
    assert isinstance(spec["targetPorts"], list) and len(spec["targetPorts"]) == 1
    for port in spec["targetPorts"]:
        _check_fields(port, {"number"}, {"number"}, "spec.targetPorts[]")
        assert isinstance(port["number"], int) and 1 <= port["number"] <= 65535
    ref = spec["endpointPickerRef"]
    _check_fields(
        ref,
        {"group", "kind", "name", "portNumber", "failureMode"},
        {"name"},
        "spec.endpointPickerRef",
    )
    assert ref.get("group", "") == "" and ref.get("kind", "Service") == "Service"
    assert ref.get("failureMode", "FailClose") in ("FailOpen", "FailClose")
    assert 1 <= ref.get("portNumber", 9002) <= 65535


@pytest.fixture(scope="module")
def docs():
    return render(OVERLAY)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_kubernetes_object_passes_the_schema(docs, version):
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail(f"kubernetes-validate is not installed; {INSTALL_HINT}")
    version = kubernetes_validate.latest_version() if version == "latest" else version
    for doc in docs:
        if doc["kind"] not in CUSTOM:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_pool_selects_the_planserve_pods_on_their_http_port(docs):
    pool = one(docs, "InferencePool")
    check_inference_pool_v1(pool)
    planserve = one(docs, "Deployment", "planserve")
    pod_labels = planserve["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["llm-d.ai/engine-type"] == "vllm" and pod_labels["llm-d.ai/role"] == "both"
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    [scheduler] = [
        c for c in planserve["spec"]["template"]["spec"]["containers"] if role(c) == "scheduler"
    ]
    argv = expand(scheduler["args"], env_of(scheduler, docs))
    http_port = int(argv[argv.index("--http-port") + 1])
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [http_port]
    assert http_port in [p["containerPort"] for p in scheduler["ports"]]


def test_the_picker_is_the_pools_and_reads_names_planserve_exports(docs):
    pool = one(docs, "InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    service = one(docs, "Service", ref["name"])
    assert ref["portNumber"] in [p["port"] for p in service["spec"]["ports"]]
    picker = one(docs, "Deployment", ref["name"])
    assert (
        service["spec"]["selector"].items()
        <= picker["spec"]["template"]["metadata"]["labels"].items()
    )
    [container] = picker["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    flag = {args[i]: args[i + 1] for i in range(0, len(args) - 1, 2) if args[i].startswith("--")}
    assert flag["--pool-name"] == pool["metadata"]["name"]
    assert flag["--grpc-port"] == str(ref["portNumber"])
    exported = {family.name for family in Metrics().registry.collect()}
    for name in (
        "--total-queued-requests-metric",
        "--kv-cache-usage-percentage-metric",
        "--lora-info-metric",
    ):
        assert flag[name] in exported, f"{name} {flag[name]} is not a metric planserve exports"
    # The config file comes from the ConfigMap mounted where --config-file says.
    [mount] = container["volumeMounts"]
    assert flag["--config-file"].startswith(mount["mountPath"] + "/")
    volume = next(
        v for v in picker["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    )
    config_map = one(docs, "ConfigMap", volume["configMap"]["name"])
    config = yaml.safe_load(config_map["data"][flag["--config-file"].rsplit("/", 1)[1]])
    assert config["kind"] == "EndpointPickerConfig"
    defined = {plugin["type"] for plugin in config["plugins"]}
    [profile] = config["schedulingProfiles"]
    used = {entry["pluginRef"] for entry in profile["plugins"]}
    assert used <= defined
    assert {
        "queue-scorer",
        "kv-cache-utilization-scorer",
        "prefix-cache-scorer",
        "lora-affinity-scorer",
    } <= used


def test_the_route_sends_every_path_to_the_pool(docs):
    route = one(docs, "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    [rule] = route["spec"]["rules"]
    [backend] = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        GIE_GROUP,
        "InferencePool",
        one(docs, "InferencePool")["metadata"]["name"],
    )
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]


def test_the_structural_check_refuses_what_v1_refuses(docs):
    pool = one(docs, "InferencePool")
    broken = yaml.safe_load(yaml.safe_dump(pool))
    broken["spec"]["targetPortNumber"] = 8000  # v1alpha2's spelling
    with pytest.raises(AssertionError, match="targetPortNumber"):
        check_inference_pool_v1(broken)
    broken = yaml.safe_load(yaml.safe_dump(pool))
    broken["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8001}]
    with pytest.raises(AssertionError):
        check_inference_pool_v1(broken)
    broken = yaml.safe_load(yaml.safe_dump(pool))
    del broken["spec"]["endpointPickerRef"]["name"]
    with pytest.raises(AssertionError, match="name"):
        check_inference_pool_v1(broken)
