"""The ring's and the all-gather's sums of block gradients over a step's keys (``ring._sum_terms``): each row's
first term copied in, later ones added, rows no term reaches zero-filled; many terms added into zeros. Against
zeros plus every term added, in float64 and for bf16 terms into fp32: the same values, every row written
(the buffers start as garbage)."""

import random

import pytest
import torch

from distcomm_attention.kernels.contract import RowSum
from distcomm_attention.strategies import ring


def _reference(n, grads, dtype):
    acc = torch.zeros(2, n, 3, dtype=dtype)
    for kv, t in grads:
        acc[:, kv] += t.to(dtype)
    return acc


@pytest.mark.parametrize("terms", [0, 1, 3, ring._MAX_TERMS, ring._MAX_TERMS + 5])
@pytest.mark.parametrize("dtypes", [(torch.float64, torch.float64), (torch.bfloat16, torch.float32)])
def test_sums_match_adding_every_term_into_zeros(terms, dtypes):
    term_dtype, acc_dtype = dtypes
    g = torch.Generator().manual_seed(terms)
    n = 40
    grads = []
    for _ in range(terms):  # overlapping, disjoint, empty, open-ended and whole-row slices alike
        a, b = sorted(torch.randint(0, n + 1, (2,), generator=g).tolist())
        kv = [slice(a, b), slice(None, b), slice(a, None), slice(0, n)][int(torch.randint(0, 4, (1,), generator=g))]
        rows = len(range(n)[kv])
        grads.append((kv, torch.randn(2, rows, 3, generator=g).to(term_dtype)))
    acc = torch.full((2, n, 3), float("nan"), dtype=acc_dtype)  # garbage: every row must be written
    ring._sum_terms((acc,), grads)
    want = _reference(n, grads, acc_dtype)
    assert not acc.isnan().any()
    torch.testing.assert_close(acc, want, rtol=0, atol=0)


@pytest.mark.parametrize("terms", [3, ring._MAX_TERMS + 5])
def test_unread_rows_are_left_as_they_were(terms):
    """Rows the caller reads none of (``unread``, the all-gather's own rows) that no term reaches are neither
    copied to nor zero-filled, with few terms or many; every other row is the float64 sum."""
    g = torch.Generator().manual_seed(terms)
    n, unread = 40, ((5, 12), (30, 34))
    outside = [i for i in range(n) if not any(a <= i < b for a, b in unread)]
    grads = []
    for _ in range(terms):  # terms on rows outside ``unread`` only, as the all-gather's others' rows
        i = outside[int(torch.randint(0, len(outside), (1,), generator=g))]
        grads.append((slice(i, i + 1), torch.randn(2, 1, 3, generator=g, dtype=torch.float64)))
    acc = torch.full((2, n, 3), float("nan"), dtype=torch.float64)
    ring._sum_terms((acc,), grads, unread=unread)
    want = _reference(n, grads, torch.float64)
    for a, b in unread:
        assert acc[:, a:b].isnan().all()
    torch.testing.assert_close(acc[:, outside], want[:, outside], rtol=0, atol=0)


def test_two_buffers_sum_their_own_terms():
    n = 12
    g = torch.Generator().manual_seed(0)
    grads = [(slice(2, 7), torch.randn(1, 5, 2, generator=g), torch.randn(1, 5, 2, generator=g)),
             (slice(5, 9), torch.randn(1, 4, 2, generator=g), torch.randn(1, 4, 2, generator=g))]
    dk, dv = torch.full((2, 1, n, 2), 7.0, dtype=torch.float64).unbind(0)
    ring._sum_terms((dk, dv), grads)
    for acc, which in ((dk, 1), (dv, 2)):
        want = torch.zeros(1, n, 2, dtype=torch.float64)
        for gr in grads:
            want[:, gr[0]] += gr[which].double()
        torch.testing.assert_close(acc, want, rtol=0, atol=0)


