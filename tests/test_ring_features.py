"""Layers 1-2: padding masks, sliding windows, softcap and packed documents in ring attention.

Layer 1 (pure functions): the ring planner covers exactly the visible pairs of every (rank, source) pair,
skips ring steps no rank needs, and ``cu_seqlens_from_position_ids`` / input validation behave.
Layer 2 (gloo worlds of 1..4 CPU ranks): outputs and q/k/v gradients of ``ring_flash_attn`` with every
feature, every layout, causal and not, GQA, against the float64 reference on the whole sequence
(``_reference.attention_reference``, which shares no code with the planner or the kernels), then sharded.
"""

import math

import pytest
import torch

import distcomm_attention as da
from distcomm.ring import RingComm
from distcomm_attention.planning import layouts
from distcomm_attention._reference import attention_reference
from distcomm_attention.planning.visibility import Visibility, ring_plan, visible_mask
from tests.dist_harness import run_world
from tests.optional import require

FP64 = dict(rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# Layer 1: the planner
# ---------------------------------------------------------------------------------------------------------


def _brute_visible(vis, layout, w, r, src, n):
    pos = [layouts.positions(layout, n * w, w, x) for x in range(w)]
    return visible_mask(vis, pos[r], pos[src])


def _covered(plan, step_index, n):
    """The (n, n) set of local pairs the plan's blocks of one step mark visible."""
    got = torch.zeros(n, n, dtype=torch.bool)
    for block in plan.blocks[step_index]:
        q0, q1, _ = block.q.indices(n)
        k0, k1, _ = block.kv.indices(n)
        nq, nk = q1 - q0, k1 - k0
        if block.mode == "full":
            sub = torch.ones(nq, nk, dtype=torch.bool)
        elif block.mode == "causal":
            sub = torch.ones(nq, nk, dtype=torch.bool).tril()
        else:
            lo, hi, clo, chi = (a.long() for a in block.intervals)
            j = torch.arange(nk)
            sub = (lo[:, None] <= j) & (j < hi[:, None])
            i = torch.arange(nq)
            # the inverse intervals describe the same set
            assert torch.equal(sub, ((clo[None, :] <= i[:, None]) & (i[:, None] < chi[None, :])))
            for a in (lo, hi, clo, chi):
                assert bool((a[1:] >= a[:-1]).all()), "interval bounds must be nondecreasing"
        assert not got[q0:q1, k0:k1].any(), "blocks of one step overlap"
        got[q0:q1, k0:k1] = sub
    return got


PLAN_VIS = [
    Visibility(),
    Visibility(causal=True),
    Visibility(causal=True, window=(5, -1)),
    Visibility(window=(3, 2)),
    Visibility(window=(0, 0)),
    Visibility(causal=True, cu_seqlens=(0, 1, 9, 10, 23, 24)),
    Visibility(cu_seqlens=(0, 12, 13, 24)),
    Visibility(causal=True, window=(4, -1), cu_seqlens=(0, 7, 24)),
]


@pytest.mark.parametrize("layout", layouts.STATIC)
@pytest.mark.parametrize("vis", PLAN_VIS, ids=str)
def test_plan_covers_exactly_the_visible_pairs(layout, vis):
    """Each block plan marks visible precisely the pairs of the element-wise rule; skipped steps have none."""
    for w in (1, 2, 3, 4) if 24 % 4 == 0 else (1,):
        if layout == "zigzag" and 24 % (2 * w):
            continue
        n = 24 // w
        for r in range(w):
            plan = ring_plan(layout, vis, w, r, n)
            for t in range(w):
                want = _brute_visible(vis, layout, w, r, (r - t) % w, n)
                if t in plan.steps:
                    assert torch.equal(_covered(plan, plan.steps.index(t), n), want), (w, r, t)
                else:
                    assert not want.any(), f"step {t} skipped but rank {r} has visible pairs"


def test_window_makes_fewer_ring_steps():
    """With a window much smaller than the sequence only the nearby ring steps remain (fewer hops)."""
    vis = Visibility(causal=True, window=(16, -1))
    assert ring_plan("contiguous", vis, 8, 3, 64).steps == (0, 1)
    assert ring_plan("zigzag", vis, 8, 3, 64).steps == (0, 1, 7)
    assert ring_plan("contiguous", Visibility(causal=True), 8, 3, 64).steps == tuple(range(8))
    docs = Visibility(causal=True, cu_seqlens=tuple(range(0, 513, 64)))  # one document per rank
    assert ring_plan("contiguous", docs, 8, 5, 64).steps == (0,)


def test_cu_seqlens_from_position_ids():
    """Position ids restarting at 0 give the document boundaries (a leading non-zero starts a document too)."""
    got = da.cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    assert got.dtype == torch.int32 and got.tolist() == [0, 3, 5, 9]
    assert da.cu_seqlens_from_position_ids(torch.tensor([5, 6, 0, 0])).tolist() == [0, 2, 3, 4]
    with pytest.raises(ValueError, match=r"`position_ids` must be an integer tensor"):
        da.cu_seqlens_from_position_ids(torch.zeros(2, 3))


def _q(n=4, b=1, dtype=torch.float64):
    return torch.zeros(b, n, 2, 16, dtype=dtype)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(window_size=(1,)), ValueError, r"`window_size` must be a pair \(left, right\) of ints in \[-1, 2\^62\).*\(1,\)"),
        (dict(window_size=(-2, 0)), ValueError, r"`window_size` must be a pair.*\(-2, 0\)"),
        (dict(window_size=(1.0, 2)), ValueError, r"`window_size` must be a pair"),
        (dict(softcap=-1.0), ValueError, r"`softcap` must be a finite float >= 0.*-1.0"),
        (dict(softcap=math.inf), ValueError, r"`softcap` must be a finite float >= 0"),
        (dict(attention_mask=torch.ones(1, 4)), TypeError, r"`attention_mask` must have dtype torch.bool"),
        (dict(attention_mask=torch.ones(1, 3, dtype=torch.bool)), ValueError,
         r"`attention_mask` must have shape \(batch, local_seq\) = \(1, 4\).*got \(1, 3\)"),
        (dict(attention_mask=[True]), TypeError, r"`attention_mask` must be a torch.Tensor or None, got list"),
        (dict(cu_seqlens=torch.tensor([1, 4])), ValueError, r"`cu_seqlens` must start at 0"),
        (dict(cu_seqlens=torch.tensor([0, 3, 3, 4])), ValueError, r"strictly increasing.*3 then 3 at index 2"),
        (dict(cu_seqlens=torch.tensor([0, 2, 5])), ValueError, r"must end at the global sequence length 4.*got 5"),
        (dict(cu_seqlens=torch.tensor([[0, 4]])), ValueError, r"`cu_seqlens` must be a 1-D integer tensor"),
        (dict(cu_seqlens=torch.tensor([0.0, 4.0])), ValueError, r"`cu_seqlens` must be a 1-D integer tensor"),
        (dict(cu_seqlens=[0, 2.5, 4]), TypeError, r"`cu_seqlens` must be a 1-D integer tensor or a list of ints"),
        (dict(backend="flash2", window_size=(2, 0)), ValueError,
         r"backend='flash2' runs plain full or causal attention only.*window_size=\(2, 0\)"),
    ],
)
def test_feature_validation(kwargs, exc, match):
    """Bad feature arguments raise a clear error naming the argument, the value and what is allowed."""
    q = _q()
    with pytest.raises(exc, match=match):
        da.ring_flash_attn(q, q, q, **kwargs)


