"""The row kernels (distcomm_attention/kernels/triton_rows.py) against PyTorch indexing, under the Triton
interpreter on CPU and on a GPU; Ulysses' all-to-all packs and places through them against its permuted
copies."""

from __future__ import annotations

import pytest
import torch

from distcomm_attention.strategies import ulysses
from distcomm_attention.transport.base import Done

triton = pytest.importorskip("triton")
triton_rows = pytest.importorskip("distcomm_attention.kernels.triton_rows")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("cols", [1, 40, 300])
def test_gather_rows_is_indexing(device, dtype, cols):
    """out[i] = x[index[i]] for any index (repeats, every row, none), into a fresh or a given buffer, and under
    another program shape: bit for bit."""
    g = torch.Generator().manual_seed(cols)
    x = (torch.randn(37, cols, generator=g) * 50).to(dtype).to(device)
    for index in (torch.randint(0, 37, (53,), generator=g), torch.randperm(37, generator=g),
                  torch.zeros(0, dtype=torch.int64)):
        index = index.to(device)
        want = x[index]
        assert torch.equal(triton_rows.gather_rows(x, index), want)
        out = torch.full_like(want, 7)
        assert triton_rows.gather_rows(x, index, out=out) is out and torch.equal(out, want)
        assert torch.equal(triton_rows.gather_rows(x, index, config=(2, 16, 1)), want)
        assert torch.equal(triton_rows.take_rows(x, index), want)  # index_select from 1 KB rows (cols 300, fp32)


