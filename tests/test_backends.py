"""The block backends ("cudnn", "fa4") on CPU, cheapest first; no GPU and no flash-attn-4 needed.

1. Pure functions: merging block outputs by logsumexp (distcomm_attention.kernels.contract) against one-shot
   attention, and the adapters' contract (a ring of one is the kernel's own result; dQ accumulates into the
   given buffer; dK/dV in the asked dtype).
2. The adapters on every block a ring of 1, 2 and 4 issues (tests/ring_sim.py), with exact float64 block
   kernels standing in for the GPU ones, against the float64 reference.
3. Backend selection with the environment simulated by monkeypatching (flash-attn-4 installed or not, the
   GPU's compute capability, cuDNN present or not): "auto" walks AUTO_PREFERENCE, a forced backend raises
   the reason it cannot run a call, and importing the package never imports flash_attn.
GPU runs of the real kernels: tests/test_gpu_backends.py.
"""

import importlib.metadata
import importlib.util
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import distcomm_attention as da
from distcomm_attention.kernels import cudnn as _cudnn
from distcomm_attention.kernels import fa4 as _fa4
from distcomm_attention.kernels import dispatch as _kernels
from distcomm_attention.kernels.contract import BlockBackward, BlockForward, MergeState, call_features, merge_block
from distcomm_attention._reference import attention_reference
from distcomm_attention.kernels.torch_exact import TorchBackward, TorchForward
from distcomm_attention.planning.visibility import CAUSAL, FULL, BlockMask, Visibility
from tests.ring_sim import simulate_ring

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
_PACKAGE_PROBLEM = _fa4._package_problem.__wrapped__  # uncached, read before any fixture replaces it


def _needs_triton():
    """Skip when triton is not installed (decided without importing it); an installed triton that fails to
    import fails the test."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")


# ------------------------------------------------------------------------------------- exact block kernels
class ExactBlockForward(BlockForward):
    """A block backend computed by the exact torch kernels (float64 for float64 input)."""

    def block(self, q, k, v, *, causal, scale, softcap):
        kernel = TorchForward()
        state = kernel.init_state(q)
        kernel.step(state, q, k, v, mask=CAUSAL if causal else FULL, scale=scale, softcap=softcap)
        return kernel.finalize(state, q.dtype)


class ExactBlockBackward(BlockBackward):
    def block(self, dout, q, k, v, out, lse, *, causal, scale, softcap):
        delta = (dout.double() * out.double()).sum(-1).transpose(1, 2)
        return TorchBackward().step(dout, q, k, v, out, lse, delta, mask=CAUSAL if causal else FULL, scale=scale,
                                    softcap=softcap)


def _window_mask(nq, nk, window):
    """FlashAttention's window over an nq x nk rectangle (bottom-right aligned) as row intervals."""
    left, right = window if window is not None else (None, None)
    r = torch.arange(nq)
    lo = torch.zeros(nq, dtype=torch.long) if left is None else (r + nk - nq - left).clamp(0, nk)
    hi = torch.full((nq,), nk) if right is None else (r + nk - nq + right + 1).clamp(0, nk)
    return BlockMask("interval", lo.to(torch.int32), torch.maximum(hi, lo).to(torch.int32))


def _segments(varlen, b):
    """(rows, keys) slices of each packed sequence of a varlen call: [cu[i], cu[i + 1]), or with segment lengths
    (Note [Packed steps]) [cu[i], cu[i] + used[i])."""
    cu_q, cu_k = varlen.cu_q.tolist(), varlen.cu_k.tolist()
    if varlen.used_q is None:
        return [(slice(a, c), slice(x, y)) for a, c, x, y in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])]
    return [(slice(a, a + m), slice(x, x + n)) for a, m, x, n in
            zip(cu_q, varlen.used_q.tolist(), cu_k, varlen.used_k.tolist())]


def _unwritten(shape, like, given):
    """An output buffer as FlashAttention treats it: the caller's (rows no segment covers keep its values), or
    a fresh one whose uncovered rows are garbage (NaN here, so that reading them fails the comparison)."""
    return given if given is not None else torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)


class WindowedExactForward(ExactBlockForward):
    """FlashAttention's window and varlen semantics, computed exactly: an independent stand-in for FA4
    (segment lengths and caller-given outputs included, as in Note [Packed steps])."""

    takes_windows = True
    packs = True

    def block(self, q, k, v, *, causal, scale, softcap, window=None, varlen=None, out=None, lse=None):
        if window is None and varlen is None:
            return super().block(q, k, v, causal=causal, scale=scale, softcap=softcap)
        kernel = TorchForward()
        if varlen is None:
            state = kernel.init_state(q)
            kernel.step(state, q, k, v, mask=_window_mask(q.shape[1], k.shape[1], window), scale=scale,
                        softcap=softcap)
            return kernel.finalize(state, q.dtype)
        out = _unwritten(q.shape, q, out)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        lse = _unwritten((q.shape[1], q.shape[0]), torch.empty(0, dtype=lse_dtype), lse)
        for rows, keys in _segments(varlen, 1):
            qs, ks, vs = q[None, rows], k[None, keys], v[None, keys]
            state = kernel.init_state(qs)
            kernel.step(state, qs, ks, vs, mask=_window_mask(qs.shape[1], ks.shape[1], window), scale=scale,
                        softcap=softcap)
            o, ls = kernel.finalize(state, q.dtype)
            out[rows], lse[:, rows] = o[0], ls[0].to(lse.dtype)
        return out, lse  # (total, H, D), (H, total)


class WindowedExactBackward(ExactBlockBackward):
    takes_windows = True
    packs = True

    def block(self, dout, q, k, v, out, lse, *, causal, scale, softcap, window=None, varlen=None, dq=None,
              dk=None, dv=None):
        if window is None and varlen is None:
            return super().block(dout, q, k, v, out, lse, causal=causal, scale=scale, softcap=softcap)
        if varlen is None:
            segments, batched = [(slice(None), slice(None))], (dout, q, k, v, out, lse)
        else:
            segments = _segments(varlen, 1)
            batched = (dout[None], q[None], k[None], v[None], out[None], lse[None])
        grads = [torch.zeros_like(x) for x in batched[1:4]]
        for rows, keys in segments:
            do, qs, ks, vs, o, ls = (x[:, rows] if i in (0, 1, 4) else x[:, :, rows] if i == 5 else x[:, keys]
                                     for i, x in enumerate(batched))
            delta = (do.double() * o.double()).sum(-1).transpose(1, 2)
            mask = _window_mask(qs.shape[1], ks.shape[1], window)
            g_q, g_k, g_v = TorchBackward().step(do, qs, ks, vs, o, ls, delta, mask=mask, scale=scale,
                                                 softcap=softcap)
            grads[0][:, rows] += g_q
            grads[1][:, keys] += g_k
            grads[2][:, keys] += g_v
        if varlen is None:
            return tuple(grads)
        result = [_unwritten(x.shape, x, given) for x, given in zip((q, k, v), (dq, dk, dv))]
        for rows, keys in segments:  # only the rows and keys of a segment are written
            result[0][rows] = grads[0][0, rows]
            result[1][keys] = grads[1][0, keys]
            result[2][keys] = grads[2][0, keys]
        return tuple(result)


