"""Layer 1 (pure functions, milliseconds): sequence layouts, the causal block plan, argument validation and
the single-process API against the float64 reference."""

import subprocess
import sys

import pytest
import torch

import distcomm_attention as da
from distcomm_attention.planning.visibility import CAUSAL, FULL
from distcomm_attention.kernels import dispatch as _kernels
from distcomm_attention.planning import layouts
from distcomm_attention._reference import attention_reference
from distcomm_attention.kernels.torch_exact import TorchBackward, TorchForward
from tests.optional import require


def _expected_positions(layout, seq_len, w, r):
    """The issue's definitions, written out token by token."""
    n = seq_len // w
    if layout == "contiguous":
        return [t for t in range(seq_len) if r * n <= t < (r + 1) * n]
    if layout == "zigzag":
        c = seq_len // (2 * w)
        return [t for t in range(seq_len) if t // c == r] + [t for t in range(seq_len) if t // c == 2 * w - 1 - r]
    return [t for t in range(seq_len) if t % w == r]


@pytest.mark.parametrize("layout", da.planning.layouts.STATIC)
@pytest.mark.parametrize("w", [1, 2, 3, 4])
def test_positions_match_definitions(layout, w):
    """Each rank holds exactly the tokens the layout's definition gives it, and the ranks partition the sequence."""
    seq_len = 2 * w * 3
    seen = []
    for r in range(w):
        pos = layouts.positions(layout, seq_len, w, r).tolist()
        assert pos == _expected_positions(layout, seq_len, w, r)
        seen += pos
    assert sorted(seen) == list(range(seq_len))


@pytest.mark.parametrize("layout", da.planning.layouts.STATIC)
@pytest.mark.parametrize("w", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [1, 0, -1])
def test_shard_unshard_round_trip(layout, w, dim):
    """unshard(shard(x)) is x, along any dim, and shard picks the positions' values."""
    seq_len = 4 * w
    shape = [3, 5, 2]
    shape[dim] = seq_len
    x = torch.randn(shape)
    shards = [layouts.shard(x, layout, w, r, dim) for r in range(w)]
    for r, s in enumerate(shards):
        idx = layouts.positions(layout, seq_len, w, r)
        torch.testing.assert_close(s, x.index_select(dim, idx), rtol=0, atol=0)
        torch.testing.assert_close(da.shard_sequence(x, layout, dim=dim, ring_size=w, rank=r), s, rtol=0, atol=0)
    torch.testing.assert_close(layouts.unshard(shards, layout, dim), x, rtol=0, atol=0)


def test_shard_sequence_integer_and_expanded_inputs():
    """Token ids and expanded position tensors shard like any other tensor."""
    pos = torch.arange(8).expand(2, 8)
    assert da.shard_sequence(pos, "zigzag", ring_size=2, rank=1).tolist() == [[2, 3, 4, 5]] * 2
    assert da.shard_sequence(pos, "striped", ring_size=2, rank=1).tolist() == [[1, 3, 5, 7]] * 2


def _plan_mask(layout, causal, w, r, src, n):
    cover = torch.zeros(n, n, dtype=torch.int64)
    for block in layouts.block_plan(layout, causal, w, r, src, n):
        rows = torch.arange(n)[block.q]
        cols = torch.arange(n)[block.kv]
        sub = torch.ones(len(rows), len(cols), dtype=torch.int64)
        if block.causal:
            sub = sub.tril()
        assert sub.any(), "a fully masked block must not be planned"
        cover[rows[:, None], cols[None, :]] += sub
    return cover


@pytest.mark.parametrize("layout", da.planning.layouts.STATIC)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("w", [1, 2, 3, 4])
def test_block_plan_covers_exactly_the_visible_pairs(layout, causal, w):
    """Every visible (query, key) pair of every rank pair is computed exactly once, and no hidden one is."""
    for n in ([2, 4] if layout == "zigzag" else [1, 2, 3, 5]):
        seq_len = n * w
        for r in range(w):
            pos_q = layouts.positions(layout, seq_len, w, r)
            for src in range(w):
                pos_k = layouts.positions(layout, seq_len, w, src)
                visible = (pos_k[None, :] <= pos_q[:, None]) if causal else torch.ones(n, n, dtype=torch.bool)
                cover = _plan_mask(layout, causal, w, r, src, n)
                assert torch.equal(cover, visible.to(torch.int64)), (layout, causal, w, r, src, n)


def test_contiguous_causal_skips_future_blocks():
    """Causal contiguous: blocks from later ranks cost no kernel call at all."""
    assert layouts.block_plan("contiguous", True, 4, 1, 2, 8) == ()
    assert layouts.block_plan("contiguous", True, 4, 1, 3, 8) == ()
    assert len(layouts.block_plan("contiguous", True, 4, 2, 1, 8)) == 1


def _zeros(*shape, **kwargs):
    return torch.zeros(*shape, **{"dtype": torch.float64, **kwargs})


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: layouts.positions("zigzag", 10, 2, 0),
         r"layout='zigzag' over a ring of 2 needs a global sequence length divisible by 4, got 10"),
        (lambda: layouts.positions("striped", 7, 2, 0), r"divisible by 2, got 7"),
        (lambda: layouts.positions("diagonal", 8, 2, 0),
         r"Invalid layout 'diagonal'. Must be one of: 'contiguous', 'zigzag', 'striped'"),
        (lambda: layouts.positions("contiguous", 8, 2, 2), r"`rank` must be an int in \[0, 2\)"),
        (lambda: layouts.check_local_length("zigzag", 5, 3),
         r"layout='zigzag' needs an even local sequence length .* got 5"),
        (lambda: da.shard_sequence(_zeros(2, 8), "contiguous", dim=2, ring_size=2, rank=0), r"`dim`=2 is out of range"),
        (lambda: da.shard_sequence(_zeros(2, 8), "contiguous", rank=0), r"`rank` needs `ring_size`"),
        (lambda: da.shard_sequence(_zeros(2, 8), "contiguous", ring_size=2),
         r"`ring_size`=2 must divide the group size 1"),
    ],
)
def test_layout_validation_messages(call, match):
    """Bad layout arguments raise a ValueError naming the argument, the value and what is allowed."""
    with pytest.raises(ValueError, match=match):
        call()


