"""The committed gRPC stubs must be what protos/generate_stubs.sh makes from the .proto files."""

import filecmp
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_committed_stubs_are_fresh(tmp_path):
    pytest.importorskip("grpc_tools")
    subprocess.run(
        ["bash", str(ROOT / "protos" / "generate_stubs.sh"), str(tmp_path)],
        check=True,
        env={"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"},
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "the script generated nothing"
    stale = [str(p) for p in generated if not filecmp.cmp(tmp_path / p, ROOT / p, shallow=False)]
    assert not stale, f"stale stubs, run protos/generate_stubs.sh: {stale}"