def _qkv(b=2, s=32, h=4, hkv=2, d=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda n: torch.randn(b, s, n, d, generator=g, dtype=dtype)  # noqa: E731
    return make(h), make(hkv), make(hkv), make(h)


# ------------------------------------------------------------------------------------------- 1. merging
def test_a_nan_row_reported_empty_keeps_its_nan_through_a_merge():
    """A block kernel may report a row with a NaN score as one that saw no key (lse -inf, flash-attn-4 does)
    while its output holds the NaN. After ``finalize`` such a row's lse is NaN whether it stayed one block's
    (lse -inf) or was merged with a finite block (the merge's lse is finite, its output NaN), so the backward
    never takes it for an empty row; a row whose NaN comes with a finite lse (a NaN value) keeps that lse, and
    an empty row without a NaN stays -inf."""
    b, s, h, d = 1, 6, 2, 4
    g = torch.Generator().manual_seed(3)
    out_a, out_b = (torch.randn(b, s, h, d, generator=g) for _ in range(2))
    lse_a, lse_b = (torch.randn(b, h, s, generator=g) for _ in range(2))
    out_a[0, 1, 0, 2] = float("nan")  # reported empty, merged with block b below: NaN lse expected
    lse_a[0, 0, 1] = float("-inf")
    out_a[0, 3, 1, 0] = float("nan")  # reported empty, one block: NaN lse expected
    lse_a[0, 1, 3] = float("-inf")
    out_a[0, 4, 0, 1] = float("nan")  # a NaN with a finite lse, one block: kept
    lse_a[0, 1, 5] = float("-inf")  # empty, no NaN: stays -inf
    out_a[0, 5, 1] = 0.0
    state = MergeState(torch.Size((b, s, h, d)), torch.device("cpu"))
    merge_block(state, out_a, lse_a)
    merge_block(state, out_b[:, :2], lse_b[:, :, :2], slice(0, 2))
    out, lse = ExactBlockForward().finalize(state, torch.float32)
    assert bool(out[0, 1, 0].isnan().any()) and bool(lse[0, 0, 1].isnan())
    assert bool(lse[0, 1, 3].isnan())
    assert float(lse[0, 0, 4]) == float(lse_a[0, 0, 4]) and bool(out[0, 4, 0].isnan().any())
    assert float(lse[0, 1, 5]) == float("-inf")
    nan_lse = {(hh, r) for hh in range(h) for r in range(s) if bool(lse[0, hh, r].isnan())}
    assert nan_lse == {(0, 1), (1, 3)}


def test_merge_of_key_blocks_equals_one_shot_attention():
    """Blocks of keys merged by logsumexp give the one-shot output and lse (fp64 blocks: to rounding)."""
    q, k, v, _ = _qkv()
    kernel = ExactBlockForward()
    whole_out, whole_lse = kernel.block(q, k, v, causal=False, scale=0.3, softcap=0.0)
    state = kernel.init_state(q)
    for keys in (slice(0, 5), slice(5, 20), slice(20, 32)):
        kernel.step(state, q, k[:, keys], v[:, keys], mask=FULL, scale=0.3)
    out, lse = kernel.finalize(state, q.dtype)
    torch.testing.assert_close(out, whole_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, whole_lse, rtol=0, atol=1e-12)


def test_single_block_is_returned_as_the_kernel_made_it():
    """A block covering every row of a fresh state is adopted without a copy or a merge (a ring of one is one
    kernel call), with or without ``final``."""
    q, k, v, _ = _qkv(dtype=torch.float32)
    out_b, lse_b = torch.randn(q.shape), torch.randn(2, 4, 32)

    class Fixed(BlockForward):
        def block(self, q, k, v, *, causal, scale, softcap):
            return out_b, lse_b

    for final in (False, True):
        kernel = Fixed()
        state = kernel.init_state(q)
        kernel.step(state, q, k, v, mask=CAUSAL, scale=1.0, final=final, q_slice=slice(0, 32))
        out, lse = kernel.finalize(state, q.dtype)
        assert out is out_b and lse is lse_b and not state.merged


def test_rows_never_reached_finalize_to_zero_and_minus_inf():
    """Rows no block touched come out as 0 with lse -inf (the contract of every forward kernel); a partial
    first block's rows are kept as the kernel returned them (no fp32 state, no merge)."""
    q, k, v, _ = _qkv(dtype=torch.bfloat16)
    state = MergeState(q.shape, q.device)
    merge_block(state, torch.ones(2, 10, 4, 16, dtype=torch.bfloat16), torch.zeros(2, 4, 10), slice(3, 13))
    out, lse = ExactBlockForward().finalize(state, torch.bfloat16)
    assert state.acc is None and state.in_acc == [] and state.touched == [(3, 13)] and out.dtype == torch.bfloat16
    assert (out[:, :3] == 0).all() and (out[:, 13:] == 0).all() and (out[:, 3:13] == 1).all()
    assert torch.isinf(lse[:, :, :3]).all() and (lse[:, :, 3:13] == 0).all()
    empty = ExactBlockForward().finalize(MergeState(q.shape, q.device), torch.bfloat16)
    assert (empty[0] == 0).all() and (empty[1] == float("-inf")).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_blocks_merge_to_the_float64_combination(dtype):
    """Blocks over overlapping row ranges, none covering every row, merge to the float64 combination of the
    blocks that reached each row (lse = log sum exp, out = sum exp(lse_b - lse) out_b); a row one block reached
    is that block's output bit for bit, rows no block reached are 0 with lse -inf."""
    g = torch.Generator().manual_seed(3)
    shape = torch.Size((2, 16, 3, 8))
    spans = [(2, 7), (5, 12), (0, 3), (9, 11)]
    blocks = [(torch.randn(2, b - a, 3, 8, generator=g).to(dtype), torch.randn(2, 3, b - a, generator=g))
              for a, b in spans]
    state = MergeState(shape, torch.device("cpu"))
    for (a, b), (o, l) in zip(spans, blocks):
        merge_block(state, o, l, slice(a, b))
    out, lse = ExactBlockForward().finalize(state, dtype)
    for row in range(shape[1]):
        reached = [(o[:, row - a].double(), l[:, :, row - a].double()) for (a, b), (o, l) in zip(spans, blocks)
                   if a <= row < b]
        if not reached:
            assert (out[:, row] == 0).all() and (lse[:, :, row] == float("-inf")).all()
            continue
        ref_lse = torch.logsumexp(torch.stack([l for _, l in reached]), 0)
        ref = sum(torch.exp(l - ref_lse).unsqueeze(-1) * o for o, l in reached)
        if len(reached) == 1:
            assert torch.equal(out[:, row], reached[0][0].to(dtype)), row
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[:, row].double(), ref, atol=tol, rtol=tol)
        torch.testing.assert_close(lse[:, :, row].double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_merging_two_empty_rows_stays_finite():
    """Two blocks that both leave a row empty (lse -inf) merge to out 0, lse -inf, without NaN."""
    state = MergeState(torch.Size((1, 2, 1, 4)), torch.device("cpu"))
    lse = torch.tensor([[[float("-inf"), 0.0]]])
    merge_block(state, torch.zeros(1, 2, 1, 4), lse.clone(), slice(0, 2))
    merge_block(state, torch.zeros(1, 2, 1, 4), lse.clone(), slice(0, 2))
    merge_block(state, torch.ones(1, 2, 1, 4), lse.clone(), slice(0, 2))
    out, lse = ExactBlockForward().finalize(state, torch.float32)
    assert not out.isnan().any() and (out[0, 0] == 0).all() and lse[0, 0, 0] == float("-inf")


# the merge kernel's tests run it on the GPU when there is one, else under the Triton interpreter
_MERGE_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _attend64(q, k, v, keys):
    """float64 attention of every row of q (B, n, H, D) to the keys ``keys[i]`` (a list of key indices per row)
    -> out (B, n, H, D), lse (B, H, n); a row with no key: out 0, lse -inf."""
    b, n, h, d = q.shape
    s = torch.einsum("bihd,bjhd->bhij", q.double(), k.double())
    seen = torch.zeros(n, k.shape[1], dtype=torch.bool)
    for i, js in enumerate(keys):
        seen[i, list(js)] = True
    s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    return torch.einsum("bhij,bjhd->bihd", p, v.double()), lse


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("first_whole", [True, False])
def test_merge_state_of_overlapping_partial_blocks_matches_float64(fused, first_whole, monkeypatch):
    """Blocks over overlapping row ranges (some rows merged twice or more, some once, some never), merged by
    the state and finalized, equal float64 attention over the union of each row's keys; the merged rows are
    summed in fp32 and rounded once. ``fused``: the Triton merge kernel (interpreter on CPU)."""
    from distcomm_attention.kernels import triton_merge

    monkeypatch.setattr(triton_merge, "fused_available", lambda device: fused)
    if fused:
        _needs_triton()
    g = torch.Generator().manual_seed(3)
    b, n, h, d, nk = 2, 24, 3, 16, 40
    q, k, v = (torch.randn(b, m, h, d, generator=g) for m in (n, nk, nk))
    blocks = [(0, n, 0, 8)] if first_whole else []  # (rows, keys) of each block; disjoint key ranges
    blocks += [(4, 12, 8, 16), (8, 20, 16, 26), (2, 10, 26, 30), (21, 23, 30, 40)]
    state = MergeState(q.shape, _MERGE_DEVICE)
    for r0, r1, k0, k1 in blocks:
        out_b, lse_b = _attend64(q[:, r0:r1], k, v, [range(k0, k1)] * (r1 - r0))
        merge_block(state, out_b.to(_MERGE_DEVICE, BF16), lse_b.float().to(_MERGE_DEVICE), slice(r0, r1))
    out, lse = (x.cpu() for x in ExactBlockForward().finalize(state, BF16))
    keys = [[j for r0, r1, k0, k1 in blocks if r0 <= i < r1 for j in range(k0, k1)] for i in range(n)]
    ref_out, ref_lse = _attend64(q, k, v, keys)
    assert out.dtype == BF16 and lse.dtype == torch.float32
    # each block's output is rounded to bf16 once, the sum once: within two bf16 roundings of the reference
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    never = [i for i in range(n) if not keys[i]]
    assert never == ([] if first_whole else [0, 1, 20, 23]) and (out[:, never] == 0).all()
    assert torch.isinf(lse[:, :, never]).all()


@pytest.mark.parametrize("d", [16, 24])
def test_triton_merge_kernel_matches_the_formula_in_float64(d):
    """The fused merge (interpreter on CPU) on strided views, rows where one side or both are empty (-inf),
    src aliasing dst, against the merge formula evaluated in float64."""
    _needs_triton()
    from distcomm_attention.kernels.triton_merge import merge_rows

    g = torch.Generator().manual_seed(5)
    b, r, h = 2, 37, 3
    acc = torch.randn(b, r + 5, h, d, generator=g)  # dst = src: rows 5.. of a larger buffer
    out_b = torch.randn(b, r, h, d, generator=g).to(BF16)
    lse = torch.randn(b, h, r + 5, generator=g)
    lse_b = torch.randn(h, b, r, generator=g).transpose(0, 1)  # a transposed view, as the packed calls give
    lse[:, :, 5:9], lse_b[:, :, 2:6] = float("-inf"), float("-inf")  # old empty, new empty, both (rows 2, 3)
    a64, o64, l64, lb64 = acc[:, 5:].double(), out_b.double(), lse[:, :, 5:].double(), lse_b.double()
    acc, out_b, lse = acc.to(_MERGE_DEVICE), out_b.to(_MERGE_DEVICE), lse.to(_MERGE_DEVICE)
    lse_b = lse_b.transpose(0, 1).to(_MERGE_DEVICE).transpose(0, 1)
    new = torch.logaddexp(l64, lb64)
    w = lambda x: torch.where(new == float("-inf"), 0.0, torch.exp(x - new)).transpose(1, 2).unsqueeze(-1)  # noqa: E731
    expected = a64 * w(l64) + o64 * w(lb64)
    merge_rows(acc[:, 5:], acc[:, 5:], lse[:, :, 5:], out_b, lse_b)
    acc, lse = acc.cpu(), lse.cpu()
    torch.testing.assert_close(acc[:, 5:].double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:, :, 5:].double(), new, atol=1e-6, rtol=1e-6)
    assert torch.isinf(lse[:, :, 7:9]).all() and (acc[:, 7:9] == 0).all()


