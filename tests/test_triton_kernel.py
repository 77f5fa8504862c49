"""Layer 3: the Triton forward kernel under TRITON_INTERPRET=1 (fp32/fp16), and the flash backward dispatch.

Every result is checked against an independent float64 masked-softmax reference built from the dense
element mask (``row_lo[i] <= j < row_hi[i]`` and the key padding mask; causal ``j <= i``). Shapes are small
and tiles are 16x16 so that ragged tails, several key tiles per program, the edge/interior split of
Note [Kernel tiles] and empty rows are all exercised while the interpreter stays fast. The reference and
interval helpers here are shared with tests/test_triton_bwd.py.
"""

import math
import os
import sys
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernel import (conftest also sets it)

from tests.optional import require

triton = require("triton")

from distcomm_attention.kernels import flash2 as _flash_bwd  # noqa: E402
from distcomm_attention.kernels.triton_fwd import TritonConfig, TritonForward  # noqa: E402
from distcomm_attention.planning.visibility import CAUSAL, FULL, BlockMask  # noqa: E402

interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter tests; the GPU path is covered by test_gpu_kernels.py"
)

SMALL = dict(block_m=16, block_n=16, num_warps=4, num_stages=1)


# ---------------------------------------------------------------------------------------------------
# float64 reference and visibility helpers (also used by test_triton_bwd.py)
# ---------------------------------------------------------------------------------------------------


def reference(q, k, v, mask, scale, *, softcap=0.0, dout=None):
    """float64 attention with an explicit boolean visibility ``mask`` (Sq, Sk) or (B, Sq, Sk).

    Returns out (B, Sq, H, D) and lse (B, H, Sq) (-inf for rows that see nothing, whose out is 0); with
    ``dout`` also (dq, dk, dv) from autograd.
    """
    q, k, v = (x.detach().double().requires_grad_(dout is not None) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, dim=2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    mask = mask[:, None] if mask.dim() == 3 else mask  # (B, 1, Sq, Sk) or (Sq, Sk)
    scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores.detach(), dim=-1)
    seen = mask.any(-1, keepdim=True)
    # Rows that see nothing: softmax over zeros, times 0 (keeps autograd free of NaN).
    probs = torch.softmax(torch.where(seen, scores, 0.0), dim=-1) * seen
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(group, dim=2))
    if dout is None:
        return out.detach(), lse
    out.backward(dout.double())
    return out.detach(), lse, (q.grad, k.grad, v.grad)


def causal_mask(seqlen_q, seqlen_k):
    """Top-left causal mask: query i sees keys 0..i."""
    return torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril()


def full_mask(seqlen_q, seqlen_k):
    return torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)


def interval_mask(row_lo, row_hi, seqlen_k):
    """An "interval" BlockMask from per-row key intervals (nondecreasing), with the inverse col arrays
    derived as ``_visibility._block`` does, and its dense (Sq, Sk) element mask."""
    row_lo, row_hi = torch.as_tensor(row_lo, dtype=torch.int64), torch.as_tensor(row_hi, dtype=torch.int64)
    row_hi = torch.maximum(row_hi, row_lo)
    assert bool((row_lo.diff() >= 0).all()) and bool((row_hi.diff() >= 0).all())
    j = torch.arange(seqlen_k)
    col_lo = torch.searchsorted(row_hi, j, right=True)  # first row with row_hi > j
    col_hi = torch.maximum(torch.searchsorted(row_lo, j, right=True), col_lo)  # rows with row_lo <= j
    dense = (j[None, :] >= row_lo[:, None]) & (j[None, :] < row_hi[:, None])
    return BlockMask("interval", *(a.to(torch.int32) for a in (row_lo, row_hi, col_lo, col_hi))), dense


def window_intervals(seqlen_q, seqlen_k, *, offset, left, right):
    """Band: query i at position i + offset sees keys j with i + offset - left <= j <= i + offset + right."""
    i = torch.arange(seqlen_q) + offset
    return interval_mask((i - left).clamp(0, seqlen_k), (i + right + 1).clamp(0, seqlen_k), seqlen_k)


def document_intervals(q_docs, k_docs, *, causal, q_pos=None, k_pos=None):
    """Documents: query i of document q_docs[i] sees the keys of the same document (and, when causal, with
    position <= its own). q_docs / k_docs: nondecreasing document ids; positions default to indices."""
    q_docs, k_docs = torch.as_tensor(q_docs), torch.as_tensor(k_docs)
    q_pos = torch.arange(len(q_docs)) if q_pos is None else torch.as_tensor(q_pos)
    k_pos = torch.arange(len(k_docs)) if k_pos is None else torch.as_tensor(k_pos)
    lo = torch.searchsorted(k_docs, q_docs, right=False)
    hi = torch.searchsorted(k_docs, q_docs, right=True)
    if causal:
        hi = torch.minimum(hi, torch.searchsorted(k_pos, q_pos, right=True))
    return interval_mask(lo, torch.maximum(hi, lo), len(k_docs))


