"""Layer 2: ring flash attention on gloo worlds of 1..4 CPU ranks against a single-process float64 reference.

Every rank builds the same global inputs from a shared seed and takes its shard; the parent recomputes plain
softmax attention on the whole global sequence in float64 (``_reference.attention_reference``, which shares
no code with the ring or the block kernels), gets reference gradients by autograd for a random dout, and
shards them by the layout. Each world loops over many cases to keep the suite fast.
"""

import re

import pytest
import torch
import torch.distributed as dist

import distcomm
import distcomm_attention as da
from distcomm_attention import _validation
from distcomm_attention.planning import layouts
from distcomm_attention._reference import attention_reference
from tests.dist_harness import run_world
from tests.optional import require
from tests.counting import max_diff

FP64 = dict(rtol=1e-10, atol=1e-12)
FP32 = dict(rtol=1e-4, atol=2e-5)


def _global_inputs(case):
    """Global (q, k, v, dout) in float64, identical in every process for the same case."""
    g = torch.Generator().manual_seed(case["seed"])
    b, h, hkv, d = case["b"], case["h"], case["hkv"], case["d"]
    seq = case["n"] * case["w"]
    q = torch.randn(b, seq, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, seq, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, seq, hkv, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, seq, h, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _run_case(case, ring_size=None, group=None, backend="auto"):
    """This rank's (out, dq, dk, dv) for ``case``, computed with ring_flash_attn on its shards."""
    dtype = getattr(torch, case.get("dtype", "float64"))
    shards = [
        da.shard_sequence(t, case["layout"], ring_size=ring_size, group=group).to(dtype)
        for t in _global_inputs(case)
    ]
    q, k, v = (t.requires_grad_() for t in shards[:3])
    out = da.ring_flash_attn(
        q, k, v, causal=case["causal"], layout=case["layout"], ring_size=ring_size, group=group,
        softmax_scale=case.get("scale"), backend=backend,
    )
    out.backward(shards[3])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _expected(case):
    """Reference (out, dq, dk, dv) on the global sequence, in float64 from the inputs as the ranks hold them
    (rounded to the case's dtype), so the comparison measures the computation's error alone."""
    dtype = getattr(torch, case.get("dtype", "float64"))
    q, k, v, dout = (t.to(dtype).double() for t in _global_inputs(case))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attention_reference(q, k, v, causal=case["causal"], softmax_scale=case.get("scale"))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}


def _max_errors(case, got_by_pos):
    """Max abs error per quantity over the ring positions (got_by_pos[r] = results of ring position r)."""
    want = _expected(case)
    errs = {}
    for name, ref in want.items():
        errs[name] = max(
            max_diff(got[name].double(), layouts.shard(ref, case["layout"], case["w"], r, 1))
            for r, got in enumerate(got_by_pos)
        )
    return errs


def _check_case(case, got_by_pos, tol):
    want = _expected(case)
    for r, got in enumerate(got_by_pos):
        for name, ref in want.items():
            torch.testing.assert_close(
                got[name].double(), layouts.shard(ref, case["layout"], case["w"], r, 1), **tol,
                msg=lambda m, name=name, r=r: f"{name} on ring position {r}, case {case}: {m}",
            )


def _cases(w):
    """A covering set for a ring of w: every layout x causal, MHA/GQA/MQA, head dims 32/64/128, odd local
    lengths where the layout allows, plus float32 cases."""
    heads = [(4, 4, 1), (4, 2, 2), (2, 1, 1)]  # (heads, kv_heads, batch)
    cases = []
    i = 0
    for layout in da.planning.layouts.STATIC:
        for causal in (False, True):
            h, hkv, b = heads[i % 3]
            n = (4 if causal else 6) if layout == "zigzag" else (5 if causal else 3)
            d = (32, 64, 128)[(i + w) % 3]
            cases.append(dict(layout=layout, causal=causal, b=b, n=n, h=h, hkv=hkv, d=d, w=w, seed=100 * w + i))
            i += 1
        cases.append(dict(layout=layout, causal=True, b=1, n=8, h=4, hkv=2, d=32, w=w, seed=7 * w + i,
                          dtype="float32", scale=0.2))
        i += 1
    return cases