def test_which_kernels_reports_the_choice():
    """which_kernels names the backend and kernels a call would use, and refuses what a backend cannot do."""
    q = _q()
    choice = da.which_kernels(q, causal=True, window_size=(3, 0))
    assert (choice.backend, choice.forward, choice.backward) == ("torch", "TorchForward", "TorchBackward")
    with pytest.raises(ValueError, match=r"backend='flash2'.*softcap=30.0"):
        da.which_kernels(q, backend="flash2", softcap=30.0)


# ---------------------------------------------------------------------------------------------------------
# Layer 2: gloo worlds against the float64 reference
# ---------------------------------------------------------------------------------------------------------


def _global_inputs(case):
    g = torch.Generator().manual_seed(case["seed"])
    b, h, hkv, d, seq = case["b"], case["h"], case["hkv"], case["d"], case["n"] * case["w"]
    q = torch.randn(b, seq, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, seq, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, seq, hkv, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, seq, h, d, generator=g, dtype=torch.float64)
    mask = None
    if case.get("pad") is not None:
        mask = torch.ones(b, seq, dtype=torch.bool)
        for row, (start, stop) in enumerate(case["pad"]):
            mask[row, start:stop] = False
    return q, k, v, dout, mask


def _options(case):
    return dict(causal=case["causal"], window_size=case.get("window", (-1, -1)), softcap=case.get("softcap", 0.0),
                cu_seqlens=case.get("docs"))