def _inputs(b, s, h, hkv, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, s, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, s, hkv, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, dout)]


@pytest.mark.parametrize("layout", da.planning.layouts.STATIC)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (3, 1)])
def test_world_of_one_matches_reference(layout, causal, heads):
    """Without a process group ring_flash_attn is ordinary attention: outputs and grads equal the fp64 reference."""
    q, k, v, dout = _inputs(2, 6, heads[0], heads[1], 16, seed=sum(heads))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = da.ring_flash_attn(q, k, v, causal=causal, layout=layout, softmax_scale=0.3)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    ref = attention_reference(q, k, v, causal=causal, softmax_scale=0.3)
    want = (ref, *torch.autograd.grad(ref, (q, k, v), dout))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_torch_kernels_multi_step_and_empty_rows():
    """The torch forward kernel accumulates over key chunks to the full answer; rows with no key give 0 and -inf."""
    q, k, v, _ = _inputs(1, 6, 2, 1, 8, seed=3)
    fwd = TorchForward()
    state = fwd.init_state(q)
    fwd.step(state, q, k[:, :2], v[:, :2], mask=FULL, scale=0.5)
    fwd.step(state, q, k[:, 2:], v[:, 2:], mask=FULL, scale=0.5)
    out, lse = fwd.finalize(state, q.dtype)
    torch.testing.assert_close(out, attention_reference(q, k, v, softmax_scale=0.5), rtol=1e-12, atol=1e-12)
    scores = torch.einsum("bihd,bjhd->bhij", q, k.expand(-1, -1, 2, -1)) * 0.5
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)

    state = fwd.init_state(q)
    fwd.step(state, q, k[:, :3], v[:, :3], mask=CAUSAL, scale=0.5, q_slice=slice(3, None))
    out, lse = fwd.finalize(state, torch.float32)
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3])) and torch.isinf(lse[..., :3]).all()
    assert not out.isnan().any() and lse.dtype == torch.float64 and out.dtype == torch.float32
    delta = (q * out.double()).sum(-1).transpose(1, 2)
    dq, dk, dv = TorchBackward().step(q, q, k, v, out.double(), lse, delta, mask=FULL, scale=0.5)
    assert not (dq.isnan().any() or dk.isnan().any() or dv.isnan().any())
    assert torch.equal(dq[:, :3], torch.zeros_like(dq[:, :3]))


