"""The contract stays wire-compatible: `buf breaking` against the committed image, and every
recorded field number and enum value keeps its meaning (descriptor_snapshot.json). Adding fields
passes both; see _snapshot.py for how to refresh the record (`make contract-baseline`)."""
from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import warnings

import pytest

from _snapshot import (BASELINE_IMAGE, REFRESH_COMMAND, ROOT, SNAPSHOT_JSON, buf, compare,
                       current_snapshot)


def _breaking(protos_root) -> subprocess.CompletedProcess:
    return subprocess.run([buf(), "breaking", "--against", str(BASELINE_IMAGE)],
                          cwd=protos_root, capture_output=True, text=True)


def _copy_module(tmp_path):
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(ROOT / "protos/planserve", tmp_path / "protos/planserve",
                    ignore=shutil.ignore_patterns("*.py", "*.pyi", "__pycache__"))
    return tmp_path


def _edit(path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} is not in {path.name}; update this test's edit"
    path.write_text(text.replace(old, new, 1))


def test_buf_breaking_against_the_committed_baseline():
    result = _breaking(ROOT)
    assert result.returncode == 0, (
        f"breaking change against {BASELINE_IMAGE.name}:\n{result.stdout}{result.stderr}")


def test_field_numbers_and_enum_values_keep_their_meaning():
    recorded = json.loads(SNAPSHOT_JSON.read_text())
    problems, added = compare(recorded, current_snapshot())
    assert not problems, "wire-incompatible changes:\n  " + "\n  ".join(problems)
    if added:  # fine, but unprotected until recorded
        warnings.warn(f"not yet in {SNAPSHOT_JSON.name} (run `{REFRESH_COMMAND}`): {', '.join(added)}")


# The checks themselves: each edit below is made on a copy of the protos.

ENGINE = "protos/planserve/v1/engine.proto"
GENERATE = "protos/planserve/v1/generate.proto"
# Numbers far above any the contract uses, so the edits stay valid as fields are added.
ADD_FIELD = (ENGINE, "  bytes extension = 15;\n",
             "  bytes extension = 15;\n  // A new field.\n  uint32 priority_hint = 9001;\n")
BREAKS = {
    "renumbered field": (ENGINE, "repeated uint32 copy_dst = 11;", "repeated uint32 copy_dst = 9002;"),
    "reused number": (ENGINE, "repeated uint32 copy_dst = 11;", "repeated uint32 copy_dest = 11;"),
    "removed field": (ENGINE, "  repeated uint32 copy_dst = 11;\n", ""),
    "changed type": (ENGINE, "repeated uint32 copy_dst = 11;", "repeated uint64 copy_dst = 11;"),
    "renumbered enum value": (GENERATE, "FINISH_REASON_DEADLINE = 5;", "FINISH_REASON_DEADLINE = 9003;"),
}


def test_adding_a_field_passes_both_checks(tmp_path):
    module = _copy_module(tmp_path)
    path, old, new = ADD_FIELD
    _edit(module / path, old, new)
    assert _breaking(module).returncode == 0
    problems, added = compare(json.loads(SNAPSHOT_JSON.read_text()), current_snapshot(module))
    assert problems == [] and "planserve.v1.BatchPlan.priority_hint = 9001" in added


@pytest.mark.parametrize("change", sorted(BREAKS))
def test_breaking_edits_fail_both_checks(tmp_path, change):
    module = _copy_module(tmp_path)
    _edit(module / BREAKS[change][0], *BREAKS[change][1:])
    result = _breaking(module)
    assert result.returncode != 0, f"buf breaking missed a {change}"
    problems, _ = compare(json.loads(SNAPSHOT_JSON.read_text()), current_snapshot(module))
    assert problems, f"the snapshot check missed a {change}"


def test_a_removed_field_may_leave_a_reservation_and_a_reserved_number_is_not_reused(tmp_path):
    module = _copy_module(tmp_path)
    recorded = json.loads(SNAPSHOT_JSON.read_text())
    _edit(module / ENGINE, "  repeated uint32 copy_dst = 11;\n", "  reserved 11;\n  reserved \"copy_dst\";\n")
    reserved = current_snapshot(module)
    assert compare(recorded, reserved)[0] == []
    # Recorded with the reservation, a later field on 11 is a reuse.
    _edit(module / ENGINE, "  reserved 11;\n  reserved \"copy_dst\";\n", "  reserved \"copy_dst\";\n  uint32 other = 11;\n")
    problems, _ = compare(reserved, current_snapshot(module))
    assert any(re.search(r"reuses a reserved number|no longer reserved", p) for p in problems), problems


def test_an_enum_value_reused_under_another_name_fails():
    recorded = json.loads(SNAPSHOT_JSON.read_text())
    current = copy.deepcopy(recorded)
    values = current["enums"]["planserve.v1.FinishReason"]["values"]
    values["FINISH_REASON_TIMEOUT"] = values.pop("FINISH_REASON_DEADLINE")
    problems, _ = compare(recorded, current)
    assert problems == ["planserve.v1.FinishReason: value 5 was FINISH_REASON_DEADLINE, "
                        "is now reused by FINISH_REASON_TIMEOUT"]