def test_block_backward_honours_the_contract():
    """dQ is added into ``dq_acc`` (and returned), dK/dV come in ``dkv_dtype``; empty blocks give zeros."""
    q, k, v, dout = _qkv(dtype=torch.float32)
    out, lse = ExactBlockForward().block(q, k, v, causal=True, scale=0.25, softcap=0.0)
    kernel = ExactBlockBackward()
    dq, dk, dv = kernel.step(dout, q, k, v, out, lse, mask=CAUSAL, scale=0.25)
    acc = torch.ones(q.shape, dtype=torch.float64)
    dq2, dk2, dv2 = kernel.step(dout, q, k, v, out, lse, mask=CAUSAL, scale=0.25, dq_acc=acc,
                                dkv_dtype=torch.float64)
    assert dq2 is acc and dk2.dtype == dv2.dtype == torch.float64
    torch.testing.assert_close(acc, 1 + dq.double())
    _, dk0, dv0 = kernel.step(dout, q, k[:, :0], v[:, :0], out, lse, mask=FULL, scale=0.25)
    assert dk0.shape == (2, 0, 2, 16) and dv0.shape == (2, 0, 2, 16)


def test_block_adapters_refuse_blocks_they_cannot_express():
    """Interval blocks and key masks are a ValueError naming the kernel (the selection never sends them)."""
    q, k, v, dout = _qkv()
    interval = BlockMask("interval", *(torch.zeros(32, dtype=torch.int32),) * 4)
    with pytest.raises(ValueError, match=r"ExactBlockForward: only full or causal blocks.*'interval'"):
        ExactBlockForward().step(ExactBlockForward().init_state(q), q, k, v, mask=interval, scale=1.0)
    with pytest.raises(ValueError, match=r"ExactBlockBackward: .*key mask given"):
        ExactBlockBackward().step(dout, q, k, v, q, torch.zeros(2, 4, 32), mask=FULL, scale=1.0,
                                  key_mask=torch.ones(2, 32, dtype=torch.bool))


# ------------------------------------------------------------------------------- 2. rings of exact blocks
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("ring_size", [1, 2, 4])
@pytest.mark.parametrize("case", [dict(causal=True), dict(causal=False), dict(causal=True, softcap=5.0)], ids=str)
def test_adapters_on_every_block_of_a_ring(case, ring_size, layout):
    """Forward merged block by block and backward from the merged out/lse, on the blocks a ring issues, equal
    float64 attention (GQA 2:1): the merge and the backward's use of global statistics are exact."""
    q, k, v, dout = _qkv(s=48, seed=ring_size)
    softcap = case.get("softcap", 0.0)
    out, dq, dk, dv = simulate_ring(q, k, v, dout, None, layout=layout, ring_size=ring_size,
                                    vis=Visibility(case["causal"]), scale=0.3, softcap=softcap,
                                    fwd=ExactBlockForward(), bwd=ExactBlockBackward())
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref = attention_reference(qr, kr, vr, causal=case["causal"], softmax_scale=0.3, softcap=softcap)
    grads = torch.autograd.grad(ref, (qr, kr, vr), dout)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref, *grads)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=name)


