"""Layer 4 (one GPU, marked ``gpu``): an emulated link changes when a simulated rank's data arrives, never the
numbers it computes (Note [Emulated links]).

scripts/bench_emulated.py times each strategy's simulated rank (``rank_step``: the ring, the sparse ring, the
dense and the sparse all-gather, Ulysses with and without its head-group pipeline and in halves, the hybrids
around a ring and a dense or sparse all-gather) on ``EmulatedLink``s:
every transfer runs on a side stream behind a sleep of its link time, and the rank's stream waits for it
where the real code waits for NCCL. A wait in the wrong place, or a buffer reused before the link has read
it, shows only when transfers take time. So each rank runs twice with the Triton kernels (on every CUDA
install of torch, and deterministic), once on ``InstantLink`` (the same data, made at once on the rank's
stream) and once on an emulated link, and out, dq, dk, dv must be bitwise equal. Two links: NVLink-class,
as the benchmark runs them, and a slow one (1 GB/s, 200 us) on which every transfer outlasts the compute it
overlaps. Deterministic algorithms are on for both runs, because ``index_add_`` (the sparse all-gather's
dK/dV, Ulysses' replicated kv heads) otherwise adds in any order on CUDA.

The cases (W = 4, rank 3, S = 4096, heads 8 / 2, head_dim 128, bf16, causal) and the paths the strategies
take on them (``PATHS``; tests/test_emulated.py checks the table and runs the same ranks on CPU):

    causal          one sequence, zigzag                 ring, all-gather, Ulysses (3 ways), the hybrids
    packed zigzag   7 documents ("pareto"), zigzag       sparse ring, sparse all-gather, Ulysses (3 ways),
                                                         the hybrids sparse (ring dimension, all-gather)
    packed auto     the same documents, the layout       ring, sparse all-gather, Ulysses (3 ways),
                    bench_emulated.py gives them         the hybrids sparse (ring dimension, all-gather)
                    ("auto": contiguous here)

The hybrids (Ulysses of DEGREE = 2 around 2 rings) plan the layout over the ring dimension.

The kernels are the project's Triton ones, chosen by name: "auto" would take flash-attn-4 where it is
installed, whose backward may accumulate dQ with atomic adds (then not bitwise the same from run to run).
"""

import contextlib

import pytest
import torch

from distcomm_attention.kernels import dispatch
from distcomm_attention.transport.emulated import NVLINK, EmulatedLink, InstantLink, Links
from tests.scripts import import_script

pytestmark = pytest.mark.gpu

SEQ, WORLD, RANK, HEADS, KV_HEADS, HEAD_DIM = 4096, 4, 3, 8, 2, 128
DEGREE = 2  # the hybrids' Ulysses degree: 2 rings of 2; the timed rank is ring rank RANK // DEGREE
CASES = {  # name: (document mix of scripts/bench_strategies.py, layout)
    "causal": ("one", "zigzag"),
    "packed zigzag": ("pareto", "zigzag"),
    "packed auto": ("pareto", "auto"),
}
STRATEGIES = ("ring", "allgather", "ulysses", "ulysses_halves", "ulysses_pipelined", "hybrid", "hybrid_allgather")
PATHS = {
    "causal": ("ring", "allgather", "ulysses", "ulysses_halves", "ulysses_pipelined", "hybrid", "hybrid_allgather"),
    "packed zigzag": ("sparse_ring", "sparse_allgather", "ulysses", "ulysses_halves", "ulysses_pipelined",
                      "hybrid_sparse", "hybrid_sparse_allgather"),
    "packed auto": ("ring", "sparse_allgather", "ulysses", "ulysses_halves", "ulysses_pipelined", "hybrid_sparse",
                    "hybrid_sparse_allgather"),
}
LINKS = {"nvlink": NVLINK, "slow": Links(1.0, 1.0, 1.0, 1.0, latency_us=200.0)}


def _bench():
    return import_script("bench_emulated")


def simulated_rank(strategy: str, make_link, mix: str, layout: str, *, device, dtype, backend: str, seq: int = SEQ,
                   head_dim: int = HEAD_DIM):
    """Rank RANK of WORLD running ``strategy`` once, forward and backward, on a causal row of ``seq`` tokens
    (``mix``, ``layout`` as scripts/bench_emulated.py plans them) over links ``make_link(size, rank)``, their
    bytes counted, on random shards (seed 0): q, dout (1, n, HEADS, head_dim), k, v (1, n, KV_HEADS,
    head_dim) -> (path taken, (out, dq, dk, dv), the counting transports). The hybrids run Ulysses rank 0 of
    DEGREE on ring rank RANK // DEGREE, as the benchmark times them."""
    path, step, sent = simulated_step(strategy, make_link, mix, layout, device=device, dtype=dtype, backend=backend,
                                      seq=seq, head_dim=head_dim)
    return path, step(), sent


