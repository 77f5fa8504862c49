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


def chunk_states(k, w, u, gl, h0, bounds):
    """fla's forward state pass in float64, autograd kept: per sequence, v_new = u - w S for each chunk of the
    state S entering it, then S <- 2^(g_last) S + (k 2^(g_last - g))^T v_new. Returns (S after each chunk in
    fla's chunk order, (batch row, first token, v_new (HV, C, V)) of each chunk, the end states (N, HV, K, V)); k
    repeated over the value heads."""
    hv = u.shape[2]
    kk = k.repeat_interleave(hv // k.shape[2], 2)
    afters, news, ends = [], [], []
    rows = range(u.shape[0]) if bounds is None else [0] * (len(bounds) - 1)
    spans = [(0, u.shape[1])] * u.shape[0] if bounds is None else list(zip(bounds[:-1], bounds[1:]))
    for i, (row, (a, e)) in enumerate(zip(rows, spans)):
        state = h0[i]  # (HV, K, V)
        for c in range(a, e, CHUNK):
            sl = slice(c, min(c + CHUNK, e))
            kc, wc, uc, gc = (x[row, sl].transpose(0, 1) for x in (kk, w, u, gl))  # heads first
            new = uc - wc @ state
            news.append((row, c, new))
            last = gc[:, -1:]
            carried = (kc * torch.exp2(last - gc)[..., None]).transpose(-1, -2) @ new
            state = torch.exp2(last)[..., None] * state + carried
            afters.append((row, state))
        ends.append(state)
    return afters, news, torch.stack(ends)


@pytest.mark.parametrize("batch, bounds, heads, dims", [
    (1, [0, 37, 37 + 150, 37 + 150 + 64], (2, 4), (16, 24)),
    (2, None, (2, 2), (8, 40)),
])
def test_end_state_grad_kernel_matches_autograd(batch, bounds, heads, dims):
    """The end-state gradient's part of the reverse state pass, added into given dh and dv, against autograd
    through the float64 state pass (``chunk_states``): dh[c] gains d<dht, S_end>/d(S after chunk c), dv gains
    d<dht, S_end>/d v_new; the pass's other inputs are its own."""
    from distcomm_attention.linear.maps_kernel import delta_end_state_grad

    gen = _gen("end state grad", batch, bounds, heads, dims)
    t = bounds[-1] if bounds else 130
    h, hv = heads
    dk, dv = dims
    n = len(bounds) - 1 if bounds else batch
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    k = torch.nn.functional.normalize(r(batch, t, h, dk), dim=-1)
    v = r(batch, t, hv, dv)
    g = -0.3 * torch.rand(batch, t, hv, generator=gen, dtype=F64)
    beta = torch.rand(batch, t, hv, generator=gen, dtype=F64)
    w, u, gl = wy_inputs(k, v, g, beta, bounds or [0, t])
    h0, dht = r(n, hv, dk, dv).requires_grad_(), r(n, hv, dk, dv)  # (a graph through the states)

    afters, news, end = chunk_states(k, w, u, gl, h0, bounds)
    states = [s for _, s in afters]
    grads = torch.autograd.grad(end, states + [x for _, _, x in news], dht)

    # fla's layouts: dh (B, NT, HV, K, V), NT the chunks of a batch row (of all sequences with cu_seqlens)
    nt = len(states) // (batch if bounds is None else 1)
    dh0, dv0 = r(batch, nt, hv, dk, dv), r(batch, t, hv, dv)
    dh_ref, dv_ref = dh0.clone(), dv0.clone()
    for i, (row, _) in enumerate(afters):
        dh_ref[row, i % nt] += grads[i]
    for (row, c, new), grad in zip(news, grads[len(states):]):
        dv_ref[row, c:c + new.shape[1]] += grad.transpose(0, 1)
    cu = None if bounds is None else torch.tensor(bounds, device=DEVICE)
    dh_k, dv_k = dh0.float().to(DEVICE), dv0.float().to(DEVICE)
    delta_end_state_grad(*(x.float().to(DEVICE) for x in (k, w, gl, dht)), dh_k, dv_k, cu_seqlens=cu)
    torch.testing.assert_close(dh_k.cpu().double(), dh_ref, **KERNEL_TOL)
    torch.testing.assert_close(dv_k.cpu().double(), dv_ref, **KERNEL_TOL)
    assert not torch.allclose(dv_ref, dv0, atol=1e-2)  # the end-state gradient reaches the values


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True])
def test_kernels_match_fla_passes(varlen):
    """At Qwen3.5's GDN shapes in bf16 (16 key heads, 32 value heads of 128) on fla's own WY form: the maps
    against fla's state pass run from zero and from I with zero values; fla's reverse state pass without an
    end-state gradient, then its part added, against the pass run with it; within bf16 rounding of the state
    products."""
    pytest.importorskip("fla")
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dv_local
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    from distcomm_attention.linear.maps_kernel import delta_end_state_grad, delta_maps

    torch.manual_seed(0)
    dev, bf = torch.device("cuda"), torch.bfloat16
    t, h, hv, dk, dv = 4096 + 100, 16, 32, 128, 128
    cu = torch.tensor([0, 1000, 1001, 3000, t], device=dev) if varlen else None
    n = 4 if varlen else 1
    q = torch.randn(1, t, h, dk, device=dev, dtype=bf)
    k = torch.nn.functional.normalize(torch.randn(1, t, h, dk, device=dev), dim=-1).to(bf)
    v = torch.randn(1, t, hv, dv, device=dev, dtype=bf)
    g = chunk_local_cumsum(torch.nn.functional.logsigmoid(torch.randn(1, t, hv, device=dev) + 4), chunk_size=64,
                           scale=RCP_LN2, cu_seqlens=cu)
    beta = torch.rand(1, t, hv, device=dev).to(bf)
    do = torch.randn(1, t, hv, dv, device=dev, dtype=bf)
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, chunk_size=64, cu_seqlens=cu)

    eye = torch.eye(dk, device=dev).expand(n, hv, dk, dk).contiguous()
    a_ref = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=torch.zeros(1, t, hv, dk, device=dev, dtype=bf), g=g,
                                         initial_state=eye, output_final_state=True, cu_seqlens=cu)[2]
    b_ref = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, output_final_state=True, cu_seqlens=cu)[2]
    a, b = delta_maps(k, w, u, g, cu)
    torch.testing.assert_close(a, a_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(b, b_ref, rtol=2e-2, atol=2e-2 * b_ref.abs().max().item())

    h0, dht = torch.randn(n, hv, dk, dv, device=dev), torch.randn(n, hv, dk, dv, device=dev)
    dv_local = chunk_bwd_dv_local(q=q, k=k, do=do, g=g, scale=dk**-0.5, cu_seqlens=cu)
    dh_ref, ds_ref, dv_ref = chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, do=do, dv=dv_local, g=g, h0=h0, dht=dht,
                                                            scale=dk**-0.5, cu_seqlens=cu)
    dh, ds, dv2 = chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, do=do, dv=dv_local, g=g, h0=h0, dht=None,
                                                 scale=dk**-0.5, cu_seqlens=cu)
    assert not torch.allclose(dh.float(), dh_ref.float(), atol=1e-2)
    delta_end_state_grad(k, w, g, dht, dh, dv2, cu)
    for mine, ref in ((dh, dh_ref), (dv2, dv_ref)):
        torch.testing.assert_close(mine.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.gpu
def test_kernels_address_long_sequences():
    """A sequence of 270k tokens with 64 value heads of 128: token offsets beyond 2^31 elements, and chunk
    offsets of the state gradients too. With w = 0 and no decay the answers are exact: B = k_T u_T^T of the
    last token alone, A = I; the end-state gradient as below."""
    from distcomm_attention.linear.maps_kernel import delta_end_state_grad, delta_maps

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
    del u
    # the end state's gradient reaches every chunk's state unchanged (w = 0, no decay) and, through the last
    # token's key alone, the last token's new values
    nt = -(-t // 64)
    dht = torch.randn(1, hv, dk, dv, device=dev, generator=gen)
    dh = torch.zeros(1, nt, hv, dk, dv, device=dev, dtype=bf)
    dvs = torch.zeros(1, t, hv, dv, device=dev, dtype=bf)
    delta_end_state_grad(k, w, g, dht, dh, dvs)
    for c in (0, nt // 2, nt - 1):
        torch.testing.assert_close(dh[0, c].float(), dht[0].to(bf).float(), rtol=0, atol=0)
    torch.testing.assert_close(dvs[0, -1].float(), torch.einsum("hk,hkv->hv", kk, dht[0].to(bf).float()),
                               rtol=1e-2, atol=1e-2)
    assert dvs[0, :-1].abs().max().item() == 0
