"""Layer 4: the CUDA kernels and ring_flash_attn on GPUs (marked ``gpu`` / ``gpu2``; skipped without them).

Run on the GPU machine, e.g.
``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=. \
python -m pytest -q tests/test_gpu_attention.py``.

Criterion (FlashAttention's own): in fp16/bf16 the maximum error of our result against an fp32 reference
is at most twice that of plain PyTorch attention computed in the same low precision (plus a negligible
floor), for outputs and for the gradients of q, k and v.
"""

import math
import os

import pytest
import torch

from distcomm_attention.planning.visibility import CAUSAL, FULL
from tests.dist_harness import run_world

for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")  # no NVLink multicast

LOW = [torch.bfloat16, torch.float16]
FLOOR = 1e-5  # absolute slack so that a reference error of exactly 0 cannot fail the 2x test


def attention(q, k, v, *, causal, scale, mask=None, upcast=True):
    """Plain softmax attention on BSHD tensors; in fp32 when ``upcast``, else in the inputs' dtype.

    ``mask``: optional (Sq, Sk) boolean visibility; ``causal``: top-left (query i sees keys 0..i).
    Returns out (B, Sq, H, D) in the input dtype and lse (B, H, Sq) in fp32.
    """
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q * scale, k)
    seqlen_q, seqlen_k = scores.shape[-2:]
    if causal:
        visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device).tril()
        mask = visible if mask is None else mask & visible
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores.float(), dim=-1)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out.to(dtype), lse


def max_err(a, b):
    return (a.float() - b.float()).abs().max().item()


def assert_2x(name, ours, ref, low, floor=FLOOR):
    err, err_low = max_err(ours, ref), max_err(low, ref)
    assert err <= 2 * err_low + floor, f"{name}: error {err:.3e} > 2 x plain low-precision error {err_low:.3e}"


def make(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype, seed=0, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=gen, device=device).to(dtype)
    k = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=gen, device=device).to(dtype)
    v = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=gen, device=device).to(dtype)
    return q, k, v


def triton_forward(q, k, v, *, causal, scale, final=True, **cfg):
    from distcomm_attention.kernels.triton_fwd import TritonForward

    kernel = TritonForward(**cfg)
    state = kernel.init_state(q)
    kernel.step(state, q, k, v, mask=CAUSAL if causal else FULL, scale=scale, final=final)
    return kernel.finalize(state, q.dtype)


# ---------------------------------------------------------------------------------------------------
# one GPU: the Triton forward kernel
# ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape", [(2, 1000, 1000, 8, 8, 64), (1, 777, 777, 8, 2, 128), (1, 300, 300, 4, 1, 256), (2, 513, 513, 4, 4, 96)],
    ids=["mha_d64", "gqa_d128", "mqa_d256", "mha_d96"],
)
@pytest.mark.parametrize("final", [True, False], ids=["fused_final", "finalize"])
def test_triton_forward_vs_fp32_and_sdpa(shape, causal, dtype, final):
    """The Triton kernel alone meets the 2x criterion and agrees with SDPA's flash kernel."""
    batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim = shape
    q, k, v = make(*shape, dtype)
    scale = head_dim**-0.5
    out, lse = triton_forward(q, k, v, causal=causal, scale=scale, final=final)
    ref, ref_lse = attention(q, k, v, causal=causal, scale=scale)
    low, low_lse = attention(q, k, v, causal=causal, scale=scale, upcast=False)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (batch, heads, seqlen_q)
    assert_2x("out", out, ref, low)
    assert_2x("lse", lse, ref_lse, low_lse)
    group = heads // kv_heads
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(group, 2).transpose(1, 2), v.repeat_interleave(group, 2).transpose(1, 2),
        is_causal=causal, scale=scale,
    ).transpose(1, 2)
    assert_2x("out vs sdpa reference", out, ref, sdpa)


