"""Layer 4 (one GPU, marked ``gpu``): the block backends "fa4" and "cudnn" against the float64 reference.

Two views, as in test_gpu_ring_features.py: ``ring_flash_attn(backend=...)`` on one GPU (a ring of one: the
backend selection and the direct kernel call), and simulated rings of 2 and 4 ranks (tests/ring_sim.py:
the planner's real blocks, merged by logsumexp in the forward and differentiated from the merged out/lse
in the backward). Plain full and causal attention, GQA, softcap, windows and packed documents (fa4: window
and varlen calls over the planner's band pieces), bf16 and fp16. A backend this machine cannot run
(flash-attn-4 not installed, a GPU it does not support) is skipped with its reason; one that is installed and
reports an error fails.

Criterion (FlashAttention's own): the maximum error against the float64 reference is at most twice that of
plain PyTorch attention in the same low precision, plus a small floor; outputs and the q/k/v gradients.
"""

import importlib.metadata
import importlib.util

import pytest
import torch

import distcomm_attention as da
from distcomm_attention.kernels import dispatch as _kernels
from distcomm_attention.kernels import fa4 as _fa4
from distcomm_attention.planning.visibility import Visibility
from tests.test_gpu_ring_features import _assert_criterion, _references

pytestmark = pytest.mark.gpu

LOW = [torch.bfloat16, torch.float16]
CASES = [dict(causal=True), dict(causal=False), dict(causal=True, softcap=30.0)]
FEATURE_CASES = [
    dict(causal=True, window=(300, -1)),
    dict(causal=False, window=(128, 64)),
    dict(causal=True, docs=[0, 1, 200, 203, 700, 1024]),
    dict(causal=False, docs=[0, 512, 513, 1024]),
    dict(causal=True, window=(100, -1), docs=[0, 333, 1024], softcap=20.0),
]
# (backend, case): cudnn runs plain attention only, so its softcap and feature cases would only skip.
BACKEND_CASES = [pytest.param(b, c, id=f"{b}-{c}") for b in ("fa4", "cudnn") for c in CASES + FEATURE_CASES
                 if b == "fa4" or c in CASES[:2]]