def simulated_step(strategy: str, make_link, mix: str, layout: str, *, device, dtype, backend: str, seq: int = SEQ,
                   head_dim: int = HEAD_DIM):
    """``simulated_rank``'s (path, the step itself, the counting transports), the step not yet run."""
    be = _bench()
    hybrid = strategy.startswith("hybrid")
    _, vis, concrete = be.plan_case(seq, WORLD // DEGREE if hybrid else WORLD, mix, layout)
    n = seq // WORLD
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(1, n, h, head_dim, generator=g, device=device, dtype=dtype)
                     for h in (HEADS, KV_HEADS, KV_HEADS, HEADS))
    _, fwd, bwd = dispatch.select_kernels(backend, q, vis, 0.0)
    scale = head_dim ** -0.5
    if hybrid:
        sent = (be._Sent(make_link(DEGREE, 0)), be._Sent(make_link(WORLD // DEGREE, RANK // DEGREE)))
        path, step = be.rank_step(strategy, sent[0], q, k, v, dout, concrete, vis, WORLD, RANK // DEGREE, fwd, bwd,
                                  scale, degree=DEGREE, t_ring=sent[1])
    else:
        sent = (be._Sent(make_link(WORLD, RANK)),)
        path, step = be.rank_step(strategy, sent[0], q, k, v, dout, concrete, vis, WORLD, RANK, fwd, bwd, scale)
    return path, step, sent


@pytest.mark.parametrize("strategy", ("ring", "allgather", "ulysses", "hybrid", "hybrid_allgather"))
@pytest.mark.parametrize("case", CASES)
def test_repeated_call_never_waits_for_the_gpu(case, strategy):
    """A simulated rank's repeated call, queued behind a long GPU sleep, returns while the sleep still runs:
    nothing in it waits for the GPU. This also catches what ``torch.cuda.set_sync_debug_mode`` does not see,
    such as a host-to-device copy from pageable memory (the driver may wait for the stream before it copies;
    64k tokens, so that the all-gather's order index is 512 KiB)."""
    mix, layout = CASES[case]
    path, step, _ = simulated_step(strategy, lambda size, rank: EmulatedLink(size, rank, NVLINK), mix, layout,
                                   device=torch.device("cuda"), dtype=torch.bfloat16, backend="triton", seq=65536)
    step()
    step()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # about a second
    slept = torch.cuda.Event()
    slept.record()
    step()
    waited = slept.query()  # True only if the host reached here after the sleep ended
    torch.cuda.synchronize()
    assert not waited, f"{strategy} ({path}, {case}) waited for the GPU"


@contextlib.contextmanager
def _deterministic():
    """Deterministic algorithms (warning where an operation has none) without filling new memory with NaN,
    restored afterwards."""
    mode = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


@pytest.mark.parametrize("link_name", LINKS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", CASES)
def test_emulated_link_changes_no_bit(case, strategy, link_name):
    """A simulated rank's out and gradients on an emulated link are bitwise those with the same transfers made
    at once, and the link spent time: its streams, events and waits put every read after its write."""
    mix, layout = CASES[case]
    run = dict(device=torch.device("cuda"), dtype=torch.bfloat16, backend="triton")
    links = []

    def emulated_link(size, rank):
        links.append(EmulatedLink(size, rank, LINKS[link_name]))
        return links[-1]

    with _deterministic():
        path, instant, sent_instant = simulated_rank(strategy, InstantLink, mix, layout, **run)
        path_emulated, emulated, sent = simulated_rank(strategy, emulated_link, mix, layout, **run)
        torch.cuda.synchronize()
    assert path == path_emulated == PATHS[case][STRATEGIES.index(strategy)]
    assert all(s.total > 0 and s.sent == i.sent for s, i in zip(sent, sent_instant, strict=True))
    assert all(link.seconds > 0 for link in links)
    for name, a, b in zip(("out", "dq", "dk", "dv"), instant, emulated):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.isfinite(a).all(), f"{name}: not finite with the instant link"
        assert torch.equal(a, b), (f"{name}: {int((a != b).sum())} of {a.numel()} elements differ, "
                                   f"max |diff| {float((a.float() - b.float()).abs().max()):.3g}")
