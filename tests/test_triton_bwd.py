"""Layer 3: the Triton backward kernels (``TritonBackward``) under TRITON_INTERPRET=1 (fp32/fp16).

Every gradient is checked against float64 autograd through dense masked softmax attention, built from the
element rule (``row_lo[i] <= j < row_hi[i]``, causal ``j <= i``, and the key padding mask), with the
GLOBAL out/lse the ring hands the kernel. Tiles are 16x16 so ragged tails, edge and interior tiles
(Note [Kernel tiles]), GQA groups and rows or tiles that see nothing all occur at small shapes. The
reference and interval helpers come from tests/test_triton_kernel.py.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernel import (conftest also sets it)

from tests.optional import require

triton = require("triton")

from distcomm_attention.planning import layouts  # noqa: E402
from distcomm_attention.kernels.triton_bwd import BackwardConfig, TritonBackward, default_backward_config  # noqa: E402
from distcomm_attention.kernels.triton_fwd import TritonForward  # noqa: E402
from distcomm_attention.planning.visibility import CAUSAL, FULL, BlockMask, Visibility, ring_plan  # noqa: E402
from tests.test_triton_kernel import (  # noqa: E402
    SMALL,
    causal_mask,
    full_mask,
    interpreter_only,
    interval_case,
    make_qkv,
    random_key_mask,
    reference,
    window_intervals,
)

pytestmark = interpreter_only

BWD_SMALL = BackwardConfig(16, 16, 4, 1, 16, 16, 4, 1)


def grad_tolerance(dtype):
    """Max error allowed relative to the largest reference gradient entry."""
    return {torch.float32: 2e-5, torch.float16: 4e-3}[dtype]


def assert_grads_match(grads, ref_grads, dtype):
    for name, g, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert not g.isnan().any(), f"{name} has NaN"
        scale = max(ref.abs().max().item(), 1e-3)
        err = (g.double() - ref).abs().max().item()
        assert err <= grad_tolerance(dtype) * scale, f"{name}: max error {err:.3e} (reference max {scale:.3e})"


def block_backward(q, k, v, block, dense, *, scale, softcap=0.0, key_mask=None, seed=0, **kwargs):
    """The kernel's gradients of one block whose out/lse are the block's own, and the float64 reference's."""
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q.dtype)
    visible = dense if key_mask is None else dense[None] & key_mask[:, None, :]
    out, lse, ref_grads = reference(q, k, v, visible, scale, softcap=softcap, dout=dout)
    grads = TritonBackward(config=BWD_SMALL).step(
        dout, q, k, v, out.to(q.dtype), lse.float(), mask=block, scale=scale, softcap=softcap, key_mask=key_mask,
        **kwargs,
    )
    return grads, ref_grads


# ---------------------------------------------------------------------------------------------------
# one block
# ---------------------------------------------------------------------------------------------------

CASES = {
    # name: (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, block kind)
    "full_ragged": (1, 37, 29, 2, 2, 32, "full"),
    "causal_gqa2": (1, 37, 37, 4, 2, 32, "causal"),
    "causal_mqa4": (1, 33, 33, 4, 1, 16, "causal"),
    "window_gqa2": (1, 37, 61, 2, 1, 32, "window"),
    "documents": (2, 45, 45, 2, 2, 16, "documents"),
    "empty_rows": (1, 40, 29, 2, 1, 32, "empty_rows"),
    "head_dim_48_padded": (1, 19, 23, 2, 1, 48, "full"),
}


def block_kind(kind, seqlen_q, seqlen_k):
    if kind == "full":
        return FULL, full_mask(seqlen_q, seqlen_k)
    if kind == "causal":
        return CAUSAL, causal_mask(seqlen_q, seqlen_k)
    return interval_case(kind, seqlen_q, seqlen_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_block_gradients_match_reference(case, dtype):
    """dQ, dK, dV of one block equal float64 autograd for every block kind, GQA group (1, 2, 4), ragged
    lengths and padded head dims; rows that see no key get dQ = 0."""
    batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, kind = CASES[case]
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype, seed=11)
    block, dense = block_kind(kind, seqlen_q, seqlen_k)
    grads, ref_grads = block_backward(q, k, v, block, dense, scale=head_dim**-0.5)
    assert grads[0].dtype == torch.float32 and grads[1].dtype == torch.float32  # defaults: fp32 dq, dk, dv
    assert_grads_match(grads, ref_grads, dtype)
    empty = ~dense.any(-1)
    assert (grads[0][:, empty] == 0).all()


