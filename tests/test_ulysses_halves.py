"""Ulysses in two halves (Note [Ulysses halves]): the split of the rows, the two plans, and the strategy against
the float64 reference on gloo, with its all-to-alls posted in two pieces that move the one-piece bytes."""

from __future__ import annotations

import pytest
import torch

from distcomm_attention.planning import balance, layouts
from distcomm_attention.planning.plans import half_plans, local_plan, natural_order
from distcomm_attention.planning.visibility import Visibility
from distcomm_attention.strategies.ulysses import Halves, halves
from tests.dist_harness import run_world

LAYOUTS = [("contiguous", 3, 4, None), ("zigzag", 4, 6, None), ("striped", 3, 5, None),
           ("balanced", 4, 8, (0, 3, 20, 21, 32))]


def _concrete(layout, world, n, docs):
    return balance.resolve(layout, world * n, world, docs) if layout == "balanced" else layout


@pytest.mark.parametrize("layout, world, n, docs", LAYOUTS)
def test_halves_route_every_row(layout, world, n, docs):
    """Every rank's rows before the cut are a prefix of its shard; what arrives of each part, in source order,
    put in ``order`` is the part's natural rows, and ``inverse`` puts them back (positions stand for rows)."""
    concrete = _concrete(layout, world, n, docs)
    split = halves(concrete, world, n)
    seq = world * n
    assert split.cut == seq // 2
    shards = [layouts.positions(concrete, seq, world, r) for r in range(world)]
    for r, pos in enumerate(shards):
        assert split.rows(r, 0) == slice(0, int((pos < split.cut).sum()))
        assert torch.equal(pos[split.rows(r, 0)], pos[pos < split.cut])
    for part, want in ((0, torch.arange(split.cut)), (1, torch.arange(split.cut, seq))):
        arrived = torch.cat([pos[split.rows(r, part)] for r, pos in enumerate(shards)])
        assert [len(pos[split.rows(r, part)]) for r, pos in enumerate(shards)] == split.splits(part, n)
        assert torch.equal(arrived[split.order[part]], want)
        assert torch.equal(want[split.inverse[part]], arrived)


def test_halves_refuse_shards_out_of_order():
    order = torch.tensor([1, 0, 2, 3])  # rank 0 holds positions 1, 0
    with pytest.raises(ValueError, match="increasing order"):
        Halves(order, 2, 2, 1)


def _pairs(plan, row0: int = 0) -> set[tuple[int, int]]:
    """The (query, key) pairs a one-step plan's blocks compute, queries shifted by ``row0``."""
    out = set()
    for block in plan.blocks[0]:
        mask = plan.mask(0, plan.blocks[0].index(block), torch.device("cpu"))
        q0, k0 = block.q.start, block.kv.start
        for i in range(block.q.stop - q0):
            for j in range(block.kv.stop - k0):
                if block.mode == "full" or (block.mode == "causal" and j <= i) or (
                        block.mode == "interval" and int(mask.row_lo[i]) <= j < int(mask.row_hi[i])):
                    out.add((row0 + q0 + i, k0 + j))
    return out


@pytest.mark.parametrize("vis", [Visibility(True), Visibility(True, (3, -1)), Visibility(True, (-1, -1), (0, 5, 11, 20)),
                                 Visibility(True, (4, -1), (0, 9, 20))])
@pytest.mark.parametrize("cut", [1, 7, 10, 19])
def test_half_plans_split_the_visible_pairs(vis, cut):
    """The two plans compute exactly the whole plan's pairs: queries before the cut on keys before it, the rest
    on any key."""
    seq = 20
    first, second = half_plans(vis, seq, cut)
    a, b = _pairs(first), _pairs(second, cut)
    assert all(qi < cut and kj < cut for qi, kj in a) and all(qi >= cut for qi, _ in b)
    assert a | b == _pairs(local_plan(vis, seq)) and not a & b


@pytest.mark.parametrize("vis", [Visibility(False), Visibility(False, (3, 1)), Visibility(False, (2, 2), (0, 8, 20))])
def test_no_halves_where_a_query_sees_a_later_key(vis):
    assert half_plans(vis, 20, 10) is None


def _rank(rank, world, n, layout, causal, window, docs, masked, heads, kv_heads, batch, split=True, gathers=False):
    import distcomm_attention as da
    from distcomm_attention.strategies import ulysses
    from tests.counting import counted, reference_errors

    ulysses.HALVES = split  # the strategy's switch (off by default)
    if gathers:  # the row gathers CUDA takes, run by the Triton interpreter (TRITON_INTERPRET, tests/conftest.py)
        ulysses._gathers = lambda t, row_elems=None: t.is_contiguous()

    seq = world * n
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(batch, seq, h, 8, dtype=torch.float64, generator=g) for h in (heads, kv_heads, kv_heads))
    dout = torch.randn(batch, seq, heads, 8, dtype=torch.float64, generator=g)
    mask = torch.rand(batch, seq, generator=g) > 0.2 if masked else None
    pos = layouts.positions(_concrete(layout, world, n, docs), seq, world, rank)
    local = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
    with counted() as made:
        out = da.context_parallel_attn(*local, strategy="ulysses", causal=causal, window_size=window,
                                       cu_seqlens=docs, layout=layout,
                                       attention_mask=None if mask is None else mask[:, pos])
        posts_fwd = sum(c.calls["all_to_all_v"] for c in made)
        out.backward(dout[:, pos])
    errors = reference_errors(q, k, v, dout, pos, out, local, causal=causal, window=window, docs=docs, mask=mask)
    return {"errors": errors, "sent": sum(c.total for c in made), "fwd": posts_fwd,
            "bwd": sum(c.calls["all_to_all_v"] for c in made) - posts_fwd}


