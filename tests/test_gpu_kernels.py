"""Layer 4: the Triton block kernels (forward and backward) on one CUDA GPU, bf16/fp16 (marked ``gpu``).

Run on the GPU machine, e.g. ``PYTHONPATH=. python -m pytest -q tests/test_gpu_kernels.py``.

Criterion (FlashAttention's own): in bf16/fp16 the maximum error of our result against an fp32 reference is
at most twice that of plain PyTorch attention computed in the same low precision, plus a small floor, for
out, lse and the gradients of q, k and v. Both references are dense masked softmax attention built from
the element rule (``row_lo[i] <= j < row_hi[i]`` / causal / full, and the key padding mask), with autograd.
"""

import math

import pytest
import torch

from distcomm_attention.planning.visibility import CAUSAL, FULL, BlockMask

pytestmark = pytest.mark.gpu

LOW = [torch.bfloat16, torch.float16]
FLOOR = 1e-4  # absolute slack, so that a plain low-precision error of ~0 cannot fail the 2x test


def dense_attention(q, k, v, visible, scale, *, softcap=0.0, upcast=True):
    """Masked softmax attention on BSHD tensors (fp32 when ``upcast``, else in the inputs' dtype).

    ``visible``: bool (Sq, Sk) or (B, Sq, Sk). Rows that see nothing give out 0 (lse -inf). Returns out in
    the input dtype and lse (B, H, Sq) fp32; differentiable.
    """
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    group = q.shape[2] // k.shape[2]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, dim=2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    visible = visible[:, None] if visible.dim() == 3 else visible
    scores = scores.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores.float(), dim=-1)
    seen = visible.any(-1, keepdim=True)
    probs = (torch.softmax(torch.where(seen, scores, 0.0), dim=-1) * seen).to(v.dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(group, dim=2))
    return out.to(dtype), lse


def interval_block(row_lo, row_hi, seqlen_k, device):
    """An "interval" BlockMask (col arrays derived as the planner does) and its dense mask, on ``device``."""
    row_hi = torch.maximum(row_hi, row_lo)
    j = torch.arange(seqlen_k)
    col_lo = torch.searchsorted(row_hi, j, right=True)
    col_hi = torch.maximum(torch.searchsorted(row_lo, j, right=True), col_lo)
    dense = (j[None, :] >= row_lo[:, None]) & (j[None, :] < row_hi[:, None])
    arrays = (a.to(device=device, dtype=torch.int32) for a in (row_lo, row_hi, col_lo, col_hi))
    return BlockMask("interval", *arrays), dense.to(device)


def make_block(kind, seqlen_q, seqlen_k, device):
    i = torch.arange(seqlen_q)
    if kind == "full":
        return FULL, torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if kind == "causal":
        return CAUSAL, torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device).tril()
    if kind == "window":  # causal sliding window of 200 keys
        return interval_block((i - 200).clamp(0, seqlen_k), (i + 1).clamp(0, seqlen_k), seqlen_k, device)
    if kind == "documents":  # causal documents of uneven lengths, a 1-token one, rows of an empty one
        bounds = torch.tensor([0, 130, 131, 400, 777, 777, seqlen_k])
        docs = torch.searchsorted(bounds[1:], i, right=True)
        lo = bounds[docs]
        return interval_block(lo, torch.minimum(i + 1, bounds[docs + 1]), seqlen_k, device)
    raise KeyError(kind)


def make(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=gen, device="cuda").to(dtype)
    k = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    v = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    return q, k, v


def max_err(a, b, where=None):
    diff = (a.float() - b.float()).abs()
    if where is not None:
        diff = diff[where]
    return diff.max().item() if diff.numel() else 0.0


def assert_2x(name, ours, ref, low, where=None):
    assert not ours.isnan().any(), f"{name} has NaN"
    err, err_low = max_err(ours, ref, where), max_err(low, ref, where)
    assert err <= 2 * err_low + FLOOR, f"{name}: error {err:.3e} > 2 x plain low-precision error {err_low:.3e}"


def triton_forward(q, k, v, block, *, scale, softcap=0.0, key_mask=None, final=True):
    from distcomm_attention.kernels.triton_fwd import TritonForward

    kernel = TritonForward()
    state = kernel.init_state(q)
    kernel.step(state, q, k, v, mask=block, scale=scale, softcap=softcap, key_mask=key_mask, final=final)
    return kernel.finalize(state, q.dtype)