def make_qkv(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=gen).to(dtype)
    return q, k, v


def random_key_mask(batch, seqlen_k, *, seed=0, keep=0.7):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(batch, seqlen_k, generator=gen) < keep


def tolerance(dtype):
    return {torch.float32: 2e-5, torch.float16: 3e-3}[dtype]


def run_single(q, k, v, *, mask, scale, final, softcap=0.0, key_mask=None, **cfg):
    kernel = TritonForward(**(cfg or SMALL))
    state = kernel.init_state(q)
    kernel.step(state, q, k, v, mask=mask, scale=scale, softcap=softcap, key_mask=key_mask, final=final)
    return kernel.finalize(state, q.dtype)


def assert_matches(out, lse, ref_out, ref_lse, dtype):
    tol = tolerance(dtype)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=0)
    assert torch.equal(lse.isinf(), ref_lse.isinf()), "rows that see no key must have lse -inf, and only they"
    seen = ~ref_lse.isinf()
    torch.testing.assert_close(lse.double()[seen], ref_lse[seen], atol=tol, rtol=0)


# ---------------------------------------------------------------------------------------------------
# single step: full and causal
# ---------------------------------------------------------------------------------------------------

CASES = {
    # name: (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal)
    "causal_ragged": (2, 37, 37, 2, 2, 32, True),
    "full_ragged": (2, 37, 37, 2, 2, 32, False),
    "full_q_neq_k": (1, 21, 50, 2, 2, 32, False),
    "causal_q_gt_k": (1, 40, 24, 2, 2, 32, True),
    "causal_q_lt_k": (1, 24, 40, 2, 2, 32, True),
    "gqa_causal": (1, 33, 33, 4, 2, 32, True),
    "mqa_full": (1, 20, 29, 4, 1, 32, False),
    "head_dim_16": (1, 19, 19, 1, 1, 16, True),
    "head_dim_48_padded": (1, 19, 23, 1, 1, 48, False),
    "head_dim_64": (1, 17, 17, 1, 1, 64, True),
    "head_dim_128": (1, 17, 20, 1, 1, 128, False),
    "head_dim_256": (1, 9, 9, 1, 1, 256, True),
}


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_single_step_matches_reference(case, dtype):
    """One step, then finalize, equals float64 attention (masks, ragged tails, GQA, head dims)."""
    batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal = CASES[case]
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    mask = causal_mask(seqlen_q, seqlen_k) if causal else full_mask(seqlen_q, seqlen_k)
    ref_out, ref_lse = reference(q, k, v, mask, scale)
    out, lse = run_single(q, k, v, mask=CAUSAL if causal else FULL, scale=scale, final=False)
    assert_matches(out, lse, ref_out, ref_lse, dtype)


@interpreter_only
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fused_final_step_matches_reference(causal):
    """A single step marked final (normalise and write out/lse in the kernel) is ordinary flash attention."""
    q, k, v = make_qkv(1, 35, 35, 4, 2, 32, torch.float16)
    scale = 0.3
    mask = causal_mask(35, 35) if causal else full_mask(35, 35)
    ref_out, ref_lse = reference(q, k, v, mask, scale)
    out, lse = run_single(q, k, v, mask=CAUSAL if causal else FULL, scale=scale, final=True)
    assert_matches(out, lse, ref_out, ref_lse, torch.float16)


@interpreter_only
def test_default_config_interpreter():
    """With no overrides the kernel runs with its interpreter defaults (one tile covers these shapes)."""
    q, k, v = make_qkv(1, 70, 70, 2, 1, 64, torch.float32)
    ref_out, ref_lse = reference(q, k, v, causal_mask(70, 70), 0.125)
    kernel = TritonForward()
    assert kernel.config(64) == TritonConfig(64, 64, 4, 1)
    state = kernel.init_state(q)
    kernel.step(state, q, k, v, mask=CAUSAL, scale=0.125)
    assert_matches(*kernel.finalize(state, torch.float32), ref_out, ref_lse, torch.float32)


@interpreter_only
def test_bf16_upcast_under_interpreter():
    """bf16 runs under the interpreter with dot operands upcast to fp32 (its bf16 tl.dot is wrong)."""
    q, k, v = make_qkv(1, 24, 24, 2, 2, 32, torch.bfloat16)
    ref_out, ref_lse = reference(q, k, v, causal_mask(24, 24), 32**-0.5)
    out, lse = run_single(q, k, v, mask=CAUSAL, scale=32**-0.5, final=False)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------------
