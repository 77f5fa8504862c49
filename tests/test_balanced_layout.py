"""The document-balanced layout (``layout="balanced"``): its placement properties and its attention on gloo.

Layer 1 (no process group): every token placed once, S / W tokens per rank in increasing order; the planner's
work balance counted here from the positions (independently of ``balance.rank_work``): within 5% of the mean
whenever a rank holds 512 tokens or more, on seeded log-normal and heavy-tailed mixes (within 25% with a
window: a known weakness of the placement's projection); one document gives zigzag's positions; shifted labels follow the placement.
Layer 2 (gloo, W = 2, 3, 4): ring, all-gather, Ulysses and "auto" with the balanced and auto layouts, causal
with and without a window, GQA, against the float64 reference on the whole sequence (outputs and q/k/v
gradients at each rank's positions); shard -> gather round trip exact; documents the ring never sharded raise
the same error on every rank.
"""

import random

import pytest
import torch

import distcomm_attention as da
from distcomm_attention._reference import attention_reference
from distcomm_attention.api import context_parallel_attn
from distcomm_attention.planning import balance, layouts
from distcomm_attention.sharding import shift_labels
from tests.dist_harness import run_world

FP64 = dict(rtol=1e-10, atol=1e-12)


def _mix(kind: str, seq: int, seed: int) -> tuple[int, ...]:
    rnd = random.Random(seed)
    cu = [0]
    while cu[-1] < seq:
        if kind == "lognormal":
            length = int(min(9216, max(1, rnd.lognormvariate(7.0, 1.0))))
        else:  # heavy-tailed, with one-token documents
            length = max(1, int(rnd.paretovariate(1.1) * rnd.choice([1, 16, 256])))
        cu.append(min(seq, cu[-1] + length))
    return tuple(cu)


def _pairs_per_rank(positions, cu, left):
    """Visible causal (query, key) pairs of each rank's queries: offset in its document + 1, capped by the
    window."""
    bounds = torch.tensor(cu)
    out = []
    for pos in positions:
        doc = torch.bucketize(pos, bounds, right=True) - 1
        keys = pos - bounds[doc] + 1
        if left is not None:
            keys = keys.clamp(max=left + 1)
        out.append(int(keys.sum()))
    return out


