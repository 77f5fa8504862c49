"""No host synchronisation on the hot path: after a call has planned and cached its device tensors, a
repeated context_parallel_attn forward + backward over NCCL runs under ``torch.cuda.set_sync_debug_mode
("warn")``, which reports most operations that make the host wait for the GPU (a blocking host-to-device
copy, ``.item()``, ``.tolist()``, ``torch.cuda.synchronize``); and, queued behind a GPU sleep of about two
seconds, it returns while the sleep still runs, which also catches what the debug mode does not see (a
host-to-device copy from pageable memory, which the driver may start only once the stream has drained: the
index tensors of 32k tokens are 256 KiB; and waits it missed on 2 x H100: fla's ``.item()`` in its state pass,
and an index put in the all-gather's backward). Marked ``gpu2``: run on the GPU machine."""

import contextlib
import cProfile
import os
import pstats
import traceback
import warnings

import pytest
import torch

from tests.dist_harness import run_world

for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")  # no NVLink multicast

STRATEGIES = ("ring", "allgather", "ulysses", "auto")
SEQ = 32768
CASES = [  # (name, layout, documents over the whole sequence, kv heads)
    ("dense causal zigzag", "zigzag", None, 2),
    ("packed balanced", "balanced", [0, 1600, 14400, 16000, 27200, SEQ], 2),
    ("kv heads replicated", "zigzag", None, 1),
]


def _rank(rank: int, world: int):
    from distcomm_attention import context_parallel_attn, shard_sequence

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    failures = []
    for name, layout, docs, kv_heads in CASES:
        g = torch.Generator(device=device).manual_seed(0)
        full = [torch.randn(1, SEQ, h, 64, device=device, dtype=torch.bfloat16, generator=g)
                for h in (4, kv_heads, kv_heads, 4)]
        cu = docs  # on the host, as the docs advise: a CUDA cu_seqlens is read back once per call
        q, k, v, dout = (shard_sequence(x, layout, cu_seqlens=cu).contiguous() for x in full)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        for strategy in STRATEGIES:
            def step():
                out = context_parallel_attn(q, k, v, strategy=strategy, causal=True, layout=layout, cu_seqlens=cu)
                out.backward(dout)

            step()  # plans, caches, kernel compilation
            failures += _never_waits(step, (), f"{name}, {strategy}")
    return failures


def _assert_no_rank_failed(rank_fn) -> None:
    """Run ``rank_fn`` on 2 GPUs over NCCL; every failure it returns, on any rank, fails the test."""
    per_rank = run_world(rank_fn, 2, backend="nccl", timeout=600)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not failures, "\n".join(failures)


@pytest.mark.gpu2
def test_repeated_calls_never_wait_for_the_gpu():
    _assert_no_rank_failed(_rank)


@contextlib.contextmanager
def _synchronizing_calls():
    """Collect every operation that makes the host wait for the GPU inside the block (``set_sync_debug_mode
    ("warn")``), each as the innermost frames of the library that made it; a list, filled on exit."""
    found = []

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if _ours(f.filename)][-5:]
            found.append(" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames)))

    # the mode switched on before the collection (a process's first switch reports a synchronization of its
    # own); the backward on this thread, so that a synchronizing call in it is seen with the frames that made it
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(), torch.autograd.set_multithreading_enabled(False):
            warnings.simplefilter("always")
            warnings.showwarning = show
            yield found
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _ours(filename: str) -> bool:
    """A frame of the library, of fla (the linear layers' kernels) or of this file."""
    name = filename.replace(os.sep, "/")
    return "distcomm" in name or "/fla/" in name or os.path.basename(name) == os.path.basename(__file__)


_LOADERS = ("/triton/compiler/", "/triton/runtime/", "/cutlass/", "/flash_attn/", "/tvm_ffi")


def _compiled(prof: cProfile.Profile) -> str:
    """What compiled or loaded a kernel in ``prof`` (the first call of a kernel specialisation does, and loading
    its binary waits for the GPU), with the seconds it took: Triton's binary loader and the top-level compile
    of Triton and of CuTe DSL (flash-attn-4), each only where it took over 50 ms (Triton runs other compiler
    functions on every launch); '' if nothing did."""
    names = []
    for (filename, _, name), (_, _, _, cumulative, _) in pstats.Stats(prof).stats.items():
        loads = "load_binary" in name
        compiles = name == "compile" and any(part in filename.replace(os.sep, "/") for part in _LOADERS)
        if (loads or compiles) and cumulative > 0.05:
            names.append(f"{os.path.basename(filename)}:{name} {cumulative:.2f} s")
    return ", ".join(sorted(names))


def _waited_in(prof: cProfile.Profile) -> str:
    """The three functions with the most own time in ``prof`` (one that waited for the GPU holds the wait),
    each with its callers in the library or this file."""
    stats = pstats.Stats(prof).stats
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:3]
    out = []
    for (filename, line, name), (_, _, own, _, callers) in top:
        by = ", ".join(f"{os.path.basename(c[0])}:{c[1]} {c[2]}" for c in callers if _ours(c[0]))
        out.append(f"{name} ({os.path.basename(filename)}:{line}) {own * 1e3:.0f} ms, called by [{by}]")
    return "; ".join(out)