# single step: interval blocks, key padding masks, softcap
# ---------------------------------------------------------------------------------------------------


def interval_case(name, seqlen_q, seqlen_k):
    """Named interval patterns of the planner's kinds: windows, documents, empty rows."""
    if name == "window":  # a sliding window crossing the block diagonally, with an interior
        return window_intervals(seqlen_q, seqlen_k, offset=20, left=24, right=3)
    if name == "window_narrow":  # narrower than one tile: edge tiles only
        return window_intervals(seqlen_q, seqlen_k, offset=0, left=5, right=0)
    if name == "documents":  # causal documents of uneven lengths, one of length 1
        docs = torch.tensor([0] * 7 + [1] + [2] * 19 + [3] * 40)
        return document_intervals(docs[:seqlen_q], docs[:seqlen_k], causal=True)
    if name == "empty_rows":  # rows at the start, in the middle and at the end see no key of the block
        lo = torch.arange(seqlen_q).clamp(max=seqlen_k - 1) // 2
        hi = lo + 9
        hi[:5] = lo[:5]
        hi[18:23] = lo[18:23] = hi[17]
        hi[-4:] = lo[-4:] = seqlen_k
        lo, hi = torch.cummax(lo, 0).values, torch.cummax(hi, 0).values
        return interval_mask(lo, hi.clamp(max=seqlen_k), seqlen_k)
    raise KeyError(name)


INTERVAL_CASES = {
    # name: (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim)
    "window": (1, 37, 61, 2, 1, 32),
    "window_narrow": (1, 33, 33, 2, 2, 32),
    "documents": (1, 45, 45, 4, 2, 16),
    "empty_rows": (1, 40, 29, 2, 1, 32),
}


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(INTERVAL_CASES))
def test_interval_block_matches_reference(case, dtype):
    """"interval" blocks (windows, documents, rows with no key) equal the dense element rule; rows that
    see nothing get out 0 and lse -inf."""
    batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim = INTERVAL_CASES[case]
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype, seed=4)
    mask, dense = interval_case(case, seqlen_q, seqlen_k)
    ref_out, ref_lse = reference(q, k, v, dense, 0.3)
    out, lse = run_single(q, k, v, mask=mask, scale=0.3, final=True)
    assert_matches(out, lse, ref_out, ref_lse, dtype)


@interpreter_only
@pytest.mark.parametrize("mode", ["full", "causal", "window"])
def test_key_mask_matches_reference(mode):
    """The key padding mask applies element-wise on every tile kind, incl. a batch row of padding only (out 0,
    lse -inf) and a tile of padding only; a non-contiguous mask view works."""
    batch, seqlen = 3, 40
    q, k, v = make_qkv(batch, seqlen, seqlen, 1, 1, 32, torch.float16, seed=5)
    wide = random_key_mask(batch, 2 * seqlen, seed=6)
    key_mask = wide[:, ::2]  # a strided view
    key_mask[1] = False  # all padding
    key_mask[2, 16:32] = False  # one whole key tile of padding
    block, dense = {"full": (FULL, full_mask(seqlen, seqlen)), "causal": (CAUSAL, causal_mask(seqlen, seqlen)),
                    "window": window_intervals(seqlen, seqlen, offset=0, left=20, right=0)}[mode]
    ref_out, ref_lse = reference(q, k, v, dense[None] & key_mask[:, None, :], 0.3)
    out, lse = run_single(q, k, v, mask=block, scale=0.3, key_mask=key_mask, final=False)
    assert_matches(out, lse, ref_out, ref_lse, torch.float16)
    assert (out[1] == 0).all() and (lse[1] == -math.inf).all()


@interpreter_only
@pytest.mark.parametrize("mode", ["full", "causal", "documents"])
def test_softcap_matches_reference(mode):
    """softcap > 0: scores = softcap * tanh(scale * q.k / softcap) before masking and softmax."""
    q, k, v = make_qkv(1, 45, 45, 2, 2, 32, torch.float32, seed=7)
    q = q * 3  # large logits: the cap matters
    block, dense = {"full": (FULL, full_mask(45, 45)), "causal": (CAUSAL, causal_mask(45, 45)),
                    "documents": interval_case("documents", 45, 45)}[mode]
    ref_out, ref_lse = reference(q, k, v, dense, 0.5, softcap=4.0)
    out, lse = run_single(q, k, v, mask=block, scale=0.5, softcap=4.0, final=False)
    assert_matches(out, lse, ref_out, ref_lse, torch.float32)


# ---------------------------------------------------------------------------------------------------
# multi-step accumulation (the ring)
# ---------------------------------------------------------------------------------------------------