def _run_case(case, backend="auto"):
    q, k, v, dout, mask = _global_inputs(case)
    dtype = getattr(torch, case.get("dtype", "float64"))
    q, k, v, dout = (da.shard_sequence(t, case["layout"]).to(dtype) for t in (q, k, v, dout))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    local_mask = None if mask is None else da.shard_sequence(mask, case["layout"])
    out = da.ring_flash_attn(q, k, v, layout=case["layout"], attention_mask=local_mask, backend=backend,
                             **_options(case))
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _expected(case):
    q, k, v, dout, mask = _global_inputs(case)
    dtype = getattr(torch, case.get("dtype", "float64"))
    q, k, v = (t.to(dtype).double().requires_grad_() for t in (q, k, v))
    out = attention_reference(q, k, v, attention_mask=mask, **_options(case))
    grads = torch.autograd.grad(out, (q, k, v), dout.to(dtype).double())
    return dict(zip(("out", "dq", "dk", "dv"), (out.detach(), *grads)))


def _check(case, got_by_rank, tol=FP64):
    want = _expected(case)
    for r, got in enumerate(got_by_rank):
        for name, ref in want.items():
            assert not got[name].isnan().any(), f"{name} has NaN on rank {r}, case {case}"
            torch.testing.assert_close(
                got[name].double(), layouts.shard(ref, case["layout"], case["w"], r, 1), **tol,
                msg=lambda m, name=name, r=r: f"{name} on ring position {r}, case {case}: {m}",
            )