def _never_waits(step, args, label: str, first_loads: bool = False) -> list[str]:
    """Run ``step(*args)`` queued behind a GPU sleep of about two seconds: what made the host wait (a
    synchronizing call, or returning only after the sleep ended), each a line naming ``label``. With
    ``first_loads``, a call that compiled or loaded a kernel (a new specialisation: loading its binary waits
    for the GPU, once per process) may return late: the list then holds one line starting "loaded" (only for
    a call that did return late)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e9))
    slept = torch.cuda.Event()
    slept.record()
    prof = cProfile.Profile()
    with _synchronizing_calls() as found:
        prof.enable()
        step(*args)
        waited = slept.query()  # the host reached here only after the sleep ended
        prof.disable()
    failures = [f"{label}: a synchronizing call at {where}" for where in dict.fromkeys(found)]
    compiled = _compiled(prof) if waited else ""
    if first_loads and compiled:
        failures.append(f"loaded: {compiled}")
    elif waited:
        failures.append(f"{label}: the call returned after a queued GPU sleep ended (it waited for the GPU"
                        f"{'; it compiled or loaded a kernel: ' + compiled if compiled else ''}); most own time: "
                        f"{_waited_in(prof)}")
    torch.cuda.synchronize()
    return failures


def _new_documents_never_wait(step, warm: list, timed: list, label: str) -> list[str]:
    """Run the ``warm`` calls, then each of the ``timed`` ones (documents none of them had) behind a GPU sleep:
    none may make a synchronizing call; one may return late only if it loaded a kernel specialisation the
    earlier calls did not need, and at most half of them do."""
    for call in warm:
        step(*call)
    found = [f for call in timed for f in _never_waits(step, call, f"{label}, new documents", first_loads=True)]
    loaded = [f for f in found if f.startswith("loaded")]
    failures = [f for f in found if not f.startswith("loaded")]
    if len(loaded) > len(timed) // 2:
        failures.append(f"{label}: {len(loaded)} of {len(timed)} calls with new documents compiled or loaded a "
                        f"kernel: {loaded}")
    return failures


def _documents(rng: "torch.Generator", count: int, seq: int = SEQ, align: int = 64) -> list[int]:
    """Boundaries of ``count`` documents of random lengths over ``seq`` tokens (host ints), multiples of
    ``align``: the kernels' specialisations on their integer arguments (Triton's on divisibility by 16) are
    mostly those of the warm-up calls, so that few timed calls load a new one."""
    cuts = (torch.randperm(seq // align - 1, generator=rng)[:count - 1] + 1) * align
    return [0, *sorted(int(c) for c in cuts), seq]


def _new_documents_rank(rank: int, world: int):
    """Every call has documents it has not seen (a new plan: masks, indices and sharding built and copied to
    the GPU on that call), and still returns while a queued GPU sleep runs, unless it compiled or loaded a
    kernel (a specialisation the earlier calls did not need: once per process); most calls do not."""
    from distcomm_attention import context_parallel_attn, shard_sequence

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    rng = torch.Generator().manual_seed(1)  # the same documents on every rank
    failures = []
    for layout in ("balanced", "zigzag"):
        for strategy in STRATEGIES:
            calls = []
            for count in (7, 9, 13, 9, 5, 12, 8, 11, 6, 10):  # four warm-up calls, then six timed ones
                cu = _documents(rng, count)
                g = torch.Generator(device=device).manual_seed(count)
                full = [torch.randn(1, SEQ, h, 64, device=device, dtype=torch.bfloat16, generator=g)
                        for h in (4, 2, 2, 4)]
                q, k, v, dout = (shard_sequence(x, layout, cu_seqlens=cu).contiguous() for x in full)
                calls.append((cu, q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout))

            def step(cu, q, k, v, dout):
                out = context_parallel_attn(q, k, v, strategy=strategy, causal=True, layout=layout, cu_seqlens=cu)
                out.backward(dout)

            failures += _new_documents_never_wait(step, calls[:4], calls[4:], f"{layout}, {strategy}")
    return failures


@pytest.mark.gpu2
def test_calls_with_new_documents_never_wait_for_the_gpu():
    _assert_no_rank_failed(_new_documents_rank)


def _linear_rank(rank: int, world: int, device_type: str = "cuda"):
    """The linear layers of a hybrid model (the conv with its halo, the gated delta rule by fla's kernels) on
    calls with the same documents and with new ones: neither waits for the GPU. Forward + backward where
    fla's backward runs on this machine, else the forward (``fla_backward_problem``). PyTorch's chunked kernel,
    the reference, launches thousands of small kernels per call: queued behind a sleep its launches fill the
    GPU's queue and the host waits by design, so it is not what this checks."""
    from distcomm_attention import shard_sequence
    from distcomm_attention.linear import causal_conv1d_cp, chunk_gated_delta_rule_cp
    from distcomm_attention.linear.kernels import fla_backward_problem

    device = torch.device(device_type, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    seq, heads, value_heads, dim, width = 8192, 4, 8, 64, 4
    rng = torch.Generator().manual_seed(2)  # the same documents on every rank
    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=device, generator=g)  # noqa: E731
    backward = device_type != "cuda" or fla_backward_problem(device) is None
    kernel = "fla" if device_type == "cuda" else "torch"
    conv_w = rnd(heads * dim, width).requires_grad_(backward)
    failures = []
    for layout in ("zigzag", "balanced"):
        def inputs(cu):
            x = rnd(1, seq, heads * dim).to(torch.bfloat16)
            v, gate, beta = rnd(1, seq, value_heads, dim), rnd(1, seq, value_heads), rnd(1, seq, value_heads)
            shard = lambda t: shard_sequence(t, layout, cu_seqlens=cu).contiguous()  # noqa: E731
            return (cu, shard(x).requires_grad_(backward), shard(v.to(torch.bfloat16)).requires_grad_(backward),
                    shard(torch.nn.functional.logsigmoid(gate)), shard(beta.sigmoid()))

        def step(cu, x, v, gate, beta):
            h = causal_conv1d_cp(x, conv_w, activation="silu", cu_seqlens=cu, layout=layout)
            qk = h.reshape(1, -1, heads, dim)
            out, _ = chunk_gated_delta_rule_cp(qk, qk, v, gate, beta, cu_seqlens=cu, layout=layout,
                                               use_qk_l2norm_in_kernel=True, kernel=kernel)
            if backward:
                out.float().square().mean().backward()

        same = inputs(_documents(rng, 5, seq))
        for call in (same, same):
            step(*call)
        failures += _never_waits(step, same, f"{layout}, same documents")
        new = [inputs(_documents(rng, count, seq)) for count in (6, 9, 4, 11, 7, 3, 8)]
        failures += _new_documents_never_wait(step, new[:3], new[3:], layout)
    return failures


@pytest.mark.gpu2
def test_linear_layers_never_wait_for_the_gpu():
    pytest.importorskip("fla", reason="the linear layers' GPU kernels are fla-core's")
    _assert_no_rank_failed(_linear_rank)


def _scalar_decay_rank(rank: int, world: int):
    """The scalar decay (Mamba-2 SSD) by fla's kernels, forward (its backward does not run on Hopper with
    Triton 3.6), a repeated call per case: contiguous shards without documents, then zigzag shards and
    contiguous shards, both with documents (boundaries on both ranks). Returns each case's failures, in order."""
    from distcomm_attention import shard_sequence
    from distcomm_attention.linear import chunk_simple_gla_cp

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    seq, heads, value_heads, dim = 8192, 2, 8, 64
    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=device, generator=g)  # noqa: E731
    full = (rnd(1, seq, heads, dim).to(torch.bfloat16), rnd(1, seq, heads, dim).to(torch.bfloat16),
            rnd(1, seq, value_heads, dim).to(torch.bfloat16), -torch.nn.functional.softplus(rnd(1, seq, value_heads)))
    out = []
    # every rank runs the same kernels in each case (boundaries on both ranks: pieces of unequal lengths, which
    # go to fla as one varlen call; equal ones go as batch rows): fla autotunes on first use, in step on every rank
    for layout, cu in (("contiguous", None), ("zigzag", [0, 1000, 3000, seq]),
                       ("contiguous", [0, 1000, 5000, 5100, seq])):
        q, k, v, gate = (shard_sequence(t, layout, cu_seqlens=cu).contiguous() for t in full)

        def step():
            chunk_simple_gla_cp(q, k, v, gate, cu_seqlens=cu, layout=layout, kernel="fla")

        step(), step()
        out.append(_never_waits(step, (), f"rank {rank}, {layout}, documents {cu}"))
    return out


