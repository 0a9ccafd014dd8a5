"""The contract's compatibility record: a buf image (for `buf breaking`) and a JSON snapshot of
every message's field numbers and every enum's values (for the wire-number check).

Both are committed next to this file and refreshed only on purpose:

    make contract-baseline        # = .venv/bin/python tests/contract/_snapshot.py

Refresh after ADDING fields, messages or enum values (the tests pass without it, and warn that
the new numbers are not yet protected). A refresh after a breaking change hides the break: bump
the contract version instead.

Field numbers, not names, are what the wire carries, so the snapshot check is about numbers:
a number once used stays with its field (same name, same type, same cardinality) or becomes
`reserved`; an enum value keeps its number or becomes reserved; reserved numbers stay reserved.
Adding anything passes.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BASELINE_IMAGE = HERE / "baseline.binpb"
SNAPSHOT_JSON = HERE / "descriptor_snapshot.json"
REFRESH_COMMAND = "make contract-baseline"

_LABELS = {descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED: "repeated"}
_TYPES = {value: name[len("TYPE_"):].lower()
          for name, value in descriptor_pb2.FieldDescriptorProto.Type.items()}


def buf() -> str:
    local = Path(sys.executable).parent / "buf"
    found = str(local) if local.exists() else shutil.which("buf")
    if found is None:
        raise FileNotFoundError("`buf` not found: install the test extra (make install-test; buf-bin on PyPI)")
    return found


def build_image(protos_root: Path, out: Path) -> None:
    """`buf build` of the module at protos_root (a dir holding buf.yaml) into a binary image.

    Source info is left out: comments change often and do not matter to compatibility."""
    subprocess.run([buf(), "build", "--exclude-source-info", "-o", str(out)],
                   cwd=protos_root, check=True, capture_output=True, text=True)


def load_image(path: Path) -> descriptor_pb2.FileDescriptorSet:
    # A buf image is wire-compatible with a FileDescriptorSet (its extra fields are skipped).
    files = descriptor_pb2.FileDescriptorSet()
    files.ParseFromString(path.read_bytes())
    return files


def _field_type(field: descriptor_pb2.FieldDescriptorProto) -> str:
    return field.type_name.lstrip(".") if field.type_name else _TYPES[field.type]


def _ranges(ranges) -> list[list[int]]:
    # DescriptorProto.ReservedRange ends are exclusive, EnumReservedRange ends inclusive; the
    # snapshot stores both as inclusive [first, last].
    return [[r.start, r.end - 1] for r in ranges]


def _message(msg, prefix: str, out: dict) -> None:
    name = f"{prefix}.{msg.name}"
    oneofs = [o.name for o in msg.oneof_decl]
    out["messages"][name] = {
        "fields": {
            f.name: {
                "number": f.number,
                "type": _field_type(f),
                "label": _LABELS.get(f.label, "optional" if f.proto3_optional else "singular"),
                # Moving a field into or out of a oneof changes what a decoder keeps.
                **({"oneof": oneofs[f.oneof_index]} if f.HasField("oneof_index") and not f.proto3_optional else {}),
            } for f in msg.field},
        "reserved_numbers": sorted([first, last] for first, last in _ranges(msg.reserved_range)),
        "reserved_names": sorted(msg.reserved_name),
    }
    for nested in msg.nested_type:
        if not nested.options.map_entry:
            _message(nested, name, out)
    for enum in msg.enum_type:
        _enum(enum, name, out)


def _enum(enum, prefix: str, out: dict) -> None:
    out["enums"][f"{prefix}.{enum.name}"] = {
        "values": {v.name: v.number for v in enum.value},
        "reserved_numbers": sorted([r.start, r.end] for r in enum.reserved_range),
        "reserved_names": sorted(enum.reserved_name),
    }


def snapshot(files: descriptor_pb2.FileDescriptorSet) -> dict:
    """{messages: {full name: {fields, reserved_*}}, enums: {full name: {values, reserved_*}}}."""
    out: dict = {"messages": {}, "enums": {}}
    for file in files.file:
        if not file.package.startswith("planserve."):
            continue  # imports such as google/protobuf/*.proto are not ours to keep
        for msg in file.message_type:
            _message(msg, file.package, out)
        for enum in file.enum_type:
            _enum(enum, file.package, out)
    out["messages"] = dict(sorted(out["messages"].items()))
    out["enums"] = dict(sorted(out["enums"].items()))
    return out


def current_snapshot(protos_root: Path = ROOT) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        image = Path(tmp) / "image.binpb"
        build_image(protos_root, image)
        return snapshot(load_image(image))


def _reserved(number: int, ranges: list[list[int]]) -> bool:
    return any(first <= number <= last for first, last in ranges)


def compare(recorded: dict, current: dict) -> tuple[list[str], list[str]]:
    """(violations, additions not yet recorded). Violations are wire incompatibilities."""
    problems: list[str] = []
    added: list[str] = []
    for name, old in recorded["messages"].items():
        new = current["messages"].get(name)
        if new is None:
            problems.append(f"message {name} was removed (its numbers would be free for reuse)")
            continue
        by_number = {f["number"]: (field, f) for field, f in new["fields"].items()}
        for field, was in old["fields"].items():
            number = was["number"]
            now_name, now = by_number.get(number, (None, None))
            if now is None:
                if not _reserved(number, new["reserved_numbers"]):
                    moved = new["fields"].get(field)
                    how = f"renumbered to {moved['number']}" if moved else "removed"
                    problems.append(f"{name}.{field} = {number} was {how} without `reserved {number};`")
                continue
            if now_name != field:
                problems.append(f"{name}: number {number} was {field}, is now reused by {now_name}")
            for key in ("type", "label", "oneof"):
                if was.get(key) != now.get(key):
                    problems.append(f"{name}.{field} = {number}: {key} changed from "
                                    f"{was.get(key)!r} to {now.get(key)!r}")
        for first, last in old["reserved_numbers"]:
            for field, f in new["fields"].items():
                if first <= f["number"] <= last:
                    problems.append(f"{name}.{field} = {f['number']} reuses a reserved number")
            if not any(a <= first and last <= b for a, b in new["reserved_numbers"]):
                problems.append(f"{name}: reserved {first} to {last} is no longer reserved")
        recorded_numbers = {f["number"] for f in old["fields"].values()}
        added += [f"{name}.{field} = {f['number']}" for field, f in new["fields"].items()
                  if f["number"] not in recorded_numbers]
    for name, old in recorded["enums"].items():
        new = current["enums"].get(name)
        if new is None:
            problems.append(f"enum {name} was removed")
            continue
        by_number = {number: value for value, number in new["values"].items()}
        for value, number in old["values"].items():
            now = by_number.get(number)
            if now is None:
                if not _reserved(number, new["reserved_numbers"]):
                    moved = new["values"].get(value)
                    how = f"renumbered to {moved}" if moved is not None else "removed"
                    problems.append(f"{name}.{value} = {number} was {how} without `reserved {number};`")
            elif now != value:
                problems.append(f"{name}: value {number} was {value}, is now reused by {now}")
        for first, last in old["reserved_numbers"]:
            for value, number in new["values"].items():
                if first <= number <= last:
                    problems.append(f"{name}.{value} = {number} reuses a reserved number")
        added += [f"{name}.{value} = {number}" for value, number in new["values"].items()
                  if number not in set(old["values"].values())]
    added += [f"message {n}" for n in current["messages"] if n not in recorded["messages"]]
    added += [f"enum {n}" for n in current["enums"] if n not in recorded["enums"]]
    return problems, added


def write_baseline() -> None:
    """Rewrites baseline.binpb and descriptor_snapshot.json from the protos as they are now."""
    build_image(ROOT, BASELINE_IMAGE)
    SNAPSHOT_JSON.write_text(json.dumps(snapshot(load_image(BASELINE_IMAGE)), indent=1) + "\n")


if __name__ == "__main__":
    write_baseline()
    print(f"wrote {BASELINE_IMAGE.relative_to(ROOT)} and {SNAPSHOT_JSON.relative_to(ROOT)}")