def _row_sum_ops(seed: int, n: int, dtype: torch.dtype):
    """A random sequence of RowSum additions: plain row slices, and packed calls' terms (``add_runs``) whose rows
    outside their runs hold NaN (what a kernel leaves there), some spanning every row."""
    g = torch.Generator().manual_seed(seed)
    ops = []
    for _ in range(int(torch.randint(1, 7, (1,), generator=g))):
        kind = int(torch.randint(0, 3, (1,), generator=g))
        if kind == 0:
            a, b = sorted(torch.randint(0, n + 1, (2,), generator=g).tolist())
            ops.append(("add", a, b, torch.randn(2, b - a, 3, generator=g).to(dtype)))
            continue
        start, stop = (0, n) if kind == 1 else sorted(torch.randint(0, n + 1, (2,), generator=g).tolist())
        cuts = sorted(set(torch.randint(start, stop + 1, (4,), generator=g).tolist()) | {start, stop})
        runs = [(a, b) for i, (a, b) in enumerate(zip(cuts, cuts[1:])) if i % 2 == 0]  # every other piece
        term = torch.full((2, stop - start, 3), float("nan"), dtype=dtype)
        for a, b in runs:
            term[:, a - start:b - start] = torch.randn(2, b - a, 3, generator=g).to(dtype)
        ops.append(("runs", runs, start, term))
    return ops


@pytest.mark.parametrize("seed", range(24))
@pytest.mark.parametrize("dtypes", [(torch.float64, torch.float64), (torch.bfloat16, torch.float32)])
def test_row_sum_matches_adding_every_term_into_zeros(seed, dtypes):
    """``RowSum``: plain additions and packed calls' terms (rows outside their runs unset), in any order: the
    float64 sum of every term's rows; a row one term reached is that term's value bit for bit; a packed term
    spanning every row, first of its kind, becomes the buffer itself (no copy)."""
    term_dtype, acc_dtype = dtypes
    n = 24
    ops = _row_sum_ops(seed, n, term_dtype)
    sums = RowSum(torch.Size((2, n, 3)), acc_dtype, torch.device("cpu"))
    want = torch.zeros(2, n, 3, dtype=torch.float64)
    count = torch.zeros(n, dtype=torch.int64)
    single = torch.zeros(2, n, 3, dtype=term_dtype)
    adopted = None
    for i, op in enumerate(ops):
        if op[0] == "add":
            _, a, b, term = op
            sums.add(a, b, term)
            pieces = [(a, b, term)]
        else:
            _, runs, start, term = op
            full = start == 0 and term.shape[1] == n and runs
            if full and adopted is None and sums.base is None and not any(o[0] == "add" for o in ops[:i]):
                adopted = term
            sums.add_runs(term, runs, start)
            pieces = [(a, b, term[:, a - start:b - start]) for a, b in runs]
        for a, b, t in pieces:
            want[:, a:b] += t.double()
            count[a:b] += 1
            single[:, a:b] = t
    out = sums.result(term_dtype)
    if adopted is not None:
        assert sums.base is adopted
    assert not out.isnan().any()
    once = count == 1
    assert torch.equal(out[:, once], single[:, once])
    assert (out[:, count == 0] == 0).all()
    tol = 1e-12 if term_dtype == torch.float64 else 1e-2
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


def test_row_sum_adopts_a_later_whole_term_after_partial_ones():
    """The all-gather's dQ: the other ranks' keys' call first (a part of the rows), then the own keys' call
    spanning every row: the second call's buffer becomes the sum (no copy of its rows), the first's rows are
    added to it, each row summed in fp32 once and rounded once."""
    g = torch.Generator().manual_seed(5)
    n = 20
    part = torch.full((1, 8, 2), float("nan"), dtype=torch.bfloat16)
    part[:, 0:3] = torch.randn(1, 3, 2, generator=g).bfloat16()
    part[:, 5:8] = torch.randn(1, 3, 2, generator=g).bfloat16()
    whole = torch.full((1, n, 2), float("nan"), dtype=torch.bfloat16)
    whole[:, :18] = torch.randn(1, 18, 2, generator=g).bfloat16()
    sums = RowSum(torch.Size((1, n, 2)), torch.float32, torch.device("cpu"))
    sums.add_runs(part, [(10, 13), (15, 18)], start=10)
    assert sums.base is None  # waiting for a term to adopt
    sums.add_runs(whole, [(0, 18)])
    assert sums.base is whole and sums.in_acc == [(10, 13), (15, 18)]
    want = torch.zeros(1, n, 2, dtype=torch.float64)
    want[:, :18] += whole[:, :18].double()
    want[:, 10:13] += part[:, 0:3].double()
    want[:, 15:18] += part[:, 5:8].double()
    out = sums.result(torch.bfloat16)
    assert out is whole  # rounded into the adopted buffer
    torch.testing.assert_close(out.double(), want.bfloat16().double(), rtol=0, atol=0)