def schedule(seqlen_q):
    """A ring-like schedule over concatenated key chunks: (chunk length, q_slice, BlockMask, dense block)."""
    window, window_dense = window_intervals(20, 24, offset=18, left=16, right=2)
    return [
        (40, slice(None), CAUSAL, causal_mask(40, 40)),  # diagonal block: Sq == Sk == 40
        (24, slice(20, 40), FULL, full_mask(20, 24)),  # a full block seen by the second half of the queries
        (24, slice(0, 20), window, window_dense),  # an interval block on the first half
        (20, slice(20, 40), CAUSAL, causal_mask(20, 20)),  # a causal block on a query half
        (17, slice(None), FULL, full_mask(seqlen_q, 17)),  # a ragged full block
    ]


def schedule_mask(seqlen_q, steps):
    blocks = []
    for length, q_slice, _, dense in steps:
        block = torch.zeros(seqlen_q, length, dtype=torch.bool)
        block[q_slice] = dense
        blocks.append(block)
    return torch.cat(blocks, dim=1)


@interpreter_only
@pytest.mark.parametrize("dtype,final", [(torch.float32, False), (torch.float16, True)],
                         ids=["fp32-finalize", "fp16-fused_final"])
def test_multi_step_accumulation(dtype, final):
    """Steps over K/V chunks (causal, full, interval, q_slice, key mask) accumulate to attention over the
    concatenation."""
    seqlen_q = 40
    steps = schedule(seqlen_q)
    total = sum(length for length, *_ in steps)
    q, k, v = make_qkv(1, seqlen_q, total, 2, 1, 32, dtype, seed=1)
    key_mask = random_key_mask(1, total, seed=8, keep=0.8)
    scale = 32**-0.5
    ref_out, ref_lse = reference(q, k, v, schedule_mask(seqlen_q, steps)[None] & key_mask[:, None, :], scale)

    kernel = TritonForward(**SMALL)
    state = kernel.init_state(q)
    start = 0
    for i, (length, q_slice, block, _) in enumerate(steps):
        is_last = final and i == len(steps) - 1
        keys = slice(start, start + length)
        kernel.step(state, q, k[:, keys], v[:, keys], mask=block, scale=scale, key_mask=key_mask[:, keys],
                    q_slice=q_slice, final=is_last)
        start += length
        if not is_last:
            assert state.acc.dtype == torch.float32 and state.m.dtype == torch.float32
    out, lse = kernel.finalize(state, dtype)
    assert_matches(out, lse, ref_out, ref_lse, dtype)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fp32_carry_error_does_not_grow_with_steps(dtype):
    """8 ring steps are as accurate as one step: the carry between steps is fp32, never rounded to fp16/bf16."""
    seqlen, chunks, head_dim = 32, 8, 32
    q, k, v = make_qkv(1, seqlen, seqlen * chunks, 2, 2, head_dim, dtype, seed=2)
    q = q * 2  # peaky softmax: per-step rescaling errors would show
    scale = head_dim**-0.5
    ref_out, _ = reference(q, k, v, full_mask(seqlen, seqlen * chunks), scale)

    cfg = dict(block_m=32, block_n=32, num_warps=4, num_stages=1)
    one, _ = run_single(q, k, v, mask=FULL, scale=scale, final=False, **cfg)
    kernel = TritonForward(**cfg)
    state = kernel.init_state(q)
    for c in range(chunks):
        kernel.step(state, q, k[:, c * seqlen : (c + 1) * seqlen], v[:, c * seqlen : (c + 1) * seqlen],
                    mask=FULL, scale=scale)
    many, _ = kernel.finalize(state, dtype)
    err_one = (one.double() - ref_out).abs().max().item()
    err_many = (many.double() - ref_out).abs().max().item()
    assert err_many <= 1.1 * err_one, (err_one, err_many)


# ---------------------------------------------------------------------------------------------------
# layouts and edge cases
# ---------------------------------------------------------------------------------------------------


@interpreter_only
def test_strided_inputs():
    """Non-contiguous views (head-major q, packed kv, a strided head dim) give the same result."""
    batch, seqlen, heads, kv_heads, head_dim = 1, 26, 2, 1, 32
    gen = torch.Generator().manual_seed(3)
    q_bhsd = torch.randn(batch, heads, seqlen, head_dim, generator=gen, dtype=torch.float16)
    q = q_bhsd.transpose(1, 2)  # (B, S, H, D) view of head-major storage
    kv = torch.randn(batch, seqlen, 2, kv_heads, 2 * head_dim, generator=gen, dtype=torch.float16)
    k, v = kv[:, :, 0, :, ::2], kv[:, :, 1, :, 1::2]  # packed, and stride 2 along head_dim
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous()) and k.stride(-1) == 2
    ref_out, ref_lse = reference(q, k, v, causal_mask(seqlen, seqlen), 0.2)
    out, lse = run_single(q, k, v, mask=CAUSAL, scale=0.2, final=False)
    assert_matches(out, lse, ref_out, ref_lse, torch.float16)
    out, lse = run_single(q, k, v, mask=CAUSAL, scale=0.2, final=True)
    assert_matches(out, lse, ref_out, ref_lse, torch.float16)