def _ring_rank(rank, world):
    return [_run_case(case) for case in _cases(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_matches_reference(world):
    """Outputs and dq/dk/dv on every rank equal the float64 global reference (fp64: tight; fp32: fp32-level)."""
    results = run_world(_ring_rank, world)
    for i, case in enumerate(_cases(world)):
        tol = FP32 if case.get("dtype") == "float32" else FP64
        _check_case(case, [results[r][i] for r in range(world)], tol)


def test_no_process_group_path():
    """Without an initialised process group every layout is ordinary attention, with the same numerics."""
    assert not dist.is_initialized()
    for case in _cases(1):
        _check_case(case, [_run_case(case)], FP32 if case.get("dtype") == "float32" else FP64)


def _triton_cases():
    return [dict(layout=layout, causal=causal, b=1, n=6, h=4, hkv=2, d=16, w=2, seed=60 + i, dtype="float32")
            for i, (layout, causal) in enumerate((lo, c) for lo in da.planning.layouts.STATIC for c in (False, True))]


def _triton_rank(rank, world):
    return [_run_case(case, backend="triton") for case in _triton_cases()]


def test_ring_with_triton_backend_on_cpu():
    """The ring loop drives the Triton forward (interpreter) with sliced and fused-final steps correctly."""
    require("triton")
    results = run_world(_triton_rank, 2)
    for i, case in enumerate(_triton_cases()):
        _check_case(case, [results[r][i] for r in range(2)], FP32)


def _growth_case(layout, dtype, w):
    return dict(layout=layout, causal=True, b=1, n=64 // w, h=4, hkv=2, d=64, w=w, seed=5, dtype=dtype)


def _growth_rank(rank, world):
    return {(layout, dtype): _run_case(_growth_case(layout, dtype, world), backend="torch")
            for layout in da.planning.layouts.STATIC for dtype in ("float32", "bfloat16")}


def _rms_errors(case, got_by_pos):
    """RMS error per quantity over all ring positions (got_by_pos[r] = results of ring position r)."""
    want = _expected(case)
    errs = {}
    for name, ref in want.items():
        sq = sum(
            (got[name].double() - layouts.shard(ref, case["layout"], case["w"], r, 1)).square().sum().item()
            for r, got in enumerate(got_by_pos)
        )
        errs[name] = (sq / ref.numel()) ** 0.5
    return errs


def test_error_does_not_grow_with_ring_size():
    """fp32 and bf16 errors at W=4 stay at the W=1 level: the softmax state is never rounded between hops
    (rounding it per hop raises the bf16 RMS error by 13-55%)."""
    world = 4
    results = run_world(_growth_rank, world)
    for layout in da.planning.layouts.STATIC:
        for dtype, bound in (("float32", 4e-6), ("bfloat16", 3e-2)):
            case_one, case_four = _growth_case(layout, dtype, 1), _growth_case(layout, dtype, world)
            got_one = [_run_case(case_one, backend="torch")]
            got_four = [results[r][(layout, dtype)] for r in range(world)]
            four = _max_errors(case_four, got_four)
            rms_one, rms_four = _rms_errors(case_one, got_one), _rms_errors(case_four, got_four)
            for name in four:
                assert four[name] < bound, (layout, dtype, name, four[name])
                assert rms_four[name] <= 1.05 * rms_one[name], (layout, dtype, name, rms_one[name], rms_four[name])


def _rings_and_subgroup_rank(rank, world):
    out = {}
    # Two rings of two in a world of four, each carrying its own sequence.
    ring = rank // 2
    for layout in da.planning.layouts.STATIC:
        case = dict(layout=layout, causal=True, b=1, n=4, h=4, hkv=1, d=32, w=2, seed=300 + ring)
        out[("rings", layout)] = _run_case(case, ring_size=2)
    # A subgroup of non-consecutive global ranks [1, 3]; ranks 0 and 2 stay out of it.
    group = dist.new_group([1, 3])
    if rank in (1, 3):
        for layout in da.planning.layouts.STATIC:
            case = dict(layout=layout, causal=True, b=2, n=4, h=2, hkv=2, d=32, w=2, seed=400)
            out[("group", layout)] = _run_case(case, group=group)
    return out


def test_rings_smaller_than_world_and_subgroup():
    """ring_size=2 in a world of 4 gives two independent rings; a subgroup of ranks [1, 3] is a ring of its own."""
    results = run_world(_rings_and_subgroup_rank, 4)
    for layout in da.planning.layouts.STATIC:
        for ring in (0, 1):
            case = dict(layout=layout, causal=True, b=1, n=4, h=4, hkv=1, d=32, w=2, seed=300 + ring)
            _check_case(case, [results[2 * ring][("rings", layout)], results[2 * ring + 1][("rings", layout)]], FP64)
        case = dict(layout=layout, causal=True, b=2, n=4, h=2, hkv=2, d=32, w=2, seed=400)
        _check_case(case, [results[1][("group", layout)], results[3][("group", layout)]], FP64)
        assert ("group", layout) not in results[0]


def _full_sequence(seed):
    return torch.randn(2, 12, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _gather_rank(rank, world, ring_size):
    w = ring_size or world
    out = {}
    for layout in da.planning.layouts.STATIC:
        full = _full_sequence(rank // w)
        x = da.shard_sequence(full, layout, ring_size=ring_size).clone().requires_grad_()
        gathered = da.gather_sequence(x, layout, ring_size=ring_size)
        weight = _full_sequence(50 + rank)
        (gathered * weight).sum().backward()
        out[layout] = {"full": full, "gathered": gathered.detach(), "grad": x.grad}
        # Along another dim, and through the transposed layout.
        xt = da.shard_sequence(full.transpose(0, 1), layout, dim=0, ring_size=ring_size)
        out[layout]["dim0"] = da.gather_sequence(xt, layout, dim=0, ring_size=ring_size)
    return out


@pytest.mark.parametrize("world, ring_size", [(3, None), (4, 2)])
def test_gather_sequence_round_trip_and_gradient(world, ring_size):
    """gather(shard(x)) == x on every rank of each ring; its grad on rank r is the ring's summed grad of r's shard."""
    results = run_world(_gather_rank, world, ring_size)
    w = ring_size or world
    for layout in da.planning.layouts.STATIC:
        for rank in range(world):
            base, pos = rank - rank % w, rank % w
            res = results[rank][layout]
            torch.testing.assert_close(res["gathered"], res["full"], rtol=0, atol=0)
            torch.testing.assert_close(res["dim0"], res["full"].transpose(0, 1), rtol=0, atol=0)
            summed = sum(_full_sequence(50 + base + j) for j in range(w))
            torch.testing.assert_close(res["grad"], layouts.shard(summed, layout, w, pos, 1), rtol=1e-14, atol=1e-14)


MODULE_KW = dict(dim=16, heads=4, dim_head=8, kv_heads=2, causal=True, bias=True)


def _module_inputs():
    g = torch.Generator().manual_seed(11)
    return tuple(torch.randn(2, 16, 16, generator=g, dtype=torch.float64) for _ in range(2))


def _module_rank(rank, world, layout):
    torch.manual_seed(0)
    module = da.RingAttention(layout=layout, **MODULE_KW).double()
    x_full, weight = _module_inputs()
    x = da.shard_sequence(x_full, layout).requires_grad_()
    y = module(x)
    (y * da.shard_sequence(weight, layout)).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "params": {n: p.grad for n, p in module.named_parameters()}}


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_module_distributed_equals_single_process(layout):
    """RingAttention on shards == the same module on the full sequence: outputs, input grads, summed param grads."""
    world = 2
    results = run_world(_module_rank, world, layout)
    torch.manual_seed(0)
    module = da.RingAttention(layout=layout, **MODULE_KW).double()
    x_full, weight = _module_inputs()
    x_full.requires_grad_()
    y = module(x_full)
    (y * weight).sum().backward()
    for r in range(world):
        torch.testing.assert_close(results[r]["y"], layouts.shard(y.detach(), layout, world, r), **FP64)
        torch.testing.assert_close(results[r]["dx"], layouts.shard(x_full.grad, layout, world, r), **FP64)
    for name, p in module.named_parameters():
        torch.testing.assert_close(sum(results[r]["params"][name] for r in range(world)), p.grad, **FP64)


def _module_bad_x_rank(rank, world, strategy):
    """Rank 1 alone passes a bad ``x`` to the module; then every rank makes a good call."""
    torch.manual_seed(0)
    module = da.RingAttention(strategy=strategy, **MODULE_KW).double()
    good = torch.randn(2, 8, 16, dtype=torch.float64)
    msgs = {}
    for key, bad in (("2-D", good[0]), ("width", good[..., :12]), ("type", good.tolist())):
        try:
            module(bad if rank == 1 else good)
            msgs[key] = None
        except (TypeError, ValueError) as e:
            msgs[key] = f"{type(e).__name__}: {e}"
    msgs["after"] = tuple(module(good).shape)
    return msgs


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_module_bad_x_on_one_rank_raises_everywhere(strategy):
    """A bad input on one rank (wrong number of dims, wrong width, not a tensor) raises the same error naming
    rank 1 and `x` on every rank, through the attention's exchange of verdicts (no rank left waiting); the
    module works after it."""
    msgs = run_world(_module_bad_x_rank, 3, strategy, timeout=60)
    for key, expect in (("2-D", r"ValueError: .*rank 1.*RingAttention expects `x` of shape \(batch, local_seq, 16\) "
                                r"\(dim=16\), got shape \(8, 16\)"),
                        ("width", r"ValueError: .*rank 1.*got shape \(2, 8, 12\)"),
                        ("type", r"TypeError: .*rank 1.*RingAttention expects `x`, a tensor .*got list")):
        assert msgs[0][key] is not None and all(m[key] == msgs[0][key] for m in msgs), (key, msgs)
        assert re.search(expect, msgs[0][key], re.S), (key, msgs[0][key])
    assert all(m["after"] == (2, 8, 16) for m in msgs)


def _catch(fn):
    try:
        fn()
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def _errors_rank(rank, world):
    msgs = {}

    def qkv(n, dtype=torch.float64):
        return tuple(torch.randn(1, n, 2, 16, dtype=dtype) for _ in range(3))

    msgs["length"] = _catch(lambda: da.ring_flash_attn(*qkv(4 + 2 * (rank == 1))))
    msgs["dtype"] = _catch(lambda: da.ring_flash_attn(*qkv(4, torch.float32 if rank == 2 else torch.float64)))
    msgs["causal"] = _catch(lambda: da.ring_flash_attn(*qkv(4), causal=rank == 0))
    msgs["ring_size"] = _catch(lambda: da.ring_flash_attn(*qkv(4), ring_size=3))
    msgs["gather"] = _catch(lambda: da.gather_sequence(torch.zeros(2, 3 + rank), "contiguous"))
    # A rank whose inputs need no grad would skip the backward its peers wait in.
    msgs["requires_grad"] = _catch(lambda: da.ring_flash_attn(*(t.requires_grad_(rank == 0) for t in qkv(4))))
    msgs["scale"] = _catch(lambda: da.ring_flash_attn(*qkv(4), softmax_scale=0.5 if rank == 1 else None))

    # Verified on every call (Note [Collective verdicts]): one exchange each, none more when the ranks agree.
    calls = []
    original = distcomm.RingComm.all_gather_ints

    def counting(*args):
        calls.append(1)
        return original(*args)

    distcomm.RingComm.all_gather_ints = counting
    try:
        da.ring_flash_attn(*qkv(6))
        first = len(calls)
        da.ring_flash_attn(*qkv(6))
        msgs["exchanges"] = (first, len(calls) - first)
        # After a verified call, a rank changing its shape alone is still caught (no cache lets a rank skip).
        msgs["check_mode"] = _catch(lambda: da.ring_flash_attn(*qkv(8 if rank == 3 else 6)))
    finally:
        distcomm.RingComm.all_gather_ints = original
    # The world still works after the errors.
    q, k, v = qkv(4)
    msgs["after"] = da.ring_flash_attn(q, k, v, causal=True).shape[1]
    return msgs


def test_cross_rank_errors_same_on_every_rank():
    """Lengths, dtypes or options that differ between ranks raise the same ValueError on every rank, no hang."""
    world = 4
    msgs = run_world(_errors_rank, world, timeout=60)
    for key, expect in [
        ("length", r"ring_flash_attn: the ranks of the ring disagree .*ring position 1: q=\(1, 6, 2, 16\)"),
        ("dtype", r"ring position 2: q=\(1, 4, 2, 16\) torch.float32"),
        ("causal", r"disagree on `causal` \(ring position 0: causal=True; ring positions 1-3: causal=False\)"),
        ("ring_size", r"`ring_size`=3 must divide the group size 4"),
        ("gather", r"gather_sequence: the ranks of the ring disagree"),
        ("requires_grad", r"ring position 0: requires_grad=True; ring positions 1-3: requires_grad=False"),
        ("scale", r"ring_flash_attn: the ranks of the ring disagree on `softmax_scale` \(ring positions 0, 2-3: "
                  r"softmax_scale=0.25; ring position 1: softmax_scale=0.5\)"),
        ("check_mode", r"ring position 3: q=\(1, 8, 2, 16\)"),
    ]:
        assert all(m[key] == msgs[0][key] for m in msgs), key
        assert msgs[0][key] is not None and re.search(expect, msgs[0][key]), (key, msgs[0][key])
    assert all(m["exchanges"] == (1, 1) for m in msgs)
    assert all(m["after"] == 4 for m in msgs)


def _check_mode_length_rank(rank, world):
    msgs = {}
    with distcomm.check_mode():
        q = torch.randn(1, 5 + rank, 2, 16, dtype=torch.float64)
        msgs["attn"] = _catch(lambda: da.ring_flash_attn(q, q, q, layout="zigzag"))
        msgs["gather"] = _catch(lambda: da.gather_sequence(torch.zeros(2, 5 + rank), "zigzag"))
    return msgs


def test_check_mode_length_errors_same_on_every_rank():
    """In check mode a length only one rank's layout rejects (zigzag 5 vs 6) raises the same error on both ranks."""
    msgs = run_world(_check_mode_length_rank, 2, timeout=30)
    for key in ("attn", "gather"):
        assert msgs[0][key] is not None and msgs[0][key] == msgs[1][key], (key, msgs)
        assert "ring position 0" in msgs[0][key] and "ring position 1" in msgs[0][key], msgs[0][key]


def test_autocast_keeps_exact_torch_path():
    """fp32 inputs under CPU bf16 autocast still get fp32-exact output and gradients (autocast is disabled inside)."""
    case = dict(layout="contiguous", causal=True, b=1, n=24, h=4, hkv=2, d=32, w=1, seed=21, dtype="float32")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _run_case(case, backend="torch")
    assert got["out"].dtype == torch.float32
    _check_case(case, [got], FP32)


def _saved_storage_bytes(fn):
    """Bytes of the distinct storages that autograd keeps alive for the backward of ``fn()``."""
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_saved_tensors_do_not_duplicate_inputs():
    """Only q, k, v (as given: no contiguous copies), out and lse stay alive for the backward."""
    b, n, h, d = 2, 16, 4, 32
    unit = b * n * h * d * 4  # one (B, S, H, D) fp32 tensor
    lse_bytes = b * h * n * 4
    packed = torch.randn(b, n, 3, h, d, requires_grad=True)  # a fused qkv projection
    q, k, v = packed.unbind(2)
    saved = _saved_storage_bytes(lambda: da.ring_flash_attn(q, k, v, causal=True, backend="torch"))
    assert saved == 3 * unit + unit + lse_bytes, (saved, unit)  # packed q/k/v + out + lse
    q, k, v = (torch.randn(b, n, h, d, requires_grad=True) for _ in range(3))
    saved = _saved_storage_bytes(lambda: da.ring_flash_attn(q, k, v, causal=True, backend="torch"))
    assert saved == 3 * unit + unit + lse_bytes, (saved, unit)


def test_cuda_only_failures_raise_before_communication(monkeypatch):
    """A missing triton, an empty batch or a pre-sm80 GPU for the FlashAttention-2 backward raise up front."""
    from distcomm_attention.kernels import dispatch as _kernels

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(_kernels, "_cuda_capability", lambda device: (7, 5))
    with pytest.raises(ValueError, match=r"FlashAttention-2 backward needs sm80\+.*sm75.*backend='torch'"):
        _kernels.check_flash_backward("flash2", cuda, 2)
    with pytest.raises(ValueError, match=r"backend='flash_attn' on CUDA does not support batch size 0.*backend='torch'"):
        _kernels.check_flash_backward("flash_attn", cuda, 0)
    _kernels.check_flash_backward("torch", cuda, 0)  # the exact path runs anywhere
    _kernels.check_flash_backward("triton", cuda, 0)  # our Triton backward has no such limit
    monkeypatch.setattr(_kernels, "_cuda_capability", lambda device: (8, 0))
    _kernels.check_flash_backward("flash2", cuda, 2)

    monkeypatch.setattr(_kernels, "_triton_importable", lambda: False)
    with pytest.raises(ImportError, match=r"backend='auto' on CUDA torch.bfloat16 .*pip install triton.*backend='torch'"):
        _kernels.resolve_backend("auto", cuda, torch.bfloat16)
    assert _kernels.resolve_backend("auto", cuda, torch.float32)[0] == "torch"
    assert _kernels.resolve_backend("auto", torch.device("cpu"), torch.bfloat16)[0] == "torch"
    q = torch.zeros(1, 4, 2, 16)
    with pytest.raises(ImportError, match=r"backend='triton' needs the Triton compiler.*pip install triton"):
        da.ring_flash_attn(q, q, q, backend="triton")


def test_backward_accumulators_round_once():
    """dK/dV accumulation of the ring backward: a single block in the accumulation dtype travels as the kernel
    returned it, one in another dtype is converted (every rank's first hop has the same dtype); partial sums
    are fp32; the last step rounds the complete sum to the input dtype exactly once (fp32 sum, then cast)."""
    from distcomm_attention.strategies.ring import _accumulate, _start_acc

    gen = torch.Generator().manual_seed(0)
    like = torch.empty(2, 6, 3, 4, dtype=torch.bfloat16)
    g1, g2 = (torch.randn(like.shape, generator=gen).bfloat16() for _ in range(2))

    wide = g1.float()
    assert _start_acc([(slice(None), wide, wide)], like, torch.float32, 1) is wide  # one term: no copy
    first = _start_acc([(slice(None), g1, g1)], like, torch.float32, 1)
    assert first.dtype == torch.float32 and torch.equal(first, g1.float())  # the same dtype as a rank's sum
    part = _start_acc([(slice(0, 3), g1[:, :3], g1[:, :3])], like, torch.float32, 1)
    assert part.dtype == torch.float32 and torch.equal(part[:, :3], g1[:, :3].float()) and not part[:, 3:].any()

    # a middle step: fp32 partial sum, in place when the received buffer is already fp32
    received = g1.float()
    mid = _accumulate(received, [(slice(None), g2, g2)], torch.float32, 1)
    assert mid is received and torch.equal(mid, g1.float() + g2.float())
    widened = _accumulate(g1, [(slice(None), g2, g2)], torch.float32, 1)
    assert widened.dtype == torch.float32 and torch.equal(widened, g1.float() + g2.float())

    # the last step: rounded to the input dtype once, full and partial kv rows, bf16 or fp32 received
    third = torch.randn(like.shape, generator=gen)
    for recv in (g1, g1.float() + third):
        full = _accumulate(recv.clone(), [(slice(None), g2, g2)], torch.float32, 1, torch.bfloat16)
        assert full.dtype == torch.bfloat16 and torch.equal(full, (recv.float() + g2.float()).bfloat16())
        rows = slice(2, 5)
        out = _accumulate(recv.clone(), [(rows, g2[:, rows], g2[:, rows])], torch.float32, 1, torch.bfloat16)
        want = recv.float().clone()
        want[:, rows] += g2[:, rows].float()
        assert out.dtype == torch.bfloat16 and torch.equal(out, want.bfloat16())


def test_single_whole_block_takes_the_fused_paths(monkeypatch):
    """The planner writes full ranges as slice(0, n): a ring of one still marks its only forward call final
    (the fused normalisation) and runs its backward as one kernel call without accumulators."""
    from distcomm_attention.kernels import torch_exact as _torch_kernels

    finals, backward_calls = [], []
    step_fwd, step_bwd = _torch_kernels.TorchForward.step, _torch_kernels.TorchBackward.step

    def recording_fwd(self, state, q, k, v, **kw):
        finals.append(kw.get("final", False))
        return step_fwd(self, state, q, k, v, **kw)

    def recording_bwd(self, *args, **kw):
        backward_calls.append(kw.get("dq_acc") is None)
        return step_bwd(self, *args, **kw)

    monkeypatch.setattr(_torch_kernels.TorchForward, "step", recording_fwd)
    monkeypatch.setattr(_torch_kernels.TorchBackward, "step", recording_bwd)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = da.ring_flash_attn(q, k, v, causal=True)
    out.sum().backward()
    assert finals == [True] and backward_calls == [True]
    ref = attention_reference(q, k, v, causal=True)
    torch.testing.assert_close(out, ref, **FP64)
