"""The state-only Triton pass of the gated delta rule's maps (distcomm_attention/linear/maps_kernel.py), under
the Triton interpreter on CPU (float32; the interpreter's bf16 products are wrong, conftest.py), against the
token-by-token float64 recurrence of tests/test_linear_attention.py: A is the end state from I with zero
values, B the end state from zero. The kernel's inputs (fla's WY form w, u and its chunk-local gates in log2
units) are made here in float64 from q, k, v, g, beta by the chunk's triangular solve."""

from __future__ import annotations

import math

import pytest
import torch

from tests.test_linear_attention import F64, _gen, recurrence

pytest.importorskip("triton")

CHUNK = 64
# on a GPU the kernels run compiled, their float32 products in TF32 (10-bit mantissas)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_TOL = dict(rtol=1e-4, atol=1e-4) if DEVICE == "cpu" else dict(rtol=5e-3, atol=5e-3)


def wy_inputs(k, v, g, beta, bounds):
    """fla's forward inputs of the state pass: w, u (B, T, HV, K/V) and the chunk-local cumulative gates in
    log2 units (B, T, HV), chunks restarting at every sequence start in ``bounds``."""
    hv = v.shape[2]
    kk = k.repeat_interleave(hv // k.shape[2], 2)
    w, u, gl = torch.zeros_like(kk), torch.zeros_like(v), torch.zeros_like(g)
    for a, e in zip(bounds[:-1], bounds[1:]):
        for c in range(a, e, CHUNK):
            sl = slice(c, min(c + CHUNK, e))
            kc, vc, bc = kk[:, sl].transpose(1, 2), v[:, sl].transpose(1, 2), beta[:, sl].transpose(1, 2)
            gam = g[:, sl].transpose(1, 2).cumsum(-1)
            n = gam.shape[-1]
            ratio = (gam[..., :, None] - gam[..., None, :]).exp()
            lower = (bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * ratio).tril(-1)
            system = torch.eye(n, dtype=F64) + lower
            solve = lambda rhs: torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # noqa: E731
            u[:, sl] = solve(bc[..., None] * vc).transpose(1, 2)
            w[:, sl] = solve((bc * gam.exp())[..., None] * kc).transpose(1, 2)
            gl[:, sl] = gam.transpose(1, 2) / math.log(2)
    return w, u, gl


@pytest.mark.parametrize("batch, bounds, heads, dims", [
    (1, [0, 37, 37 + 150, 37 + 150 + 64], (2, 4), (16, 24)),  # sequences of 37, 150 (3 chunks), 64 tokens; GVA
    (2, None, (2, 2), (8, 40)),  # two batch rows of 130 tokens, K below the smallest tile, V over one tile
])
def test_maps_kernel_matches_the_recurrence(batch, bounds, heads, dims):
    from distcomm_attention.linear.maps_kernel import delta_maps

    gen = _gen("maps", batch, bounds, heads, dims)
    t = bounds[-1] if bounds else 130
    h, hv = heads
    dk, dv = dims
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    k = torch.nn.functional.normalize(r(batch, t, h, dk), dim=-1)
    v = r(batch, t, hv, dv)
    g = -0.3 * torch.rand(batch, t, hv, generator=gen, dtype=F64)
    beta = torch.rand(batch, t, hv, generator=gen, dtype=F64)
    w, u, gl = wy_inputs(k, v, g, beta, bounds or [0, t])

    n = len(bounds) - 1 if bounds else batch
    _, b_ref = recurrence(k, k, v, g, beta, 1.0, torch.zeros(n, hv, dk, dv, dtype=F64), bounds)
    eye = torch.eye(dk, dtype=F64).expand(n, hv, dk, dk).clone()
    _, a_ref = recurrence(k, k, torch.zeros(batch, t, hv, dk, dtype=F64), g, beta, 1.0, eye, bounds)

    cu = None if bounds is None else torch.tensor(bounds, device=DEVICE)
    a, b = delta_maps(*(x.float().to(DEVICE) for x in (k, w, u, gl)), cu_seqlens=cu)
    assert a.shape == (n, hv, dk, dk) and b.shape == (n, hv, dk, dv) and a.dtype == b.dtype == torch.float32
    torch.testing.assert_close(b.cpu().double(), b_ref, **KERNEL_TOL)
    torch.testing.assert_close(a.cpu().double(), a_ref, **KERNEL_TOL)
    assert not torch.allclose(a.cpu().double(), eye, atol=1e-2)  # the transition is far from I here


def test_maps_kernel_refuses_wide_keys():
    from distcomm_attention.linear.maps_kernel import delta_maps

    k = torch.zeros(1, 64, 1, 256)
    with pytest.raises(ValueError, match="key dim 256 > 128"):
        delta_maps(k, k, torch.zeros(1, 64, 1, 8), torch.zeros(1, 64, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True])
def test_kernels_match_fla_passes(varlen):
    """At Qwen3.5's GDN shapes in bf16 (16 key heads, 32 value heads of 128) on fla's own WY form: the maps
    against fla's state pass run from zero and from I with zero values, within bf16 rounding of the state
    products (the same roundings)."""
    pytest.importorskip("fla")
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    from distcomm_attention.linear.maps_kernel import delta_maps

    torch.manual_seed(0)
    dev, bf = torch.device("cuda"), torch.bfloat16
    t, h, hv, dk, dv = 4096 + 100, 16, 32, 128, 128
    cu = torch.tensor([0, 1000, 1001, 3000, t], device=dev) if varlen else None
    n = 4 if varlen else 1
    k = torch.nn.functional.normalize(torch.randn(1, t, h, dk, device=dev), dim=-1).to(bf)
    v = torch.randn(1, t, hv, dv, device=dev, dtype=bf)
    g = chunk_local_cumsum(torch.nn.functional.logsigmoid(torch.randn(1, t, hv, device=dev) + 4), chunk_size=64,
                           scale=RCP_LN2, cu_seqlens=cu)
    beta = torch.rand(1, t, hv, device=dev).to(bf)
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, chunk_size=64, cu_seqlens=cu)

    eye = torch.eye(dk, device=dev).expand(n, hv, dk, dk).contiguous()
    a_ref = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=torch.zeros(1, t, hv, dk, device=dev, dtype=bf), g=g,
                                         initial_state=eye, output_final_state=True, cu_seqlens=cu)[2]
    b_ref = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, output_final_state=True, cu_seqlens=cu)[2]
    a, b = delta_maps(k, w, u, g, cu)
    torch.testing.assert_close(a, a_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(b, b_ref, rtol=2e-2, atol=2e-2 * b_ref.abs().max().item())


@pytest.mark.gpu
def test_kernels_address_long_sequences():
    """A sequence of 270k tokens with 64 value heads of 128: token offsets beyond 2^31 elements. With w = 0
    and no decay the answers are exact: B = k_T u_T^T of the last token alone, A = I (every other token's
    values are zero)."""
    from distcomm_attention.linear.maps_kernel import delta_maps

    dev, bf = torch.device("cuda"), torch.bfloat16
    t, h, hv, dk, dv = 270_000, 16, 64, 128, 128
    assert t * hv * dv > 2**31
    gen = torch.Generator(device=dev).manual_seed(0)
    k = torch.zeros(1, t, h, dk, device=dev, dtype=bf)
    k[:, -1] = torch.randn(1, h, dk, device=dev, generator=gen).to(bf)
    u = torch.zeros(1, t, hv, dv, device=dev, dtype=bf)
    u[:, -1] = torch.randn(1, hv, dv, device=dev, generator=gen).to(bf)
    w = torch.zeros(1, t, hv, dk, device=dev, dtype=bf)
    g = torch.zeros(1, t, hv, device=dev)
    a, b = delta_maps(k, w, u, g)
    kk = k[0, -1].float().repeat_interleave(hv // h, 0)
    torch.testing.assert_close(b[0], kk[:, :, None] * u[0, -1].float()[:, None, :], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(a[0], torch.eye(dk, device=dev).expand(hv, dk, dk), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dk, inputs_grad", [(128, True), (256, True), (128, False)])
def test_fla_open_segments_match_float64(dk, inputs_grad):
    """The open segments by fla's kernels in bf16 (Note [Open segments in two passes]; K <= 128 by this module's
    pass, wider keys by fla's state passes) against the token-by-token float64 recurrence, on four sequences
    (one of one token), GVA: the outputs, the end states A S_in + B and every gradient, S_in's included (alone
    where the inputs take none, and again in a second backward), each error at most 2x (plus 1e-3) that of one fla
    call over the same sequences from S_in."""
    pytest.importorskip("fla")
    from distcomm_attention.linear import kernels
    from tests.test_linear_attention import recurrence

    dev, bf = torch.device("cuda"), torch.bfloat16
    bounds = [0, 100, 300, 301, 700]
    t, h, hv, dv, n = bounds[-1], 2, 4, 64, len(bounds) - 1
    gen = torch.Generator().manual_seed(dk)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    x = dict(q=r(1, t, h, dk), k=torch.nn.functional.normalize(r(1, t, h, dk), dim=-1), v=r(1, t, hv, dv),
             g=torch.nn.functional.logsigmoid(r(1, t, hv) + 4), beta=torch.rand(1, t, hv, generator=gen, dtype=F64),
             h_in=r(n, hv, dk, dv))
    wo, wf = r(1, t, hv, dv), r(n, hv, dk, dv)
    scale = dk ** -0.5
    names = list(x)
    grads = names if inputs_grad else ["h_in"]

    leaves = {k: v.clone().requires_grad_(k in grads) for k, v in x.items()}
    o_ref, ends_ref = recurrence(*(leaves[k] for k in names[:5]), scale, leaves["h_in"], bounds)
    ((o_ref * wo).sum() + (ends_ref * wf).sum()).backward()
    ref = dict(o=o_ref.detach(), ends=ends_ref.detach(), **{f"d{k}": leaves[k].grad for k in grads})

    def on_gpu(split: bool) -> dict:
        leaves = {k: v.to(dev, torch.float32 if k in ("g", "h_in") else bf).requires_grad_(k in grads)
                  for k, v in x.items()}
        inputs = [leaves[k] for k in names[:5]]
        cu = torch.tensor(bounds, device=dev)
        if split:
            a, b, finish = kernels.open_segments(kernels.FlaPasses, *inputs, scale=scale, cu_seqlens=cu)
            o, ends = finish(leaves["h_in"]), a @ leaves["h_in"] + b
        else:
            o, ends = kernels.fla_chunk(*inputs, scale=scale, initial_state=leaves["h_in"], cu_seqlens=cu)
        loss = (o.double().cpu() * wo).sum() + (ends.double().cpu() * wf).sum()
        if not inputs_grad:  # a second backward through the same graph adds S_in's gradient again
            loss.backward(retain_graph=True)
            first = leaves["h_in"].grad.clone()
        loss.backward()
        if not inputs_grad:
            torch.testing.assert_close(leaves["h_in"].grad, 2 * first)
            leaves["h_in"].grad = first
        return dict(o=o, ends=ends, **{f"d{k}": leaves[k].grad for k in grads})

    def errors(got: dict) -> dict:
        return {k: ((got[k].double().cpu() - v).abs().max() / v.abs().max()).item() for k, v in ref.items()}

    split, whole = errors(on_gpu(True)), errors(on_gpu(False))
    print(dk, inputs_grad, split, whole)
    assert set(split) == {"o", "ends", *(f"d{k}" for k in grads)}
    for name, err in split.items():
        assert err <= 2 * whole[name] + 1e-3, (name, split, whole)