@interpreter_only
def test_rows_without_keys_are_zero_not_nan():
    """Rows no step touched finalize to out 0 and lse -inf, with or without any step, never NaN."""
    q, k, v = make_qkv(1, 30, 16, 2, 2, 32, torch.float16)
    kernel = TritonForward(**SMALL)

    state = kernel.init_state(q)  # no step at all
    out, lse = kernel.finalize(state, torch.float16)
    assert (out == 0).all() and (lse == -math.inf).all()

    state = kernel.init_state(q)
    kernel.step(state, q, k, v, mask=FULL, scale=0.2, q_slice=slice(0, 12))
    kernel.step(state, q, k[:, :0], v[:, :0], mask=FULL, scale=0.2)  # an empty key block adds nothing
    out, lse = kernel.finalize(state, torch.float16)
    mask = torch.zeros(30, 16, dtype=torch.bool)
    mask[:12] = True
    ref_out, ref_lse = reference(q, k, v, mask, 0.2)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[:, 12:] == 0).all() and (lse[:, :, 12:] == -math.inf).all()
    torch.testing.assert_close(out.double(), ref_out, atol=3e-3, rtol=0)
    torch.testing.assert_close(lse[:, :, :12].double(), ref_lse[:, :, :12], atol=3e-3, rtol=0)


# ---------------------------------------------------------------------------------------------------
# the split-2 kernel (Note [Split-2 forward]): same contract, pointer loads and TMA descriptors
# ---------------------------------------------------------------------------------------------------

SPLIT2 = dict(block_m=32, block_n=16, num_warps=4, num_stages=1, split=2)  # two 16-row halves


@interpreter_only
@pytest.mark.parametrize("final", [False, True], ids=["state", "fused_final"])
@pytest.mark.parametrize("case", ["causal_ragged", "full_q_neq_k", "causal_q_gt_k", "causal_q_lt_k", "gqa_causal",
                                  "mqa_full", "head_dim_48_padded"])
def test_split2_single_step_matches_reference(case, final):
    """The split-2 kernel (two interleaved halves per program) equals float64 attention on ragged tails,
    q != k lengths, GQA/MQA and a padded head dim, through the fp32 state and the fused final step."""
    batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal = CASES[case]
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, torch.float16)
    scale = head_dim**-0.5
    mask = causal_mask(seqlen_q, seqlen_k) if causal else full_mask(seqlen_q, seqlen_k)
    ref_out, ref_lse = reference(q, k, v, mask, scale)
    out, lse = run_single(q, k, v, mask=CAUSAL if causal else FULL, scale=scale, final=final, **SPLIT2)
    assert_matches(out, lse, ref_out, ref_lse, torch.float16)


@interpreter_only
@pytest.mark.parametrize("mode", ["causal", "window"])
def test_split2_softcap_key_mask_interval(mode):
    """Softcap and a key padding mask on a causal block and on an interval (window) block with empty rows."""
    seqlen = 45
    q, k, v = make_qkv(2, seqlen, seqlen, 2, 1, 32, torch.float16, seed=4)
    key_mask = random_key_mask(2, seqlen, seed=5)
    if mode == "causal":
        block, dense = CAUSAL, causal_mask(seqlen, seqlen)
    else:
        block, dense = window_intervals(seqlen, seqlen, offset=-3, left=9, right=2)
    ref_out, ref_lse = reference(q, k, v, dense[None] & key_mask[:, None, :], 0.3, softcap=4.0)
    out, lse = run_single(q, k, v, mask=block, scale=0.3, softcap=4.0, key_mask=key_mask, final=True, **SPLIT2)
    assert_matches(out, lse, ref_out, ref_lse, torch.float16)


@interpreter_only
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_split2_multi_step_accumulation(monkeypatch, tma):
    """Split-2 steps (causal, full, interval, q_slice, key mask; fp32 state) accumulate to attention over the
    concatenation, the last one fused final; also with the TMA descriptors forced (q slices through them;
    the ragged 17-key block gets no descriptors, which on a GPU means the plain kernel)."""
    import distcomm_attention.kernels.triton_fwd as F

    monkeypatch.setattr(F, "_tma_capable", lambda device: tma)
    seqlen_q = 40
    steps = schedule(seqlen_q)
    total = sum(length for length, *_ in steps)
    q, k, v = make_qkv(1, seqlen_q, total, 2, 1, 32, torch.float16, seed=1)
    key_mask = random_key_mask(1, total, seed=8, keep=0.8)
    scale = 32**-0.5
    ref_out, ref_lse = reference(q, k, v, schedule_mask(seqlen_q, steps)[None] & key_mask[:, None, :], scale)
    kernel = TritonForward(**SPLIT2)
    state = kernel.init_state(q)
    start = 0
    for i, (length, q_slice, block, _) in enumerate(steps):
        keys = slice(start, start + length)
        kernel.step(state, q, k[:, keys], v[:, keys], mask=block, scale=scale, key_mask=key_mask[:, keys],
                    q_slice=q_slice, final=i == len(steps) - 1)
        start += length
    assert_matches(*kernel.finalize(state, torch.float16), ref_out, ref_lse, torch.float16)