def test_depth_counts_the_spans_sharing_a_row():
    """``allgather._depth``: the most spans sharing one row (touching spans share none; empty spans count not)."""
    from distcomm_attention.strategies.allgather import _depth

    assert _depth([]) == 0 and _depth([(3, 3)]) == 0
    assert _depth([(0, 4), (4, 8)]) == 1
    assert _depth([(0, 5), (3, 8), (4, 6)]) == 3
    assert _depth([(0, 2), (1, 3), (2, 4), (3, 5)]) == 2
    rows = [0] * 20
    spans = [(1, 9), (2, 4), (3, 12), (8, 15), (14, 20), (0, 1)]
    for a, b in spans:
        for i in range(a, b):
            rows[i] += 1
    assert _depth(spans) == max(rows) == 3
    assert _depth(iter(spans)) == 3 and _depth(span for span in [(0, 4), (4, 8)]) == 1  # read once


def test_rows_going_home_are_rounded_once():
    """``AllGatherKV._others_sums`` in bf16 (Note [Sparse gather], "What goes home"): every row that goes home
    equals the float64 sum of the step-1 terms reaching it, rounded once to bf16, whether one, two or more terms
    reach it (random spans: cases at most two deep and cases three or more deep both met), and whether the terms
    come in bf16 or as fp32 sums of two bf16 values (as several window calls give; one case puts such a sum and a
    bf16 term on the same rows, which rounding the sum alone first would round twice); own rows are left to the own
    keys' sums (returned apart). The values are bf16 of magnitude 2^-6 to 8, so that every sum here is exact in fp32
    and float64 alike: one rounding, and one answer."""

    def values(shape, g, dtype):  # bf16 values of magnitude [2^-6, 8]; an fp32 term is two of them summed
        def one():
            x = torch.randn(shape, generator=g).clamp(-8, 8)
            return torch.where(x.abs() < 2 ** -6, torch.full_like(x, 2 ** -6), x).bfloat16()

        return one() if dtype == torch.bfloat16 else one().float() + one().float()

    import types

    from distcomm_attention.strategies.allgather import AllGatherKV, _depth

    m, own = 40, (5, 9)  # buffer rows; one run of own rows at buffer rows [5, 14), shard rows [3, 12)
    sparse = types.SimpleNamespace(own_runs=((3, own[0], own[1]),),
                                   own_ranges=lambda k0, k1: [(3 + lo - own[0], 3 + hi - own[0], lo - k0)
                                                              for lo, hi in [(max(k0, own[0]), min(k1, sum(own)))]
                                                              if lo < hi])
    depths = []
    for seed in range(40):
        rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
        grads = []
        if seed == 0:  # an fp32 sum and a bf16 term on the same rows: rounding the first alone would round twice
            grads = [(slice(20, 36), *(values((1, 16, 2, 4), g, torch.float32) for _ in range(2))),
                     (slice(24, 40), *(values((1, 16, 2, 4), g, torch.bfloat16) for _ in range(2)))]
        for _ in range(rng.randint(1, 9) if seed else 0):
            a = rng.randrange(m)
            b = rng.randint(a + 1, m)
            dtype = torch.bfloat16 if rng.random() < 0.8 else torch.float32
            grads.append((slice(a, b), *(values((1, b - a, 2, 4), g, dtype) for _ in range(2))))
        k_all = torch.empty(1, m, 2, 4, dtype=torch.bfloat16)
        this = types.SimpleNamespace(sparse=sparse, _buffers=AllGatherKV._buffers)
        dk, dv, own_terms = AllGatherKV._others_sums(this, grads, k_all, k_all, torch.float32, torch.bfloat16)
        assert dk.dtype == dv.dtype == torch.bfloat16
        for i, got in ((1, dk), (2, dv)):
            want = torch.zeros(1, m, 2, 4, dtype=torch.float64)
            home = torch.zeros(m, dtype=torch.bool)
            for term in grads:
                want[:, term[0]] += term[i].double()
                home[term[0]] = True
            home[own[0]:sum(own)] = False
            torch.testing.assert_close(got[:, home].double(), want[:, home].bfloat16().double(), rtol=0, atol=0)
        for a, z, t_k, _ in own_terms:  # the own rows' parts, for the own keys' sums
            assert 3 <= a < z <= 3 + own[1] and t_k.shape[1] == z - a
        fp32 = any(t[1].dtype == torch.float32 for t in grads)
        depths.append((_depth((t[0].start, t[0].stop) for t in grads), fp32))
    assert min(d for d, _ in depths) <= 2 and max(d for d, _ in depths) >= 3, depths
    assert sum(d == 2 and fp32 for d, fp32 in depths) >= 3, depths  # (where a term of another dtype forces fp32)