WINDOW_CASES = [
    dict(causal=True, window_size=(5, 0)),
    dict(causal=False, window_size=(7, 3)),
    dict(causal=False, window_size=(0, 9)),
    dict(causal=True, cu_seqlens=[0, 5, 6, 29, 48]),
    dict(causal=False, cu_seqlens=[0, 20, 48]),
    dict(causal=True, window_size=(6, 0), cu_seqlens=[0, 17, 30, 48], softcap=4.0),
    dict(causal=False, window_size=(11, 2), cu_seqlens=[0, 1, 33, 48]),
]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("ring_size", [1, 2, 3, 4])
@pytest.mark.parametrize("case", WINDOW_CASES, ids=str)
def test_window_calls_on_every_block_of_a_ring(case, ring_size, layout):
    """Windows and packed documents through a block backend that takes FlashAttention windows and varlen
    batches (as "fa4" does): every interval block of a ring of 1-4 ranks, split into band pieces and grouped
    into window calls, equals float64 attention under the visibility rule (GQA 2:1, batch 2)."""
    s = 48
    q, k, v, dout = _qkv(s=s, seed=7 * ring_size)
    window = case.get("window_size", (-1, -1))
    cu = case.get("cu_seqlens")
    vis = Visibility(case["causal"], window, None if cu is None else tuple(cu))
    softcap = case.get("softcap", 0.0)
    out, dq, dk, dv = simulate_ring(q, k, v, dout, None, layout=layout, ring_size=ring_size, vis=vis, scale=0.3,
                                    softcap=softcap, fwd=WindowedExactForward(), bwd=WindowedExactBackward())
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref = attention_reference(qr, kr, vr, causal=case["causal"], softmax_scale=0.3, softcap=softcap,
                              window_size=window, cu_seqlens=cu)
    grads = torch.autograd.grad(ref, (qr, kr, vr), dout)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref, *grads)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=name)


def _dense_pieces(pieces, nq, nk):
    """How often each (row, key) pair of a block is covered by the pieces, by FlashAttention's window rule."""
    count = torch.zeros(nq, nk, dtype=torch.int32)
    for p in pieces:
        a, b = p.q1 - p.q0, p.k1 - p.k0
        r, j = torch.arange(a)[:, None], torch.arange(b)[None, :]
        ok = torch.ones(a, b, dtype=torch.bool)
        if p.left is not None:
            ok &= j >= r + (b - a) - p.left
        if p.right is not None:
            ok &= j <= r + (b - a) + p.right
        count[p.q0:p.q1, p.k0:p.k1] += ok.int()
    return count


def test_band_pieces_partition_every_interval_block():
    """Random windows, documents, layouts and rings: the band pieces of each interval block cover exactly its
    visible pairs (by FlashAttention's bottom-right window rule), each pair once."""
    from distcomm_attention.planning.visibility import pieces_of, ring_plan

    rng = random.Random(0)
    checked = 0
    for _ in range(150):
        w, layout, n = rng.choice([1, 2, 3, 4]), rng.choice(["contiguous", "zigzag", "striped"]), rng.choice([8, 12, 16])
        cuts = sorted(rng.sample(range(1, n * w), rng.randint(1, 4)))
        cu = tuple([0] + cuts + [n * w]) if rng.random() < 0.5 else None
        vis = Visibility(rng.random() < 0.6, (rng.choice([-1, 0, 1, 3, 7, 20]), rng.choice([-1, 0, 2, 5])), cu)
        for rank in range(w):
            plan = ring_plan(layout, vis, w, rank, n)
            for i, blocks in enumerate(plan.blocks):
                for j, block in enumerate(blocks):
                    if block.mode != "interval":
                        continue
                    lo, hi = (a.long() for a in block.intervals[:2])
                    nq, nk = lo.numel(), block.kv.stop - block.kv.start
                    keys = torch.arange(nk)[None, :]
                    want = ((keys >= lo[:, None]) & (keys < hi[:, None])).int()
                    got = _dense_pieces(pieces_of(plan.mask(i, j, torch.device("cpu"))), nq, nk)
                    assert torch.equal(got, want), (layout, vis, rank, i)
                    checked += 1
    assert checked > 300


def _random_intervals(rng, most: int, jump: float, steps, empty: float = 0.0):
    """(nq, nk, row_lo, row_hi) of up to ``most`` rows and keys: each row's interval jumps anywhere with
    probability ``jump``, else both ends step by one of ``steps``; with probability ``empty`` a row sees no key."""
    nq, nk = rng.randint(1, most), rng.randint(1, most)
    lo, hi, a, b = [], [], rng.randint(0, nk), rng.randint(0, nk)
    for _ in range(nq):
        if rng.random() < jump:
            a, b = rng.randint(0, nk), rng.randint(0, nk)
        else:
            a, b = (min(nk, max(0, x + rng.choice(steps))) for x in (a, b))
        lo.append(a)
        hi.append(a if empty and rng.random() >= 1 - empty else max(a, b))
    return nq, nk, lo, hi


def test_band_pieces_by_whole_arrays_equal_the_row_by_row_pass():
    """``band_pieces`` (whole-array splitting rounds) gives the pieces of the row-by-row pass on random row
    intervals (jumps, shrinking rows, empty rows, both ends moving), and where the runs need more splitting
    rounds than it takes (an end alternating between moving and stopping) it is that pass."""
    from distcomm_attention.planning import visibility

    rng = random.Random(5)
    for _ in range(5000):
        _, _, lo, hi = _random_intervals(rng, 40, 0.25, [-1, 0, 0, 1, 1, 2], empty=0.1)
        lo_t, hi_t = torch.tensor(lo, dtype=torch.int32), torch.tensor(hi, dtype=torch.int32)
        assert visibility.band_pieces(lo_t, hi_t) == visibility._band_pieces_by_rows(lo_t, hi_t), (lo, hi)
    lo_t = torch.arange(200) // 2  # a split every other row: more rounds than _BAND_ROUNDS
    hi_t = torch.arange(200) + 50
    pieces = visibility.band_pieces(lo_t, hi_t)
    assert pieces == visibility._band_pieces_by_rows(lo_t, hi_t) and len(pieces) > visibility._BAND_ROUNDS


def test_window_calls_keep_each_piece_exact_on_arbitrary_intervals():
    """Any row intervals (not only the planner's: jumps, shrinking rows, empty rows): the band pieces cover the
    visible pairs once with windows that are never negative, and each segment of every grouped window call,
    under the call's shared window, sees exactly its piece's pairs (no bound clips or widens a piece)."""
    from distcomm_attention.kernels.contract import window_calls
    from distcomm_attention.planning.visibility import band_pieces

    rng = random.Random(1)
    for _ in range(2000):
        nq, nk, lo, hi = _random_intervals(rng, 12, 0.5, [-1, 0, 1, 1, 2])
        lo_t, hi_t = torch.tensor(lo), torch.tensor(hi)
        keys = torch.arange(nk)[None, :]
        pieces = band_pieces(lo_t, hi_t)
        want = ((keys >= lo_t[:, None]) & (keys < hi_t[:, None])).int()
        assert torch.equal(_dense_pieces(pieces, nq, nk), want), (lo, hi, pieces)
        assert all(w is None or w >= 0 for p in pieces for w in (p.left, p.right)), pieces
        for call in window_calls(pieces):
            cu_q, cu_k = call.cu_q or (0, call.q1 - call.q0), call.cu_k or (0, call.k1 - call.k0)
            members = [p for p in pieces if call.q0 <= p.q0 and p.q1 <= call.q1]
            assert len(members) == len(cu_q) - 1, (call, pieces)
            for p, q0, q1, k0, k1 in zip(members, cu_q, cu_q[1:], cu_k, cu_k[1:]):
                seg = (call.q0 + q0, call.q0 + q1, call.k0 + k0, call.k0 + k1)
                assert seg == p[:4], (call, p)
                assert torch.equal(_dense_pieces([p._replace(left=call.window[0], right=call.window[1])], nq, nk),
                                   _dense_pieces([p], nq, nk)), (call, p)


