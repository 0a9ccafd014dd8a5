"""The Kubernetes manifests: every kustomization renders, passes the Kubernetes schemas offline,
and agrees with the code on ports, health services, flags and drain time."""
from __future__ import annotations

import pytest

from _deploy import (INSTALL_HINT, K8S, K8S_VERSIONS, KUSTOMIZATIONS, engine_drain_s, env_of,
                     expand, one, parse_planserve, prestop_sleep_s, render, role,
                     scheduler_drain_s, validate_command)

from model_service.config import ModelServiceConfig
from scheduler_service.config import SchedulerConfig

SCHEDULER_PORT = SchedulerConfig().port
ENGINE_PORT = ModelServiceConfig().port
# The CLI's defaults (the library config serves neither by default): what `planserve scheduler`
# binds when the flags are left out, and what the manifests must spell out.
HTTP_PORT = parse_planserve(["scheduler"]).http_port
METRICS_PORT = parse_planserve(["scheduler"]).metrics_port
SCHEDULER_PORTS = {"grpc": SCHEDULER_PORT, "http": HTTP_PORT, "metrics": METRICS_PORT}
GENERATION_SERVICE = "planserve.v1.GenerationService"
ENGINE_SERVICE = "planserve.v1.EngineService"
IMAGE_UID = 10001  # Dockerfile: USER 10001:10001 (test_dockerfile checks that side)

all_kustomizations = pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)


def deployment(kustomization: str) -> tuple[list[dict], dict, dict]:
    docs = render(kustomization)
    deploy = one(docs, "Deployment")
    return docs, deploy, deploy["spec"]["template"]["spec"]


def containers_by_role(pod: dict) -> dict[str, dict]:
    found = {}
    for container in pod["containers"]:
        found.setdefault(role(container), container)
    return found


def flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


def matches(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are checked"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def test_the_health_service_names_are_the_codes():
    from model_service.server import SERVICE_NAME as engine_name
    from scheduler_service.api.doors import SERVICE_NAME as scheduler_name
    assert (scheduler_name, engine_name) == (GENERATION_SERVICE, ENGINE_SERVICE)


@all_kustomizations
def test_renders_one_deployment_with_both_services(kustomization):
    docs, _, pod = deployment(kustomization)
    roles = containers_by_role(pod)
    assert {"scheduler", "model-service"} <= set(roles), f"containers: {[c['name'] for c in pod['containers']]}"
    kinds = sorted(d["kind"] for d in docs)
    assert {"ConfigMap", "Deployment", "NetworkPolicy", "Service"} <= set(kinds)


@all_kustomizations
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_passes_the_kubernetes_schema(kustomization, version):
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail(f"kubernetes-validate is not installed; {INSTALL_HINT}")
    version = kubernetes_validate.latest_version() if version == "latest" else version
    for doc in render(kustomization):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{kustomization}: {doc['kind']} {doc['metadata']['name']} is invalid for "
                        f"Kubernetes {version}: {error.message} at {list(error.path)}")


@all_kustomizations
def test_container_args_parse_with_the_cli_and_validate(kustomization):
    docs, _, pod = deployment(kustomization)
    for container in pod["containers"]:
        if role(container) == "other":
            continue
        assert "command" not in container, "planserve containers keep the image's ENTRYPOINT (planserve)"
        argv = expand(container["args"], env_of(container, docs))
        validate_command(argv)


@all_kustomizations
def test_ports_agree_with_the_code_defaults_and_engine_traffic_is_pod_local(kustomization):
    docs, _, pod = deployment(kustomization)
    roles = containers_by_role(pod)
    scheduler = roles["scheduler"]
    args = expand(scheduler["args"], env_of(scheduler, docs))
    assert int(flag(args, "--port")) == SCHEDULER_PORT
    assert int(flag(args, "--http-port")) == HTTP_PORT
    assert int(flag(args, "--metrics-port")) == METRICS_PORT
    assert flag(args, "--host") in ("0.0.0.0", "[::]"), "the public API must listen beyond loopback"
    assert {p["name"]: p["containerPort"] for p in scheduler["ports"]} == SCHEDULER_PORTS
    assert all(p["protocol"] == "TCP" for p in scheduler["ports"])
    engine_host, engine_port = flag(args, "--engine").rsplit(":", 1)
    assert engine_host == "127.0.0.1", "the scheduler reaches the engine over the pod's loopback"
    assert int(engine_port) == ENGINE_PORT

    engine = roles["model-service"]
    engine_args = expand(engine["args"], env_of(engine, docs))
    assert int(flag(engine_args, "--port")) == ENGINE_PORT
    assert [p["containerPort"] for p in engine["ports"]] == [ENGINE_PORT]


