"""Layer 3: the Triton forward kernel under TRITON_INTERPRET=1 (fp32/fp16), and the flash backward dispatch.

Every result is checked against an independent float64 masked-softmax reference. Shapes are small and
blocks are 16x16 so that ragged tails, several key blocks per program and the causal diagonal split are
all exercised while the interpreter stays fast.
"""

import math
import os
import sys
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernel import (conftest also sets it)

triton = pytest.importorskip("triton")

from distcomm_attention import _flash_bwd  # noqa: E402
from distcomm_attention._triton_fwd import TritonConfig, TritonForward  # noqa: E402

interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter tests; the GPU path is covered by test_gpu_attention.py"
)

SMALL = dict(block_m=16, block_n=16, num_warps=4, num_stages=1)


def reference(q, k, v, mask, scale):
    """float64 attention with an explicit (Sq, Sk) boolean visibility mask; -> out (B,Sq,H,D), lse (B,H,Sq)."""
    q, k, v = (x.double() for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # rows with no key: all-zero weights
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse


def causal_mask(seqlen_q, seqlen_k):
    """Top-left causal mask: query i sees keys 0..i."""
    return torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril()


def make_qkv(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=gen).to(dtype)
    return q, k, v


def tolerance(dtype):
    return {torch.float32: 2e-5, torch.float16: 3e-3}[dtype]


def run_single(q, k, v, *, causal, scale, final, **cfg):
    kernel = TritonForward(**(cfg or SMALL))
    state = kernel.init_state(q)
    kernel.step(state, q, k, v, causal=causal, scale=scale, final=final)
    return kernel.finalize(state, q.dtype)


def assert_matches(out, lse, ref_out, ref_lse, dtype):
    tol = tolerance(dtype)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=0)


# ---------------------------------------------------------------------------------------------------
# single step
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
    mask = causal_mask(seqlen_q, seqlen_k) if causal else torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    ref_out, ref_lse = reference(q, k, v, mask, scale)
    out, lse = run_single(q, k, v, causal=causal, scale=scale, final=False)
    assert_matches(out, lse, ref_out, ref_lse, dtype)


@interpreter_only
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fused_final_step_matches_reference(causal):
    """A single step marked final (normalise and write out/lse in the kernel) is ordinary flash attention."""
    q, k, v = make_qkv(2, 35, 35, 4, 2, 32, torch.float16)
    scale = 0.3
    mask = causal_mask(35, 35) if causal else torch.ones(35, 35, dtype=torch.bool)
    ref_out, ref_lse = reference(q, k, v, mask, scale)
    out, lse = run_single(q, k, v, causal=causal, scale=scale, final=True)
    assert_matches(out, lse, ref_out, ref_lse, torch.float16)


@interpreter_only
def test_default_config_interpreter():
    """With no overrides the kernel runs with its interpreter defaults (one block covers these shapes)."""
    q, k, v = make_qkv(1, 70, 70, 2, 1, 64, torch.float32)
    ref_out, ref_lse = reference(q, k, v, causal_mask(70, 70), 0.125)
    kernel = TritonForward()
    assert kernel.config(64) == TritonConfig(64, 64, 4, 1)
    state = kernel.init_state(q)
    kernel.step(state, q, k, v, causal=True, scale=0.125)
    assert_matches(*kernel.finalize(state, torch.float32), ref_out, ref_lse, torch.float32)


@interpreter_only
def test_bf16_upcast_under_interpreter():
    """bf16 runs under the interpreter with dot operands upcast to fp32 (its bf16 tl.dot is wrong)."""
    q, k, v = make_qkv(1, 24, 24, 2, 2, 32, torch.bfloat16)
    ref_out, ref_lse = reference(q, k, v, causal_mask(24, 24), 32**-0.5)
    out, lse = run_single(q, k, v, causal=True, scale=32**-0.5, final=False)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------------
# multi-step accumulation (the ring)
# ---------------------------------------------------------------------------------------------------

# A ring-like schedule over concatenated key chunks: (chunk length, causal, q_slice).
SCHEDULE = [
    (40, True, slice(None)),  # diagonal block: Sq == Sk == 40
    (24, False, slice(20, 40)),  # a full block seen by the second half of the queries
    (20, True, slice(20, 40)),  # a causal block on a query half (Sq == Sk == 20)
    (17, False, slice(None)),  # a ragged full block
]


def schedule_mask(seqlen_q, schedule):
    blocks = []
    for length, causal, q_slice in schedule:
        block = torch.zeros(seqlen_q, length, dtype=torch.bool)
        rows = range(seqlen_q)[q_slice]
        block[rows.start : rows.stop] = causal_mask(len(rows), length) if causal else True
        blocks.append(block)
    return torch.cat(blocks, dim=1)


