"""The shape rules of both services, the tools beside them and config_fields (issue 17), checked
on the tree as it is: no import loop (imports for type annotations counted too), no module above
400 lines, no function above 60; the model service's rooms import only downward; the scheduler
service imports neither torch nor the model service, the model service not the scheduler
service, and config_fields neither service (both declare their configs with it)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The packages the rules hold for, as paths from the root.
CHECKED = (
    "scheduler_service",
    "model_service",
    "config_fields",
    "tools",
    "bench/load",
    "bench/peers",
)
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under CHECKED."""
    found = {}
    for top in CHECKED:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if any(part.startswith(".") for part in parts):  # ignored scratch: bench/peers/.work
                continue
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """Imports under `if TYPE_CHECKING:`: annotations only, never run."""
    return {
        node
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
        for node in ast.walk(block)
    }


def _imports(path: Path, name: str, modules: dict[str, Path], type_only: bool = True) -> set[str]:
    """The checked modules `name` imports, anywhere in it (in a function too: a loop broken by
    a late import is still a loop; so is one closed by an import for type annotations only).
    type_only=False leaves the `if TYPE_CHECKING:` imports out."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    tree = ast.parse(path.read_text())
    skipped = set() if type_only else _type_checking_only(tree)
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                ).strip(".")
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.add(full if full in modules else base)
    return {t for t in targets if t in modules and t != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_loop():
    modules = _modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def _room(module: str) -> str:
    """A model_service module's room: its subpackage ("step/"), or the module itself at the top
    (config, runner, server, ...: each top module is a room of its own)."""
    parts = module.split(".")
    if len(parts) > 2:
        return parts[1] + "/"
    return parts[1] if len(parts) == 2 else parts[0]


def test_the_model_service_rooms_import_only_downward():
    """No room imports a room that imports it, directly or around a circle of rooms: the rooms
    stack (kernels/ under attention/ under models/ under loading/ under step/ ...)."""
    modules = _modules()
    rooms: dict[str, set[str]] = {}
    for name, path in modules.items():
        if not name.startswith("model_service."):
            continue
        rooms.setdefault(_room(name), set())
        for target in _imports(path, name, modules):
            if target.startswith("model_service.") and _room(target) != _room(name):
                rooms[_room(name)].add(_room(target))
                rooms.setdefault(_room(target), set())
    assert {"step/", "speculative/", "loading/", "models/", "attention/", "kernels/"} <= set(rooms)
    assert _cycles(rooms) == []


def test_every_package_is_installed():
    """pyproject's package list names every package of the services, the tools and the benches
    (a package missing there imports in a checkout but not from an installed wheel)."""
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    packages = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in (*CHECKED, "bench", "cython_ext")
        for init in (ROOT / top).rglob("__init__.py")
        if not any(part.startswith(".") for part in init.relative_to(ROOT).parts)
    }
    assert packages - listed == set()


def test_no_module_above_400_lines():
    long = {
        name: n
        for name, path in _modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_no_function_above_60_lines():
    long = {}
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long[f"{name}:{node.lineno} {node.name}"] = length
    assert long == {}


def _imported_tops(prefix: str) -> dict[str, set[str]]:
    """For each checked module under `prefix`: the top-level packages it imports (anywhere)."""
    found = {}
    for name, path in _modules().items():
        if not name.startswith(prefix):
            continue
        tops = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                tops.add((node.module or "").split(".")[0])
        found[name] = tops
    return found


def test_the_scheduler_service_imports_neither_torch_nor_the_model_service():
    for name, tops in _imported_tops("scheduler_service").items():
        banned = tops & {"torch", "model_service", "tools", "bench"}
        assert not banned, f"{name} imports {sorted(banned)}"
    # And at run time, the whole service with its doors (nothing imports them lazily behind it).
    loaded = _top_packages_loaded_by("import scheduler_service.server, scheduler_service.cli")
    assert loaded.isdisjoint({"torch", "model_service"}), sorted(loaded)


def test_the_model_service_imports_neither_the_scheduler_service_nor_the_tools():
    for name, tops in _imported_tops("model_service").items():
        banned = tops & {"scheduler_service", "tools", "bench"}
        assert not banned, f"{name} imports {sorted(banned)}"


def test_config_fields_imports_neither_service():
    """Both services declare their configs with it; it stays light (no torch)."""
    for name, tops in _imported_tops("config_fields").items():
        banned = tops & {"torch", "model_service", "scheduler_service", "tools", "bench"}
        assert not banned, f"{name} imports {sorted(banned)}"


def test_the_planserve_command_imports_no_torch():
    """`planserve` starts the model service as a child; it reads only its config module."""
    assert "torch" not in _top_packages_loaded_by("import tools.cli")


def _top_packages_loaded_by(statement: str) -> set[str]:
    """The top-level packages in sys.modules after a fresh interpreter runs `statement`."""
    code = f"import sys; {statement}; print(sorted({{m.split('.')[0] for m in sys.modules}}))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "protos"), str(ROOT)]))
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return set(ast.literal_eval(out.strip()))
