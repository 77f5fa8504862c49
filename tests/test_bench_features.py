"""scripts/bench_ring_features.py: layer 1 (its FLOP and document helpers, milliseconds) and layer 2 (its
``--smoke`` mode, a gloo world of 2 on CPU in a subprocess, tens of seconds)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.scripts import import_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_ring_features.py"


def _bench_module():
    return import_script("bench_ring_features")


def test_packed_documents_and_useful_pairs():
    """Documents tile the sequence within the length bounds (only the last is cut), and the useful-FLOP
    conventions reduce to plain causal at their limits."""
    b = _bench_module()
    cu = b.packed_documents(32768, 512, 8192, seed=0)
    lens = [y - x for x, y in zip(cu[:-1], cu[1:])]
    assert cu[0] == 0 and cu[-1] == 32768 and all(512 <= n <= 8192 for n in lens[:-1]) and 1 <= lens[-1] <= 8192
    assert cu == b.packed_documents(32768, 512, 8192, seed=0)
    causal = {"S": 1024, "window": (-1, -1)}
    assert b.visible_pairs(causal) == 1024 * 1024 / 2
    assert b.visible_pairs({**causal, "window": (4096, 0)}) == 1024 * 1024 / 2
    assert b.visible_pairs({**causal, "window": (256, 0)}) == 1024 * 256 - 256 * 256 / 2
    assert b.visible_pairs({**causal, "docs": [0, 1024]}) == 1024 * 1024 / 2
    assert b.visible_pairs({**causal, "docs": [0, 512, 1024]}) == 2 * 512 * 512 / 2


def test_smoke_run(tmp_path):
    """The --smoke run (every part on a gloo world of 2) finishes and writes the JSON and the Markdown with
    the command, the ring steps and the context_parallel caveat."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "ring_features_smoke.json").read_text())
    assert report["complete"]
    rows = [r for r in report["rows"] if r["case"] != "context_parallel"]
    assert rows and all(r.get("fwdbwd_ms") for r in rows), [r.get("error") for r in rows]
    assert {r["part"] for r in rows} == {"docs", "window", "extras"}
    assert all(r["kernels"]["backend"] == "torch" for r in rows)
    assert all(r["ring_steps"] == (1 if r["single"] else 2) for r in rows)
    assert all(r.get("per_flop_vs_plain") for r in rows if r["case"] == "docs" and not r["single"])
    assert all(r.get("rel_time") for r in rows if r["part"] == "window")
    md = (tmp_path / "ring_features_smoke.md").read_text()
    assert "scripts/bench_ring_features.py --smoke" in md
    assert "it cannot mask documents" in md
