"""scripts/bench_strategies.py: its pure-Python parts (document mixes, layout planning and the planner's work
imbalance, the --ranks selection) and one tiny row on CPU with the exact torch kernels and stand-in timers
(the bench itself needs CUDA and flash-attn-4)."""

import argparse
import json
import time

import pytest
import torch

from tests.scripts import import_script


def _bench_module():
    return import_script("bench_strategies")


@pytest.mark.parametrize("seq", [131072, 524288])
@pytest.mark.parametrize("mix", ["lognormal", "one_long", "pareto", "short", "one"])
def test_document_mixes_are_valid_cu_seqlens(mix, seq):
    b = _bench_module()
    cu = b.documents(mix, seq)
    assert cu[0] == 0 and cu[-1] == seq
    assert all(x < y for x, y in zip(cu, cu[1:]))
    assert cu == b.documents(mix, seq)  # seeded: the same mix every time
    if mix == "one":
        assert cu == [0, seq]
    if mix == "pareto":  # heavy-tailed: many documents, the longest far above the median
        lengths = sorted(y - x for x, y in zip(cu, cu[1:]))
        assert len(lengths) > 50 and lengths[-1] > 20 * lengths[len(lengths) // 2]
    if mix == "short":  # hundreds of documents, most under 1k tokens, mean ~500
        lengths = [y - x for x, y in zip(cu, cu[1:])]
        assert len(lengths) > seq // 1024 and sum(n < 1024 for n in lengths) > 0.8 * len(lengths)
        assert 400 < sum(lengths[:-1]) / (len(lengths) - 1) < 600
    with pytest.raises(ValueError):
        b.documents("uniform", seq)


def test_balanced_with_one_document_is_zigzag_and_balanced():
    from distcomm_attention.planning import balance, layouts

    b = _bench_module()
    seq, world = 131072, 8
    docs = b.documents("one", seq)
    concrete = balance.resolve("balanced", seq, world, None)
    for r in range(world):
        assert torch.equal(layouts.positions(concrete, seq, world, r), layouts.positions("zigzag", seq, world, r))
    assert b.planner_imbalance("balanced", seq, world, docs) == 1.0
    assert b.planner_imbalance("zigzag", seq, world, docs) == 1.0
    # contiguous over one causal document: the last rank sees (2W - 1) / W of the mean
    assert b.planner_imbalance("contiguous", seq, world, docs) == pytest.approx(2 - 1 / world, rel=1e-3)


@pytest.mark.parametrize("mix", ["lognormal", "one_long", "pareto", "short"])
def test_planner_imbalance_and_planning(mix):
    b = _bench_module()
    seq, world = 131072, 8
    docs = b.documents(mix, seq)
    imb = {lay: b.planner_imbalance(lay, seq, world, docs) for lay in ("contiguous", "zigzag", "balanced")}
    assert all(v >= 1.0 for v in imb.values())
    work = b.planner_work("balanced", seq, world, docs)
    assert len(work) == world and max(work) / (sum(work) / world) == pytest.approx(imb["balanced"])
    # what the balanced layout balances: the kernel's time (visible pairs may differ more: short documents)
    costs = {lay: b.planner_cost(lay, seq, world, docs) for lay in ("contiguous", "zigzag", "balanced")}
    cost_imb = {lay: max(c) / (sum(c) / world) for lay, c in costs.items()}
    assert cost_imb["balanced"] < 1.03 and cost_imb["balanced"] <= min(cost_imb.values()) + 1e-9
    # plan_layout: the planner's layout, its name and cold-cache timings; auto names the layout it chose
    p = b.plan_layout("balanced", seq, world, docs)
    assert p["chosen_layout"] == "balanced" and p["concrete"].ring_size == world
    assert 0 <= p["plan_resolve_s"] <= p["plan_first_rank_s"] <= p["plan_s"]
    p = b.plan_layout("auto", seq, world, docs)
    assert p["chosen_layout"] in ("balanced", "zigzag", "contiguous")
    assert p["chosen_layout"] == b.layout_name(p["concrete"])
    assert b.plan_layout("zigzag", seq, world, docs)["concrete"] == "zigzag"


def test_pick_ranks():
    b = _bench_module()
    work = [1.0, 5.0, 3.0, 9.0, 2.0, 9.0, 0.5, 4.0]
    assert b.pick_ranks(work, None) == list(range(8))
    assert b.pick_ranks(work, 8) == b.pick_ranks(work, 20) == list(range(8))
    assert b.pick_ranks(work, 1) == [0, 3]  # the largest (ties: the lower rank), plus rank 0
    assert b.pick_ranks(work, 2) == [0, 3, 5]
    assert b.pick_ranks(work, 3) == [0, 1, 3, 5]
    assert b.pick_ranks([7.0, 1.0, 2.0], 2) == [0, 2]  # rank 0 among the k largest: k ranks
    for k in range(1, 8):
        picked = b.pick_ranks(work, k)
        assert len(picked) in (k, k + 1) and 0 in picked and picked == sorted(picked)
        assert work.index(max(work)) in picked
        assert min(work[r] for r in picked if r) >= max(work[r] for r in range(8) if r not in picked)
    # with the planner's per-rank compute: the rank with the most planned work is among those timed
    from distcomm_attention.planning.visibility import Visibility

    seq, world = 131072, 8
    docs = b.documents("pareto", seq)
    vis = Visibility(True, cu_seqlens=tuple(docs))
    for lay in ("contiguous", "zigzag"):
        for strategy in ("ring", "allgather"):
            planned = b.planned_rank_s(strategy, lay, vis, world, seq // world, 32, 8)
            picked = b.pick_ranks(planned, 2)
            assert planned.index(max(planned)) in picked and 0 in picked and len(picked) <= 3
    assert b.parse_ranks("all") is None and b.parse_ranks("3") == 3
    with pytest.raises(argparse.ArgumentTypeError):
        b.parse_ranks("0")


def test_one_row_on_cpu(monkeypatch):
    """bench_case end to end at a tiny size (exact torch kernels, stand-in timers): the row's fields, the
    timed ranks, and Ulysses' kernels measured once across layouts."""
    b = _bench_module()
    from distcomm_attention.kernels import dispatch
    from distcomm_attention.planning.visibility import Visibility

    inner_runs = []

    def timed(fn, iters, warmup):
        t = time.perf_counter()
        fn()
        inner_runs.append(fn)
        return time.perf_counter() - t

    monkeypatch.setattr(b, "_timed", timed)
    monkeypatch.setattr(b, "_peak", lambda fn: 0)
    monkeypatch.setattr(b, "_fa4_single", lambda *a, **k: (lambda: None))
    monkeypatch.setattr(b, "_MEASURED", {})
    _, fwd, bwd = dispatch.select_kernels("torch", torch.empty(1, 1, 4, 16, dtype=torch.bfloat16), Visibility(True))
    seq, world = 512, 4
    docs = b.documents("pareto", seq)
    args = argparse.Namespace(iters=1, warmup=0, device="cpu", head_dim=16, ranks=1,
                              strategies=("ring", "allgather", "ulysses"))
    lays = ("contiguous", "zigzag", "balanced", "auto")
    rows = [b.bench_case(seq, world, 4, 2, True, lay, args, fwd, bwd, docs, "pareto") for lay in lays]
    for r in rows:
        json.dumps(r)
        assert r["chosen_layout"] in ("balanced", "zigzag", "contiguous")
        assert r["work_imbalance"] >= 1.0 and r["plan_s"] >= r["plan_resolve_s"] >= 0
        for s in ("ring", "allgather"):
            planned = r["planned_rank_s"][s]
            assert r["timed_ranks"][s] == b.pick_ranks(planned, 1)
            assert len(r["rank_s"][s]) == len(r["timed_ranks"][s])
            assert r["imbalance"][s] is None and r["planned_imbalance"][s] >= 1.0
        assert set(r["efficiency"]) == {"ring", "allgather", "ulysses"}
        assert "pick" in r["nvlink"] and b._line(r).startswith(f"S={seq} W={world} 4/2 pareto docs")
    assert len([k for k in b._MEASURED if k[0] == "ulysses"]) == 1
    assert rows[0]["ulysses_reorder_s"] == 0  # contiguous: already in natural order
    assert rows[1]["rank_s"]["ulysses"][0] >= rows[1]["ulysses_reorder_s"] > 0  # zigzag: re-ordered
    # auto: the timings of the row of the layout it chose (measured once)
    auto = rows[-1]
    assert auto["layout"] == "auto" and auto["timings_from"] == auto["chosen_layout"]
    assert auto["rank_s"] == rows[lays.index(auto["chosen_layout"])]["rank_s"]
    assert "timings_from" not in rows[0] and "(timings of the" in b._line(auto)
    # every rank timed: measured max / mean
    args.ranks, args.strategies = None, ("ring",)
    r = b.bench_case(seq, world, 4, 2, True, "contiguous", args, fwd, bwd, docs, "pareto")
    assert r["timed_ranks"] == {"ring": list(range(world))} and r["imbalance"]["ring"] >= 1.0
    assert set(r["rank_s"]) == {"ring"}


def test_kernel_law_work_counts():
    """scripts/bench_kernel_law.py's work counts of causal documents against counting every pair: the visible
    pairs, the 128 x 128 tiles holding at least one of them (times 128 x 128), the 128-row query tiles."""
    law = import_script("bench_kernel_law")
    lengths = [1, 64, 127, 128, 129, 300, 513]
    pairs, tiles, q_tiles = 0, set(), 0
    for d, n in enumerate(lengths):
        for i in range(n):
            for j in range(i + 1):
                pairs += 1
                tiles.add((d, i // 128, j // 128))
        q_tiles += -(-n // 128)
    assert law.work(lengths) == dict(pairs=pairs, tile_pairs=len(tiles) * 128 * 128, q_tiles=q_tiles,
                                     documents=len(lengths))
