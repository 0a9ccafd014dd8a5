"""The `replicas` overlay (a StatefulSet of model services behind one scheduler): it renders,
passes the Kubernetes schemas offline, its containers' flags parse with the CLI, and the
scheduler reaches every engine through the headless Service's DNS name on the engine port."""
from __future__ import annotations

import pytest

from _deploy import (INSTALL_HINT, K8S_VERSIONS, env_of, expand, parse_planserve, render, role,
                     validate_command)

from model_service.config import ModelServiceConfig

OVERLAY = "overlays/replicas"


def _pods(docs):
    return {d["metadata"]["name"]: (d["kind"], d["spec"]["template"]["spec"])
            for d in docs if d["kind"] in ("Deployment", "StatefulSet")}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_passes_the_kubernetes_schema(version):
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail(f"kubernetes-validate is not installed; {INSTALL_HINT}")
    version = kubernetes_validate.latest_version() if version == "latest" else version
    for doc in render(OVERLAY):
        kubernetes_validate.validate(doc, version, strict=True)


def test_engines_are_a_statefulset_behind_a_headless_service_and_one_scheduler():
    docs = render(OVERLAY)
    kinds = {kind for kind, _ in _pods(docs).values()}
    assert kinds == {"Deployment", "StatefulSet"}
    statefulset = next(d for d in docs if d["kind"] == "StatefulSet")
    headless = next(d for d in docs if d["kind"] == "Service"
                    and d["metadata"]["name"] == statefulset["spec"]["serviceName"])
    assert headless["spec"].get("clusterIP") == "None"
    assert [p["port"] for p in headless["spec"]["ports"]] == [ModelServiceConfig().port]

    scheduler_deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert scheduler_deployment["spec"]["replicas"] == 1
    for _, pod in _pods(docs).values():
        for container in pod["containers"]:
            if role(container) == "other":
                continue
            argv = expand(container["args"], env_of(container, docs))
            validate_command(argv)
            if role(container) == "scheduler":
                args = parse_planserve(argv)
                engines = args.engine if isinstance(args.engine, list) else [args.engine]
                assert any(e.startswith(f"dns:///{headless['metadata']['name']}") for e in engines), engines