def test_gather_rows_refuses_what_it_would_misread():
    """Strided inputs, indices or outputs (the kernel assumes stride 1) are refused, naming the argument."""
    x = torch.zeros(4, 6)
    with pytest.raises(ValueError, match="x must be a contiguous 2-D tensor"):
        triton_rows.gather_rows(x.t(), torch.arange(2))
    with pytest.raises(ValueError, match="index must be a contiguous 1-D int64"):
        triton_rows.gather_rows(x, torch.arange(4)[::2])
    with pytest.raises(ValueError, match="index must be a contiguous 1-D int64"):
        triton_rows.gather_rows(x, torch.arange(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        triton_rows.gather_rows(x, torch.arange(2), out=torch.zeros(6, 2).t())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("empty_only", [False, True])
@pytest.mark.parametrize("s", [45, 4100])
def test_nan_rows_marks_exactly_the_rows_holding_a_nan(device, dtype, empty_only, s):
    """lse becomes NaN where the output row holds a NaN, anywhere in the head dimension; with ``empty_only`` only
    where lse is -inf (a row reported as having seen no key): a NaN row with a finite lse keeps it, an empty row
    without a NaN stays -inf. Rows of +-inf values are not NaN rows; lse given as a transposed view (the packed
    calls' layout) is written in place. 4100 rows: programs walking several blocks of rows, the last one
    partly past the end."""
    g = torch.Generator().manual_seed(2)
    b, h, d = 2, 3, 24
    out = torch.randn(b, s, h, d, generator=g)
    out[0, 3, 1, 0] = out[1, 44, 2, 23] = out[1, 10, 0, 11] = out[0, 20, 2, 5] = float("nan")
    out[0, 5, 0, :] = float("inf")
    out[0, 6, 2, 3] = -float("inf")
    out = out.to(dtype)
    lse32 = torch.randn(h, b, s, generator=g)
    empty = [(0, 3, 1), (1, 44, 2), (1, 10, 0), (0, 5, 0), (0, 6, 2), (1, 30, 1)]
    if s > 45:  # one more reported empty and holding a NaN, in the last block of rows
        out[1, s - 2, 1, 7] = float("nan")
        empty.append((1, s - 2, 1))
    for b_, s_, h_ in empty:
        lse32[h_, b_, s_] = float("-inf")  # reported empty: three (four) hold a NaN, two +-inf, one nothing odd
    want = lse32.transpose(0, 1).double()
    bad = out.double().isnan().any(-1).transpose(1, 2)
    want.masked_fill_(bad & (want == float("-inf")) if empty_only else bad, float("nan"))
    lse = lse32.to(device).transpose(0, 1)  # (B, H, S), not contiguous
    got = triton_rows.nan_rows_(out.to(device), lse, empty_only=empty_only)
    assert got is lse
    assert torch.equal(got.isnan().cpu(), want.isnan())
    assert int(want.isnan().sum()) == (3 if empty_only else 4) + (s > 45)
    assert float(got[0, 2, 20]).__eq__(float(lse32[2, 0, 20])) == empty_only, "a NaN row with a finite lse"
    assert int((want == float("-inf")).sum()) == 3
    torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=0, equal_nan=True, check_dtype=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch, trailing", [(1, (3, 5)), (3, (300,)), (2, (2, 130))])
def test_sum_rows_adds_each_rows_terms_in_order_and_rounds_once(device, out_dtype, batch, trailing):
    """``sum_rows``: each row of a segment is the sum in fp32 of its terms' rows in the order given (terms of
    every dtype it reads, views with batch strides and row offsets), rounded once to out's dtype: bit for bit
    the same as adding them in that order in fp32 and rounding with PyTorch; rows in no segment are left as
    they were; a segment without terms is 0; more terms a row than SUM_TERMS are refused."""
    g = torch.Generator().manual_seed(batch)
    n = 23
    big = torch.randn(40, batch, *trailing, generator=g)  # row-major (rows, batch, ...): strided terms
    terms = [torch.randn(batch, 30, *trailing, generator=g).to(torch.bfloat16),
             big.transpose(0, 1)[:, 5:35],
             torch.randn(batch, n, *trailing, generator=g).to(torch.float16)]
    segments = [(0, 4, [(0, 0)]), (4, 9, [(1, 2), (0, -1), (2, 0)]), (11, 15, []), (15, 23, [(2, 0), (1, -10)])]
    out = torch.full((batch, n, *trailing), 7.0, dtype=out_dtype)
    want = out.clone()
    for r0, r1, parts in segments:
        for r in range(r0, r1):
            acc = None
            for t, off in parts:
                x = terms[t][:, r + off].float()
                acc = x if acc is None else acc + x
            want[:, r] = 0 if acc is None else acc.to(out_dtype)
    got = triton_rows.sum_rows(out.to(device), segments, [t.to(device) for t in terms]).cpu()
    bits = torch.int16 if out_dtype != torch.float32 else torch.int32
    assert torch.equal(got.view(bits), want.view(bits))
    assert bool((got[:, 9:11] == 7).all()), "rows in no segment are left as they were"
    with pytest.raises(ValueError, match="a row adds at most"):
        triton_rows.sum_rows(out.to(device), [(0, 1, [(0, 0)] * (triton_rows.SUM_TERMS + 1))], terms[:1])
    # the same segments over other terms (a later call of the same plan): the segments' table is the one made
    # before, the terms' addresses this call's
    made = triton_rows._segment_table.cache_info().misses
    others = [t * -2 for t in terms]
    again = triton_rows.sum_rows(torch.full_like(out, 7.0).to(device), segments, [t.to(device) for t in others]).cpu()
    assert triton_rows._segment_table.cache_info().misses == made
    want2 = got * -2  # (exact: a power of two scales each term, their sum and its rounding alike)
    want2[:, 9:11] = 7
    assert torch.equal(again, want2)


class _Mirror:
    """A transport whose all-to-all hands back what was sent: the packs and places are what is compared."""

    def all_to_all_v(self, send, send_splits, recv_splits):
        return Done(send.clone())


@pytest.mark.parametrize("groups,group", [(1, 0), (2, 0), (2, 1), (4, 3)])
def test_ulysses_packs_and_places_by_row_gather_match_the_permuted_copies(monkeypatch, groups, group):
    """Ulysses' send buffers and the placed results through the row gather (the interpreter stands in for the
    GPU) equal the permuted copies' bit for bit, for one head group or several."""
    g = torch.Generator().manual_seed(groups)
    b, n, degree, d = 2, 5, 4, 8
    heads = degree * groups * 2
    x = torch.randn(b, n, heads, d, generator=g).to(torch.bfloat16)
    copies = ulysses._post(_Mirror(), x, degree, group, groups).wait()[0]
    monkeypatch.setattr(ulysses, "_gathers", lambda t, row_elems=None: t.is_contiguous())
    gathered = ulysses._post(_Mirror(), x, degree, group, groups).wait()[0]
    assert gathered.shape == copies.shape == (degree, b, n, heads // (degree * groups), d)
    assert torch.equal(gathered, copies)
    if groups == 1:  # the way back: all a rank's heads from every rank's share
        y = torch.randn(degree, b, n, heads // degree, d, generator=g).to(torch.bfloat16)
        placed = ulysses._place([Done(y)], b, n, heads, d, degree, y.dtype, y.device)
        monkeypatch.undo()
        want = ulysses._place([Done(y)], b, n, heads, d, degree, y.dtype, y.device)
        assert torch.equal(placed, want)
        assert torch.equal(want, y.permute(1, 2, 0, 3, 4).reshape(b, n, heads, d))
