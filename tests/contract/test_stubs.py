"""The contract: committed stubs equal a fresh generation, and buf lint (STANDARD) passes."""
import filecmp
import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_regenerating_the_stubs_gives_no_diff(tmp_path):
    shutil.copytree(ROOT / "protos", tmp_path / "protos")
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    for stub in (tmp_path / "protos/planserve/v1").glob("*_pb2*"):
        stub.unlink()
    subprocess.run(["bash", str(tmp_path / "scripts/gen_protos.sh")], check=True,
                   env=dict(os.environ, PYTHON=sys.executable))
    committed = sorted(p.name for p in (ROOT / "protos/planserve/v1").glob("*_pb2*"))
    fresh = sorted(p.name for p in (tmp_path / "protos/planserve/v1").glob("*_pb2*"))
    assert fresh == committed and len(committed) == 9
    _, mismatch, errors = filecmp.cmpfiles(
        ROOT / "protos/planserve/v1", tmp_path / "protos/planserve/v1", committed, shallow=False)
    assert not mismatch and not errors, f"stale stubs: {mismatch or errors}; run `make protos`"


def test_buf_lint_passes():
    buf = shutil.which("buf") or str(pathlib.Path(sys.executable).parent / "buf")
    result = subprocess.run([buf, "lint"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