@interpreter_only
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_split2_tma_descriptor_loads(monkeypatch, causal):
    """The TMA path (host descriptors of the (B*S, heads*D) views of q, k, v, taken on sm_90+) gives the same
    attention: forced here under the interpreter, with two batches, GQA, a q tail (40 rows, 16-row halves)
    and two steps through the fp32 state; strides that do not allow the view fall back to pointer loads."""
    import distcomm_attention.kernels.triton_fwd as F

    monkeypatch.setattr(F, "_tma_capable", lambda device: True)
    made = []
    real = F._view_descriptor
    monkeypatch.setattr(F, "_view_descriptor", lambda x, rows: made.append(real(x, rows)[0]) or real(x, rows))
    q, k, v = make_qkv(2, 40, 64, 4, 2, 32, torch.float16, seed=6)
    block, half = CAUSAL if causal else FULL, 32
    mask = torch.zeros(40, 64, dtype=torch.bool)
    mask[:, :half] = causal_mask(40, half) if causal else True
    mask[:, half:] = causal_mask(40, half) if causal else True
    ref_out, ref_lse = reference(q, k, v, mask, 0.25)
    kernel = TritonForward(**SPLIT2)
    state = kernel.init_state(q)
    kernel.step(state, q, k[:, :half], v[:, :half], mask=block, scale=0.25)  # row slices of packed k/v
    kernel.step(state, q, k[:, half:], v[:, half:], mask=block, scale=0.25, final=True)
    assert len(made) == 6 and all(d is not None for d in made)  # q, k, v per step
    assert_matches(*kernel.finalize(state, torch.float16), ref_out, ref_lse, torch.float16)
    assert real(q.transpose(1, 2).contiguous().transpose(1, 2), 16) == (None, 0)  # head-major: pointer loads


def test_split2_selection():
    """split=2 is the GPU default for head_dim 128 in fp16/bf16 only; fp32, other head dims, the interpreter
    and hand-picked tiles without ``split`` keep the plain kernel; bad values are rejected by name."""
    from distcomm_attention.kernels.triton_fwd import default_config

    assert default_config(128, interpret=False) == TritonConfig(128, 64, 4, 2, 2)
    assert default_config(128, torch.bfloat16, interpret=False).split == 2
    assert default_config(128, torch.float32, interpret=False) == TritonConfig(128, 128, 8, 3)
    assert default_config(64, torch.float16, interpret=False).split == 1
    assert default_config(120, torch.float16, interpret=False).split == 1
    assert default_config(128, interpret=True).split == 1
    assert TritonForward(**SMALL).config(128, torch.float16).split == 1
    assert TritonForward(**SPLIT2).config(128).astuple() == (32, 16, 4, 1, 2)
    with pytest.raises(ValueError, match=r"`split`=3 must be 1 or 2"):
        TritonConfig(64, 16, 4, 1, 3)
    with pytest.raises(ValueError, match=r"`block_m`=16 must be >= 32 with `split`=2"):
        TritonConfig(16, 16, 4, 1, 2)


