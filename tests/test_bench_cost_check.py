"""scripts/check_cost_model.py on the recorded emulated-link runs (CPU, seconds): the rows it rebuilds are the
recorded ones, its predictions are the cost model's for those calls, and its summary counts what it lists."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from distcomm_attention.planning import cost
from distcomm_attention.planning.visibility import Visibility

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
        hw = m._hardware(m.LINKS[r["link"]])
        for s, seconds in r["measured"].items():
            assert seconds == source["links"][r["link"]][s]["max_s"]
            assert r["predicted"][s] == cost.predict(call, s, hw).seconds
        assert r["pick"] == cost.choose(call, tuple(r["measured"]), hw).strategy
        assert r["pick_vs_fastest"] >= 1.0


def test_hybrid_rows_are_predicted_on_their_mesh():
    """A row with the hybrids (W = 16: Ulysses of 8 inside a node around 2 rings between nodes) gives a "mesh"
    entry of its own: the hybrids' measured times, predicted on the mesh's call (the layout over the 2 rings)
    with the ring dimension's links across, and the pick among them."""
    m = _module()
    path = ROOT / "docs" / "bench" / "emulated_w16_dense.json"
    (source,) = json.loads(path.read_text())["rows"]
    rows = m.check([str(path)])
    assert [(r["link"], r["group"]) for r in rows] == [("internode", "1-D"), ("internode", "mesh")]
    mesh = rows[1]
    call = m.call_of(source, mesh=True)
    assert (call.world, call.ulysses, call.local_len) == (16, 8, source["seq"] // 16)
    hw = cost.Hardware(a2a_gbps=250.0, p2p_gbps=360.0, allgather_gbps=277.0, reduce_scatter_gbps=272.0,
                       latency_s=10e-6, across=cost.Hardware(p2p_gbps=50.0, a2a_gbps=50.0, allgather_gbps=50.0,
                                                             reduce_scatter_gbps=50.0, latency_s=20e-6))
    assert set(mesh["measured"]) == {"hybrid", "hybrid_allgather"}
    for s, seconds in mesh["measured"].items():
        assert seconds == source["links"]["internode"][s]["max_s"]
        assert mesh["predicted"][s] == cost.predict(call, s, hw).seconds
    assert mesh["pick"] == cost.choose(call, ("hybrid", "hybrid_allgather"), hw).strategy


def test_cli_summary():
    out = subprocess.run([sys.executable, str(SCRIPT), *map(str, RUNS), "--exclude", "emulated_run2.json:lognormal"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 9 and lines[-1].startswith("predictions within 15%: ") and "of 24" in lines[-1]


def test_gpu_measure_compares_with_the_gpu_only_times():
    """``--measure gpu`` compares the predictions with the slowest timed rank's GPU-only time where a run
    recorded it (``bench_emulated.py --host-time``), and leaves out strategies without one."""
    m = _module()
    path = ROOT / "docs" / "bench" / "run8" / "packs_w8.json"
    rows = m.check([str(path)], measure="gpu")
    recorded = json.loads(path.read_text())["rows"]
    assert len(rows) == len(recorded)
    for r in rows:
        source = next(x for x in recorded if x["documents"] == r["documents"])
        for s, seconds in r["measured"].items():
            assert seconds == max(source["links"][r["link"]][s]["gpu_s"])
        assert r["fastest"] == min(r["measured"], key=r["measured"].get)
    assert m._seconds({"max_s": 1.0}, "gpu") is None and m._seconds({"max_s": 1.0}, "wall") == 1.0
    with pytest.raises(SystemExit, match=r"final_packs.json .*no gpu time recorded for .*--host-time"):
        m.check([str(ROOT / "docs" / "bench" / "run6" / "final_packs.json")], measure="gpu")


@pytest.mark.parametrize("mix", ["pareto", "lognormal"])
def test_the_benchmarks_time_the_models_slowest_rank(mix):
    """The ranks a benchmark times as the busiest (``planned_rank_s``, with a packing backend's calls) are the
    cost model's: the largest is the compute the model predicts for the all-gather on the same call (the max
    over ranks), and ``pick_ranks(..., 1)`` includes that rank. Before, ranks were picked by visible pairs and
    one call per block, which the balanced layout makes nearly equal, and the slowest rank of a pack went
    untimed (docs/bench/emulated.md, run 15)."""
    bs = import_script("bench_strategies")
    seq, world, n = 32768, 8, 4096
    docs = bs.documents(mix, seq)
    vis = Visibility(True, cu_seqlens=tuple(docs))
    concrete = bs.plan_layout("balanced", seq, world, docs, True)["concrete"]
    planned = bs.planned_rank_s("allgather", concrete, vis, world, n, 32, 8, 128)
    call = cost.Call(1, n, 32, 8, 128, 2, concrete, vis, world, packs=True)
    assert max(planned) == pytest.approx(cost.predict(call, "allgather").compute_s, rel=1e-12)
    busiest = max(range(world), key=planned.__getitem__)
    assert busiest in bs.pick_ranks(planned, 1)
    unpacked = bs.planned_rank_s("allgather", concrete, vis, world, n, 32, 8, 128, packs=False)
    assert unpacked != planned  # the call counts enter
