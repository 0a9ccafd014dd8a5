"""Helpers for the deployment tests: find the tools, render the kustomizations, read the code's
defaults. No tool is skipped: a missing one fails with how to get it."""
from __future__ import annotations

import ast
import functools
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
KUSTOMIZATIONS = ["base", "overlays/cpu", "overlays/gpu", "overlays/sidecar"]
# The oldest Kubernetes the manifests promise to work on (native gRPC probes are GA since 1.27,
# the PDB's unhealthyPodEvictionPolicy since 1.27 as beta), and the newest schemas shipped.
K8S_VERSIONS = ["1.29.0", "latest"]
INSTALL_HINT = "install the test extra: .venv/bin/pip install --no-build-isolation -e '.[model,test]' (make install-test)"


def tool(name: str) -> str:
    """A command-line tool from the venv (test extra) or PATH, or a failure saying how to get it."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"`{name}` not found in {local.parent} nor on PATH; {INSTALL_HINT}")
    return found


@functools.lru_cache(maxsize=None)
def _render_text(kustomization: str) -> str:
    kubectl, kustomize = shutil.which("kubectl"), shutil.which("kustomize")
    if kubectl:
        command = [kubectl, "kustomize", str(K8S / kustomization)]
    elif kustomize:
        command = [kustomize, "build", str(K8S / kustomization)]
    else:
        pytest.fail("neither `kubectl` (kubectl kustomize) nor `kustomize` is on PATH: install "
                    "kubectl (Debian/Ubuntu: apt-get install kubectl from the Kubernetes or "
                    "Google Cloud SDK apt repository) or a kustomize binary >= 5.0")
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr}"
    return result.stdout


def render(kustomization: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(_render_text(kustomization)) if doc]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def env_of(container: dict, docs: list[dict]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom ConfigMaps, then env."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source["configMapRef"]["name"]
        env.update(one(docs, "ConfigMap", ref)["data"])
    for var in container.get("env", []):
        assert "value" in var, f"env {var['name']}: only literal values are checked here"
        env[var["name"]] = var["value"]
    return env


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of command and args; an unknown variable fails."""
    def substitute(match: re.Match) -> str:
        name = match.group(1)
        assert name in env, f"$({name}) in the args is not defined in the container's environment"
        return env[name]
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", substitute, arg) for arg in args]


def role(container: dict) -> str:
    """'scheduler' or 'model-service' by the planserve subcommand the container runs."""
    args = container.get("args") or []
    return args[0] if args and args[0] in ("scheduler", "model-service", "serve") else "other"


def parse_planserve(argv: list[str]):
    """argv through the real CLI parser; argparse's exit becomes a test failure."""
    from tools.cli import build_parser
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exit_:
        pytest.fail(f"`planserve {' '.join(argv)}` is rejected by tools.cli (exit {exit_.code})")


def validate_command(argv: list[str]):
    """Parses a planserve command line and validates the config it would start with."""
    from scheduler_service.cli import scheduler_config
    from tools import cli
    args = parse_planserve(argv)
    # argparse also takes unambiguous prefixes (--dtyp); a manifest spells every flag in full.
    subparsers = next(a for a in cli.build_parser()._actions if a.dest == "command")
    known = {o for action in subparsers.choices[args.command]._actions for o in action.option_strings}
    for token in argv[1:]:
        if token.startswith("--"):
            assert token.split("=")[0] in known, f"`{token}` is not a flag of `planserve {args.command}`"
    if args.command == "scheduler":
        # --engine is one address, or (a repeatable flag) a list of them joined as the CLI does.
        engines = args.engine if isinstance(args.engine, str) else ",".join(args.engine or [])
        scheduler_config(args, engines)
    elif args.command in ("model-service", "serve"):
        from model_service.__main__ import parse_args as model_parse_args
        host, port = (args.host, args.port) if args.command == "model-service" else ("127.0.0.1", args.engine_port)
        try:
            model_parse_args(cli._model_service_argv(args, host, port)[3:])
        except SystemExit as exit_:
            pytest.fail(f"model service rejects {argv} (exit {exit_.code})")
        if args.command == "serve":
            scheduler_config(args, f"127.0.0.1:{args.engine_port}")
    return args


def _calls(path: Path, function: str, callee: str) -> list[ast.Call]:
    """The calls to *.callee (or callee) inside `function` of the module at path."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            return [call for call in ast.walk(node) if isinstance(call, ast.Call) and callee == (
                call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None))]
    raise AssertionError(f"{path.name} has no function {function}")


def _seconds(node: ast.expr, config_defaults) -> float:
    """A literal, `a if c else b` (the longer of the two) or `*.config.<field>` (the field's
    default in config_defaults)."""
    if isinstance(node, ast.IfExp):
        return max(_seconds(node.body, config_defaults), _seconds(node.orelse, config_defaults))
    if isinstance(node, ast.Attribute) and config_defaults is not None and hasattr(config_defaults, node.attr):
        return float(getattr(config_defaults, node.attr))
    return float(ast.literal_eval(node))


def _call_kwarg(path: Path, function: str, callee: str, keyword: str, config_defaults=None,
                position: int | None = None):
    """The seconds given as `keyword=` (or as positional argument `position`) to the call of
    *.callee inside function; None when the call leaves it to the callee's default."""
    calls = _calls(path, function, callee)
    if not calls:
        raise AssertionError(f"{path.name}:{function} no longer calls {callee}(); update the drain check")
    call = calls[0]
    for kw in call.keywords:
        if kw.arg == keyword:
            return _seconds(kw.value, config_defaults)
    if position is not None and len(call.args) > position:
        return _seconds(call.args[position], config_defaults)
    return None


def scheduler_drain_s(args=None) -> float:
    """How long the scheduler may take after SIGTERM: its drain (requests in flight run to their
    end, where the CLI calls server.drain(...)) and then the gRPC server's stop grace. `args`: the
    container's parsed command line (its --drain-grace-seconds), else the config's defaults."""
    import types
    from scheduler_service.config import SchedulerConfig
    from scheduler_service.server import SchedulerServer
    config = SchedulerConfig()
    if args is not None and getattr(args, "drain_grace_s", None) is not None:
        config = types.SimpleNamespace(drain_grace_s=args.drain_grace_s)
    cli = ROOT / "scheduler_service" / "cli.py"
    drain = (_call_kwarg(cli, "run_until_signal", "drain", "grace_s", config, position=0)
             if _calls(cli, "run_until_signal", "drain") else 0.0)
    explicit = _call_kwarg(cli, "run_until_signal", "stop", "grace_s", config)
    stop = (explicit if explicit is not None
            else inspect.signature(SchedulerServer.stop).parameters["grace_s"].default)
    return float(drain or 0.0) + float(stop)


def engine_drain_s() -> float:
    """How long the model service lets its streams finish after SIGTERM."""
    from model_service.server import shutdown
    explicit = _call_kwarg(ROOT / "model_service" / "__main__.py", "_run", "shutdown", "grace_s")
    return float(explicit if explicit is not None
                 else inspect.signature(shutdown).parameters["grace_s"].default)


def prestop_sleep_s(container: dict) -> float:
    pre = container.get("lifecycle", {}).get("preStop")
    if not pre:
        return 0.0
    if "sleep" in pre:
        return float(pre["sleep"]["seconds"])
    command = pre["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, f"preStop is not a plain sleep: {command}"
    return float(command[1])