@interpreter_only
def test_errors_are_clear():
    """Unsupported head dims, dtypes, configs, slices, masks and softcaps raise errors naming the argument."""
    kernel = TritonForward(**SMALL)
    with pytest.raises(ValueError, match=r"`q` has head_dim 12.*multiples of 8 from 16 to 256"):
        kernel.init_state(torch.zeros(1, 4, 1, 12))
    with pytest.raises(ValueError, match=r"head_dim 264"):
        kernel.init_state(torch.zeros(1, 4, 1, 264))
    assert TritonForward.supports_head_dim(128) and not TritonForward.supports_head_dim(100)
    with pytest.raises(TypeError, match=r"`q` has dtype torch.float64.*allowed"):
        kernel.init_state(torch.zeros(1, 4, 1, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"`block_m`=24 must be a power of two"):
        TritonForward(block_m=24, block_n=16, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match=r"`block_m`=16 must be a multiple of `block_n`=32"):
        TritonConfig(16, 32, 4, 1)

    q, k, v = make_qkv(1, 8, 8, 3, 2, 16, torch.float32)
    state = kernel.init_state(q)
    with pytest.raises(ValueError, match=r"query heads 3 must be a multiple of kv heads 2"):
        kernel.step(state, q, k, v, mask=FULL, scale=1.0)
    q, k, v = make_qkv(1, 8, 8, 2, 2, 16, torch.float32)
    state = kernel.init_state(q)
    with pytest.raises(ValueError, match=r"`q_slice`=slice\(0, 8, 2\) must have step 1"):
        kernel.step(state, q, k, v, mask=FULL, scale=1.0, q_slice=slice(0, 8, 2))
    with pytest.raises(ValueError, match=r"`final`=True needs `q_slice` to cover all 8 rows"):
        kernel.step(state, q, k, v, mask=FULL, scale=1.0, q_slice=slice(0, 4), final=True)
    with pytest.raises(ValueError, match=r"`k` \(torch.float16"):
        kernel.step(state, q, k.half(), v, mask=FULL, scale=1.0)
    with pytest.raises(ValueError, match=r"`mask` must be a BlockMask with mode 'full', 'causal' or 'interval'"):
        kernel.step(state, q, k, v, mask=BlockMask("band"), scale=1.0)
    block, _ = window_intervals(4, 8, offset=0, left=2, right=0)
    with pytest.raises(ValueError, match=r"`mask.row_lo` must be a 1-D tensor of length 8; got \(4,\)"):
        kernel.step(state, q, k, v, mask=block, scale=1.0)  # arrays for 4 rows, 8 rows given
    with pytest.raises(ValueError, match=r"`softcap` must be a finite float >= 0.*got -1.0"):
        kernel.step(state, q, k, v, mask=FULL, scale=1.0, softcap=-1.0)
    with pytest.raises(TypeError, match=r"`key_mask` must be a bool tensor"):
        kernel.step(state, q, k, v, mask=FULL, scale=1.0, key_mask=torch.ones(1, 8))
    with pytest.raises(ValueError, match=r"`key_mask` must have shape \(1, 8\) \(batch, keys\); got \(1, 7\)"):
        kernel.step(state, q, k, v, mask=FULL, scale=1.0, key_mask=torch.ones(1, 7, dtype=torch.bool))


@interpreter_only
def test_custom_ops_pass_opcheck():
    """The step/last launches are torch.library custom ops whose schema (optional interval arrays and key
    mask) and fake kernels are consistent."""
    q, k, v = make_qkv(1, 16, 16, 2, 1, 16, torch.float32)
    acc = torch.zeros(q.shape)
    m = torch.full((1, 2, 16), -math.inf)
    l = torch.zeros(1, 2, 16)
    meta = (16, 16, 4, 1)
    checks = ("test_schema", "test_faketensor")
    block, _ = window_intervals(16, 16, offset=0, left=4, right=0)
    key_mask = random_key_mask(1, 16)
    torch.library.opcheck(torch.ops.distcomm_attention.triton_fwd_step.default,
                          (q, k, v, acc, m, l, None, None, None, 0, 16, 1, 0.25, 0.0, True, *meta), test_utils=checks)
    torch.library.opcheck(torch.ops.distcomm_attention.triton_fwd_step.default,
                          (q, k, v, acc, m, l, block.row_lo, block.row_hi, key_mask, 0, 16, 2, 0.25, 3.0, True, *meta),
                          test_utils=checks)
    torch.library.opcheck(torch.ops.distcomm_attention.triton_fwd_last.default,
                          (q, k, v, acc, m, l, None, None, key_mask, 1, 0.25, 0.0, False, *meta), test_utils=checks)
    split2 = (32, 16, 4, 1, 2)  # the split-2 kernel through the same ops (trailing ``split`` argument)
    torch.library.opcheck(torch.ops.distcomm_attention.triton_fwd_step.default,
                          (q, k, v, acc, m, l, None, None, key_mask, 0, 16, 1, 0.25, 0.0, True, *split2),
                          test_utils=checks)
    torch.library.opcheck(torch.ops.distcomm_attention.triton_fwd_last.default,
                          (q, k, v, acc, m, l, None, None, None, 0, 0.25, 0.0, False, *split2), test_utils=checks)


def test_fake_tensors_use_the_fake_kernels():
    """Eager calls launch the kernel directly, but under FakeTensorMode (shape/memory dry runs) the steps go
    through the custom ops' fake kernels: a launch on fake tensors would fail on their missing storage."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    kern = TritonForward()

    def run(q, k, v):
        state = kern.init_state(q)
        kern.step(state, q, k, v, mask=CAUSAL, scale=0.25, q_slice=slice(0, 8))
        kern.step(state, q, k, v, mask=FULL, scale=0.25, key_mask=torch.ones(1, 16, dtype=torch.bool))
        return kern.finalize(state, q.dtype)

    with FakeTensorMode():
        q, k, v = make_qkv(1, 16, 16, 4, 2, 16, torch.float32)
        out, lse = run(q, k, v)
        assert isinstance(out, FakeTensor) and isinstance(lse, FakeTensor)
        assert out.shape == q.shape and lse.shape == (1, 4, 16)
        q, k, v = make_qkv(1, 16, 16, 4, 2, 16, torch.float32)
        state = kern.init_state(q)
        kern.step(state, q, k, v, mask=FULL, scale=0.25, final=True)  # the fused last step
        out, lse = kern.finalize(state, q.dtype)
        assert isinstance(out, FakeTensor) and out.shape == q.shape


# ---------------------------------------------------------------------------------------------------
# flash backward wrappers (dispatch only: the kernels need CUDA)
# ---------------------------------------------------------------------------------------------------


def test_flash_attn_backward_missing_package(monkeypatch):
    """Without flash_attn, asking for its backward raises ImportError saying what to install."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import of a None entry raises ImportError
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", None)
    with pytest.raises(ImportError, match=r"pip install flash-attn"):
        _flash_bwd.FlashAttnBackward()


def _fake_flash_attn(monkeypatch, version, backward):
    package = types.ModuleType("flash_attn")
    package.__version__ = version
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_backward = backward
    package.flash_attn_interface = interface
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)