@interpreter_only
@pytest.mark.parametrize("final", [False, True], ids=["finalize", "fused_final"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_multi_step_accumulation(dtype, final):
    """Steps over K/V chunks (causal, full, q_slice) accumulate to attention over the concatenation."""
    seqlen_q, heads, kv_heads, head_dim = 40, 4, 2, 32
    total = sum(length for length, _, _ in SCHEDULE)
    q, k, v = make_qkv(2, seqlen_q, total, heads, kv_heads, head_dim, dtype, seed=1)
    scale = head_dim**-0.5
    ref_out, ref_lse = reference(q, k, v, schedule_mask(seqlen_q, SCHEDULE), scale)

    kernel = TritonForward(**SMALL)
    state = kernel.init_state(q)
    start = 0
    for i, (length, causal, q_slice) in enumerate(SCHEDULE):
        is_last = final and i == len(SCHEDULE) - 1
        kernel.step(state, q, k[:, start : start + length], v[:, start : start + length],
                    causal=causal, scale=scale, q_slice=q_slice, final=is_last)
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
    ref_out, _ = reference(q, k, v, torch.ones(seqlen, seqlen * chunks, dtype=torch.bool), scale)

    cfg = dict(block_m=32, block_n=32, num_warps=4, num_stages=1)
    one, _ = run_single(q, k, v, causal=False, scale=scale, final=False, **cfg)
    kernel = TritonForward(**cfg)
    state = kernel.init_state(q)
    for c in range(chunks):
        kernel.step(state, q, k[:, c * seqlen : (c + 1) * seqlen], v[:, c * seqlen : (c + 1) * seqlen],
                    causal=False, scale=scale)
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
    out, lse = run_single(q, k, v, causal=True, scale=0.2, final=False)
    assert_matches(out, lse, ref_out, ref_lse, torch.float16)
    out, lse = run_single(q, k, v, causal=True, scale=0.2, final=True)
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
    kernel.step(state, q, k, v, causal=False, scale=0.2, q_slice=slice(0, 12))
    kernel.step(state, q, k[:, :0], v[:, :0], causal=False, scale=0.2)  # an empty key block adds nothing
    out, lse = kernel.finalize(state, torch.float16)
    mask = torch.zeros(30, 16, dtype=torch.bool)
    mask[:12] = True
    ref_out, ref_lse = reference(q, k, v, mask, 0.2)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[:, 12:] == 0).all() and (lse[:, :, 12:] == -math.inf).all()
    torch.testing.assert_close(out.double(), ref_out, atol=3e-3, rtol=0)
    torch.testing.assert_close(lse[:, :, :12].double(), ref_lse[:, :, :12], atol=3e-3, rtol=0)


@interpreter_only
def test_errors_are_clear():
    """Unsupported head dims, dtypes, configs and slices raise errors naming the argument and value."""
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
        kernel.step(state, q, k, v, causal=False, scale=1.0)
    q, k, v = make_qkv(1, 8, 8, 2, 2, 16, torch.float32)
    state = kernel.init_state(q)
    with pytest.raises(ValueError, match=r"`q_slice`=slice\(0, 8, 2\) must have step 1"):
        kernel.step(state, q, k, v, causal=False, scale=1.0, q_slice=slice(0, 8, 2))
    with pytest.raises(ValueError, match=r"`final`=True needs `q_slice` to cover all 8 rows"):
        kernel.step(state, q, k, v, causal=False, scale=1.0, q_slice=slice(0, 4), final=True)
    with pytest.raises(ValueError, match=r"`k` \(torch.float16"):
        kernel.step(state, q, k.half(), v, causal=False, scale=1.0)


@interpreter_only
def test_custom_ops_pass_opcheck():
    """The step/last launches are torch.library custom ops whose schema and fake kernels are consistent."""
    q, k, v = make_qkv(1, 16, 16, 2, 1, 16, torch.float32)
    acc = torch.zeros(q.shape)
    m = torch.full((1, 2, 16), -math.inf)
    l = torch.zeros(1, 2, 16)
    meta = (16, 16, 4, 1)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.distcomm_attention.triton_fwd_step.default,
                          (q, k, v, acc, m, l, 0, 16, True, 0.25, True, *meta), test_utils=checks)
    torch.library.opcheck(torch.ops.distcomm_attention.triton_fwd_last.default,
                          (q, k, v, acc, m, l, True, 0.25, False, *meta), test_utils=checks)


def test_fake_tensors_use_the_fake_kernels():
    """Eager calls launch the kernel directly, but under FakeTensorMode (shape/memory dry runs) the steps go
    through the custom ops' fake kernels: a launch on fake tensors would fail on their missing storage."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    kern = TritonForward()

    def run(q, k, v):
        state = kern.init_state(q)
        kern.step(state, q, k, v, causal=True, scale=0.25, q_slice=slice(0, 8))
        kern.step(state, q, k, v, causal=False, scale=0.25)
        return kern.finalize(state, q.dtype)

    with FakeTensorMode():
        q, k, v = make_qkv(1, 16, 16, 4, 2, 16, torch.float32)
        out, lse = run(q, k, v)
        assert isinstance(out, FakeTensor) and isinstance(lse, FakeTensor)
        assert out.shape == q.shape and lse.shape == (1, 4, 16)
        q, k, v = make_qkv(1, 16, 16, 4, 2, 16, torch.float32)
        state = kern.init_state(q)
        kern.step(state, q, k, v, causal=False, scale=0.25, final=True)  # the fused last step
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
        kernel.step(q, q, k, v, q, lse, causal=False, scale=1.0)
    with pytest.raises(ValueError, match=r"`lse` must have shape \(1, 2, 8\)"):
        kernel.step(q, q, k, v, q, lse[:, :1], causal=False, scale=1.0)
    q2, k2, v2 = make_qkv(1, 8, 12, 2, 1, 16, torch.float16)
    with pytest.raises(ValueError, match=r"needs equal query and key lengths \(got 8 and 12\)"):
        _flash_bwd._check_block("AtenFlashBackward", q2, q2, k2, v2, q2, lse, True)
    assert _flash_bwd.AtenFlashBackward.supports_head_dim(256)
    assert not _flash_bwd.AtenFlashBackward.supports_head_dim(260)
