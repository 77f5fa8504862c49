"""scripts/bench_ring_attention.py: layer 1 (method names, efficiency against the fastest single-GPU kernel,
"vs CP" per context_parallel backend, the targets; milliseconds) and layer 2 (a reduced ``--smoke`` run, a
gloo world of 2 on CPU in a subprocess, tens of seconds)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import import_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_ring_attention.py"


def _bench_module():
    return import_script("bench_ring_attention")


def test_methods_and_aliases():
    """The old names keep working: "sdpa" is every single-GPU kernel, "cp" is context_parallel under FA2 and
    cuDNN; cp_efficient only when named; unknown names exit."""
    b = _bench_module()
    assert b.expand_methods(["sdpa", "cp", "ring"]) == ["sdpa_flash", "sdpa_cudnn", "fa4", "cp_flash", "cp_cudnn",
                                                        "ring"]
    assert b.expand_methods(["ring", "cp_efficient", "fa4"]) == ["fa4", "cp_efficient", "ring"]
    assert "cp_efficient" not in b.DEFAULT_METHODS and "fa4" in b.DEFAULT_METHODS
    with pytest.raises(SystemExit):
        b.expand_methods(["context_parallel"])


def test_efficiency_against_the_fastest_single_kernel_and_each_cp(monkeypatch):
    """eff uses the fastest single-GPU kernel per metric (here cuDNN for fwd+bwd, FA4 for fwd), eff_vs has
    each; "vs CP" is per context_parallel backend, and the flat keys are against the strongest one."""
    b = _bench_module()
    base = {"sdpa_flash": {"fwd_ms": 4.0, "fwdbwd_ms": 12.0}, "sdpa_cudnn": {"fwd_ms": 2.5, "fwdbwd_ms": 8.0},
            "fa4": {"fwd_ms": 2.0, "fwdbwd_ms": None, "skipped": "x"},
            "cp_flash": {"fwd_ms": 3.0, "fwdbwd_ms": 10.0, "peak_gib": 4.0},
            "cp_cudnn": {"fwd_ms": 2.0, "fwdbwd_ms": 5.0, "peak_gib": 3.0}}
    row = {"method": "ring-zigzag", "fwd_ms": 1.25, "fwdbwd_ms": 5.0, "peak_gib": 2.0}
    b._fill_eff(row, base, 2)
    assert row["best_fwdbwd"] == "sdpa_cudnn" and row["fwdbwd_eff"] == pytest.approx(8.0 / 10.0)
    assert row["best_fwd"] == "fa4" and row["fwd_eff"] == pytest.approx(2.0 / 2.5)
    assert row["eff_vs"]["sdpa_flash"]["fwdbwd"] == pytest.approx(12.0 / 10.0)
    # _fill_row on a distributed row without GPU facts: patch the cross-rank reductions to identities
    monkeypatch.setattr(b.U, "all_max", lambda values, device: list(values))
    import torch

    c = {"S": 1024, "H": 4, "Hkv": 4, "D": 32, "causal": True, "batch": 1}
    row = {"method": "ring-zigzag"}
    b._fill_row(row, {"fwd_s": 1.25e-3, "fwdbwd_s": 5e-3, "peak": 0}, c, 2, torch.device("cpu"), single=False,
                base=base)
    assert row["vs_cp"]["cp_flash"]["fwdbwd"] == pytest.approx(2.0)
    assert row["vs_cp"]["cp_cudnn"]["fwdbwd"] == pytest.approx(1.0)
    assert row["cp_strongest"] == "cp_cudnn" and row["fwdbwd_speedup_vs_cp"] == pytest.approx(1.0)
    report = {"env": {"world_size": 2}, "rows": [{**row, "S": 32768, "heads": 4, "kv_heads": 4, "causal": True}],
              "kernel_rows": []}
    checks = {c["check"]: c["ok"] for c in b.summarize(report)["checks"]}
    assert checks["S=32k 4/4 causal ring-zigzag: faster than cp_flash (fwd+bwd)"]
    assert not checks["S=32k 4/4 causal ring-zigzag: faster than cp_cudnn (fwd+bwd)"]
    assert not checks["S=32k 4/4 causal ring-zigzag: fwd+bwd efficiency vs sdpa_cudnn >= 0.9"]


def test_smoke_run(tmp_path):
    """A reduced --smoke run finishes: the GPU-only baselines are skipped with a reason, the ring rows carry
    efficiency against the fastest kernel that ran (SDPA flash on CPU) and which_kernels."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--seqs", "256", "--heads", "4/2",
                           "--causal", "yes", "--methods", "sdpa,cp,ring", "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "ring_attention_smoke.json").read_text())
    assert report["complete"]
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"sdpa_flash", "sdpa_cudnn", "fa4", "cp_flash", "cp_cudnn", "ring-contiguous",
                         "ring-zigzag", "ring-striped"}
    assert rows["sdpa_cudnn"]["skipped"] and rows["fa4"]["skipped"] and rows["cp_cudnn"]["skipped"]
    for lay in ("contiguous", "zigzag", "striped"):
        r = rows[f"ring-{lay}"]
        assert r["best_fwdbwd"] == "sdpa_flash" and r["fwdbwd_eff"] > 0, r
        assert r["kernels"]["backend"] == "torch"
    md = (tmp_path / "ring_attention_smoke.md").read_text()
    assert "scripts/bench_ring_attention.py --smoke" in md and "eff vs" in md