def test_flash_attn_backward_version_gate(monkeypatch):
    """Unsupported flash_attn releases are refused with an ImportError naming the installed version."""
    for version in ("2.5.9", "2.9.0", "3.0.0b1"):
        _fake_flash_attn(monkeypatch, version, lambda *args: None)
        with pytest.raises(ImportError, match=rf"flash_attn {version} is installed.*>= 2.6.0, < 2.9.0"):
            _flash_bwd.FlashAttnBackward()


def _backward_2_6(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                  window_size, softcap, alibi_slopes, deterministic, rng_state=None):
    _backward_2_6.seen = dict(window_size=window_size, causal=causal, scale=softmax_scale, dk=dk)
    dq.fill_(1.0)
    dk.fill_(2.0)
    dv.fill_(3.0)


def _backward_2_8(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                  window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    _backward_2_8.seen = dict(window=(window_size_left, window_size_right), causal=causal, scale=softmax_scale)
    dq.fill_(1.0)
    dk.fill_(2.0)
    dv.fill_(3.0)
    return torch.empty(0)


@pytest.mark.parametrize("version", ["2.6.3", "2.7.4.post1", "2.8.3"])
def test_flash_attn_backward_argument_layout(monkeypatch, version):
    """Each supported release gets its own positional layout; dq/dk/dv come back at q/kv head counts."""
    fake = _backward_2_6 if version.startswith("2.6") else _backward_2_8
    _fake_flash_attn(monkeypatch, version, fake)
    kernel = _flash_bwd.FlashAttnBackward()
    q, k, v = make_qkv(1, 8, 8, 4, 2, 16, torch.float16)
    lse = torch.zeros(1, 4, 8)
    dq, dk, dv = _flash_bwd._call_flash_attn_backward(
        kernel._backward, kernel._split_window, q, q, k, v, q, lse, causal=True, scale=0.5
    )
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert (dq == 1).all() and (dk == 2).all() and (dv == 3).all()
    if fake is _backward_2_6:
        assert fake.seen["window_size"] == (-1, -1)
    else:
        assert fake.seen["window"] == (-1, -1)
    assert fake.seen["causal"] is True and fake.seen["scale"] == 0.5


def test_aten_flash_backward_rejects_cpu_and_bad_blocks():
    """The aten flash backward explains that it needs CUDA fp16/bf16 and square causal blocks."""
    kernel = _flash_bwd.AtenFlashBackward()
    q, k, v = make_qkv(1, 8, 8, 2, 1, 16, torch.float16)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match=r"`q` is on cpu; this backward kernel needs CUDA"):
        kernel.step(q, q, k, v, q, lse, mask=FULL, scale=1.0)
    with pytest.raises(ValueError, match=r"`lse` must have shape \(1, 2, 8\)"):
        kernel.step(q, q, k, v, q, lse[:, :1], mask=FULL, scale=1.0)
    q2, k2, v2 = make_qkv(1, 8, 12, 2, 1, 16, torch.float16)
    with pytest.raises(ValueError, match=r"needs equal query and key lengths \(got 8 and 12\)"):
        _flash_bwd._check_block("AtenFlashBackward", q2, q2, k2, v2, q2, lse, True)
    assert _flash_bwd.AtenFlashBackward.supports_head_dim(256)
    assert not _flash_bwd.AtenFlashBackward.supports_head_dim(260)
