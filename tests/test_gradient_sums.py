"""The ring's and the all-gather's sums of block gradients over a step's keys (``ring._sum_terms``): each row's
first term copied in, later ones added, rows no term reaches zero-filled; many terms added into zeros. Against
zeros plus every term added, in float64 and for bf16 terms into fp32: the same values, every row written
(the buffers start as garbage)."""

import pytest
import torch

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