@all_kustomizations
def test_probes_are_native_grpc_on_the_health_service(kustomization):
    _, _, pod = deployment(kustomization)
    expected = {"scheduler": (SCHEDULER_PORT, GENERATION_SERVICE),
                "model-service": (ENGINE_PORT, ENGINE_SERVICE)}
    for name, container in containers_by_role(pod).items():
        if name not in expected:
            continue
        port, service = expected[name]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(kind)
            assert probe and "grpc" in probe, f"{name}: {kind} must be a gRPC health probe"
            assert probe["grpc"]["port"] == port, f"{name}: {kind} probes port {probe['grpc']['port']}"
            # Both servers report "" and their own service name; nothing else exists.
            assert probe["grpc"].get("service", "") in ("", service), f"{name}: {kind} service"
        # Ready means this service itself is SERVING (the scheduler: once Describe answered).
        assert container["readinessProbe"]["grpc"].get("service") == service


def test_the_scheduler_start_waits_as_long_as_its_engine_connect_timeout():
    for kustomization in KUSTOMIZATIONS:
        _, _, pod = deployment(kustomization)
        probe = containers_by_role(pod)["scheduler"]["startupProbe"]
        budget = probe["periodSeconds"] * probe["failureThreshold"]
        assert budget >= SchedulerConfig().engine_connect_timeout_s, (
            f"{kustomization}: the startup probe gives up after {budget} s, before the scheduler's "
            f"engine_connect_timeout_s ({SchedulerConfig().engine_connect_timeout_s} s)")


@all_kustomizations
def test_grace_period_covers_the_drain(kustomization):
    docs, _, pod = deployment(kustomization)
    grace = pod["terminationGracePeriodSeconds"]
    roles = containers_by_role(pod)
    scheduler = roles["scheduler"]
    scheduler_args = parse_planserve(expand(scheduler["args"], env_of(scheduler, docs)))
    scheduler_done = prestop_sleep_s(scheduler) + scheduler_drain_s(scheduler_args)
    engine = roles["model-service"]
    engine_stops = prestop_sleep_s(engine)
    # The engine keeps serving until the scheduler's drain is over: its steps finish the requests.
    assert engine_stops >= scheduler_done, (
        f"model service stops at {engine_stops} s, before the scheduler's drain ends at {scheduler_done} s")
    engine_done = engine_stops + engine_drain_s()
    assert grace >= max(scheduler_done, engine_done), (
        f"terminationGracePeriodSeconds {grace} < the drain ({max(scheduler_done, engine_done)} s)")


@all_kustomizations
def test_network_policy_admits_the_public_ports_and_metrics_from_monitoring_only(kustomization):
    docs, deploy, _ = deployment(kustomization)
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    policy = one(docs, "NetworkPolicy")
    assert matches(policy["spec"]["podSelector"], labels), "the NetworkPolicy does not select the pods"
    assert "Ingress" in policy["spec"]["policyTypes"]
    from_anywhere, from_some = set(), set()
    for rule in policy["spec"].get("ingress", []):
        assert rule.get("ports"), "an ingress rule without ports admits every port"
        ports = {(port["port"], port.get("protocol", "TCP")) for port in rule["ports"]}
        if rule.get("from"):
            from_some |= ports
        else:
            from_anywhere |= ports
    # The gRPC and HTTP APIs from anywhere; metrics only from the sources named (the monitoring
    # namespace); the engine port never (the scheduler reaches it over the pod's loopback).
    assert from_anywhere == {(SCHEDULER_PORT, "TCP"), (HTTP_PORT, "TCP")}
    assert from_some == {(METRICS_PORT, "TCP")}


@all_kustomizations
def test_metrics_are_announced_for_scraping_on_the_metrics_port(kustomization):
    _, deploy, _ = deployment(kustomization)
    annotations = deploy["spec"]["template"]["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/scrape") == "true"
    assert int(annotations.get("prometheus.io/port", -1)) == METRICS_PORT
    assert annotations.get("prometheus.io/path") == "/metrics"


