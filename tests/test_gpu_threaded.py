"""The public API at W = 2, 4, 8, 16 on one GPU: ranks are threads of a threaded process group
(``tests/threaded_pg.py``), every strategy x feature, bf16, against a float64 reference of the whole sequence.

Criterion (flash-attn's): for out, dQ, dK and dV, the max error against the float64 reference
(``_reference.attention_reference``, which shares no code with the strategies) is at most twice that of plain
PyTorch attention in bf16 on the whole sequence (the same formula, ``upcast=False``), plus 1e-6. Features:
causal (zigzag), full (contiguous), GQA (striped), packed documents (contiguous, zigzag, striped, balanced),
window, softcap, key padding; the backend is "auto" (flash-attn-4 where installed; a key padding mask goes to
Triton), and the dK/dV test runs "triton" too.

dK/dV flat in W: the ring's and all-gather's dK/dV error is at most 1.25x Ulysses' on the same data, for the
backends whose block backward writes fp32 dK/dV (Triton): every partial sum then stays in fp32 until the last
rounding, as in Ulysses' one call.

``python -m tests.test_gpu_threaded [seeds]`` prints the error ratios (docs/bench/numerics.md).
"""

from __future__ import annotations

import sys

import pytest
import torch

import distcomm_attention as da
from distcomm_attention._reference import attention_reference
from tests.threaded_pg import run_threads

pytestmark = pytest.mark.gpu

WORLDS = (2, 4, 8, 16)
STRATEGIES = ("ring", "ulysses", "allgather", "auto")
N, HEADS, D = 128, 16, 64  # tokens per rank, query heads (divisible by every W: Ulysses runs), head dim
NAMES = ("out", "dq", "dk", "dv")