def _qkv(h=4, hkv=2, d=16, s=4, dtype=torch.float64):
    return (torch.randn(1, s, h, d, dtype=dtype), torch.randn(1, s, hkv, d, dtype=dtype),
            torch.randn(1, s, hkv, d, dtype=dtype))


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(q=[1.0]), TypeError, r"`q` must be a torch.Tensor, got list"),
        (dict(q=_zeros(1, 4, 16)), ValueError,
         r"`q` must have 4 dims \(batch, local_seq, heads, head_dim\), got shape \(1, 4, 16\)"),
        (dict(k=_zeros(1, 4, 2, 16, dtype=torch.float32)), ValueError,
         r"same dtype, got q=torch.float64, k=torch.float32"),
        (dict(k=_zeros(1, 4, 2, 16, device="meta")), ValueError, r"same device, got q=cpu, k=meta"),
        (dict(q=_zeros(1, 4, 3, 16)), ValueError, r"heads \(3\) must be a multiple of kv_heads \(2\)"),
        (dict(k=_zeros(1, 4, 2, 8), v=_zeros(1, 4, 2, 8)), ValueError, r"same head_dim, got q: 16, k/v: 8"),
        (dict(v=_zeros(1, 4, 1, 16)), ValueError, r"k and v must have the same shape"),
        (dict(k=_zeros(1, 5, 2, 16), v=_zeros(1, 5, 2, 16)), ValueError, r"q's batch size and local sequence length"),
        (dict(q=_zeros(1, 4, 4, 16, dtype=torch.int64)), TypeError, r"`q` must be a floating-point tensor"),
        (dict(causal=1), TypeError, r"`causal` must be a bool, got int 1"),
        (dict(softmax_scale=float("nan")), ValueError, r"`softmax_scale` must be a finite float or None, got nan"),
        (dict(layout="ring"), ValueError, r"Invalid layout 'ring'. Must be one of"),
        (dict(backend="cuda"), ValueError,
         r"Invalid backend 'cuda'. Must be one of: 'auto', 'torch', 'triton', 'flash2', 'flash_attn'"),
        (dict(layout="zigzag", q=_zeros(1, 3, 4, 16), k=_zeros(1, 3, 2, 16), v=_zeros(1, 3, 2, 16)), ValueError,
         r"layout='zigzag' needs an even local sequence length .* got 3"),
        (dict(ring_size=2), ValueError, r"`ring_size`=2 must divide the group size 1"),
        (dict(backend="triton"), ValueError,
         r"backend='triton' on CPU \(interpreter\) supports float16, bfloat16 and float32, got torch.float64"),
    ],
)
def test_argument_validation(kwargs, exc, match):
    """Every bad argument raises a clear error naming it, before any kernel or communication runs."""
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v)
    args.update({n: kwargs.pop(n) for n in ("q", "k", "v") if n in kwargs})
    with pytest.raises(exc, match=match):
        da.ring_flash_attn(args["q"], args["k"], args["v"], **kwargs)


def test_triton_backend_rejects_unsupported_head_dim(monkeypatch):
    """A head_dim the Triton kernel cannot run is a ValueError naming the backend and the allowed head dims."""
    require("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = _qkv(d=20, dtype=torch.float32)
    match = r"backend='triton': head_dim=20 is not supported .*multiples of 8 from 16 to 256"
    with pytest.raises(ValueError, match=match):
        da.ring_flash_attn(q, k, v, backend="triton")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    """backend='triton' on CPU tensors without TRITON_INTERPRET=1 is a ValueError saying how to enable it."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _qkv(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"backend='triton' on CPU tensors runs only in the Triton interpreter"):
        da.ring_flash_attn(q, k, v, backend="triton")


def test_auto_backend_on_cpu_is_torch(monkeypatch):
    """backend='auto' picks the torch kernels for CPU tensors even with triton installed and TRITON_INTERPRET=1."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        name, fwd, bwd = _kernels.select_kernels("auto", torch.zeros(1, 2, 2, 64, dtype=dtype))
        assert name == "torch" and isinstance(fwd, TorchForward) and isinstance(bwd, TorchBackward)
    assert _kernels.resolve_backend("auto", torch.device("cuda"), torch.bfloat16)[0] in _kernels.AUTO_PREFERENCE
    assert _kernels.resolve_backend("auto", torch.device("cuda"), torch.float32)[0] == "torch"
    q, k, v = _qkv(dtype=torch.float16)
    out = da.ring_flash_attn(q, k, v, causal=True)
    ref = attention_reference(q, k, v, causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-3)


def test_flash_attn_backend_missing_package_is_import_error():
    """backend='flash_attn' without the package raises ImportError saying to install flash-attn."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("flash_attn is installed")
    q, k, v = _qkv(dtype=torch.float16)
    with pytest.raises(ImportError, match=r"pip install flash-attn"):
        da.ring_flash_attn(q, k, v, backend="flash_attn")


def test_import_needs_neither_triton_nor_flash_attn():
    """`import distcomm_attention` and a CPU call work on a machine where triton and flash_attn cannot be imported."""
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['flash_attn'] = None\n"
        "import torch, distcomm_attention as da\n"
        "q = torch.randn(1, 4, 2, 8)\n"
        "print(da.ring_flash_attn(q, q, q, causal=True).shape)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "torch.Size([1, 4, 2, 8])" in done.stdout


def test_ring_attention_module_validation():
    """RingAttention rejects bad head counts and layouts at construction, not at the first forward."""
    with pytest.raises(ValueError, match=r"`heads`=6 must be a multiple of `kv_heads`=4"):
        da.RingAttention(32, heads=6, kv_heads=4)
    with pytest.raises(ValueError, match=r"Invalid layout 'stripes'"):
        da.RingAttention(32, heads=4, layout="stripes")
    with pytest.raises(ValueError, match=r"`dim_head` must be a positive int, got 0"):
        da.RingAttention(32, heads=4, dim_head=0)