def _shared_window(group):
    """The window rule written out: pieces share a window side iff their finite bounds on it agree, and that
    bound is at least each unbounded piece's extent minus one (so it clips none of them)."""
    out = []
    for bound_of, extent_of in ((lambda p: p.left, lambda p: p.k1 - p.k0), (lambda p: p.right, lambda p: p.q1 - p.q0)):
        finite = [bound_of(p) for p in group if bound_of(p) is not None]
        if len(set(finite)) > 1:
            return False, None
        bound = finite[0] if finite else None
        if bound is not None and any(bound < extent_of(p) - 1 for p in group if bound_of(p) is None):
            return False, None
        out.append(bound)
    return True, tuple(out)


def test_fits_follows_the_window_rule_on_random_groups():
    """``fits`` (grown one piece at a time) agrees with the rule written out, on random groups of pieces."""
    from distcomm_attention.planning.calls import fits
    from distcomm_attention.planning.visibility import Piece

    rng = random.Random(3)
    agreed = {True: 0, False: 0}
    for _ in range(3000):
        group = []
        for _ in range(rng.randint(1, 6)):
            q0, k0 = rng.randint(0, 20), rng.randint(0, 20)
            group.append(Piece(q0, q0 + rng.randint(1, 9), k0, k0 + rng.randint(1, 9),
                               rng.choice([None, None, -2, 0, 3, 8]), rng.choice([None, 0, 0, -3, 2, 8])))
        ok, window = _shared_window(group)
        got_ok, got_window = fits(group)
        assert got_ok == ok, group
        if ok:
            assert got_window == window, group
        agreed[ok] += 1
    assert min(agreed.values()) > 300  # both answers exercised


def test_window_calls_are_grouped_once_per_pieces():
    """Grouping a block's pieces is cached: the same pieces give the same calls object (hundreds of documents'
    pieces are grouped once, not on every call of a layer)."""
    from distcomm_attention.kernels.contract import window_calls
    from distcomm_attention.planning.visibility import pieces_of, ring_plan

    cu = tuple(range(0, 4096, 16)) + (4096,)
    plan = ring_plan("contiguous", Visibility(True, cu_seqlens=cu), 1, 0, 4096)
    pieces = pieces_of(plan.mask(0, 0, torch.device("cpu")))
    first = window_calls(pieces)
    assert window_calls(tuple(pieces)) is first
    assert sum(len(c.cu_q or (0, 0)) - 1 for c in first) == len(pieces)


def test_packed_documents_are_one_varlen_call_per_block():
    """A diagonal block of packed documents is one packed call (varlen over the documents), and a causal window
    on the contiguous layout one plain window call per block."""
    from distcomm_attention.kernels.contract import window_calls
    from distcomm_attention.planning.visibility import pieces_of, ring_plan

    docs = Visibility(True, cu_seqlens=(0, 100, 300, 301, 1024))
    plan = ring_plan("contiguous", docs, 1, 0, 1024)
    (call,) = window_calls(pieces_of(plan.mask(0, 0, torch.device("cpu"))))
    assert call.cu_q == call.cu_k == (0, 100, 300, 301, 1024) and call.window == (None, 0)
    band = Visibility(True, window=(100, 0))
    for rank in range(4):
        plan = ring_plan("contiguous", band, 4, rank, 256)
        for i, blocks in enumerate(plan.blocks):
            for j, block in enumerate(blocks):
                if block.mode == "interval":
                    (call,) = window_calls(pieces_of(plan.mask(i, j, torch.device("cpu"))))
                    assert call.cu_q is None and call.window[0] is not None


def _block_backend_cases(world, dtype):
    from tests import test_ring_features as rf

    return [dict(c, dtype=dtype) for c in rf._feature_cases(world) if "pad" not in c]


def _block_backend_ring_rank(rank, world, dtype):
    """Every feature case but padding through the real ring loop (gloo, communication included) with the
    exact FlashAttention-semantics stand-ins as the block backend."""
    from tests import test_ring_features as rf

    def stand_ins(backend, q, vis=Visibility(), softcap=0.0):
        return "fa4", WindowedExactForward(), WindowedExactBackward()

    _kernels.select_kernels = stand_ins  # this rank's process only
    return [rf._run_case(c) for c in _block_backend_cases(world, dtype)]


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize("world", [2, 3])
def test_block_backends_in_a_gloo_ring(world, dtype):
    """A block backend that takes windows in the ring proper (gloo): merged forward, backward from the merged
    out/lse with the block kernels' own delta, dK/dV sent home, windows and documents as window calls; outputs
    and gradients equal the float64 reference. In bf16 the kernels' dK/dV come back in bf16 while the ring sums
    in fp32: every rank must send the same dtype whatever its blocks (a rank with one block and a rank with
    several disagreed once, and the transfer failed)."""
    from tests import test_ring_features as rf
    from tests.dist_harness import run_world

    results = run_world(_block_backend_ring_rank, world, dtype)
    tol = rf.FP64 if dtype == "float64" else dict(rtol=2e-2, atol=3e-2)
    for i, case in enumerate(_block_backend_cases(world, dtype)):
        rf._check(case, [results[r][i] for r in range(world)], tol=tol)