def _feature_cases(w):
    """Every layout x causal with each feature alone and combined, GQA/MQA, edge cases of each feature."""
    n = 8  # local length: even (zigzag), 8 * w global
    seq = n * w
    cases = []
    heads = [(4, 2, 1), (2, 2, 2), (4, 1, 1)]
    feature_sets = [
        dict(pad=[(seq - 5, seq)]),  # padding at the end
        dict(pad=[(0, n), (n // 2, seq)], b=2),  # rank 0's keys all padding (row 0); almost all of row 1
        dict(window=(3, -1)),
        dict(window=(0, 0)),  # only the diagonal
        dict(window=(seq + 5, seq + 5)),  # wider than the sequence
        dict(window=(2, 1), softcap=0.5),
        dict(softcap=2.0),
        dict(docs=sorted({0, 1, 2, 3, seq - 2, seq - 1, seq})),  # single-token documents and one spanning every rank
        dict(docs=sorted({x for x in (0, 3, n + 1, 2 * n + 3) if x < seq} | {seq})),  # documents spanning rank boundaries
        dict(docs=[0, seq // 2, seq], window=(4, -1), pad=[(1, 3)], softcap=1.5),
    ]
    i = 0
    for layout in layouts.STATIC:
        for causal in (False, True):
            for features in feature_sets:
                h, hkv, b = heads[i % 3]
                case = dict(layout=layout, causal=causal, b=b, n=n, h=h, hkv=hkv, d=8, w=w, seed=1000 * w + i)
                case.update(features)
                cases.append(case)
                i += 1
    return cases


def _features_rank(rank, world):
    return [_run_case(case) for case in _feature_cases(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_features_match_reference(world):
    """Masks, windows, softcap and documents: outputs and gradients equal the float64 reference, never NaN."""
    results = run_world(_features_rank, world)
    for i, case in enumerate(_feature_cases(world)):
        _check(case, [results[r][i] for r in range(world)])


def _hops_rank(rank, world):
    sent = []
    original = RingComm.send_recv

    def counting(self, *tensors, shift=1, **kwargs):
        if shift % self.size:
            sent.append((shift % self.size, tensors[0].shape[1]))
        return original(self, *tensors, shift=shift, **kwargs)

    RingComm.send_recv = counting
    try:
        case = dict(layout="contiguous", causal=True, b=1, n=8, h=2, hkv=2, d=8, w=world, seed=5, window=(3, -1))
        result = _run_case(case)
    finally:
        RingComm.send_recv = original
    return result, sent


def test_window_skips_ring_steps_on_the_wire():
    """A causal window of 3 over 4 ranks of 8 tokens needs only the neighbour's last 3 keys: the forward sends
    those 3 rows one hop (Note [Sparse ring]), the backward keeps them and sends their dK, dV straight back."""
    results = run_world(_hops_rank, 4)
    case = dict(layout="contiguous", causal=True, b=1, n=8, h=2, hkv=2, d=8, w=4, seed=5, window=(3, -1))
    _check(case, [r[0] for r in results])
    for rank, (_result, sent) in enumerate(results):
        # rank 3's keys are seen by no query of rank 0 (causal); rank 0 sees no other rank's keys
        forward = 0 if rank == 3 else 3
        backward = 0 if rank == 0 else 3
        assert sent == [(1, forward), (3, backward)], (rank, sent)


def _mismatch_rank(rank, world):
    q = torch.zeros(1, 4, 2, 8, dtype=torch.float64)
    docs = [0, 3, 8] if rank == 0 else [0, 5, 8]
    try:
        da.ring_flash_attn(q, q, q, cu_seqlens=docs)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_cu_seqlens_differing_across_ranks_raise_everywhere():
    """Ranks given different document boundaries all raise the same error instead of computing garbage."""
    messages = run_world(_mismatch_rank, 2)
    assert all("disagree" in m and "cu_seqlens" in m for m in messages), messages
    assert messages[0] == messages[1]


def _sim_case(case, fwd, bwd, dtype=torch.float64):
    from tests.ring_sim import simulate_ring

    q, k, v, dout, mask = _global_inputs(case)
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    vis = Visibility(case["causal"], case.get("window", (-1, -1)),
                     None if case.get("docs") is None else tuple(case["docs"]), mask is not None)
    out, dq, dk, dv = simulate_ring(q, k, v, dout, mask, layout=case["layout"], ring_size=case["w"], vis=vis,
                                    scale=case["d"] ** -0.5, softcap=case.get("softcap", 0.0), fwd=fwd, bwd=bwd)
    return {"out": out, "dq": dq, "dk": dk, "dv": dv}


def test_simulated_ring_harness_matches_reference():
    """The one-process ring simulation used by the GPU kernel tests computes the reference (torch kernels)."""
    from distcomm_attention.kernels.torch_exact import TorchBackward, TorchForward

    for case in _feature_cases(3)[::3]:
        got = _sim_case(case, TorchForward(), TorchBackward())
        want = _expected(case)
        for name in want:
            torch.testing.assert_close(got[name].double(), want[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}, case {case}: {m}")


def _triton_feature_cases():
    cases = []
    for i, case in enumerate(_feature_cases(2)):
        if i % 4 == 0:  # a spread of layouts, features and causal, kept few: the interpreter is slow
            cases.append(dict(case, dtype="float32", d=16))
    return cases


def _triton_features_rank(rank, world):
    return [_run_case(case, backend="triton") for case in _triton_feature_cases()]


def test_triton_backend_features_on_cpu():
    """The Triton forward and backward (interpreter, fp32) run every feature in a real 2-rank ring."""
    require("triton")
    results = run_world(_triton_features_rank, 2, timeout=240)
    for i, case in enumerate(_triton_feature_cases()):
        _check(case, [results[r][i] for r in range(2)], tol=dict(rtol=1e-4, atol=5e-5))
