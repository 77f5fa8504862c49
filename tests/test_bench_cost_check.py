"""scripts/check_cost_model.py on the recorded emulated-link runs (CPU, seconds): the rows it rebuilds are the
recorded ones, its predictions are the cost model's for those calls, and its summary counts what it lists."""

import json
import subprocess
import sys
from pathlib import Path

from distcomm_attention.planning import cost

from tests.scripts import import_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_cost_model.py"
RUNS = [ROOT / "docs" / "bench" / name for name in ("emulated_run2.json", "emulated_run5.json", "emulated_run5_dense.json")]


def _module():
    return import_script("check_cost_model")


def test_rows_are_the_recorded_ones_and_predictions_the_models():
    m = _module()
    rows = m.check([str(p) for p in RUNS], exclude=("emulated_run2.json:lognormal",))
    recorded = [(r["documents"], r["seq"]) for p in RUNS for r in json.loads(p.read_text())["rows"]
                if not (p.name == "emulated_run2.json" and r["documents"] == "lognormal")]
    assert sorted({(r["documents"], r["seq"]) for r in rows}) == sorted(set(recorded))
    for r in rows:
        source = next(x for p in RUNS if p.name == r["file"] for x in json.loads(p.read_text())["rows"]
                      if x["documents"] == r["documents"] and x["seq"] == r["seq"])
        call = m.call_of(source)
        hw = m.hardware(m.LINKS[r["link"]])
        for s, seconds in r["measured"].items():
            assert seconds == source["links"][r["link"]][s]["max_s"]
            assert r["predicted"][s] == cost.predict(call, s, hw).seconds
        assert r["pick"] == cost.choose(call, tuple(r["measured"]), hw).strategy
        assert r["pick_vs_fastest"] >= 1.0


def test_cli_summary():
    out = subprocess.run([sys.executable, str(SCRIPT), *map(str, RUNS), "--exclude", "emulated_run2.json:lognormal"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 9 and lines[-1].startswith("predictions within 15%: ") and "of 24" in lines[-1]