# --------------------------------------------------------------------------------------------- 3. selection
@pytest.fixture
def hopper(monkeypatch):
    """A simulated machine: flash-attn-4 installed, cuDNN 9.1, an sm90 GPU, triton importable."""
    monkeypatch.setattr(_fa4, "_package_problem", lambda: None)
    monkeypatch.setattr(_fa4, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(_cudnn, "_cudnn_version", lambda: 90100)
    monkeypatch.setattr(_cudnn, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(_kernels, "_cuda_capability", lambda device: (9, 0))
    monkeypatch.setattr(_kernels, "_triton_importable", lambda: True)
    return monkeypatch


def _auto(vis=Visibility(True), softcap=0.0, dtype=BF16, head_dim=128):
    return _kernels.resolve_backend("auto", CUDA, dtype, vis, softcap, head_dim=head_dim, batch=1)[0]


def test_auto_walks_the_preference(hopper):
    """auto takes the first backend of AUTO_PREFERENCE that can run the call; features and GPUs a backend
    cannot take move the call down the list."""
    assert _auto() == "fa4"
    assert _auto(softcap=20.0) == "fa4"
    assert _auto(Visibility(True, window=(64, 0))) == "fa4"
    assert _auto(Visibility(True, cu_seqlens=(0, 5, 8))) == "fa4"
    assert _auto(Visibility(False, key_mask=True)) == "triton"
    assert _auto(dtype=torch.float32) == "torch"
    hopper.setattr(_fa4, "_package_problem", lambda: "backend='fa4' needs flash-attn-4")
    assert _auto() == "cudnn"
    assert _auto(Visibility(True, window=(64, 0))) == "triton"
    assert _auto(softcap=20.0) == "triton"
    hopper.setattr(_cudnn, "_capability", lambda device: (7, 5))
    hopper.setattr(_kernels, "_cuda_capability", lambda device: (7, 5))
    assert _auto() == "triton"
    reason = _kernels.resolve_backend("auto", CUDA, BF16, Visibility(True), head_dim=128, batch=1)[1]
    assert "skipped: fa4: backend='fa4' needs flash-attn-4; cudnn:" in reason and "sm75" in reason


def test_auto_follows_the_measured_order(hopper):
    """The committed AUTO_PREFERENCE is the measured order (docs/bench/backends.md): fa4, cudnn, triton."""
    assert _kernels.AUTO_PREFERENCE[:3] == ("fa4", "cudnn", "triton")
    assert _auto() == "fa4"
    assert set(_kernels.AUTO_PREFERENCE) <= set(_kernels.BACKENDS) - {"auto"}


def test_which_kernels_names_the_block_kernels(hopper):
    """The choice reports the backend, its kernel classes and why (choose: the function which_kernels runs)."""
    q = SimpleNamespace(shape=(1, 256, 8, 128), device=CUDA, dtype=BF16)
    choice = _kernels.choose("auto", q, Visibility(True), 0.0)
    assert choice[:3] == ("fa4", "FA4Forward", "FA4Backward") and "AUTO_PREFERENCE" in choice.reason
    assert _kernels.choose("cudnn", q, Visibility(False), 0.0)[:3] == ("cudnn", "CudnnForward", "CudnnBackward")


def test_missing_flash_attn_4_is_an_import_error(hopper):
    """On a Hopper GPU without flash-attn-4, backend='fa4' raises ImportError saying what to install."""
    hopper.setattr(_fa4, "_module_available", lambda name: False)
    hopper.setattr(_fa4, "_package_problem", _PACKAGE_PROBLEM)
    with pytest.raises(ImportError, match=r'^backend=\'fa4\' needs flash-attn-4.*pip install "distcomm\[fa4\]"'):
        _kernels.resolve_backend("fa4", CUDA, BF16, Visibility(True), head_dim=128, batch=1)
    # uncached: a process that has used flash-attn-4 before holds its interface in the cache
    hopper.setattr(_fa4, "_interface", _fa4._interface.__wrapped__)
    with pytest.raises(ImportError, match=r"needs flash-attn-4"):
        _fa4.FA4Forward()


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("installed", [False, True])
def test_fa4_on_cpu_names_the_hardware_first(monkeypatch, dtype, installed):
    """On a CPU machine backend='fa4' says first that it needs a Hopper/Blackwell GPU and CUDA fp16/bf16
    tensors, naming the device and dtype it got, and only then (when flash-attn-4 is missing too) how to
    install it: "pip install distcomm[fa4]" alone sent users to install a package they cannot run."""
    monkeypatch.setattr(_fa4, "_module_available", lambda name: installed)
    monkeypatch.setattr(_fa4, "_package_problem", _PACKAGE_PROBLEM)
    if installed:
        monkeypatch.setattr(importlib.metadata, "version", lambda name: _fa4.VERIFIED_VERSION)
    q = torch.zeros(1, 8, 2, 64, dtype=dtype)
    hardware = (r"^backend='fa4' needs a Hopper \(sm90\) or Blackwell \(sm100\) GPU and CUDA float16/bfloat16 "
                rf"tensors, got {dtype} tensors on cpu; use backend='torch'")
    install = r'\. Also: backend=\'fa4\' needs flash-attn-4 .*: pip install "distcomm\[fa4\]"'
    with pytest.raises(ValueError, match=hardware + (".*" if installed else ".*" + install)) as info:
        da.ring_flash_attn(q, q, q, causal=True, backend="fa4")
    assert ("pip install" in str(info.value)) is not installed
    with pytest.raises(ValueError, match=hardware):
        da.which_kernels(q, causal=True, backend="fa4")


def test_unverified_flash_attn_4_release_is_refused(monkeypatch):
    """A flash-attn-4 release outside the verified range is an ImportError naming the installed version."""
    monkeypatch.setattr(_fa4, "_module_available", lambda name: True)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "4.0.0b20")
    with pytest.raises(ImportError, match=r"flash-attn-4 4.0.0b20 is installed.*>= 4.0.0b36, < 4.1"):
        raise ImportError(_fa4._package_problem.__wrapped__())
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "4.0.0b36")
    assert _fa4._package_problem.__wrapped__() is None


def test_forced_fa4_names_what_is_missing(hopper):
    """Forcing fa4 where it cannot run raises the reason: CPU tensors, no GPU, an older GPU, fp32, head_dim."""
    def forced(device=CUDA, dtype=BF16, head_dim=128, vis=Visibility(True), softcap=0.0):
        return _kernels.resolve_backend("fa4", device, dtype, vis, softcap, head_dim=head_dim, batch=1)

    assert forced() == ("fa4", "requested")
    assert forced(softcap=30.0)[0] == "fa4"
    with pytest.raises(ValueError, match=r"needs a Hopper .* CUDA float16/bfloat16 tensors, got torch.bfloat16 "
                                         r"tensors on cpu; use backend='torch'"):
        forced(device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"needs a Hopper .* CUDA float16/bfloat16 tensors, got torch.float32 "
                                         r"tensors on cuda; use backend='torch'"):
        forced(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"backend='fa4': head_dim=264 is not supported on sm90"):
        forced(head_dim=264)
    hopper.setattr(_fa4, "_capability", lambda device: None)
    with pytest.raises(ValueError, match=r"backend='fa4' needs a Hopper .* on cuda, but CUDA is not available"):
        forced()
    hopper.setattr(_fa4, "_capability", lambda device: (8, 0))
    with pytest.raises(ValueError, match=r"needs a Hopper \(sm90\) or Blackwell \(sm100\) GPU .*, got an sm80 GPU"):
        forced()
    hopper.setattr(_fa4, "_capability", lambda device: (10, 0))
    assert forced()[0] == "fa4"
    with pytest.raises(ValueError, match=r"head_dim=256 is not supported on sm100 .*up to 128"):
        forced(head_dim=256)


@pytest.mark.parametrize("kwargs, match", [
    (dict(window_size=(16, 0)), r"window_size=\(16, 0\)"),
    (dict(attention_mask=torch.ones(1, 8, dtype=torch.bool)), r"attention_mask"),
    (dict(cu_seqlens=[0, 3, 8]), r"cu_seqlens \(packed documents\)"),
])
def test_forced_block_backends_refuse_unsupported_features(kwargs, match):
    """cudnn forced with a window, padding or documents, and fa4 forced with padding, raise a ValueError
    naming the feature, on any machine (the feature check comes first), and point to triton."""
    q = torch.zeros(1, 8, 2, 64, dtype=BF16)
    backends = ("fa4", "cudnn") if "attention_mask" in kwargs else ("cudnn",)
    for backend in backends:
        with pytest.raises(ValueError, match=rf"backend='{backend}' runs .*{match}.*backend='triton'"):
            da.ring_flash_attn(q, q, q, causal=True, backend=backend, **kwargs)


def test_fa4_takes_windows_and_documents():
    """Windows, packed documents and softcap are fa4's (window/varlen calls); only a key mask is not."""
    for vis in (Visibility(True, window=(16, 0)), Visibility(False, window=(3, 5)),
                Visibility(True, cu_seqlens=(0, 3, 8)), Visibility(True, (4, 0), (0, 3, 8))):
        assert _fa4.unsupported_feature(vis, 30.0) is None
    assert "attention_mask" in _fa4.unsupported_feature(Visibility(True, key_mask=True), 0.0)


def test_cudnn_takes_no_softcap_and_fa4_does():
    """Softcap: fa4 computes it, cudnn (plain attention only) refuses it."""
    assert _fa4.unsupported_feature(Visibility(True), 30.0) is None
    assert "softcap=30.0" in _cudnn.unsupported_feature(Visibility(True), 30.0)
    assert call_features(Visibility(True, window=(-1, 0)), 0.0) == {}  # a causal "window" is plain causal