def _docs(seq):
    """Documents of uneven lengths, some spanning ranks, one of one token."""
    cuts = {0, 1, seq // 7, seq // 3 + 5, seq // 2 + 1, seq - N // 2 - 3, seq}
    return sorted(c for c in cuts if 0 <= c <= seq)


FEATURES = {
    "causal": dict(layout="zigzag", causal=True),
    "full": dict(layout="contiguous"),
    "gqa": dict(layout="striped", causal=True, kv_heads=4),
    "docs_contiguous": dict(layout="contiguous", causal=True, docs=True),
    "docs_zigzag": dict(layout="zigzag", causal=True, docs=True),
    "docs_striped": dict(layout="striped", causal=True, docs=True),
    "docs_balanced": dict(layout="balanced", causal=True, docs=True, kv_heads=4),
    "window": dict(layout="zigzag", causal=True, window=(N + 17, 0)),
    "softcap": dict(layout="zigzag", causal=True, softcap=5.0),
    "padding": dict(layout="contiguous", causal=True, pad=True),
}


def _case(w, feature, seed):
    """Global bf16 inputs on the GPU, the call's keyword arguments and each rank's positions."""
    f = FEATURES[feature]
    seq = N * w
    g = torch.Generator(device="cuda").manual_seed(1000 * w + seed)
    hkv = f.get("kv_heads", HEADS)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, seq, HEADS, D, generator=g, **bf)
    k = torch.randn(1, seq, hkv, D, generator=g, **bf)
    v = torch.randn(1, seq, hkv, D, generator=g, **bf)
    dout = torch.randn(1, seq, HEADS, D, generator=g, **bf)
    docs = _docs(seq) if f.get("docs") else None
    mask = None
    if f.get("pad"):
        mask = torch.ones(1, seq, dtype=torch.bool, device="cuda")
        mask[0, seq // 3: seq // 3 + N + 9] = False  # more than a rank's keys
        mask[0, -5:] = False
    kw = dict(causal=f.get("causal", False), window_size=f.get("window", (-1, -1)), softcap=f.get("softcap", 0.0),
              cu_seqlens=docs)
    index = [da.position_ids(N, f["layout"], ring_size=w, rank=r, cu_seqlens=docs).clone().cuda() for r in range(w)]
    return (q, k, v, dout, mask), kw, f["layout"], index


def _errors_of(got, ref):
    return {name: (got[name].double() - ref[name]).abs().max().item() for name in NAMES}


def _reference(inputs, kw, upcast):
    q, k, v, dout, mask = inputs
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attention_reference(q, k, v, attention_mask=mask, upcast=upcast, **kw)
    grads = torch.autograd.grad(out, (q, k, v), dout.to(out.dtype))
    return {name: t.detach().double() for name, t in zip(NAMES, (out, *grads))}


def _rank(rank, w, inputs, kw, layout, index, strategy, backend):
    q, k, v, dout, mask = inputs
    idx = index[rank]
    q, k, v = (t.index_select(1, idx).requires_grad_() for t in (q, k, v))
    local_mask = None if mask is None else mask.index_select(1, idx)
    out = da.context_parallel_attn(q, k, v, strategy=strategy, layout=layout, backend=backend,
                                   attention_mask=local_mask, **kw)
    out.backward(dout.index_select(1, idx))
    torch.cuda.synchronize()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _run(w, inputs, kw, layout, index, strategy, backend):
    """Every rank's results put back in global order."""
    res = run_threads(_rank, w, inputs, kw, layout, index, strategy, backend, timeout=120)
    full = {}
    for name in NAMES:
        like = inputs[0] if name in ("out", "dq") else inputs[1]
        t = torch.empty(like.shape, dtype=res[0][name].dtype, device="cuda")
        for r in range(w):
            t[:, index[r]] = res[r][name]
        full[name] = t
    return full


def measure(w, feature, seed, strategies=STRATEGIES, backend="auto"):
    """{strategy: {name: error}} and the plain bf16 attention's {name: error}, both against float64."""
    inputs, kw, layout, index = _case(w, feature, seed)
    ref = _reference(inputs, kw, upcast=True)
    plain = _errors_of(_reference(inputs, kw, upcast=False), ref)
    return {s: _errors_of(_run(w, inputs, kw, layout, index, s, backend), ref) for s in strategies}, plain


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("w", WORLDS)
def test_public_api_within_flash_attn_criterion(w, feature):
    """out, dQ, dK, dV of every strategy within 2x plain bf16 attention's error (+1e-6) against float64."""
    errs, plain = measure(w, feature, seed=0)
    bad = [f"{s} {name}: {e[name]:.3g} > 2 x {plain[name]:.3g}" for s, e in errs.items() for name in NAMES
           if not e[name] <= 2 * plain[name] + 1e-6]
    assert not bad, f"W={w} {feature}: " + "; ".join(bad)


@pytest.mark.parametrize("feature", ["causal", "gqa"])
@pytest.mark.parametrize("w", (8, 16))
def test_dkdv_error_flat_in_w_triton(w, feature):
    """Triton blocks: the ring's and all-gather's dK/dV error at most 1.25x Ulysses' on the same data."""
    for seed in (0, 1):
        errs, _ = measure(w, feature, seed, strategies=("ring", "allgather", "ulysses"), backend="triton")
        for s in ("ring", "allgather"):
            for name in ("dk", "dv"):
                assert errs[s][name] <= 1.25 * errs["ulysses"][name], \
                    f"W={w} {feature} seed {seed} {s} {name}: {errs[s][name]:.3g} vs Ulysses {errs['ulysses'][name]:.3g}"


def main(seeds: int = 3) -> None:
    """Print, per backend, W, feature and seed: each strategy's error / (2 x plain bf16 error) for out, dQ, dK,
    dV, and the ring's / all-gather's dK, dV error over Ulysses'."""
    for backend in ("auto", "triton"):
        for w in WORLDS:
            for feature in ("causal", "gqa", "docs_zigzag", "full"):
                for seed in range(seeds):
                    errs, plain = measure(w, feature, seed, backend=backend)
                    crit = " ".join(f"{s}:" + ",".join(f"{errs[s][n] / (2 * plain[n]):.2f}" for n in NAMES)
                                    for s in STRATEGIES)
                    rel = " ".join(f"{s}/uly dk {errs[s]['dk'] / errs['ulysses']['dk']:.2f} dv "
                                   f"{errs[s]['dv'] / errs['ulysses']['dv']:.2f}" for s in ("ring", "allgather"))
                    print(f"{backend} W={w} {feature} seed={seed} | {crit} | {rel}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)


def _nan_rank(rank, w, inputs, index, strategy, backend):
    q, k, v, dout = inputs
    idx = index[rank]
    q, k, v = (t.index_select(1, idx).requires_grad_() for t in (q, k, v))
    out = da.context_parallel_attn(q, k, v, strategy=strategy, layout="zigzag", backend=backend, causal=True)
    out.backward(dout.index_select(1, idx))
    torch.cuda.synchronize()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("backend", ["fa4", "cudnn", "triton"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_in_nan_out(backend, where):
    """A NaN in one element of q, k or v (W = 4, causal zigzag, every strategy): exactly the output elements that
    depend on it are NaN (decided by the float64 reference run with two finite values there), and every
    gradient element that depends on it is NaN (a NaN in v leaves the rows' lse finite: their backward is NaN
    through rowsum(dout * out)). A NaN in v may also reach rows of its tile that do not see it (their masked
    score's weight 0 times NaN, as in every tiled kernel): for v only the elements that depend on it are
    checked, as tests/test_numerics.py does on the CPU."""
    from distcomm_attention.kernels import dispatch

    w, hkv = 4, 4
    g = torch.Generator(device="cuda").manual_seed(5)
    seq = N * w
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v, dout = (torch.randn(1, seq, h, D, generator=g, **bf) for h in (HEADS, hkv, hkv, HEADS))
    pos = seq // 2 - 3
    target = {"q": q, "k": k, "v": v}[where]
    index = [da.position_ids(N, "zigzag", ring_size=w, rank=r).clone().cuda() for r in range(w)]
    problem = dispatch.backend_problem(backend, q.device, q.dtype)
    if problem is not None:
        if backend == "triton" or not isinstance(problem, ImportError):
            raise problem  # a GPU backend that cannot run on this GPU is a failure; only a missing package skips
        pytest.skip(str(problem))
    refs = []
    for value in (0.5, -0.75):
        target[0, pos, 1, 3] = value
        refs.append(_reference((q, k, v, dout, None), dict(causal=True), upcast=True))
    target[0, pos, 1, 3] = float("nan")
    for strategy in ("ring", "ulysses", "allgather"):
        res = run_threads(_nan_rank, w, (q, k, v, dout), index, strategy, backend, timeout=120)
        for name in NAMES:
            for r in range(w):
                a, b = (ref[name][:, index[r]] for ref in refs)
                x = res[r][name].double()
                dep = a != b
                assert bool(x[dep].isnan().all()), f"{strategy} {name} rank {r}: elements depending on the NaN are finite"
                if name == "out" and where != "v":  # a tile's masked scores weigh a NaN value by 0: NaN
                    assert not x[~dep].isnan().any(), f"{strategy} out rank {r}: NaN where nothing depends on it"