@pytest.mark.parametrize("kind", ["full", "causal", "window"])
def test_key_mask_gradients(kind):
    """With a key padding mask (a strided view; a batch row of padding only; a key tile of padding only),
    padded keys get exactly zero dK/dV and rows that see nothing get zero dQ, never NaN."""
    batch, seqlen = 3, 40
    q, k, v = make_qkv(batch, seqlen, seqlen, 2, 1, 32, torch.float16, seed=12)
    key_mask = random_key_mask(batch, 2 * seqlen, seed=13)[:, ::2]
    key_mask[1] = False
    key_mask[2, 16:32] = False
    block, dense = {"full": (FULL, full_mask(seqlen, seqlen)), "causal": (CAUSAL, causal_mask(seqlen, seqlen)),
                    "window": window_intervals(seqlen, seqlen, offset=0, left=20, right=0)}[kind]
    (dq, dk, dv), ref_grads = block_backward(q, k, v, block, dense, scale=0.3, key_mask=key_mask)
    assert_grads_match((dq, dk, dv), ref_grads, torch.float16)
    hidden = ~key_mask
    assert (dk[hidden] == 0).all() and (dv[hidden] == 0).all()
    assert (dq[1] == 0).all()


@pytest.mark.parametrize("kind", ["full", "causal", "documents"])
def test_softcap_gradients(kind):
    """softcap > 0: the backward applies d(cap tanh(x / cap))/dx = 1 - tanh^2 to dS."""
    q, k, v = make_qkv(1, 45, 45, 2, 2, 32, torch.float32, seed=14)
    block, dense = block_kind(kind, 45, 45)
    grads, ref_grads = block_backward(q * 3, k, v, block, dense, scale=0.5, softcap=4.0)
    assert_grads_match(grads, ref_grads, torch.float32)


def test_rows_without_any_key_get_zero_gradients():
    """Rows whose GLOBAL lse is -inf (no visible key anywhere) get zero dQ and add nothing to dK/dV, even
    inside a full block (the kernel must not compute exp(s - (-inf)))."""
    q, k, v = make_qkv(1, 24, 20, 2, 2, 16, torch.float32, seed=15)
    dout = torch.randn(q.shape)
    out, lse, (rq, rk, rv) = reference(q, k, v, full_mask(24, 20), 0.4, dout=dout)
    lse[:, :, 5:9] = -math.inf  # as if these rows saw nothing in the whole ring
    out[:, 5:9] = 0
    dq, dk, dv = TritonBackward(config=BWD_SMALL).step(dout, q, k, v, out, lse.float(), mask=FULL, scale=0.4)
    assert not any(g.isnan().any() for g in (dq, dk, dv))
    assert (dq[:, 5:9] == 0).all()
    keep = torch.ones(24, dtype=torch.bool)
    keep[5:9] = False
    # The other rows' contributions: the reference restricted to them.
    _, _, (rq2, rk2, rv2) = reference(q[:, keep], k, v, full_mask(20, 20), 0.4, dout=dout[:, keep])
    assert_grads_match((dq[:, keep], dk, dv), (rq2, rk2, rv2), torch.float32)


# ---------------------------------------------------------------------------------------------------
# the ring contract: global statistics, dq accumulation, dK/dV dtype
# ---------------------------------------------------------------------------------------------------