def test_forced_cudnn_names_what_is_missing(hopper):
    """cudnn without cuDNN is an ImportError; before sm80, or head_dim above 128, a ValueError."""
    def forced(head_dim=128):
        return _kernels.resolve_backend("cudnn", CUDA, BF16, Visibility(True), head_dim=head_dim, batch=1)

    assert forced() == ("cudnn", "requested")
    with pytest.raises(ValueError, match=r"backend='cudnn': head_dim=256 is not supported"):
        forced(head_dim=256)
    hopper.setattr(_cudnn, "_capability", lambda device: (7, 5))
    with pytest.raises(ValueError, match=r"cuDNN attention needs sm80\+.*got sm75"):
        forced()
    hopper.setattr(_cudnn, "_cudnn_version", lambda: None)
    with pytest.raises(ImportError, match=r"backend='cudnn' needs PyTorch built with cuDNN >= 9.0.*found no cuDNN"):
        forced()


def test_auto_without_any_usable_backend_says_so(monkeypatch):
    """With no block backend usable and triton missing, auto raises ImportError naming triton and each
    skipped backend's reason."""
    monkeypatch.setattr(_fa4, "_package_problem", lambda: "backend='fa4' needs flash-attn-4")
    monkeypatch.setattr(_fa4, "_capability", lambda device: (9, 0))  # the package is the only problem
    monkeypatch.setattr(_cudnn, "_cudnn_version", lambda: None)  # a torch build without cuDNN, even on a GPU
    monkeypatch.setattr(_kernels, "_triton_importable", lambda: False)
    with pytest.raises(ImportError, match=r"backend='auto' on CUDA torch.bfloat16 .*pip install triton.*"
                                          r"fa4: backend='fa4' needs flash-attn-4.*backend='torch'"):
        _auto()


def test_backend_names():
    """The new backends are valid names; an unknown one lists them all."""
    assert {"cudnn", "fa4"} <= set(_kernels.BACKENDS)
    q = torch.zeros(1, 4, 2, 16)
    with pytest.raises(ValueError, match=r"Invalid backend 'fa5'. Must be one of: .*'cudnn', 'fa4'"):
        da.ring_flash_attn(q, q, q, backend="fa5")