CASES = {
    # name: (batch, seqlen, heads, kv_heads, head_dim, block kind, softcap, key mask)
    "full": (2, 1000, 8, 8, 128, "full", 0.0, False),
    "causal_gqa4": (2, 1000, 8, 2, 128, "causal", 0.0, False),
    "window_gqa2": (1, 1000, 8, 4, 64, "window", 0.0, False),
    "documents_keymask": (2, 1000, 4, 2, 128, "documents", 0.0, True),
    "softcap_causal": (1, 777, 4, 4, 128, "causal", 20.0, False),
    "head_dim_256": (1, 500, 4, 2, 256, "causal", 0.0, True),
    "head_dim_72": (1, 500, 4, 1, 72, "full", 0.0, False),
}


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_backward_flash_criterion(case, dtype):
    """Triton forward (fused final step) and backward of one block meet the 2x criterion for out, lse and
    dq/dk/dv, for every block kind, key padding, softcap, GQA and head dim; no NaN where rows see nothing."""
    from distcomm_attention.kernels.triton_bwd import TritonBackward

    batch, seqlen, heads, kv_heads, head_dim, kind, softcap, with_key_mask = CASES[case]
    q, k, v = make(batch, seqlen, seqlen, heads, kv_heads, head_dim, dtype, seed=1)
    block, dense = make_block(kind, seqlen, seqlen, "cuda")
    key_mask = None
    visible = dense
    if with_key_mask:
        key_mask = torch.rand(batch, seqlen, device="cuda") < 0.8
        key_mask[-1, -300:] = False  # a run of padding: whole key tiles hidden
        visible = dense[None] & key_mask[:, None, :]
    scale = head_dim**-0.5

    ref_inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    low_inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = dense_attention(*ref_inputs, visible, scale, softcap=softcap)
    low_out, low_lse = dense_attention(*low_inputs, visible, scale, softcap=softcap, upcast=False)
    out, lse = triton_forward(q, k, v, block, scale=scale, softcap=softcap, key_mask=key_mask)
    seen = ~ref_lse.isinf()
    assert torch.equal(lse.isinf(), ~seen)
    assert_2x("out", out, ref_out, low_out)
    assert_2x("lse", lse, ref_lse, low_lse, where=seen)

    dout = torch.randn_like(q)
    ref_out.float().backward(dout.float())
    low_out.backward(dout)
    dq, dk, dv = TritonBackward().step(dout, q, k, v, out, lse, mask=block, scale=scale, softcap=softcap,
                                       key_mask=key_mask, dkv_dtype=dtype)
    assert dk.dtype == dtype and dq.dtype == torch.float32
    for name, ours, ref, low in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_inputs, low_inputs):
        assert_2x(name, ours, ref.grad, low.grad)


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
def test_ring_blocks_with_global_statistics(dtype):
    """Two key blocks of a ring step (a causal diagonal and a full block on half the rows): forward steps with
    the fp32 state, then each block's backward from the merged out/lse, dQ accumulated in one fp32 buffer and
    dK/dV in fp32, meet the 2x criterion against attention over the concatenation."""
    from distcomm_attention.kernels.triton_bwd import TritonBackward
    from distcomm_attention.kernels.triton_fwd import TritonForward

    seqlen, heads, kv_heads, head_dim = 1024, 8, 2, 128
    q, k, v = make(1, seqlen, 2 * seqlen, heads, kv_heads, head_dim, dtype, seed=2)
    visible = torch.zeros(seqlen, 2 * seqlen, dtype=torch.bool, device="cuda")
    visible[:, :seqlen] = torch.ones(seqlen, seqlen, dtype=torch.bool, device="cuda").tril()
    visible[seqlen // 2 :, seqlen:] = True
    scale = head_dim**-0.5
    ref_inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    low_inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ref_out, _ = dense_attention(*ref_inputs, visible, scale)
    low_out, _ = dense_attention(*low_inputs, visible, scale, upcast=False)
    dout = torch.randn_like(q)
    ref_out.float().backward(dout.float())
    low_out.backward(dout)

    blocks = [(slice(None), slice(0, seqlen), CAUSAL), (slice(seqlen // 2, None), slice(seqlen, None), FULL)]
    fwd = TritonForward()
    state = fwd.init_state(q)
    for rows, keys, block in blocks:
        fwd.step(state, q, k[:, keys], v[:, keys], mask=block, scale=scale, q_slice=rows)
    out, lse = fwd.finalize(state, dtype)
    assert_2x("out", out, ref_out, low_out)
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    dk = torch.zeros(k.shape, dtype=torch.float32, device="cuda")
    dv = torch.zeros(v.shape, dtype=torch.float32, device="cuda")
    bwd = TritonBackward()
    for rows, keys, block in blocks:
        _, dk_b, dv_b = bwd.step(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], None, lse[:, :, rows],
                                 delta[:, :, rows], mask=block, scale=scale, dq_acc=dq[:, rows])
        dk[:, keys] += dk_b
        dv[:, keys] += dv_b
    for name, ours, ref, low in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_inputs, low_inputs):
        assert_2x(name, ours, ref.grad, low.grad)


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["causal", "full"])
def test_split2_forward_tails_gqa_and_state(monkeypatch, kind, dtype):
    """The split-2 forward (the head_dim-128 default, Note [Split-2 forward]) with TMA loads, checked to be the
    kernel that ran: 1000 query rows (a tail in both 64-row halves), batch 2, GQA 8/2, key blocks of 512 as
    views of a longer k/v, steps through the fp32 state (a q slice first, then all rows, with and without
    the fused final step), meet the 2x criterion; with 1000 keys (no TMA for k/v) the plain kernel runs."""
    import distcomm_attention.kernels.triton_fwd as F

    made = []
    real = F._split_descriptors
    monkeypatch.setattr(F, "_split_descriptors", lambda *args: made.append(real(*args)) or made[-1])
    seqlen_q, keys, heads, kv_heads, head_dim = 1000, 512, 8, 2, 128
    q, k, v = make(2, seqlen_q, 2 * keys, heads, kv_heads, head_dim, dtype, seed=4)
    block = CAUSAL if kind == "causal" else FULL
    visible = torch.zeros(seqlen_q, 2 * keys, dtype=torch.bool, device="cuda")
    visible[:, :keys] = make_block(kind, seqlen_q, keys, "cuda")[1]
    visible[300:, keys:] = make_block(kind, seqlen_q - 300, keys, "cuda")[1]
    scale = head_dim**-0.5
    ref_out, ref_lse = dense_attention(q, k, v, visible, scale)
    low_out, low_lse = dense_attention(q, k, v, visible, scale, upcast=False)
    assert F.TritonForward().config(head_dim, dtype).split == 2
    for final in (False, True):
        made.clear()
        fwd = F.TritonForward()
        state = fwd.init_state(q)
        fwd.step(state, q, k[:, keys:], v[:, keys:], mask=block, scale=scale, q_slice=slice(300, None))
        fwd.step(state, q, k[:, :keys], v[:, :keys], mask=block, scale=scale, final=final)
        out, lse = fwd.finalize(state, dtype)
        assert len(made) == 2 and all(d is not None for d in made), "the split kernel did not run"
        assert_2x(f"out (final={final})", out, ref_out, low_out)
        assert_2x(f"lse (final={final})", lse, ref_lse, low_lse)

    made.clear()
    k_t, v_t = k[:, :seqlen_q], v[:, :seqlen_q]
    dense = make_block(kind, seqlen_q, seqlen_q, "cuda")[1]
    out, lse = triton_forward(q, k_t, v_t, block, scale=scale)
    assert made == [None]  # 1000 keys: no TMA for k/v, so the plain kernel
    ref_out, ref_lse = dense_attention(q, k_t, v_t, dense, scale)
    low_out, low_lse = dense_attention(q, k_t, v_t, dense, scale, upcast=False)
    assert_2x("out (plain kernel)", out, ref_out, low_out)
    assert_2x("lse (plain kernel)", lse, ref_lse, low_lse)


def test_backward_is_deterministic():
    """Two runs of the backward give bitwise equal gradients (no atomics)."""
    from distcomm_attention.kernels.triton_bwd import TritonBackward

    q, k, v = make(1, 2048, 2048, 8, 2, 128, torch.bfloat16, seed=3)
    out, lse = triton_forward(q, k, v, CAUSAL, scale=0.1)
    dout = torch.randn_like(q)
    first = TritonBackward().step(dout, q, k, v, out, lse, mask=CAUSAL, scale=0.1)
    second = TritonBackward().step(dout, q, k, v, out, lse, mask=CAUSAL, scale=0.1)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_device_indices_kept_per_stream():
    """``_device.on_device_kept`` on CUDA: a packed call's device indices are looked up once per stream that reads
    them (the same object again on that stream; on another stream a lookup through ``on_device``, which makes
    that stream wait for the copies, of the same device copies), and not kept while a graph is captured."""
    from distcomm_attention.kernels import contract
    from distcomm_attention.planning.calls import PackedCall
    from distcomm_attention.planning.visibility import Piece

    dev = torch.device("cuda", torch.cuda.current_device())
    call = PackedCall((Piece(0, 8, 0, 8, None, 0), Piece(8, 20, 8, 20, None, 0)), (None, 0))  # two documents
    first = contract._packed_varlen(call, 1, 20, 20, dev)
    assert contract._packed_varlen(call, 1, 20, 20, dev) is first
    assert first.varlen.cu_q.is_cuda and first.varlen.cu_q.tolist() == [0, 8, 20]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        other = contract._packed_varlen(call, 1, 20, 20, dev)
        assert contract._packed_varlen(call, 1, 20, 20, dev) is other
    assert other is not first and other.varlen.cu_q.data_ptr() == first.varlen.cu_q.data_ptr()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = contract._packed_varlen(call, 1, 20, 20, dev)
        assert contract._packed_varlen(call, 1, 20, 20, dev) is not captured
    assert captured.varlen.cu_q.data_ptr() == first.varlen.cu_q.data_ptr()