def _vis(case, seq=1024):
    """The case's Visibility for a global sequence of ``seq`` (documents scaled to it)."""
    docs = case.get("docs")
    if docs is not None:
        docs = tuple(d * seq // 1024 for d in docs)
    return Visibility(case["causal"], case.get("window", (-1, -1)), docs)


def _scaled(case, seq):
    """The case with its documents scaled from 1024 tokens to ``seq``."""
    return dict(case, docs=list(_vis(case, seq).cu_seqlens)) if "docs" in case else case


def _installed(backend):
    """Whether the backend's software is present, decided without importing it: flash-attn-4's distribution
    (or a flash_attn.cute checkout on the path) for "fa4", a torch built with cuDNN for "cudnn"."""
    if backend == "fa4":
        try:
            importlib.metadata.version("flash-attn-4")
            return True
        except importlib.metadata.PackageNotFoundError:
            return importlib.util.find_spec("flash_attn") is not None and _fa4._module_available("flash_attn.cute")
    if backend == "cudnn":
        return torch.backends.cudnn.is_available()
    raise ValueError(f"_installed: backend must be 'fa4' or 'cudnn', got {backend!r}")


def _usable(backend, dtype, case):
    """Skip when this machine lacks what ``backend`` needs for this case: the package, or a GPU / feature it
    does not support (a ValueError from the backend's own check, decided before any call). A backend that is
    installed and still reports a problem (an unsupported release, a broken install) fails the test."""
    vis = _vis(case)
    problem = _kernels.backend_problem(backend, torch.device("cuda"), dtype, vis, case.get("softcap", 0.0),
                                       head_dim=128, batch=2)
    if problem is None:
        return
    if isinstance(problem, ValueError):
        pytest.skip(f"{backend}: {problem}")
    if not _installed(backend):
        pytest.skip(f"{backend} is not installed: {problem}")
    pytest.fail(f"{backend} is installed but cannot be used: {type(problem).__name__}: {problem}")


def _inputs(dtype, seq, heads, kv_heads, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h: torch.randn(2, seq, h, 128, device="cuda", generator=g).to(dtype)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads), make(heads)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("hkv", [4, 1])
@pytest.mark.parametrize("backend, case", BACKEND_CASES)
def test_ring_of_one(backend, case, hkv, dtype):
    """ring_flash_attn(backend=...) on one GPU is one block-kernel call and meets the flash-attn criterion."""
    _usable(backend, dtype, case)
    q, k, v, dout = _inputs(dtype, 1024, 4, hkv, seed=1)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = da.ring_flash_attn(qg, kg, vg, causal=case["causal"], softcap=case.get("softcap", 0.0), backend=backend,
                             window_size=case.get("window", (-1, -1)), cu_seqlens=case.get("docs"))
    out.backward(dout)
    refs, lows = _references(case, q, k, v, dout, None)
    _assert_criterion(case, (out, qg.grad, kg.grad, vg.grad), refs, lows)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped", "balanced"])
@pytest.mark.parametrize("ring_size", [2, 4])
@pytest.mark.parametrize("backend, case", BACKEND_CASES)
def test_simulated_ring(backend, case, ring_size, layout, dtype):
    """Every block a ring of 2 / 4 issues, merged by logsumexp, meets the criterion (GQA 4:1); packed documents
    and windows run as packed steps (Note [Packed steps]), "balanced" placed for the case's documents and
    window."""
    from distcomm_attention.planning import balance
    from tests.ring_sim import simulate_ring

    _usable(backend, dtype, case)
    vis = _vis(case, 2048)
    case = _scaled(case, 2048)
    if layout == "balanced":
        if vis.cu_seqlens is None:
            pytest.skip("balanced without documents is zigzag")
        layout = balance.balanced(vis.cu_seqlens, 2048, ring_size, (vis.window[0], 0) if vis.causal else (-1, -1))
    _name, fwd, bwd = _kernels.select_kernels(backend, torch.zeros(2, 8, 4, 128, device="cuda", dtype=dtype),
                                              vis, case.get("softcap", 0.0))
    q, k, v, dout = _inputs(dtype, 2048, 4, 1, seed=2)
    ours = simulate_ring(q, k, v, dout, None, layout=layout, ring_size=ring_size, vis=vis,
                         scale=q.shape[-1] ** -0.5, softcap=case.get("softcap", 0.0), fwd=fwd, bwd=bwd)
    refs, lows = _references(case, q, k, v, dout, None)
    _assert_criterion(case, ours, refs, lows)


def test_auto_takes_the_first_usable_backend():
    """which_kernels on CUDA bf16: auto picks the first backend of AUTO_PREFERENCE whose check passes, and
    calls with a window go to a backend that runs windows."""
    q = torch.zeros(1, 128, 4, 128, device="cuda", dtype=torch.bfloat16)
    usable = [b for b in _kernels.AUTO_PREFERENCE
              if _kernels.backend_problem(b, q.device, q.dtype, Visibility(True), head_dim=128, batch=1) is None]
    assert da.which_kernels(q, causal=True).backend == usable[0]
    assert da.which_kernels(q, causal=True, window_size=(64, 0)).backend in ("fa4", "triton")
    padded = da.which_kernels(q, causal=True, attention_mask=torch.ones(1, 128, dtype=torch.bool, device="cuda"))
    assert padded.backend == "triton"


def test_forced_block_backends_refuse_what_they_cannot_run():
    """cudnn with a sliding window and fa4 with a padding mask raise a ValueError naming the feature."""
    q = torch.zeros(1, 128, 4, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"backend='cudnn'.*window_size=\(64, 0\)"):
        da.ring_flash_attn(q, q, q, causal=True, window_size=(64, 0), backend="cudnn")
    with pytest.raises(ValueError, match=r"backend='fa4'.*attention_mask"):
        da.ring_flash_attn(q, q, q, causal=True, attention_mask=torch.ones(1, 128, dtype=torch.bool, device="cuda"),
                           backend="fa4")


@pytest.mark.parametrize("case", [dict(causal=False), dict(causal=True), dict(causal=False, window=(100, 0))],
                         ids=["full", "causal", "window"])
def test_fa4_packed_calls_write_only_their_segments(case):
    """``FA4Forward`` / ``FA4Backward.writes_segments_only``: a packed (varlen) call with segment offsets and
    lengths apart writes only its segments' rows of the out, lse, dq, dk and dv it is handed (rows between
    segments keep what they held), so calls whose spans overlap but whose segments do not may write into one
    buffer (Note [Packed steps]: slots); an lse handed as columns of a larger buffer is written in place; inside
    the segments everything is written and finite."""
    from distcomm_attention.kernels.contract import Varlen

    _usable("fa4", torch.bfloat16, case)
    fwd, bwd = _fa4.FA4Forward(), _fa4.FA4Backward()
    assert fwd.writes_segments_only and bwd.writes_segments_only
    g = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, d = 32, 8, 128
    cu_q, used_q = [0, 300, 1000, 2000], [200, 500, 700]
    cu_k, used_k = [0, 400, 1200, 2400], [300, 700, 900]
    if case["causal"] or "window" in case:
        used_k = used_q[:]  # square pieces
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    varlen = Varlen(i32(cu_q), i32(cu_k), max(used_q), max(used_k), i32(used_q), i32(used_k))
    nq, nk = cu_q[-1], cu_k[-1]
    q, dout = (torch.randn(nq, heads, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(nk, kv_heads, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    rows, keys = (torch.zeros(n, dtype=torch.bool, device="cuda") for n in (nq, nk))
    for mask, starts, used in ((rows, cu_q, used_q), (keys, cu_k, used_k)):
        for a, u in zip(starts, used):
            mask[a:a + u] = True
    mark = 7.0
    kw = dict(causal=case["causal"], scale=d ** -0.5, softcap=0.0, window=case.get("window"), varlen=varlen)
    # lse: columns of a larger (H, S) buffer, as the rank's state hands them (row stride S)
    out, state_lse = torch.full_like(q, mark), torch.full((heads, nq + 700), mark, device="cuda")
    lse = state_lse[:, 300:300 + nq]
    o, ls = fwd.block(q, k, v, out=out, lse=lse, **kw)
    assert o.data_ptr() == out.data_ptr() and ls.data_ptr() == lse.data_ptr() and ls.stride() == lse.stride()
    assert bool((out[~rows] == mark).all()) and bool((lse[:, ~rows] == mark).all())
    assert bool((state_lse[:, :300] == mark).all()) and bool((state_lse[:, 300 + nq:] == mark).all())
    assert bool(out[rows].isfinite().all()) and bool(lse[:, rows].isfinite().all())
    dq, dk, dv = torch.full_like(q, mark), torch.full_like(k, mark), torch.full_like(v, mark)
    got = bwd.block(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **kw)
    assert [a.data_ptr() for a in got] == [b.data_ptr() for b in (dq, dk, dv)]
    assert bool((dq[~rows] == mark).all()) and bool((dk[~keys] == mark).all()) and bool((dv[~keys] == mark).all())
    assert bool(dq[rows].isfinite().all()) and bool(dk[keys].isfinite().all()) and bool(dv[keys].isfinite().all())