def _waited_first_in_fla(failure: str) -> bool:
    """Whether a failure of ``_never_waits`` is a call that returned late with fla's ``.item()`` in its state
    pass (``chunk_h.py``) holding the most own time, i.e. the first wait, there."""
    if "returned after a queued GPU sleep" not in failure or "most own time: " not in failure:
        return False
    top = failure.split("most own time: ", 1)[1].split("; ")[0]
    return top.startswith("<method 'item'") and "chunk_h.py" in top


def _reported_in_fla(failure: str) -> bool:
    """Whether a failure of ``_never_waits`` is the debug mode's report of a synchronizing call whose innermost
    frame is fla's state pass (``chunk_h.py``)."""
    return ": a synchronizing call at chunk_h.py:" in failure


@pytest.mark.gpu2
def test_scalar_decay_waits_only_where_fla_takes_boundaries():
    """Without boundaries the scalar decay never waits. With them (documents cutting a rank's tokens into pieces
    of unequal lengths) every call waits, and the first wait is fla-core's state pass reading its chunk count
    back with ``.item()`` (docs/hybrid.md, Limits; a later wait cannot be seen once the queue has drained); the
    debug mode may report that wait too (it did on 2 x H100 with fla-core 0.6.0), and reports nothing else.
    When fla stops waiting this test fails and the limit is to be struck from the docs."""
    pytest.importorskip("fla", reason="the linear layers' GPU kernels are fla-core's")
    per_rank = run_world(_scalar_decay_rank, 2, backend="nccl", timeout=600)
    plain = [f for cases in per_rank for f in cases[0]]
    assert not plain, "\n".join(plain)
    for cases in per_rank:
        for case in cases[1:]:  # the late return, and the debug mode's reports of the same wait, if any
            late = [f for f in case if "returned after a queued GPU sleep" in f]
            assert len(late) == 1 and _waited_first_in_fla(late[0]), case or "a call with boundaries did not wait"
            assert all(_reported_in_fla(f) for f in case if f not in late), case