@pytest.mark.gpu
def test_triton_forward_non_square_and_strided():
    """Non-causal Sq != Sk, a causal Sq != Sk block (top-left) and non-contiguous views on the GPU."""
    q, k, v = make(1, 300, 700, 4, 2, 64, torch.bfloat16)
    for causal in (False, True):
        out, lse = triton_forward(q, k, v, causal=causal, scale=0.125)
        ref, ref_lse = attention(q, k, v, causal=causal, scale=0.125)
        low, low_lse = attention(q, k, v, causal=causal, scale=0.125, upcast=False)
        assert_2x(f"out causal={causal}", out, ref, low)
        assert_2x(f"lse causal={causal}", lse, ref_lse, low_lse)
    qkv = torch.randn(2, 333, 3, 4, 64, device="cuda", dtype=torch.float16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # packed: none of them contiguous
    out, _ = triton_forward(q, k, v, causal=True, scale=0.125)
    ref, _ = attention(q, k, v, causal=True, scale=0.125)
    low, _ = attention(q, k, v, causal=True, scale=0.125, upcast=False)
    assert_2x("packed qkv", out, ref, low)


@pytest.mark.gpu
def test_triton_forward_fp32_is_ieee():
    """fp32 inputs use IEEE fp32 dot products (no TF32): close to the fp32 reference."""
    q, k, v = make(1, 200, 200, 2, 2, 64, torch.float32)
    out, lse = triton_forward(q, k, v, causal=True, scale=0.125)
    ref, ref_lse = attention(q.double(), k.double(), v.double(), causal=True, scale=0.125)
    assert max_err(out, ref) < 1e-5 and max_err(lse, ref_lse) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
def test_triton_multi_step_accumulation(dtype):
    """Eight ring-like steps (causal diagonal, full blocks, half-row slices) keep the 2x criterion."""
    from distcomm_attention.kernels.triton_fwd import TritonForward

    n, heads, kv_heads, head_dim = 256, 8, 2, 128
    schedule = [(n, True, slice(None))] + [(n, False, slice(None))] * 3 + [(n // 2, False, slice(n // 2, n))] * 2
    schedule += [(n // 2, True, slice(n // 2, n)), (n - 7, False, slice(None))]
    total = sum(length for length, _, _ in schedule)
    q, k, v = make(1, n, total, heads, kv_heads, head_dim, dtype, seed=1)
    mask = torch.zeros(n, total, dtype=torch.bool, device="cuda")
    kernel = TritonForward()
    state = kernel.init_state(q)
    start = 0
    for i, (length, causal, rows) in enumerate(schedule):
        r = range(n)[rows]
        block = torch.ones(len(r), length, dtype=torch.bool, device="cuda")
        mask[r.start : r.stop, start : start + length] = block.tril() if causal else block
        kernel.step(state, q, k[:, start : start + length], v[:, start : start + length],
                    mask=CAUSAL if causal else FULL, scale=head_dim**-0.5, q_slice=rows, final=i + 1 == len(schedule))
        start += length
    out, lse = kernel.finalize(state, dtype)
    ref, ref_lse = attention(q, k, v, causal=False, scale=head_dim**-0.5, mask=mask)
    low, low_lse = attention(q, k, v, causal=False, scale=head_dim**-0.5, mask=mask, upcast=False)
    assert_2x("out", out, ref, low)
    assert_2x("lse", lse, ref_lse, low_lse)


@pytest.mark.gpu
def test_triton_custom_op_compiles():
    """The fused-final launch is a custom op that torch.compile traces with fullgraph=True."""
    from distcomm_attention.kernels.triton_fwd import default_config
    from distcomm_attention.kernels.triton_mask import MODE_CAUSAL

    q, k, v = make(1, 256, 256, 4, 2, 64, torch.bfloat16)
    cfg = default_config(64)
    meta = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)

    def fwd(q, k, v):
        empty = q.new_empty(0, dtype=torch.float32)
        out, lse = torch.ops.distcomm_attention.triton_fwd_last(
            q, k, v, empty, empty, empty, None, None, None, MODE_CAUSAL, 0.125, 0.0, False, *meta
        )
        return out * 2, lse

    eager = fwd(q, k, v)
    compiled = torch.compile(fwd, fullgraph=True)(q, k, v)
    torch.testing.assert_close(compiled[0], eager[0], atol=0, rtol=0)
    torch.testing.assert_close(compiled[1], eager[1], atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------------
# one GPU: the aten flash backward wrapper
# ---------------------------------------------------------------------------------------------------


def _grads(q, k, v, dout, *, causal, scale, upcast):
    """(out, dq, dk, dv) of plain attention: fp32 leaves and math when ``upcast``, else the inputs' dtype."""
    cast = (lambda x: x.detach().float()) if upcast else (lambda x: x.detach().clone())
    q, k, v = (cast(x).requires_grad_() for x in (q, k, v))
    out, _ = attention(q, k, v, causal=causal, scale=scale, upcast=upcast)
    out.backward(cast(dout))
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_aten_flash_backward_vs_fp32_autograd(heads, causal, dtype):
    """AtenFlashBackward (GQA expanded and reduced) meets the 2x criterion for dq, dk, dv."""
    from distcomm_attention.kernels.flash2 import AtenFlashBackward

    (h, hkv), n, head_dim, scale = heads, 600, 128, 128**-0.5
    q, k, v = make(2, n, n, h, hkv, head_dim, dtype, seed=2)
    dout = torch.randn_like(q)
    out, lse = triton_forward(q, k, v, causal=causal, scale=scale)
    dq, dk, dv = AtenFlashBackward().step(dout, q, k, v, out, lse, mask=CAUSAL if causal else FULL, scale=scale)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    _, *ref = _grads(q, k, v, dout, causal=causal, scale=scale, upcast=True)
    _, *low = _grads(q, k, v, dout, causal=causal, scale=scale, upcast=False)
    for name, ours, r, lo in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, low):
        assert_2x(name, ours, r, lo)


@pytest.mark.gpu
def test_aten_flash_backward_blocks_sum_to_full():
    """Backward of two key blocks with the GLOBAL out/lse sums to the full backward (what the ring does)."""
    from distcomm_attention.kernels.flash2 import AtenFlashBackward

    n, scale = 512, 64**-0.5
    q, k, v = make(1, n, 2 * n, 4, 2, 64, torch.bfloat16, seed=3)
    dout = torch.randn_like(q)
    mask = torch.ones(n, 2 * n, dtype=torch.bool, device="cuda")
    mask[:, n:] = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()  # second block causal
    out, lse = attention(q, k, v, causal=False, scale=scale, mask=mask)
    kernel = AtenFlashBackward()
    dq0, dk0, dv0 = kernel.step(dout, q, k[:, :n], v[:, :n], out, lse, mask=FULL, scale=scale)
    dq1, dk1, dv1 = kernel.step(dout, q, k[:, n:], v[:, n:], out, lse, mask=CAUSAL, scale=scale)
    qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref, _ = attention(qr, kr, vr, causal=False, scale=scale, mask=mask)
    ref.backward(dout.float())
    ql, kl, vl = (x.detach().clone().requires_grad_() for x in (q, k, v))
    low, _ = attention(ql, kl, vl, causal=False, scale=scale, mask=mask, upcast=False)
    low.backward(dout)
    assert_2x("dq", dq0.float() + dq1.float(), qr.grad, ql.grad)
    assert_2x("dk", torch.cat([dk0.float(), dk1.float()], 1), kr.grad, kl.grad)
    assert_2x("dv", torch.cat([dv0.float(), dv1.float()], 1), vr.grad, vl.grad)


# ---------------------------------------------------------------------------------------------------
# two GPUs: ring_flash_attn end to end over NCCL
# ---------------------------------------------------------------------------------------------------


def _positions(layout, seq_len, world, rank, device):
    """Global token positions held by ``rank`` (written out here, independent of the library's layouts)."""
    n = seq_len // world
    if layout == "contiguous":
        return torch.arange(rank * n, (rank + 1) * n, device=device)
    if layout == "zigzag":
        c = seq_len // (2 * world)
        first = torch.arange(rank * c, (rank + 1) * c)
        second = torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c)
        return torch.cat([first, second]).to(device)
    return torch.arange(rank, seq_len, world, device=device)  # striped


def _ring_cases_rank(rank, world, cases):
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")
    import distcomm_attention

    device = torch.device("cuda", torch.cuda.current_device())
    results = []
    for layout, causal, heads, kv_heads, dtype_name in cases:
        dtype = getattr(torch, dtype_name)
        seq_len, head_dim = 1024, 64
        scale = head_dim**-0.5
        q, k, v = make(2, seq_len, seq_len, heads, kv_heads, head_dim, dtype, seed=7, device=device)
        dout = torch.randn(q.shape, generator=torch.Generator(device=device).manual_seed(8), device=device).to(dtype)
        ref_out, *ref_grads = _grads(q, k, v, dout, causal=causal, scale=scale, upcast=True)
        low_out, *low_grads = _grads(q, k, v, dout, causal=causal, scale=scale, upcast=False)

        pos = _positions(layout, seq_len, world, rank, device)
        ql, kl, vl = (x[:, pos].detach().clone().requires_grad_() for x in (q, k, v))
        out = distcomm_attention.ring_flash_attn(ql, kl, vl, causal=causal, layout=layout, backend="auto")
        out.backward(dout[:, pos])
        row = {"case": f"{layout} causal={causal} heads={heads}/{kv_heads} {dtype_name}"}
        for name, ours, ref, low in zip(
            ("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), (ref_out, *ref_grads), (low_out, *low_grads)
        ):
            row[name] = (max_err(ours, ref[:, pos]), max_err(low, ref), ref.abs().max().item(), ours.dtype == dtype)
        results.append(row)
    return results


@pytest.mark.gpu2
def test_ring_flash_attn_two_gpus():
    """Every layout, causal and not, MHA and GQA, bf16 and fp16: outputs and grads against fp32.

    Outputs meet the 2x criterion exactly (the forward carries its state in fp32 across ring steps).
    Gradients: each ring step's block gradient comes back from the FlashAttention-2 kernel already rounded
    to the input dtype before the fp32 accumulation, so an element of dq/dk/dv may carry one extra
    rounding per contributing block, at most one per ring step; the bound adds W ulps of the gradient's
    magnitude to the 2x criterion (W = 2 here).
    """
    world = 2
    cases = [
        (layout, causal, heads, kv_heads, dtype)
        for layout in ("contiguous", "zigzag", "striped")
        for causal in (False, True)
        for heads, kv_heads in ((8, 8), (8, 2))
        for dtype in ("bfloat16", "float16")
    ]
    per_rank = run_world(_ring_cases_rank, world, cases, backend="nccl", timeout=600)
    failures = []
    for rank, rows in enumerate(per_rank):
        for row in rows:
            eps = torch.finfo(getattr(torch, row["case"].split()[-1])).eps
            for name in ("out", "dq", "dk", "dv"):
                err, err_low, magnitude, dtype_ok = row[name]
                extra = 0.0 if name == "out" else world * eps * magnitude
                bound = 2 * err_low + extra + FLOOR
                print(f"rank {rank} {row['case']:<45} {name}: {err:.3e} (2x plain {2 * err_low:.3e}, "
                      f"bound {bound:.3e})")
                if not dtype_ok or err > bound:
                    failures.append(f"rank {rank} {row['case']} {name}: {err:.3e} > {bound:.3e} (plain {err_low:.3e})")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
def test_cuda_boundaries_are_read_once_per_call(monkeypatch):
    """cu_seqlens given as a CUDA tensor is read back once at the entry of a call: every step that plans from it
    then gets the host copy, so a call waits for the GPU once, whichever strategy runs (and ring_flash_attn)."""
    from distcomm_attention import _validation, context_parallel_attn, ring_flash_attn

    seen = []
    check = _validation.check_cu_seqlens

    def recorded(cu, global_len):
        seen.append(cu.device.type if isinstance(cu, torch.Tensor) else type(cu).__name__)
        return check(cu, global_len)

    monkeypatch.setattr(_validation, "check_cu_seqlens", recorded)
    q = torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 100, 256], device="cuda", dtype=torch.int32)
    calls = {s: (lambda s=s: context_parallel_attn(q, q, q, strategy=s, causal=True, cu_seqlens=cu))
             for s in ("ring", "ulysses", "allgather", "auto")}
    calls["ring_flash_attn"] = lambda: ring_flash_attn(q, q, q, causal=True, cu_seqlens=cu)
    for name, call in calls.items():
        seen.clear()
        call().float().sum().backward()
        assert seen and set(seen) == {"cpu"}, (name, seen)