@all_kustomizations
def test_services_serve_the_public_ports_of_the_pods(kustomization):
    docs, deploy, pod = deployment(kustomization)
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    services = [d for d in docs if d["kind"] == "Service"]
    assert services
    named_ports = {p["name"]: p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])}
    protocols = {SCHEDULER_PORT: "kubernetes.io/h2c", HTTP_PORT: "http"}
    for service in services:
        assert matches({"matchLabels": service["spec"]["selector"]}, labels), service["metadata"]["name"]
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            target = named_ports.get(target) if isinstance(target, str) else target
            # Same number outside and in; only the public APIs (metrics are scraped per pod).
            assert port["port"] == target and target in protocols, f"{service['metadata']['name']}: {port}"
            assert port.get("appProtocol") == protocols[target]
    # The Service named planserve carries both APIs.
    public = one(docs, "Service", "planserve")
    assert {p["port"] for p in public["spec"]["ports"]} == {SCHEDULER_PORT, HTTP_PORT}


@pytest.mark.parametrize("kustomization", ["base", "overlays/cpu", "overlays/gpu"])
def test_pod_disruption_budget_selects_the_pods_and_never_blocks_every_eviction(kustomization):
    docs, deploy, _ = deployment(kustomization)
    pdb = one(docs, "PodDisruptionBudget")
    assert matches(pdb["spec"]["selector"], deploy["spec"]["template"]["metadata"]["labels"])
    assert deploy["spec"]["selector"] == pdb["spec"]["selector"]
    if "maxUnavailable" in pdb["spec"]:
        assert pdb["spec"]["maxUnavailable"] >= 1
    else:
        assert pdb["spec"]["minAvailable"] < deploy["spec"]["replicas"]


@all_kustomizations
def test_pods_run_as_the_images_non_root_user(kustomization):
    _, _, pod = deployment(kustomization)
    for container in pod["containers"]:
        context = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
        assert context.get("runAsNonRoot") is True, container["name"]
        assert context.get("runAsUser") == IMAGE_UID, container["name"]
        assert container["securityContext"].get("allowPrivilegeEscalation") is False
        if container["securityContext"].get("readOnlyRootFilesystem"):
            assert any(m["mountPath"] == "/tmp" for m in container.get("volumeMounts", [])), (
                f"{container['name']}: a read-only root needs a writable /tmp (HOME in the image)")


@pytest.mark.parametrize("kustomization,tag,device", [
    ("base", "0.1.0-cpu", "cpu"), ("overlays/cpu", "0.1.0-cpu", "cpu"),
    ("overlays/gpu", "0.1.0-cuda", "cuda")])
def test_variant_images_devices_and_gpu_request(kustomization, tag, device):
    docs, _, pod = deployment(kustomization)
    for container in pod["containers"]:
        assert container["image"] == f"planserve:{tag}", container["image"]
    engine = containers_by_role(pod)["model-service"]
    args = expand(engine["args"], env_of(engine, docs))
    assert flag(args, "--device") == device
    resources = engine["resources"]
    gpus = [resources.get(part, {}).get("nvidia.com/gpu") for part in ("requests", "limits")]
    assert gpus == ([1, 1] if device == "cuda" else [None, None])
    scheduler_container = containers_by_role(pod)["scheduler"]
    scheduler = scheduler_container["resources"]
    assert "nvidia.com/gpu" not in {**scheduler.get("requests", {}), **scheduler.get("limits", {})}, (
        "the scheduler never uses a GPU")
    # On a GPU the doors run in frontend processes (as `planserve serve` starts them there).
    scheduler_args = expand(scheduler_container["args"], env_of(scheduler_container, docs))
    assert flag(scheduler_args, "--frontend-processes") == ("4" if device == "cuda" else "0")
    for container in pod["containers"]:
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), container["name"]
        assert "memory" in container["resources"]["limits"], container["name"]


def test_sidecar_adds_the_same_scheduler_to_the_users_deployment_without_touching_its_selector():
    import yaml
    original = yaml.safe_load((K8S / "overlays/sidecar/model-server.yaml").read_text())
    docs, deploy, pod = deployment("overlays/sidecar")
    assert deploy["metadata"]["name"] == original["metadata"]["name"]
    assert deploy["spec"]["selector"] == original["spec"]["selector"], "a Deployment's selector is immutable"
    user_containers = [c["name"] for c in original["spec"]["template"]["spec"]["containers"]]
    assert [c["name"] for c in pod["containers"] if c["name"] != "scheduler"] == user_containers

    base_docs, _, base_pod = deployment("base")
    sidecar = containers_by_role(pod)["scheduler"]
    reference = containers_by_role(base_pod)["scheduler"]
    for key in ("image", "ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle", "resources"):
        assert sidecar[key] == reference[key], f"the sidecar's {key} drifted from the base's"
    assert expand(sidecar["args"], env_of(sidecar, docs)) == expand(reference["args"], env_of(reference, base_docs))