CASES = [  # world, n, layout, causal, window, docs, masked, heads, kv_heads, batch
    (2, 8, "zigzag", True, (-1, -1), None, False, 4, 2, 2),
    (4, 6, "zigzag", True, (-1, -1), None, True, 8, 2, 1),            # kv heads replicated, padding
    (3, 8, "contiguous", True, (5, -1), (0, 7, 13, 24), False, 6, 2, 1),  # a window, documents, kv expanded
    (4, 8, "balanced", True, (-1, -1), (0, 3, 20, 21, 32), False, 4, 4, 2),
    (2, 6, "striped", True, (-1, -1), None, False, 2, 2, 1),
]


@pytest.mark.parametrize("world, n, layout, causal, window, docs, masked, heads, kv_heads, batch", CASES)
def test_ulysses_in_halves_matches_float64(world, n, layout, causal, window, docs, masked, heads, kv_heads, batch):
    """With the switch on: out, dq, dk, dv equal the float64 reference; every all-to-all is posted twice (q, k,
    v, out; dout, dq, dk, dv), and the bytes are those of one piece (the default, switch off: each posted once):
    the two parts partition the rows."""
    got = run_world(_rank, world, n, layout, causal, window, docs, masked, heads, kv_heads, batch, timeout=90)
    for g in got:
        assert max(g["errors"]) < 1e-10, g["errors"]
        assert (g["fwd"], g["bwd"]) == (8, 8), g
    one_piece = run_world(_rank, world, n, layout, causal, window, docs, masked, heads, kv_heads, batch, False,
                          timeout=90)
    for g, h in zip(got, one_piece):
        assert max(h["errors"]) < 1e-10 and (h["fwd"], h["bwd"]) == (4, 4), h
        assert g["sent"] == h["sent"], (g["sent"], h["sent"])


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_ulysses_in_halves_through_the_row_gathers(kv_heads):
    """The halves' packs, reorders and places through the row gathers CUDA tensors take (the Triton
    interpreter on CPU): float64 exact, batch 1, kv heads split and replicated."""
    pytest.importorskip("triton")
    got = run_world(_rank, 4, 6, "zigzag", True, (-1, -1), (0, 5, 17, 24), True, 4, kv_heads, 1, True, True,
                    timeout=120)
    for g in got:
        assert max(g["errors"]) < 1e-10 and (g["fwd"], g["bwd"]) == (8, 8), g


def test_attention_that_sees_later_keys_runs_in_one_piece():
    """Non-causal attention has no split: each all-to-all is posted once, the switch on."""
    got = run_world(_rank, 2, 6, "zigzag", False, (-1, -1), None, False, 4, 2, 1, timeout=90)
    for g in got:
        assert max(g["errors"]) < 1e-10 and (g["fwd"], g["bwd"]) == (4, 4), g


def test_natural_order_of_one_rank_is_none():
    assert natural_order("zigzag", 1, 8) is None and halves("zigzag", 1, 1) is None


def test_cost_model_counts_the_halves():
    """The model's Ulysses in halves: the two parts' calls (never less compute than one piece), and exposed
    transfers that shrink where the link is slow (50 GB/s: about half); attention without a split predicts
    the same either way."""
    import dataclasses

    from distcomm_attention.planning import cost

    slow = cost.Hardware(p2p_gbps=50.0, a2a_gbps=50.0, allgather_gbps=50.0, reduce_scatter_gbps=50.0)
    one = cost.Call(1, 8192, 32, 8, 128, 2, "zigzag", Visibility(True), 8, packs=True)
    two = dataclasses.replace(one, ulysses_halves=True)
    a, b = cost.predict(one, "ulysses", slow), cost.predict(two, "ulysses", slow)
    assert b.compute_s >= a.compute_s and 0.4 * a.comm_s < b.comm_s < 0.75 * a.comm_s
    full = dataclasses.replace(one, vis=Visibility(False))
    assert cost.predict(full, "ulysses", slow) == cost.predict(dataclasses.replace(full, ulysses_halves=True),
                                                               "ulysses", slow)


def _mismatched_rank(rank, world):
    import distcomm_attention as da
    from distcomm_attention.strategies import ulysses

    ulysses.HALVES = rank == 0  # one rank in halves, the other in one piece: different collectives
    q, k, v = (torch.randn(1, 6, 4, 8, dtype=torch.float64) for _ in range(3))
    try:
        da.context_parallel_attn(q, k, v, strategy="ulysses", causal=True, layout="zigzag")
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_ranks_that_disagree_on_the_halves_get_one_clear_error():
    """The switch decides how many all-to-alls a rank posts: ranks that disagree get the same clear error
    naming it, before any all-to-all, instead of a hang."""
    got = run_world(_mismatched_rank, 2, timeout=60)
    assert all("ulysses_halves" in g for g in got), got
    assert got[0].split(":")[0] == got[1].split(":")[0] != "no error", got
