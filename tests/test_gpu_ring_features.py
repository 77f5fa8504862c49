"""Layer 4 (one GPU, marked ``gpu``): ring attention's features through the CUDA kernels in bf16/fp16.

Two views: ``ring_flash_attn`` itself on one GPU (a ring of one: the whole API, backend selection included),
and simulated rings of 2 and 4 ranks (``tests/ring_sim.py``: the planner's real blocks, including interval
blocks of zigzag/striped layouts and skipped steps, through the same Triton kernels, no communication).
The 2-GPU runs of the real ring are in test_gpu_attention.py (``gpu2``).

Criterion (FlashAttention's own): the maximum error of our result against the float64 reference is at most
twice that of plain PyTorch attention computed in the same low precision, plus a small floor; outputs and
the gradients of q, k and v.
"""

import math

import pytest
import torch

import distcomm_attention as da
from distcomm_attention._reference import attention_reference
from distcomm_attention.planning.visibility import Visibility

pytestmark = pytest.mark.gpu

LOW = [torch.bfloat16, torch.float16]
FLOOR = 1e-4


def _plain_low(q, k, v, visible, softcap, scale):
    """Plain attention in the inputs' low precision (the criterion's yardstick); visible: (B, 1, S, S)."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    empty = ~visible.any(-1, keepdim=True)  # rows with no visible key: zero weights, no NaN in the grads
    s = s.masked_fill(~(visible | empty), -math.inf)
    p = torch.softmax(s, dim=-1).masked_fill(empty, 0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _visible(seq, causal, window, docs, key_mask, device):
    """The (B, 1, S, S) visibility over natural positions (the reference's rule, written once more here)."""
    i = torch.arange(seq, device=device)
    d = i[:, None] - i[None, :]
    ok = torch.ones(seq, seq, dtype=torch.bool, device=device)
    if causal:
        ok &= d >= 0
    if window[0] >= 0:
        ok &= d <= window[0]
    if window[1] >= 0:
        ok &= -d <= window[1]
    if docs is not None:
        doc = torch.bucketize(i, torch.tensor(docs[1:], device=device), right=True)
        ok &= doc[:, None] == doc[None, :]
    ok = ok[None, None]
    return ok if key_mask is None else ok & key_mask[:, None, None, :]


CASES = [
    dict(causal=True),
    dict(causal=False),
    dict(causal=True, window=(300, -1)),
    dict(causal=False, window=(128, 64)),
    dict(causal=True, softcap=30.0),
    dict(causal=True, docs=[0, 1, 200, 203, 700, 1024]),
    dict(causal=False, docs=[0, 512, 513, 1024], pad=(900, 1024)),
    dict(causal=True, pad=(0, 600)),  # the first ranks' keys all padding
    dict(causal=True, window=(100, -1), docs=[0, 333, 1024], softcap=20.0, pad=(1000, 1024)),
]


def _inputs(case, dtype, hkv, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, s, h, d = 2, 1024, 4, 128
    make = lambda heads: torch.randn(b, s, heads, d, device="cuda", generator=g)  # noqa: E731
    q, k, v, dout = make(h), make(hkv), make(hkv), make(h)
    q, k, v, dout = (x.to(dtype) for x in (q, k, v, dout))
    key_mask = None
    if "pad" in case:
        key_mask = torch.ones(b, s, dtype=torch.bool, device="cuda")
        key_mask[1, case["pad"][0]:case["pad"][1]] = False  # row 1 padded; row 0 untouched
    return q, k, v, dout, key_mask


def _references(case, q, k, v, dout, key_mask):
    """(float64 reference, plain low-precision) outputs and q/k/v gradients."""
    opts = dict(causal=case["causal"], window_size=case.get("window", (-1, -1)), softcap=case.get("softcap", 0.0),
                cu_seqlens=case.get("docs"))
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref = attention_reference(q64, k64, v64, attention_mask=key_mask, **opts)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    ql, kl, vl = (x.detach().clone().requires_grad_() for x in (q, k, v))
    visible = _visible(q.shape[1], case["causal"], opts["window_size"], case.get("docs"), key_mask, q.device)
    low = _plain_low(ql, kl, vl, visible, opts["softcap"], q.shape[-1] ** -0.5)
    low_grads = torch.autograd.grad(low, (ql, kl, vl), dout)
    return (ref, *ref_grads), (low, *low_grads)


def _assert_criterion(case, ours, refs, lows):
    for name, o, r, lo in zip(("out", "dq", "dk", "dv"), ours, refs, lows):
        assert not o.isnan().any(), f"{name} has NaN, case {case}"
        err = (o.double() - r).abs().max().item()
        err_low = (lo.double() - r).abs().max().item()
        assert err <= 2 * err_low + FLOOR, f"{name}: error {err:.3e} > 2 x low-precision {err_low:.3e}, {case}"


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("hkv", [4, 1])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_one_gpu_ring_features(case, hkv, dtype):
    """ring_flash_attn on one GPU with each feature (backend auto) meets the flash-attn error criterion."""
    q, k, v, dout, key_mask = _inputs(case, dtype, hkv, seed=1)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = da.ring_flash_attn(qg, kg, vg, causal=case["causal"], window_size=case.get("window", (-1, -1)),
                             softcap=case.get("softcap", 0.0), cu_seqlens=case.get("docs"), attention_mask=key_mask)
    out.backward(dout)
    refs, lows = _references(case, q, k, v, dout, key_mask)
    _assert_criterion(case, (out, qg.grad, kg.grad, vg.grad), refs, lows)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("ring_size", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_simulated_ring_triton_kernels(case, ring_size, layout, dtype):
    """The Triton kernels on every block a ring of 2 / 4 issues (interval blocks included) meet the criterion."""
    from distcomm_attention.kernels.triton_bwd import TritonBackward
    from distcomm_attention.kernels.triton_fwd import TritonForward
    from tests.ring_sim import simulate_ring

    q, k, v, dout, key_mask = _inputs(case, dtype, hkv=2, seed=2)
    docs = case.get("docs")
    vis = Visibility(case["causal"], case.get("window", (-1, -1)), None if docs is None else tuple(docs),
                     key_mask is not None)
    ours = simulate_ring(q, k, v, dout, key_mask, layout=layout, ring_size=ring_size, vis=vis,
                         scale=q.shape[-1] ** -0.5, softcap=case.get("softcap", 0.0),
                         fwd=TritonForward(), bwd=TritonBackward())
    refs, lows = _references(case, q, k, v, dout, key_mask)
    _assert_criterion(case, ours, refs, lows)


def test_auto_picks_a_backend_that_can_do_the_call():
    """which_kernels on CUDA bf16: every call runs on the first backend of AUTO_PREFERENCE this machine can run
    for it: windows and documents on fa4 where flash-attn-4 is usable, else triton; padding masks on triton."""
    from distcomm_attention.kernels import dispatch as _kernels
    from distcomm_attention.planning.visibility import Visibility

    q = torch.zeros(1, 128, 4, 128, device="cuda", dtype=torch.bfloat16)
    fa4 = _kernels.backend_problem("fa4", q.device, q.dtype, Visibility(True, (64, 0)), head_dim=128, batch=1) is None
    features = "fa4" if fa4 else "triton"
    assert da.which_kernels(q, causal=True, window_size=(64, 0)).backend == features
    assert da.which_kernels(q, cu_seqlens=[0, 128]).backend == features
    padding = torch.ones(1, 128, dtype=torch.bool, device="cuda")
    assert da.which_kernels(q, causal=True, attention_mask=padding).backend == "triton"
    assert da.which_kernels(q, causal=True).backend in _kernels.AUTO_PREFERENCE


def test_compiled_ring_on_gpu_equals_eager():
    """torch.compile(fullgraph=True) with inductor around ring_flash_attn (Triton backend, features) on CUDA
    gives eager's output and gradients."""
    case = dict(causal=True, window=(100, -1), docs=[0, 333, 1024], softcap=20.0, pad=(1000, 1024))
    q, k, v, dout, key_mask = _inputs(case, torch.bfloat16, 2, seed=3)

    def attend(q, k, v):
        return da.ring_flash_attn(q, k, v, causal=True, window_size=case["window"], softcap=case["softcap"],
                                  cu_seqlens=case["docs"], attention_mask=key_mask) * 2

    results = []
    for fn in (attend, torch.compile(attend, fullgraph=True)):
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        out = fn(qg, kg, vg)
        out.backward(dout)
        results.append((out, qg.grad, kg.grad, vg.grad))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
