"""The README's client examples are the files in examples/, and they run against the live tiny
servers: Python and Node stream the same greedy text. Go is not installed here, so the Go
example is checked against the .proto names protoc-gen-go would give, not run."""
from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from planserve.v1 import generate_pb2

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SECTION = "## Clients in other languages"


def readme_blocks() -> dict[str, str]:
    """{language: code} of the fenced blocks in the README's client section."""
    text = (ROOT / "README.md").read_text()
    assert SECTION in text, f"README.md lost its {SECTION!r} section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return {lang: code for lang, code in re.findall(r"```(\w+)\n(.*?)```", section, re.S)}


@pytest.mark.parametrize("language,path", [("python", "python/generate.py"), ("js", "node/generate.js")])
def test_the_readme_shows_the_example_files(language, path):
    blocks = readme_blocks()
    assert language in blocks, f"no ```{language} block in the README's client section"
    assert blocks[language] == (EXAMPLES / path).read_text(), (
        f"the README's {language} example differs from examples/{path}; copy the file into it")


async def _run(*argv: str, env: dict) -> str:
    process = await asyncio.create_subprocess_exec(
        *argv, cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await process.communicate()
    assert process.returncode == 0, f"{argv} exited {process.returncode}:\n{out.decode()}{err.decode()}"
    return out.decode()


def _parse(output: str) -> tuple[str, str, int]:
    """(streamed text, finish reason, completion tokens) from an example's output."""
    match = re.search(r"\n\[(FINISH_REASON_\w+), (\d+) tokens, request \w+\]\n$", output)
    assert match, f"unexpected output: {output!r}"
    return output[:match.start()], match.group(1), int(match.group(2))


async def test_python_and_node_examples_stream_the_same_completion(tiny_server):
    node = shutil.which("node")
    if node is None:
        pytest.fail("`node` is not on PATH: install Node.js >= 18")
    assert (ROOT / "tests/node/node_modules/@grpc/grpc-js").exists(), "run `make install-test` (npm ci)"
    address = f"127.0.0.1:{tiny_server.port}"
    python_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "protos"), str(ROOT)]))
    python_out = await _run(sys.executable, "examples/python/generate.py", address, env=python_env)
    # The example is CommonJS, so NODE_PATH finds the test's locked packages.
    node_env = dict(os.environ, NODE_PATH=str(ROOT / "tests/node/node_modules"))
    node_out = await _run(node, "examples/node/generate.js", address, env=node_env)
    text, reason, tokens = _parse(python_out)
    assert reason in ("FINISH_REASON_LENGTH", "FINISH_REASON_EOS", "FINISH_REASON_STOP")
    assert 1 <= tokens <= 32 and text
    assert _parse(node_out) == (text, reason, tokens), "greedy: both clients get the same completion"


# -- Go: names only ---------------------------------------------------------------------------

def _go_name(snake: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in snake.split("_"))


def _go_names() -> tuple[dict[str, set[str]], set[str]]:
    """({Go type: its field names}, other exported names) of generate.proto as protoc-gen-go and
    protoc-gen-go-grpc name them."""
    file = generate_pb2.DESCRIPTOR
    types: dict[str, set[str]] = {}
    names: set[str] = set()
    for pb_file in (file, *file.dependencies):
        for message in pb_file.message_types_by_name.values():
            fields = {_go_name(f.name) for f in message.fields if f.containing_oneof is None
                      or f.containing_oneof.name.startswith("_")}  # proto3 optional: a plain field
            fields |= {_go_name(o.name) for o in message.oneofs if not o.name.startswith("_")}
            types[message.name] = fields
            for field in message.fields:
                oneof = field.containing_oneof
                if oneof is not None and not oneof.name.startswith("_"):
                    types[f"{message.name}_{_go_name(field.name)}"] = {_go_name(field.name)}
        for enum in pb_file.enum_types_by_name.values():
            names.add(enum.name)
            names |= {f"{enum.name}_{value.name}" for value in enum.values}
    for service in file.services_by_name.values():
        names |= {f"New{service.name}Client", f"{service.name}Client"}
        names |= {f"{service.name}_{method.name}Client" for method in service.methods}
    return types, names


def test_the_go_example_uses_names_the_go_stubs_have():
    source = re.sub(r'"(?:\\.|[^"\\])*"', '""', (EXAMPLES / "go/main.go").read_text())
    types, names = _go_names()
    used = set(re.findall(r"\bpb\.(\w+)", source))
    assert used, "main.go uses no pb. names"
    unknown = sorted(used - set(types) - names)
    assert not unknown, f"main.go uses pb.{unknown}, which generate.proto's Go stubs would not have"
    # Keys of every &pb.Type{...} literal are fields of that type.
    stack: list[str | None] = []
    for token in re.finditer(r"&pb\.(\w+)\{|[{}]|\b(\w+):(?!=)", source):
        if token.group(1):
            stack.append(token.group(1))
        elif token.group(0) == "{":
            stack.append(None)
        elif token.group(0) == "}":
            stack.pop()
        elif stack and stack[-1] is not None:
            assert token.group(2) in types[stack[-1]], (
                f"pb.{stack[-1]} has no field {token.group(2)} (fields: {sorted(types[stack[-1]])})")
    all_fields = set().union(*types.values())
    getters = set(re.findall(r"\.Get(\w+)\(\)", source))
    assert getters <= all_fields, f"getters of no field: {sorted(getters - all_fields)}"


def test_the_go_readme_protoc_command_covers_every_file_the_api_needs():
    readme = (EXAMPLES / "go/README.md").read_text()
    command = readme.split("protoc -I ../../protos", 1)[1].split("\n\n", 1)[0]
    needed = {generate_pb2.DESCRIPTOR.name, *(d.name for d in generate_pb2.DESCRIPTOR.dependencies)}
    for proto in needed:
        assert command.rstrip().endswith(proto) or f" {proto}" in command, f"{proto} is not compiled"
        for plugin in ("go", "go-grpc"):
            assert f"--{plugin}_opt=M{proto}=$PKG" in command, f"no --{plugin}_opt=M{proto}"
    assert "--go_out=" in command and "--go-grpc_out=" in command
    assert "Go is not installed" in readme
