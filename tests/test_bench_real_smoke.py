"""scripts/bench_real.py: layer 1 (its --mesh and length checks, raised before any rank starts; milliseconds) and
layer 2 (--device cpu on a gloo world of 4 with a 2 x 2 mesh in a subprocess: every 1-D and hybrid strategy's
row, each checked against the float64 reference; tens of seconds)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import import_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_real.py"


def _module():
    return import_script("bench_real")


def test_mesh_parsing():
    m = _module()
    assert m.parse_mesh(None, 4, 32) is None
    assert m.parse_mesh("2x2", 4, 32) == (2, 2)
    assert m.parse_mesh("1X4", 4, 32) == (1, 4)
    with pytest.raises(ValueError, match="is 6 ranks, but --world is 4"):
        m.parse_mesh("3x2", 4, 32)
    with pytest.raises(ValueError, match="does not divide them"):
        m.parse_mesh("1x4", 4, 6)
    for bad in ("2", "2x", "ax2", "2x2x1", "0x4"):
        with pytest.raises(ValueError, match="must be RxU"):
            m.parse_mesh(bad, 4, 32)


def test_length_checks():
    m = _module()
    m.check_lengths([(1024, "one", True), (1028, "one", False), (1028, "pareto", True)], 4, "auto")
    with pytest.raises(ValueError, match="must divide by 8"):
        m.check_lengths([(1028, "one", True)], 4, "auto")
    with pytest.raises(ValueError, match="must divide by 8"):
        m.check_lengths([(1028, "pareto", True)], 4, "zigzag")


def test_bad_mesh_exits_before_spawning():
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--world", "4", "--mesh", "4x2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--world is 4" in done.stderr, done.stderr[-2000:]


def test_cpu_world4_mesh_smoke(tmp_path):
    """W = 4, mesh 2 x 2: a dense causal row and a packed one, each with the four 1-D strategies and the three
    hybrid ones (labelled with the mesh), bytes counted, the hybrids' predictions from the mesh, and every
    output and gradient within the tolerance of the float64 reference."""
    out = tmp_path / "real_w4.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--world", "4", "--mesh", "2x2", "--seqs", "256",
         "--packed-seq", "2k", "--docs", "one,pareto", "--heads", "8/2", "--head-dim", "16", "--iters", "1",
         "--warmup", "0", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["world"] == 4 and report["mesh"] == "2x2" and "partial" not in report
    m = _module()
    assert [(r["seq"], r["documents"]) for r in report["rows"]] == [(256, "one"), (2048, "pareto")]
    for row in report["rows"]:
        assert "error" not in row, row.get("error")
        assert set(row["strategies"]) == {"ring", "allgather", "ulysses", "auto", "hybrid", "hybrid_allgather",
                                          "auto_mesh"}
        # auto over a mesh weighs the hybrids and the 1-D strategies over all its ranks
        assert row["mesh"]["shape"] == "2x2" and row["pick_mesh"] in ("hybrid", "hybrid_allgather", "ring",
                                                                       "ulysses", "allgather")
        for name, s in row["strategies"].items():
            assert "error" not in s, (name, s.get("error"))
            assert s["max_s"] > 0 and s["bytes_sent"] > 0
            assert s["check_error"] <= m.CHECK_TOL, (name, s["check_error"])
            assert s["predicted_s"] is not None
            assert (s.get("mesh") == "2x2") == (name in ("hybrid", "hybrid_allgather", "auto_mesh"))
