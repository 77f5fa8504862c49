"""NaN in means NaN out, through the public API on gloo worlds of CPU ranks, every strategy.

A NaN in one element of q, k or v must reach every output and gradient element that depends on it, and only
rows that truly see no key (padding) may come out as the "no visible key" case (out 0, gradients 0).

Which elements depend on the NaN is decided without the code under test: the float64 reference
(``_reference.attention_reference``) is run twice with that element set to two different finite values, and
an element whose reference differs between the two runs depends on it. Then on every rank:

    out   elements that depend on the NaN are NaN (whole rows for a NaN in q or k, one column of the rows
          that see the key for a NaN in v); for a NaN in q or k exactly those (the others equal the
          reference); for a NaN in v at least those (a kernel may multiply a zero weight by the NaN value in
          the same tile), and every finite element equals the reference
    dq, dk, dv
          elements that depend on the NaN are NaN; finite elements equal the reference (a kernel may also
          give NaN where a zero weight meets a NaN operand; for a NaN in q the other rows' dq are finite)
    rows with no visible key (left padding, causal): out exactly 0 and dq exactly 0
"""

import pytest
import torch

import distcomm_attention as da
from distcomm_attention._reference import attention_reference
from distcomm_attention.planning import layouts
from tests.dist_harness import run_world

TOL = {"float64": dict(rtol=1e-9, atol=1e-11), "float32": dict(rtol=2e-4, atol=2e-5)}
STRATEGIES = ("ring_flash_attn", "ring", "ulysses", "allgather", "auto")
N, D, B = 8, 16, 2


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _heads(w):
    return (6, 3) if w == 3 else (4, 2)


def _cases(w):
    seq = N * w
    cases = []
    for backend, dtype in (("torch", "float64"), ("triton", "float32")):
        for strategy in STRATEGIES:
            for where in ("q", "k", "v"):
                for layout, causal in (("zigzag", True), ("contiguous", False)):
                    if backend == "triton" and (layout, where) != ("zigzag", "k") and strategy != "ring":
                        continue  # the Triton interpreter is slow: one case per strategy, all of them for the ring
                    cases.append(dict(backend=backend, dtype=dtype, strategy=strategy, where=where, layout=layout,
                                      causal=causal, pos=seq // 2 - 1, pad=0, seed=len(cases)))
            # left padding: the first rows of batch element 1 see no key (causal); the NaN is in another row
            cases.append(dict(backend=backend, dtype=dtype, strategy=strategy, where="q", layout="zigzag",
                              causal=True, pos=seq - 2, pad=3, seed=len(cases)))
    return cases


def _inputs(case, w, value=float("nan")):
    """Global (q, k, v, dout, mask) in the case's dtype, with ``value`` in the chosen element."""
    h, hkv = _heads(w)
    seq = N * w
    g = torch.Generator().manual_seed(case["seed"])
    q = torch.randn(B, seq, h, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, seq, hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, seq, hkv, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, seq, h, D, generator=g, dtype=torch.float64)
    dtype = getattr(torch, case["dtype"])
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    target = {"q": q, "k": k, "v": v}[case["where"]]
    target[1, case["pos"], 1 if case["where"] == "q" else 0, 3] = value
    mask = None
    if case["pad"]:
        mask = torch.ones(B, seq, dtype=torch.bool)
        mask[1, :case["pad"]] = False
    return q, k, v, dout, mask


def _rank(rank, world):
    results = []
    for case in _cases(world):
        q, k, v, dout, mask = _inputs(case, world)
        index = layouts.positions(case["layout"], N * world, world, rank)
        q, k, v = (t.index_select(1, index).requires_grad_() for t in (q, k, v))
        local_mask = None if mask is None else mask.index_select(1, index)
        kw = dict(causal=case["causal"], layout=case["layout"], backend=case["backend"], attention_mask=local_mask)
        if case["strategy"] == "ring_flash_attn":
            out = da.ring_flash_attn(q, k, v, **kw)
        else:
            out = da.context_parallel_attn(q, k, v, strategy=case["strategy"], **kw)
        out.backward(dout.index_select(1, index))
        results.append({"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad})
    return results


def _reference(case, w, value):
    q, k, v, dout, mask = _inputs(case, w, value)
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attention_reference(q, k, v, causal=case["causal"], attention_mask=mask)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return dict(zip(("out", "dq", "dk", "dv"), (out.detach(), *grads)))


def _check(case, w, got_by_rank):
    ref_a, ref_b = _reference(case, w, 0.5), _reference(case, w, -0.75)
    assert bool((ref_a["out"] != ref_b["out"]).any()), "the element must matter to some output"
    tol = TOL[case["dtype"]]
    for r, got in enumerate(got_by_rank):
        index = layouts.positions(case["layout"], N * w, w, r)
        where = f"rank {r} of {w}, case {case}"
        for name in ("out", "dq", "dk", "dv"):
            a, b = ref_a[name].index_select(1, index), ref_b[name].index_select(1, index)
            x = got[name].double()
            dep = a != b
            assert x[dep].isnan().all(), f"{name}: {int((~x[dep].isnan()).sum())} elements that depend on the " \
                                         f"NaN are not NaN, {where}"
            finite = ~x.isnan()
            exact = name == "out" and case["where"] in "qk" or name == "dq" and case["where"] == "q"
            if exact:
                assert bool(finite[~dep].all()), f"{name}: NaN outside the elements that depend on it, {where}"
            torch.testing.assert_close(x[finite & ~dep], a[finite & ~dep], **tol,
                                       msg=lambda m, name=name: f"{name}, {where}: {m}")
        if case["pad"]:
            no_key = torch.zeros(B, N * w, dtype=torch.bool)
            no_key[1, :case["pad"]] = True
            rows = no_key.index_select(1, index)
            for name in ("out", "dq"):
                assert bool((got[name][rows] == 0).all()), f"{name}: a row with no visible key is not 0, {where}"


@pytest.mark.parametrize("world", [2, 3])
def test_nan_in_nan_out(world):
    """Every strategy and the CPU backends (exact torch in float64, Triton under the interpreter in float32):
    a NaN in q, k or v reaches exactly what depends on it; rows with no visible key stay 0."""
    results = run_world(_rank, world, timeout=600)
    for i, case in enumerate(_cases(world)):
        _check(case, world, [results[r][i] for r in range(world)])


def test_reference_keeps_nan_and_zeroes_rows_without_keys():
    """The reference itself: NaN in q reaches its row only; a row with no visible key gives 0 and zero grads."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    q[0, 4, 0, 1] = float("nan")
    mask = torch.tensor([[False, False, True, True, True, True]])
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attention_reference(q, k, v, causal=True, attention_mask=mask)
    rows_nan = out.isnan().any(-1)[0]
    assert rows_nan[:, 0].tolist() == [False, False, False, False, True, False]
    assert not rows_nan[:, 1].any()
    assert bool((out[0, :2] == 0).all())
    out.backward(torch.ones_like(out))
    assert bool((q.grad[0, :2] == 0).all())
    assert bool(q.grad[0, 4, 0].isnan().all()) and not q.grad[0, :4].isnan().any()