@pytest.mark.parametrize("in_place", [True, False])
def test_rows_going_home_from_terms_written_in_place(in_place):
    """``AllGatherKV._others_sums`` with ``home`` (step 1's calls writing their dK/dV straight into the buffers
    that go home, one term a row, ``_home_slots``): the other ranks' rows hold exactly their term, in place or
    copied in where a kernel wrote a buffer of its own (``in_place`` False), rows no term reached are zero (the
    buffers start as NaN), and the own rows' parts are returned as they are: views of the buffers when written
    there, copies (one tensor each) when not."""
    import types

    from distcomm_attention.strategies.allgather import AllGatherKV

    m, own = 40, (5, 9)  # buffer rows; one run of own rows at buffer rows [5, 14), shard rows [3, 12)
    sparse = types.SimpleNamespace(own_runs=((3, own[0], own[1]),),
                                   own_ranges=lambda k0, k1: [(3 + lo - own[0], 3 + hi - own[0], lo - k0)
                                                              for lo, hi in [(max(k0, own[0]), min(k1, sum(own)))]
                                                              if lo < hi])
    this = types.SimpleNamespace(sparse=sparse, _buffers=AllGatherKV._buffers)
    g = torch.Generator().manual_seed(3)
    k_all = torch.empty(1, m, 2, 4, dtype=torch.bfloat16)
    dk_all, dv_all = (torch.full((1, m, 2, 4), float("nan"), dtype=torch.bfloat16) for _ in range(2))
    spans = [(2, 10), (10, 20), (26, 33)]  # rows 0-1, 20-25 and 33-39 reached by no term; 5-13 own
    grads = []
    for a, b in spans:
        terms = [torch.randn(1, b - a, 2, 4, generator=g).bfloat16() for _ in range(2)]
        if in_place:  # the kernel wrote them into the buffers' rows
            dk_all[:, a:b], dv_all[:, a:b] = terms
            terms = [dk_all[:, a:b], dv_all[:, a:b]]
        grads.append((slice(a, b), *terms))
    dk, dv, own_terms = AllGatherKV._others_sums(this, grads, k_all, k_all, torch.float32, torch.bfloat16,
                                                 (dk_all, dv_all, None))
    assert dk is dk_all and dv is dv_all
    for i, got in ((1, dk), (2, dv)):
        want = torch.zeros(1, m, 2, 4, dtype=torch.bfloat16)
        for term in grads:
            want[:, term[0]] = term[i]
        others = torch.ones(m, dtype=torch.bool)
        others[own[0]:sum(own)] = False
        assert torch.equal(got[:, others], want[:, others])  # (a NaN left in an unreached row fails)
    assert [(a, z) for a, z, _, _ in own_terms] == [(3, 8), (8, 12)]
    for (a, z, t_k, t_v), (rows, g_k, g_v) in zip(own_terms, grads[:2]):
        start = rows.start + (0 if rows.start >= own[0] else own[0] - rows.start)
        lo = start - rows.start
        assert torch.equal(t_k, g_k[:, lo:lo + z - a]) and torch.equal(t_v, g_v[:, lo:lo + z - a])
        shares = t_k.untyped_storage().data_ptr() == dk_all.untyped_storage().data_ptr()
        assert shares == in_place  # views where written in place, else one copy (the kernels' buffers go)