def _sparse_pieces_rank(rank: int, world: int):
    """The sparse all-gather's exchange by direct pieces over NCCL (k, v forward, fp32 gradients back), behind
    a GPU sleep: no host wait; the buffer and the summed gradients against float64 sums on the host."""
    from distcomm_attention.planning import layouts
    from distcomm_attention.planning.exchange import exchange_plan
    from distcomm_attention.planning.visibility import Visibility
    from distcomm_attention.strategies.sparse_gather import SparseGather
    from distcomm_attention.transport import TorchTransport

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    n, seq = 4096, 4096 * world
    vis = Visibility(True, (-1, -1), (0, 1000, 5000, 6000, seq), False)
    ex = exchange_plan("zigzag", vis, world, n)
    pos = layouts.positions("zigzag", seq, world, rank)
    full = torch.randn(1, seq, 2, 64, generator=torch.Generator().manual_seed(3))
    x = full[:, pos].to(device, torch.bfloat16)
    sparse = SparseGather(TorchTransport(), ex, "zigzag")
    failures = [] if sparse.pieces is not None else ["the case does not take the direct pieces"]
    weight = torch.randn(1, sparse.buffer_len, 2, 64, generator=torch.Generator().manual_seed(10 + rank))
    w = weight.to(device)
    sparse.scatter_add(w, n)  # first use: plans, caches
    got = {}

    def step():
        (got["buffer"],) = sparse.gather(x)
        got["grad"] = sparse.scatter_add(w, n)

    failures += _never_waits(step, (), "sparse gather by pieces")
    needed = torch.tensor([p for a, b in ex.union[rank] for p in range(a, b)], dtype=torch.int64)
    if not torch.equal(got["buffer"].cpu(), full[:, needed].to(torch.bfloat16)):
        failures.append("the gathered buffer differs from the needed keys")
    return failures, weight, got["grad"].cpu()


@pytest.mark.gpu2
def test_sparse_gather_pieces_never_wait():
    """Direct pieces over NCCL's batched point-to-point transfers: the right rows, no host wait, and every
    rank's gradient is the float64 sum of the ranks' weights over the keys they hold."""
    from distcomm_attention.planning import layouts
    from distcomm_attention.planning.exchange import exchange_plan
    from distcomm_attention.planning.visibility import Visibility

    world, n = 2, 4096
    per_rank = run_world(_sparse_pieces_rank, world, backend="nccl", timeout=300)
    seq = world * n
    ex = exchange_plan("zigzag", Visibility(True, (-1, -1), (0, 1000, 5000, 6000, seq), False), world, n)
    total = torch.zeros(1, seq, 2, 64, dtype=torch.float64)
    for r, (_, weight, _) in enumerate(per_rank):
        needed = torch.tensor([p for a, b in ex.union[r] for p in range(a, b)], dtype=torch.int64)
        total[:, needed] += weight.double()
    failures = [f"rank {r}: {f}" for r, (fs, _, _) in enumerate(per_rank) for f in fs]
    for r, (_, _, grad) in enumerate(per_rank):
        want = total[:, layouts.positions("zigzag", seq, world, r)]
        if not torch.allclose(grad.double(), want, rtol=1e-6, atol=1e-6):
            failures.append(f"rank {r}: gradient off by {(grad.double() - want).abs().max():.3e}")
    assert not failures, "\n".join(failures)
