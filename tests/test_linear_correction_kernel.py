"""The fused scalar-decay correction (distcomm_attention/linear/correction_kernel.py) under the Triton
interpreter on CPU (float32 and float16; the interpreter's bf16 products are wrong, conftest.py) against the
same formula in float64 with autograd: o = o0 + w * (q @ S), S rounded to o0's dtype for the product."""

from __future__ import annotations

import pytest
import torch

from tests.test_linear_attention import F64, _gen

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(o0, q, w, s, dtype):
    """float64, S through its rounding to ``dtype`` with the identity as its gradient (the kernel's contract)."""
    rounded = s + (s.to(dtype).to(F64) - s).detach()
    groups = o0.shape[2] // q.shape[2]
    qq = q.repeat_interleave(groups, 2)
    return o0 + w[..., None] * torch.einsum("bthk,bhkv->bthv", qq, rounded)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("b, t, heads, hv, k, v", [
    (1, 150, 1, 5, 32, 16),   # one key head for every value head (Mamba-2's one group); tokens over 2 tiles
    (2, 64, 2, 6, 24, 40),    # GVA 3, K and V not powers of two
])
def test_correction_matches_float64(dtype, b, t, heads, hv, k, v):
    from distcomm_attention.linear.correction_kernel import ScalarCorrection

    gen = _gen("correction", dtype, b, t, heads, hv, k, v)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    o0, q, s = r(b, t, hv, v).to(dtype).to(F64), r(b, t, heads, k).to(dtype).to(F64), r(b, hv, k, v)
    w = torch.rand(b, t, hv, generator=gen, dtype=F64).float().double()
    dout = r(b, t, hv, v).to(dtype).to(F64)

    leaves = [x.clone().requires_grad_() for x in (o0, q, w, s)]
    ref = reference(*leaves, dtype)
    ref.backward(dout)

    mine = [x.to(DEVICE) for x in (o0.to(dtype), q.to(dtype), w.float(), s.float())]
    mine = [x.requires_grad_() for x in mine]
    out = ScalarCorrection.apply(*mine)
    out.backward(dout.to(dtype).to(DEVICE))
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    if DEVICE == "cuda":
        tol = dict(rtol=1e-2, atol=1e-2)  # TF32 products
    assert out.dtype == dtype and mine[0].grad.dtype == dtype and mine[2].grad.dtype == torch.float32
    torch.testing.assert_close(out.cpu().double(), ref.detach(), **tol)
    for name, x, y in zip(("o0", "q", "w", "S"), mine, leaves):
        scale = max(1.0, y.grad.abs().max().item())
        torch.testing.assert_close(x.grad.cpu().double() / scale, y.grad / scale, **tol,
                                   msg=lambda m, n=name: f"d{n}: {m}")


def test_correction_refuses_mismatched_shapes():
    from distcomm_attention.linear.correction_kernel import ScalarCorrection

    o0 = torch.zeros(1, 8, 4, 8)
    with pytest.raises(ValueError, match="HV a multiple of H"):
        ScalarCorrection.apply(o0, torch.zeros(1, 8, 3, 16), torch.zeros(1, 8, 4), torch.zeros(1, 4, 16, 8))


@pytest.mark.gpu
def test_correction_at_mamba2_shapes_matches_the_pytorch_path():
    """bf16 at Mamba-2 2.7B's SSD shapes (80 value heads of 64, state 128, one group), 4k tokens: the kernel
    against the float64 formula, each error within twice the PyTorch path's (its matmul then scaled add)."""
    from distcomm_attention.linear.correction_kernel import ScalarCorrection

    dev, bf = torch.device("cuda"), torch.bfloat16
    b, t, heads, hv, k, v = 1, 4096, 1, 80, 128, 64
    gen = torch.Generator(device=dev).manual_seed(0)
    o0 = torch.randn(b, t, hv, v, device=dev, generator=gen).to(bf)
    q = torch.randn(b, t, heads, k, device=dev, generator=gen).to(bf)
    w = torch.rand(b, t, hv, device=dev, generator=gen)
    s = torch.randn(b, hv, k, v, device=dev, generator=gen)
    ref = reference(o0.double(), q.double(), w.double(), s.double(), bf)
    mine = ScalarCorrection.apply(o0, q, w, s)
    qh = torch.matmul(q.transpose(1, 2), s.to(bf).reshape(b, heads, k, hv * v)).reshape(b, heads, t, hv, v)
    torch_path = torch.addcmul(o0, qh.permute(0, 2, 1, 3, 4).reshape(b, t, hv, v), w.to(bf)[..., None])
    err = (mine.double() - ref).abs().max().item()
    err_torch = (torch_path.double() - ref).abs().max().item()
    assert err <= 2 * err_torch + 1e-6, (err, err_torch)