def test_blocks_with_global_statistics_accumulate():
    """Blocks of a ring step (causal diagonal, a q_slice interval block, a full block) backpropagated with the
    GLOBAL out/lse of the forward steps: dQ added into a strided fp32 view of a bigger buffer (``dq_acc``)
    and dK/dV of each block (returned in fp32 or fp16, ``dkv_dtype``) sum to the gradients of attention
    over the concatenation."""
    seqlen_q, heads, kv_heads, head_dim = 32, 4, 2, 16
    window, window_dense = window_intervals(16, 24, offset=12, left=10, right=1)
    steps = [  # (key chunk length, q_slice, BlockMask, dense block, dkv_dtype)
        (32, slice(None), CAUSAL, causal_mask(32, 32), torch.float32),
        (24, slice(16, 32), window, window_dense, torch.float16),
        (19, slice(None), FULL, full_mask(32, 19), torch.float32),
    ]
    total = sum(s[0] for s in steps)
    q, k, v = make_qkv(1, seqlen_q, total, heads, kv_heads, head_dim, torch.float16, seed=16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(17)).to(torch.float16)
    dense = torch.zeros(seqlen_q, total, dtype=torch.bool)
    start = 0
    for length, rows, _, block_dense, _ in steps:
        dense[rows, start : start + length] = block_dense
        start += length
    _, _, ref_grads = reference(q, k, v, dense, 0.25, dout=dout)

    fwd = TritonForward(**SMALL)
    state = fwd.init_state(q)
    start = 0
    for length, rows, block, _, _ in steps:
        fwd.step(state, q, k[:, start : start + length], v[:, start : start + length], mask=block, scale=0.25,
                 q_slice=rows)
        start += length
    out, lse = fwd.finalize(state, q.dtype)
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()

    buffer = torch.full((1, seqlen_q, heads + 1, head_dim), 7.0)  # a bigger buffer: dq_acc is a strided view
    dq = buffer[:, :, 1:]
    dq.zero_()
    dk = torch.zeros(k.shape, dtype=torch.float64)
    dv = torch.zeros(v.shape, dtype=torch.float64)
    bwd = TritonBackward(config=BWD_SMALL)
    start = 0
    for length, rows, block, _, dkv_dtype in steps:
        keys = slice(start, start + length)
        got, dk_b, dv_b = bwd.step(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], None, lse[:, :, rows],
                                   delta[:, :, rows], mask=block, scale=0.25, dq_acc=dq[:, rows], dkv_dtype=dkv_dtype)
        assert got.data_ptr() == dq[:, rows].data_ptr()  # the accumulator itself is returned
        assert dk_b.dtype == dkv_dtype and dv_b.dtype == dkv_dtype
        dk[:, keys] += dk_b.double()
        dv[:, keys] += dv_b.double()
        start += length
    assert (buffer[:, :, 0] == 7.0).all()  # nothing outside the view was written
    assert_grads_match((dq, dk, dv), ref_grads, torch.float16)


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_ring_plan_blocks(layout):
    """The blocks ``ring_plan`` gives one rank (causal window over packed documents, a key padding mask)
    run through the forward and backward kernels equal that rank's rows of dense float64 attention over the
    global sequence (rule evaluated here on global positions, independently of the planner)."""
    ring, local, rank = 3, 16, 1
    seq_len = ring * local
    cu = (0, 5, 6, 29, 48)
    vis = Visibility(causal=True, window=(12, -1), cu_seqlens=cu, key_mask=True)
    plan = ring_plan(layout, vis, ring, rank, local)
    pos = [layouts.positions(layout, seq_len, ring, r) for r in range(ring)]
    q_all, k_all, v_all = make_qkv(1, seq_len, seq_len, 2, 1, 16, torch.float32, seed=18)
    key_mask_all = random_key_mask(1, seq_len, seed=19, keep=0.85)
    dout = torch.randn(1, local, 2, 16, generator=torch.Generator().manual_seed(20))

    pq, pk = pos[rank], torch.arange(seq_len)
    doc = lambda p: torch.searchsorted(torch.tensor(cu), p, right=True)  # noqa: E731
    dense = (pk[None] <= pq[:, None]) & (pk[None] >= pq[:, None] - 12) & (doc(pq)[:, None] == doc(pk)[None])
    q = q_all[:, pq]
    ref_out, ref_lse, (rq, rk, rv) = reference(q, k_all, v_all, dense[None] & key_mask_all[:, None], 0.25,
                                               dout=dout)

    fwd = TritonForward(**SMALL)
    state = fwd.init_state(q)
    for i, (t, blocks) in enumerate(zip(plan.steps, plan.blocks)):
        src = pos[(rank - t) % ring]
        for j, block in enumerate(blocks):
            keys = src[block.kv]
            fwd.step(state, q, k_all[:, keys], v_all[:, keys], mask=plan.mask(i, j, q.device), scale=0.25,
                     key_mask=key_mask_all[:, keys], q_slice=block.q)
    out, lse = fwd.finalize(state, q.dtype)
    assert_grads_match((out,), (ref_out,), torch.float32)
    seen = ~ref_lse.isinf()
    assert torch.equal(lse.isinf(), ~seen)
    torch.testing.assert_close(lse.double()[seen], ref_lse[seen], atol=1e-5, rtol=0)

    dq = torch.zeros(q.shape)
    dk, dv = torch.zeros(k_all.shape), torch.zeros(v_all.shape)
    bwd = TritonBackward(config=BWD_SMALL)
    for i, (t, blocks) in enumerate(zip(plan.steps, plan.blocks)):
        src = pos[(rank - t) % ring]
        for j, block in enumerate(blocks):
            keys, rows = src[block.kv], block.q
            _, dk_b, dv_b = bwd.step(dout[:, rows], q[:, rows], k_all[:, keys], v_all[:, keys], out[:, rows],
                                     lse[:, :, rows], mask=plan.mask(i, j, q.device), scale=0.25,
                                     key_mask=key_mask_all[:, keys], dq_acc=dq[:, rows])
            dk[:, keys] += dk_b
            dv[:, keys] += dv_b
    assert_grads_match((dq, dk, dv), (rq, rk, rv), torch.float32)