@pytest.mark.parametrize("kind", ["lognormal", "pareto"])
@pytest.mark.parametrize("world", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("left", [None, 1023])
def test_placement_and_balance(kind, world, left):
    for seed in range(4):
        seq = world * random.Random(seed).choice([512, 2048, 8192])
        cu = _mix(kind, seq, seed)
        window = (-1, -1) if left is None else (left, 0)
        a = balance.balanced(cu, seq, world, window)
        pos = [layouts.positions(a, seq, world, r) for r in range(world)]
        assert all(p.numel() == seq // world and bool((p[1:] > p[:-1]).all()) for p in pos)
        assert torch.equal(torch.sort(torch.cat(pos)).values, torch.arange(seq))
        work = _pairs_per_rank(pos, cu, left)
        mean = sum(work) / world
        # Without a window within 5%. With one, the light fill is projected at each document's mean work per
        # token while a windowed document's head is lighter than its tail: measured up to 1.24 at 512-8192
        # tokens per rank here (1.00-1.08 on the benchmark's 128k mixes); this bound records it.
        bound = 1.05 if left is None else 1.25
        assert max(work) <= bound * mean, (kind, world, left, seed, max(work) / mean)
        # the static layouts are far from it on the same mixes (what the layout exists for)
        zig = _pairs_per_rank([layouts.positions("contiguous", seq, world, r) for r in range(world)], cu, left)
        assert max(work) <= max(zig)


def test_one_document_is_zigzag_and_deterministic():
    for world, seq in ((2, 64), (4, 4096), (8, 65536)):
        for cu in (None, (0, seq)):
            a = balance.balanced(cu, seq, world)
            for r in range(world):
                assert torch.equal(layouts.positions(a, seq, world, r), layouts.positions("zigzag", seq, world, r))
    cu = _mix("pareto", 8 * 4096, 3)
    first = balance.balanced(cu, 8 * 4096, 8).ranges
    balance.balanced.cache_clear()
    assert balance.balanced(cu, 8 * 4096, 8).ranges == first


def test_short_documents_stay_whole():
    """Documents of the one-long mix: the long one is split, no 1k document is."""
    seq, world = 131072, 8
    cu = (0,) + tuple(range(seq // 2, seq + 1, 1024))
    a = balance.balanced(cu, seq, world)
    owner = torch.empty(seq, dtype=torch.long)
    for r in range(world):
        owner[layouts.positions(a, seq, world, r)] = r
    split = [d for d in range(len(cu) - 1) if owner[cu[d]:cu[d + 1]].unique().numel() > 1]
    assert split == [0]


def test_labels_and_positions_follow_the_placement():
    seq, world, cu = 48, 4, [0, 5, 6, 30, 48]
    labels = torch.arange(100, 100 + seq)[None]
    want = torch.full_like(labels, -100)
    for a, b in zip(cu, cu[1:]):
        want[0, a:b - 1] = labels[0, a + 1:b]
    assert torch.equal(shift_labels(labels, cu_seqlens=cu), want)
    for r in range(world):
        ids = da.position_ids(seq // world, "balanced", ring_size=world, rank=r, cu_seqlens=cu)
        assert torch.equal(da.shard_sequence(torch.arange(seq)[None], "balanced", ring_size=world, rank=r,
                                             cu_seqlens=cu)[0], ids)
        assert torch.equal(da.shard_sequence(want, "balanced", ring_size=world, rank=r, cu_seqlens=cu),
                           want[:, ids])


def test_errors():
    with pytest.raises(ValueError, match="balance_window"):
        da.Sharding("zigzag", balance_window=4)
    with pytest.raises(ValueError, match="balance_window"):
        da.Sharding("balanced", balance_window=-2)
    with pytest.raises(ValueError, match="cu_seqlens"):
        da.shard_sequence(torch.zeros(1, 16), "balanced", ring_size=2, rank=0, cu_seqlens=[0, 5, 12])
    with pytest.raises(ValueError, match="divisible by 3"):
        da.shard_sequence(torch.zeros(1, 16), "balanced", ring_size=3, rank=0, cu_seqlens=[0, 5, 16])


# ---------------------------------------------------------------------------------------------------------
# Layer 2: gloo
# ---------------------------------------------------------------------------------------------------------

SEQ = 48


def _cases(world):
    cases = []
    for i, (cu, window) in enumerate([((0, 1, 2, 30, SEQ), (-1, -1)), ((0, 7, 8, 9, 40, SEQ), (5, 0)),
                                      ((0, SEQ), (-1, -1)), ((0, 3) + tuple(range(4, SEQ, 6)) + (SEQ,), (-1, -1))]):
        for strategy in ("ring", "allgather", "ulysses", "auto"):
            for layout in ("balanced", "auto"):
                cases.append(dict(seed=i, cu=cu, window=window, strategy=strategy, layout=layout,
                                  heads=4 if world != 3 else 6, kv_heads=2 if world != 3 else 3))
    return cases


def _inputs(case):
    g = torch.Generator().manual_seed(case["seed"])
    q = torch.randn(1, SEQ, case["heads"], 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, SEQ, case["kv_heads"], 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, SEQ, case["kv_heads"], 8, generator=g, dtype=torch.float64)
    dout = torch.randn(1, SEQ, case["heads"], 8, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _rank(rank, world):
    torch.set_num_threads(1)
    results = []
    for case in _cases(world):
        q, k, v, dout = _inputs(case)
        window = case["window"][0] if case["window"][0] >= 0 else None
        s = da.Sharding(case["layout"], balance_window=window)
        local = [s.shard(t, cu_seqlens=case["cu"]).detach().requires_grad_() for t in (q, k, v)]
        out = context_parallel_attn(*local, causal=True, window_size=case["window"], cu_seqlens=case["cu"],
                                    strategy=case["strategy"], sharding=s)
        out.backward(s.shard(dout, cu_seqlens=case["cu"]))
        ids = s.position_ids(SEQ // world, cu_seqlens=case["cu"])
        gathered = s.gather(out.detach(), cu_seqlens=case["cu"])
        roundtrip = torch.equal(s.gather(s.shard(q, cu_seqlens=case["cu"]), cu_seqlens=case["cu"]), q)
        results.append((ids, out.detach(), *(t.grad for t in local), gathered, roundtrip))
    # documents this ring never sharded: the same error on every rank
    q = torch.randn(1, SEQ // world, 4, 8, dtype=torch.float64)
    try:
        da.ring_flash_attn(q, q, q, causal=True, cu_seqlens=[0, 11, SEQ], layout="balanced")
        error = None
    except ValueError as e:
        error = str(e)
    return results, error


@pytest.mark.parametrize("world", [2, 3, 4])
def test_balanced_attention_matches_reference(world):
    got = run_world(_rank, world, timeout=180)
    for i, case in enumerate(_cases(world)):
        q, k, v, dout = (t.requires_grad_() if j < 3 else t for j, t in enumerate(_inputs(case)))
        out = attention_reference(q, k, v, causal=True, window_size=case["window"], cu_seqlens=list(case["cu"]))
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        for r in range(world):
            ids, o, gq, gk, gv, gathered, roundtrip = got[r][0][i]
            where = f"rank {r} of {world}: {case}"
            torch.testing.assert_close(o, out.detach()[:, ids], **FP64, msg=where)
            torch.testing.assert_close(gq, dq[:, ids], **FP64, msg=where)
            torch.testing.assert_close(gk, dk[:, ids], **FP64, msg=where)
            torch.testing.assert_close(gv, dv[:, ids], **FP64, msg=where)
            torch.testing.assert_close(gathered, out.detach(), **FP64, msg=where)
            assert roundtrip, where
    errors = [got[r][1] for r in range(world)]
    assert errors[0] is not None and "cu_seqlens" in errors[0]
    assert all(e == errors[0] for e in errors)