def test_importing_the_package_never_imports_flash_attn():
    """flash-attn-4 is imported only when its kernels are built, never by importing the package or by a
    capability check."""
    code = (
        "import sys, torch\n"
        "from distcomm_attention.kernels import fa4 as _fa4, dispatch as _kernels\n"
        "from distcomm_attention.planning.visibility import Visibility\n"
        "_fa4.can_use(torch.device('cuda'), torch.bfloat16, 128, Visibility(True), 0.0)\n"
        "cute = [m for m in sys.modules if m == 'flash_attn.cute' or m.startswith('flash_attn.cute.')]\n"
        "assert not cute, cute\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _packed_cases():
    """(cu_seqlens, seq, world, left window or None): documents of one token, one longer than S / 2, boundaries
    crossing ranks; balanced placements with and without a balance window."""
    rng = random.Random(5)
    cases = []
    for world in (1, 2, 3, 4):
        seq = 24 * world
        for kind in ("long", "mixed", "ones"):
            if kind == "long":
                cut = seq // 2 + rng.randint(1, seq // 4)
                cu = [0, cut] + sorted(rng.sample(range(cut + 1, seq), 2)) + [seq]
            elif kind == "mixed":
                cu = [0] + sorted(rng.sample(range(1, seq), 5)) + [seq]
            else:
                cu = [0, 1, 2, 3] + sorted(rng.sample(range(4, seq), 3)) + [seq]
            cases += [(tuple(cu), seq, world, None), (tuple(cu), seq, world, 5)]
    return cases


@pytest.mark.parametrize("case", _packed_cases(), ids=str)
def test_packed_steps_with_the_balanced_layout(case):
    """Note [Packed steps]: with the balanced layout every ring step's pieces run in few varlen calls (segment
    offsets and lengths, caller-given outputs) through the FA4 stand-in; outputs and gradients equal float64
    attention, and without a window each step is ONE forward call and at most two backward calls."""
    from distcomm_attention.planning import balance
    from distcomm_attention.planning.visibility import ring_plan
    from distcomm_attention.strategies.ring import packed

    cu, seq, world, left = case
    window = (-1, -1) if left is None else (left, 0)
    assignment = balance.balanced(cu, seq, world, window)
    vis = Visibility(True, window, cu)
    q, k, v, dout = _qkv(b=2, s=seq, seed=seq + world)
    fwd, bwd = WindowedExactForward(), WindowedExactBackward()
    out, dq, dk, dv = simulate_ring(q, k, v, dout, None, layout=assignment, ring_size=world, vis=vis, scale=0.3,
                                    softcap=3.0, fwd=fwd, bwd=bwd)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref = attention_reference(qr, kr, vr, causal=True, softmax_scale=0.3, softcap=3.0, window_size=window,
                              cu_seqlens=list(cu))
    grads = torch.autograd.grad(ref, (qr, kr, vr), dout)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref, *grads)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=name)
    cpu = torch.device("cpu")
    for rank in range(world):
        plan = ring_plan(assignment, vis, world, rank, seq // world)
        for i in range(len(plan.steps)):
            calls_f = packed(plan, i, fwd, None, cpu, backward=False)
            calls_b = packed(plan, i, bwd, None, cpu, backward=True)
            if calls_f is None:  # no packed pieces at this step: plain blocks
                assert all(b.mode != "interval" for b in plan.blocks[i])
                continue
            if left is None:
                assert len(calls_f) <= 1 and len(calls_b) <= 2, (rank, i, calls_f, calls_b)
            for call in calls_b:  # the backward's segments never share a key
                keys = [(p.k0, p.k1) for p in call.pieces]
                assert all(a1 <= b0 for (_, a1), (b0, _) in zip(keys, keys[1:]))


def test_packed_and_window_calls_put_every_index_on_the_device(monkeypatch, request):
    """A packed call's and a window call's index tensors are cached on the host and reach another device each
    through ``_device.on_device`` (every one of them: boundaries, segment lengths, the gathered key index),
    looked up once per stream that reads them (``on_device_kept``; each time while a graph is captured);
    the host cache stays on the host. Checked with a stand-in for on_device that records what it moves, and
    stand-in streams."""
    from distcomm_attention import _device
    from distcomm_attention.kernels import contract
    from distcomm_attention.planning import balance
    from distcomm_attention.planning.plans import gathered_plan
    from distcomm_attention.strategies.ring import packed

    moved, reader = [], [(0, 1)]

    def on_device(index, device):
        moved.append(index)
        return index.to("meta")

    monkeypatch.setattr(contract, "on_device", on_device)
    monkeypatch.setattr(_device, "_reader", lambda device: reader[0])
    # the host caches start and end empty: what this test keeps on their anchors (meta tensors under stand-in
    # streams) goes with them, and nothing kept by a run before this one is found
    for cache in (contract._packed_host, contract._varlen_host):
        cache.cache_clear()
        request.addfinalizer(cache.cache_clear)
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    seq, world = 96, 4
    cu = (0, 10, 13, 40, 43, 88, 94, 96)  # rank 0's backward: one call of gathered key runs, one not
    plan = gathered_plan(balance.balanced(cu, seq, world, (-1, -1)), Visibility(True, cu_seqlens=cu), world, 0,
                         seq // world)
    calls = packed(plan, 0, WindowedExactBackward(), None, cpu, True)
    assert sorted(contract._packed_host(c, 1, seq // world, seq).key_index is not None for c in calls) == [False, True]
    for call in calls:
        for batch in (1, 2):
            moved.clear()
            host = contract._packed_host(call, batch, seq // world, seq)
            got = contract._packed_varlen(call, batch, seq // world, seq, gpu)
            tensors = [host.varlen.cu_q, host.varlen.cu_k, host.varlen.used_q, host.varlen.used_k, host.key_index]
            assert [id(t) for t in moved] == [id(t) for t in tensors if t is not None]
            assert all(t.device.type == "cpu" for t in tensors if t is not None)
            for want, t in zip(tensors, (got.varlen.cu_q, got.varlen.cu_k, got.varlen.used_q, got.varlen.used_k,
                                         got.key_index)):
                assert (want is None and t is None) or (t.device.type == "meta" and t.shape == want.shape)
            assert contract._packed_varlen(call, batch, seq // world, seq, cpu) is host  # the host path: as cached
            moved.clear()
            assert contract._packed_varlen(call, batch, seq // world, seq, gpu) is got and moved == []  # kept
            reader[0] = (0, 2)  # another stream: through on_device again (which makes it wait for the copies)
            again = contract._packed_varlen(call, batch, seq // world, seq, gpu)
            assert again is not got and len(moved) == len([t for t in tensors if t is not None])
            reader[0] = None  # a graph being captured: nothing kept
            assert contract._packed_varlen(call, batch, seq // world, seq, gpu) is not again
            assert contract._packed_varlen(call, batch, seq // world, seq, gpu) is not again
            reader[0] = (0, 1)
    window = contract.WindowCall(0, 8, 0, 8, (None, 0), (0, 3, 8), (0, 3, 8))
    moved.clear()
    varlen = contract._varlen(window, 2, gpu)
    host = contract._varlen_host(window, 2)
    assert [id(t) for t in moved] == [id(host.cu_q), id(host.cu_k)] and varlen.cu_q.device.type == "meta"
    assert host.cu_q.tolist() == [0, 3, 8, 11, 16]
    moved.clear()
    assert contract._varlen(window, 2, gpu) is varlen and moved == []  # kept for this stream
    reader[0] = (0, 2)
    assert contract._varlen(window, 2, gpu) is not varlen and len(moved) == 2  # another stream: looked up again


def test_all_gather_packed_calls_with_the_balanced_layout():
    """All-gather KV's one step with the balanced layout through the FA4 stand-in, batch 1 and 2: each rank's
    queries against the whole gathered sequence in packed calls, outputs and the summed dK/dV equal float64
    attention. A rank's documents lie scattered over the gathered keys: calls whose key runs fill less than a
    third of their span hand the kernel only those runs, gathered (both kinds of call occur here)."""
    from distcomm.ring import RingComm
    from distcomm_attention.kernels.contract import _packed_varlen
    from distcomm_attention.planning import balance
    from distcomm_attention.planning.plans import gathered_plan
    from distcomm_attention.strategies.allgather import local_backward
    from distcomm_attention.strategies.ring import packed, ring_forward

    rng = random.Random(11)
    fwd, bwd, cpu = WindowedExactForward(), WindowedExactBackward(), torch.device("cpu")
    gathered = set()
    for world, seq, batch in ((4, 96, 1), (3, 72, 2), (4, 128, 1)):
        cu = tuple([0] + sorted(rng.sample(range(1, seq), 9)) + [seq])
        a = balance.balanced(cu, seq, world, (-1, -1))
        vis = Visibility(True, cu_seqlens=cu)
        q, k, v, dout = _qkv(b=batch, s=seq, seed=seq)
        qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
        ref = attention_reference(qr, kr, vr, causal=True, softmax_scale=0.3, cu_seqlens=list(cu))
        ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref, (qr, kr, vr), dout)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        n = seq // world
        for rank in range(world):
            rows = a.positions(rank)
            plan = gathered_plan(a, vis, world, rank, n)
            for call in packed(plan, 0, bwd, None, cpu, backward=True) + packed(plan, 0, fwd, None, cpu, False):
                gathered.add(_packed_varlen(call, batch, n, seq, cpu).key_index is not None)
            out, lse = ring_forward(q[:, rows], k, v, None, RingComm(None), plan, 0.0, 0.3, fwd)
            dq_r, dk_r, dv_r = local_backward(dout[:, rows], q[:, rows], k, v, out, lse, None, plan, 0.0, 0.3, bwd)
            torch.testing.assert_close(out, ref[:, rows], rtol=0, atol=1e-5)
            torch.testing.assert_close(dq_r, ref_dq[:, rows], rtol=0, atol=1e-5)
            dk += dk_r
            dv += dv_r
        torch.testing.assert_close(dk, ref_dk, rtol=0, atol=1e-5)
        torch.testing.assert_close(dv, ref_dv, rtol=0, atol=1e-5)
    assert gathered == {True, False}


@pytest.mark.parametrize("first_whole", [True, False])
def test_row_sum_rounds_each_row_once(first_whole):
    """RowSum (a rank's dQ over block calls): bf16 terms over overlapping row runs; rows one term reaches are
    that term exactly, rows two or more reach are their float64 sum within one bf16 rounding, rows none
    reaches are 0; a first term over every row is adopted without a copy."""
    from distcomm_attention.kernels.contract import RowSum

    g = torch.Generator().manual_seed(4)
    b, n, h, d = 2, 30, 3, 8
    runs = ([(0, n)] if first_whole else []) + [(5, 12), (10, 20), (2, 6), (25, 27), (11, 19)]
    terms = [torch.randn(b, r1 - r0, h, d, generator=g).to(BF16) for r0, r1 in runs]
    expected = torch.zeros(b, n, h, d, dtype=torch.float64)
    reached = [0] * n
    for (r0, r1), t in zip(runs, terms):
        expected[:, r0:r1] += t.double()
        for i in range(r0, r1):
            reached[i] += 1
    total = RowSum(torch.Size((b, n, h, d)), torch.float32, torch.device("cpu"))
    for (r0, r1), t in zip(runs, terms):
        total.add(r0, r1, t)
    out = total.result(BF16)
    if first_whole:
        assert out.data_ptr() == terms[0].data_ptr()  # adopted: the summed rows were rounded into it
    assert out.dtype == BF16
    # up to four bf16 terms of similar size: their fp32 sum is exact, so one rounding gives the float64 sum's
    torch.testing.assert_close(out, expected.to(BF16), rtol=0, atol=0)
    never = [i for i in range(n) if reached[i] == 0]
    assert [i for i in range(n) if reached[i] == 1] and (out[:, never] == 0).all()
    assert bool(never) == (not first_whole)


def test_row_sum_of_mixed_dtypes_rounds_each_row_once():
    """RowSum with bf16 kernel outputs and fp32 partial sums (the all-gather's own rows): a first fp32 term is
    not rounded into the bf16 rows, so every row is its fp32 sum rounded once; rows one bf16 term reached stay
    that term."""
    from distcomm_attention.kernels.contract import RowSum

    g = torch.Generator().manual_seed(9)
    b, n, h, d = 1, 4, 1, 4096
    first = torch.randn(b, 2, h, d, generator=g).to(BF16)
    parts = [torch.randn(b, 2, h, d, generator=g) * 3 for _ in range(2)]  # fp32, rows 2-3, twice
    total = RowSum(torch.Size((b, n, h, d)), torch.float32, torch.device("cpu"))
    total.add(0, 2, first)
    for p in parts:
        total.add(2, 4, p)
    out = total.result(BF16)
    assert torch.equal(out[:, :2], first)
    assert torch.equal(out[:, 2:], (parts[0] + parts[1]).to(BF16))  # rounding twice differs in ~1/4 of them