def test_deterministic():
    """Two runs give bitwise equal gradients (no atomics: every output tile has one owner)."""
    q, k, v = make_qkv(1, 40, 40, 4, 1, 16, torch.float16, seed=21)
    block, dense = block_kind("documents", 40, 40)
    first, _ = block_backward(q, k, v, block, dense, scale=0.3)
    second, _ = block_backward(q, k, v, block, dense, scale=0.3)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_bf16_and_default_config_under_interpreter():
    """bf16 runs under the interpreter (dot operands upcast to fp32) with the default (large-tile) config,
    and dK/dV come back in bf16 when asked."""
    q, k, v = make_qkv(1, 70, 70, 2, 1, 32, torch.bfloat16, seed=22)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(23)).to(torch.bfloat16)
    out, lse, ref_grads = reference(q, k, v, causal_mask(70, 70), 0.2, dout=dout)
    bwd = TritonBackward()
    assert bwd.config(32) == default_backward_config(32) == BackwardConfig(64, 64, 4, 1, 64, 64, 4, 1)
    dq, dk, dv = bwd.step(dout, q, k, v, out.to(torch.bfloat16), lse.float(), mask=CAUSAL, scale=0.2,
                          dkv_dtype=torch.bfloat16)
    assert dk.dtype == dv.dtype == torch.bfloat16 and dq.dtype == torch.float32
    for g, ref in zip((dq, dk, dv), ref_grads):
        assert (g.double() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


# ---------------------------------------------------------------------------------------------------
# interface
# ---------------------------------------------------------------------------------------------------


def test_errors_are_clear():
    """Bad statistics, accumulators, dtypes and interval arrays raise errors naming the argument."""
    q, k, v = make_qkv(1, 8, 8, 2, 1, 16, torch.float32)
    lse = torch.zeros(1, 2, 8)
    bwd = TritonBackward(config=BWD_SMALL)
    with pytest.raises(ValueError, match=r"`lse` must have shape \(1, 2, 8\); got \(1, 2, 7\)"):
        bwd.step(q, q, k, v, q, lse[:, :, :7], mask=FULL, scale=1.0)
    with pytest.raises(ValueError, match=r"`delta` is None, so `out` of q's shape is needed"):
        bwd.step(q, q, k, v, None, lse, mask=FULL, scale=1.0)
    with pytest.raises(ValueError, match=r"`delta` must have shape \(1, 2, 8\)"):
        bwd.step(q, q, k, v, None, lse, lse[:, :1], mask=FULL, scale=1.0)
    with pytest.raises(ValueError, match=r"`dq_acc` must be a float32 tensor of q's shape"):
        bwd.step(q, q, k, v, q, lse, mask=FULL, scale=1.0, dq_acc=torch.zeros(q.shape, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"`dkv_dtype` must be torch.float32, torch.float16 or torch.bfloat16"):
        bwd.step(q, q, k, v, q, lse, mask=FULL, scale=1.0, dkv_dtype=torch.float64)
    with pytest.raises(ValueError, match=r"`dout` \(1, 7, 2, 16\) must have q's shape"):
        bwd.step(q[:, :7], q, k, v, q, lse, mask=FULL, scale=1.0)
    row_only = BlockMask("interval", torch.zeros(8, dtype=torch.int32), torch.ones(8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"`mask.col_lo` must be a 1-D tensor of length 8; got NoneType"):
        bwd.step(q, q, k, v, q, lse, mask=row_only, scale=1.0)
    with pytest.raises(ValueError, match=r"`softcap` must be a finite float >= 0"):
        bwd.step(q, q, k, v, q, lse, mask=FULL, scale=1.0, softcap=math.inf)
    with pytest.raises(ValueError, match=r"query heads 2 must be a multiple of kv heads 3"):
        bwd.step(q, q, k.expand(1, 8, 3, 16), v.expand(1, 8, 3, 16), q, lse, mask=FULL, scale=1.0)
    with pytest.raises(ValueError, match=r"`block_m2`=24 must be a power of two"):
        BackwardConfig(16, 16, 4, 1, 24, 16, 4, 1)
    with pytest.raises(TypeError, match=r"`config` must be a BackwardConfig or None"):
        TritonBackward(config=(16, 16))


def test_empty_blocks():
    """Zero keys or zero query rows: nothing to launch, zero gradients of the right shapes."""
    q, k, v = make_qkv(1, 8, 8, 2, 1, 16, torch.float32)
    lse = torch.zeros(1, 2, 8)
    bwd = TritonBackward(config=BWD_SMALL)
    dq, dk, dv = bwd.step(q, q, k[:, :0], v[:, :0], q, lse, mask=FULL, scale=1.0)
    assert (dq == 0).all() and dk.shape == (1, 0, 1, 16)
    acc = torch.ones(q.shape)
    dq, _, _ = bwd.step(q, q, k[:, :0], v[:, :0], q, lse, mask=FULL, scale=1.0, dq_acc=acc)
    assert (dq == 1).all()
    dq, dk, dv = bwd.step(q[:, :0], q[:, :0], k, v, q[:, :0], lse[:, :, :0], mask=FULL, scale=1.0)
    assert dq.shape == (1, 0, 2, 16) and (dk == 0).all() and (dv == 0).all()


def test_custom_op_passes_opcheck():
    """The launch pair is a torch.library custom op (dq mutated, dk/dv returned, optional interval arrays and
    key mask) whose schema and fake kernel are consistent."""
    q, k, v = make_qkv(1, 16, 16, 2, 1, 16, torch.float32)
    lse = torch.randn(1, 2, 16)
    delta = torch.randn(1, 2, 16)
    block, _ = window_intervals(16, 16, offset=0, left=4, right=0)
    meta = BWD_SMALL.astuple()
    checks = ("test_schema", "test_faketensor")
    op = torch.ops.distcomm_attention.triton_bwd_block.default
    torch.library.opcheck(op, (q, q, k, v, lse, delta, torch.zeros(q.shape), None, None, None, None, None, 1, False,
                               0.25, 0.0, torch.float32, *meta), test_utils=checks)
    torch.library.opcheck(op, (q, q, k, v, lse, delta, torch.zeros(q.shape), *block[1:5], random_key_mask(1, 16), 2,
                               True, 0.25, 2.0, torch.float16, *meta), test_utils=checks)


def test_fake_tensors_use_the_fake_kernel():
    """Under FakeTensorMode the backward goes through the custom op's fake kernel (no launch on fake data)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        q, k, v = make_qkv(1, 16, 16, 4, 2, 16, torch.float16)
        lse = torch.zeros(1, 4, 16)
        dq, dk, dv = TritonBackward().step(q, q, k, v, q, lse, mask=CAUSAL, scale=0.25, dkv_dtype=torch.float16)
        assert all(isinstance(t, FakeTensor) for t in (dq, dk, dv))
        assert dq.shape == q.shape and dq.dtype == torch.float32 and dk.shape == k.shape and dk.dtype == torch.float16


@pytest.mark.parametrize("kind", ["full", "causal"])
def test_grid_orders_agree(kind, monkeypatch):
    """Both program orders of the backward grid (tiles or heads fastest, chosen per call by the grid size)
    compute the same gradients, bit for bit."""
    from distcomm_attention.kernels import triton_bwd as _triton_bwd

    q, k, v = make_qkv(1, 33, 33, 4, 2, 16, torch.float16, seed=24)
    block, dense = block_kind(kind, 33, 33)
    results = []
    for heads_fastest in (False, True):
        monkeypatch.setattr(_triton_bwd, "_heads_fastest", lambda *args, _h=heads_fastest: _h)
        grads, ref_grads = block_backward(q, k, v, block, dense, scale=0.3)
        assert_grads_match(grads, ref_grads, torch.float16)
        results.append(grads)
    assert all(torch.equal(a, b) for a, b in zip(*results))
