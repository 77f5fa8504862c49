"""Exchange plans and the transports (Note [Exchange plan], Note [Transport], Note [Sparse gather]).

Layered, cheapest first:
1. pure functions: the plan against a brute-force count of visible pairs (every layout, documents, windows);
   zero traffic for documents that stay on one rank; the compacted plan's blocks;
2. gloo worlds of 1-4 ranks: the torch transport's operations against the data they must move (empty
   pieces included); the sparse gather and its adjoint against a float64 reference built from the whole
   sequence; the counting transport's bytes equal to the plan's.
"""

import random

import pytest
import torch

from distcomm_attention.planning import balance, layouts
from distcomm_attention.planning.exchange import compact_plan, exchange_plan
from distcomm_attention.planning.plans import gathered_plan
from distcomm_attention.planning.visibility import Visibility
from tests.dist_harness import run_world
from tests.counting import max_diff


def _visible(vis: Visibility, seq_len: int) -> torch.Tensor:
    """(seq_len, seq_len) bool: query i sees key j, straight from the definition."""
    i = torch.arange(seq_len)[:, None]
    j = torch.arange(seq_len)[None, :]
    ok = torch.ones(seq_len, seq_len, dtype=torch.bool)
    if vis.causal:
        ok &= j <= i
    if vis.window[0] >= 0:
        ok &= i - j <= vis.window[0]
    if vis.window[1] >= 0:
        ok &= j - i <= vis.window[1]
    if vis.cu_seqlens is not None:
        doc = torch.bucketize(torch.arange(seq_len), torch.tensor(vis.cu_seqlens[1:]), right=True)
        ok &= doc[:, None] == doc[None, :]
    return ok


def _random_docs(rng, seq_len):
    cuts = sorted(rng.sample(range(1, seq_len), rng.randint(0, 6)))
    return tuple([0] + cuts + [seq_len])


def _case_rng(layout, world, local_len) -> random.Random:
    """The random cases of one parametrisation, the same in every process: seeded by a string (hashed with
    SHA-512 by ``random``), not by ``hash()``, which PYTHONHASHSEED salts for str."""
    return random.Random(f"{layout}-{world}-{local_len}")


CASES = [(layout, w, n) for layout in ("contiguous", "zigzag", "striped", "balanced") for w, n in ((2, 8), (3, 6), (4, 4))]


@pytest.mark.parametrize("layout, world, local_len", CASES)
def test_plan_is_exactly_the_rows_some_query_sees(layout, world, local_len):
    """need[s][d] holds a row of s exactly when some query of d sees that key (brute force over all pairs),
    for random documents, windows and causal/full masks."""
    rng = _case_rng(layout, world, local_len)
    seq_len = world * local_len
    for _ in range(6):
        docs = _random_docs(rng, seq_len) if rng.random() < 0.7 else None
        window = (rng.choice([-1, 0, 1, 3]), rng.choice([-1, 0, 2]))
        vis = Visibility(rng.random() < 0.5, window, docs)
        if layout == "zigzag" and local_len % 2:
            continue
        concrete = balance.resolve(layout, seq_len, world, docs) if layout == "balanced" else layout
        ex = exchange_plan(concrete, vis, world, local_len)
        seen = _visible(vis, seq_len)
        pos = [layouts.positions(concrete, seq_len, world, r) for r in range(world)]
        for d in range(world):  # the union: every key position some query of d sees
            union = [p for a, b in ex.union[d] for p in range(a, b)]
            assert union == seen[pos[d]].any(0).nonzero().flatten().tolist(), (vis, d)
        for s in range(world):
            for d in range(world):
                wanted = seen[pos[d]][:, pos[s]].any(0).nonzero().flatten().tolist()
                got = [i for a, b in ex.need[s][d] for i in range(a, b)]
                assert got == wanted, (vis, s, d, got, wanted)


def test_random_cases_are_the_same_in_every_process():
    """The random cases above do not depend on PYTHONHASHSEED (random in every process unless set): two
    processes with different hash seeds draw the same ones."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "from tests.test_exchange import CASES, _case_rng; print([_case_rng(*c).random() for c in CASES])"
    drawn = [subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONHASHSEED": seed},
                            capture_output=True, text=True, check=True, timeout=120).stdout for seed in ("1", "2")]
    assert drawn[0] == drawn[1] and drawn[0].startswith("["), drawn


def test_documents_on_one_rank_move_nothing():
    """Documents that never cross a rank boundary need no remote key: the plan says so (zero traffic)."""
    vis = Visibility(True, (-1, -1), (0, 3, 8, 12, 16, 20, 24, 32))
    ex = exchange_plan("contiguous", vis, 4, 8)
    assert ex.moves_nothing and all(ex.remote_rows(r) == (0, 0) for r in range(4))
    crossing = exchange_plan("contiguous", Visibility(True, (-1, -1), (0, 3, 9, 32)), 4, 8)
    assert not crossing.moves_nothing
    # rank 1 (positions 8-15) receives document [3, 9)'s keys 3-7 and sends keys 9-15 of [9, 32) to ranks 2, 3
    assert crossing.remote_rows(1) == (7 + 7, 5)


def test_compacted_plan_reads_the_same_keys():
    """Every block of the compacted plan reads, from the compacted buffer, the same global key positions as the
    gathered plan reads from the whole sequence."""
    vis = Visibility(True, (5, -1), (0, 7, 20, 32))
    for layout in ("contiguous", "zigzag"):
        ex = exchange_plan(layout, vis, 4, 8)
        for r in range(4):
            plan = gathered_plan(layout, vis, 4, r, 8)
            compact = compact_plan(plan, ex, r)
            needed = [p for a, b in ex.union[r] for p in range(a, b)]
            for full, small in zip(plan.blocks[0], compact.blocks[0]):
                assert needed[small.kv] == list(range(full.kv.start, full.kv.stop))
                assert (full.q, full.mode) == (small.q, small.mode)


# ------------------------------------------------------------------------------------------------------
# 2. gloo worlds
# ------------------------------------------------------------------------------------------------------


def _transport_rank(rank, world):
    from distcomm_attention.transport import TorchTransport

    t = TorchTransport()
    out = {}
    x = torch.arange(6, dtype=torch.float64).view(3, 2) + 10 * rank
    out["gather"] = t.all_gather(x).wait()[0]
    out["reduce"] = t.reduce_scatter(torch.ones(world * 2, 3, dtype=torch.float64) * (rank + 1)).wait()[0]
    # rank r sends (r + d) % 3 rows to rank d: some pieces empty
    splits = [(rank + d) % 3 for d in range(world)]
    recv = [(s + rank) % 3 for s in range(world)]
    send = torch.cat([torch.full((splits[d], 2), float(100 * rank + d)) for d in range(world)])
    out["a2a"] = t.all_to_all_v(send, splits, recv).wait()[0]
    out["empty"] = t.all_to_all_v(torch.zeros(0, 2), [0] * world, [0] * world).wait()[0].shape[0]
    # rank 0 sends nothing at all while the others send it a row each
    send = torch.zeros(0, 2) if rank == 0 else torch.full((1, 2), float(rank))
    mixed = t.all_to_all_v(send, [0] * world if rank == 0 else [1] + [0] * (world - 1),
                           [0] + [1] * (world - 1) if rank == 0 else [0] * world).wait()[0]
    out["mixed"] = mixed
    (hop,) = t.send_recv([x], 1).wait()
    out["hop"] = hop
    # exchange: rank r sends rank d (d != r) (r + d) % 3 pieces, piece i of i + 1 rows, each received into its
    # slice of one buffer; a rank whose pairs have no pieces sends and receives nothing
    sends = [(d, torch.full((i + 1, 2), float(100 * rank + 10 * d + i))) for d in range(world) if d != rank
             for i in range((rank + d) % 3)]
    slices = [(src, i + 1) for src in range(world) if src != rank for i in range((src + rank) % 3)]
    buffer = torch.full((sum(n for _, n in slices) + 1, 2), -1.0)  # one row more: left as it was
    recvs, row = [], 0
    for src, n in slices:
        recvs.append((src, buffer[row:row + n]))
        row += n
    filled = t.exchange(sends, recvs).wait()
    out["exchange"] = buffer
    out["filled_views"] = len(filled) == len(recvs) and all(a is b for a, (_, b) in zip(filled, recvs))
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_torch_transport_moves_what_it_says(world):
    """all_gather, reduce_scatter, all_to_all_v (pieces of 0-2 rows, an exchange of nothing) and ring hops
    deliver exactly the rows the definition names, on every rank."""
    got = run_world(_transport_rank, world, timeout=60)
    for r, g in enumerate(got):
        expected = torch.cat([torch.arange(6, dtype=torch.float64).view(3, 2) + 10 * s for s in range(world)])
        assert torch.equal(g["gather"], expected)
        assert torch.equal(g["reduce"], torch.full((2, 3), float(sum(range(1, world + 1))), dtype=torch.float64))
        want = torch.cat([torch.full(((s + r) % 3, 2), float(100 * s + r)) for s in range(world)])
        assert torch.equal(g["a2a"], want)
        assert g["empty"] == 0
        expected_mixed = torch.tensor([[float(s)] * 2 for s in range(1, world)]) if r == 0 else torch.zeros(0, 2)
        assert torch.equal(g["mixed"], expected_mixed.reshape(-1, 2))
        left = (r - 1) % world
        assert torch.equal(g["hop"], torch.arange(6, dtype=torch.float64).view(3, 2) + 10 * left)
        want = [torch.full((i + 1, 2), float(100 * s + 10 * r + i)) for s in range(world) if s != r
                for i in range((s + r) % 3)]
        assert torch.equal(g["exchange"], torch.cat(want + [torch.full((1, 2), -1.0)]))
        assert g["filled_views"]


class _FourOps:
    """A transport with Note [Transport]'s operations before ``exchange`` (one a user may have installed)."""

    def __init__(self, inner):
        self.size, self.rank = inner.size, inner.rank
        for op in ("send_recv", "all_to_all_v", "all_gather", "reduce_scatter"):
            setattr(self, op, getattr(inner, op))


def _sparse_rank(rank, world, layout, vis_args, local_len, max_runs, max_pieces, batch=2, four_ops=False):
    from distcomm_attention.strategies import sparse_gather
    from distcomm_attention.strategies.sparse_gather import SparseGather
    from distcomm_attention.transport import CountingTransport, TorchTransport

    vis = Visibility(*vis_args)
    seq_len = world * local_len
    concrete = balance.resolve(layout, seq_len, world, vis.cu_seqlens) if layout == "balanced" else layout
    ex = exchange_plan(concrete, vis, world, local_len)
    full = _sparse_full(batch, seq_len)
    pos = layouts.positions(concrete, seq_len, world, rank)
    # a counting transport over one without ``exchange``: counted, and still without it
    counting = CountingTransport(_FourOps(TorchTransport()) if four_ops else TorchTransport())
    sparse_gather.MAX_RUNS = max_runs  # 0: own rows by index gather and scatter, not by runs
    sparse_gather.MAX_PIECES = max_pieces  # 0: the all-to-all-v, not direct pieces
    sparse = SparseGather(counting, ex, concrete)
    if max_runs == 0 or layout != "striped":  # (a striped shard's own rows may form more runs than allowed)
        assert (sparse.own_runs is None) == (max_runs == 0)
    (buffer,) = sparse.gather(full[:, pos])
    # gradient of sum(buffer * weight_r) over ranks: each key gets the sum of weights of the ranks holding it
    weight = torch.randn(buffer.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    grad = sparse.scatter_add(weight, local_len)
    return {"buffer": buffer, "weight": weight, "grad": grad, "sent": counting.total, "calls": dict(counting.calls),
            "direct": sparse.pieces is not None}


def _sparse_full(batch, seq_len):
    return torch.randn(batch, seq_len, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))


SPARSE = [  # (layout, visibility, world, local rows, direct pieces where at most 64 are allowed)
    ("contiguous", (True, (-1, -1), (0, 5, 13, 24)), 3, 8, True),
    ("zigzag", (True, (-1, -1), None), 4, 4, True),
    ("contiguous", (False, (2, 2), None), 3, 6, True),
    ("balanced", (True, (-1, -1), (0, 2, 9, 10, 24)), 3, 8, True),
    ("contiguous", (True, (-1, -1), (0, 8, 16, 24)), 3, 8, False),  # documents on one rank each: nothing moves
    ("contiguous", (True, (-1, -1), (0, 8, 24)), 3, 8, False),  # rank 0 has no piece: the all-to-all-v
    ("striped", (True, (-1, -1), (0, 5, 13, 24)), 3, 8, True),  # pieces of one row
    ("striped", (True, (-1, -1), None), 4, 24, False),  # more pieces than allowed: the all-to-all-v
]


def _check_sparse(got, layout, vis_args, world, local_len, batch, op):
    """Every rank's buffer, bytes, operations (``op`` posted twice where anything moves) and gradient against
    the float64 reference over the whole sequence."""
    vis = Visibility(*vis_args)
    seq_len = world * local_len
    concrete = balance.resolve(layout, seq_len, world, vis.cu_seqlens) if layout == "balanced" else layout
    ex = exchange_plan(concrete, vis, world, local_len)
    full = _sparse_full(batch, seq_len)
    total_grad = torch.zeros_like(full)
    for r, g in enumerate(got):
        needed = torch.tensor([p for a, b in ex.union[r] for p in range(a, b)], dtype=torch.int64)
        assert torch.equal(g["buffer"], full[:, needed])
        total_grad[:, needed] += g["weight"]
        row_bytes = batch * 3 * 4 * 8
        sent, received = ex.remote_rows(r)
        assert g["sent"] == (sent + received) * row_bytes  # its rows forward, the received rows' gradients back
        assert g["direct"] == (op == "exchange")
        assert g["calls"] == ({} if ex.moves_nothing else {op: 2})
    for r, g in enumerate(got):
        pos = layouts.positions(concrete, seq_len, world, r)
        torch.testing.assert_close(g["grad"], total_grad[:, pos], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("max_runs, max_pieces, batch", [(16, 64, 2), (0, 64, 2), (16, 0, 2), (0, 0, 2), (16, 64, 1)])
@pytest.mark.parametrize("layout, vis_args, world, local_len, direct", SPARSE)
def test_sparse_gather_and_its_adjoint(layout, vis_args, world, local_len, direct, max_runs, max_pieces, batch):
    """Rank r's buffer holds exactly the keys at the positions it needs (in natural order), its gradient is
    every rank's contribution to the rows it holds (float64 reference over the whole sequence), and the bytes
    it sends are the plan's (rows x row size; zero, and no exchange posted, when nothing crosses a rank); the
    own rows moved by runs of slice copies and by index gather and scatter alike, the others' rows by direct
    pieces (views of the shard at batch 1, copies at 2) and by an all-to-all-v alike."""
    got = run_world(_sparse_rank, world, layout, vis_args, local_len, max_runs, max_pieces, batch, timeout=60)
    _check_sparse(got, layout, vis_args, world, local_len, batch,
                  "exchange" if direct and max_pieces else "all_to_all_v")


def _random_plans(world, local_len, count, seed):
    """(layout, visibility) of ``count`` random calls: documents cut at random (some of one token, some
    crossing several ranks), causal or not, a window now and then, over every layout."""
    rng = random.Random(seed)
    seq_len = world * local_len
    cases = []
    for i in range(count):
        cuts = sorted(rng.sample(range(1, seq_len), rng.randint(1, 6)))
        if rng.random() < 0.3:
            cuts.append(cuts[-1] + 1 if cuts[-1] + 1 < seq_len else cuts[-1])  # a document of one token
        docs = tuple(sorted({0, *cuts, seq_len}))
        causal = rng.random() < 0.8
        window = (rng.randint(1, local_len), -1 if causal else rng.randint(1, local_len)) if rng.random() < 0.25 \
            else (-1, -1)
        layout = ("contiguous", "zigzag", "balanced")[i % 3]
        cases.append((layout, (causal, window, docs)))
    return cases


def _random_sparse_rank(rank, world, local_len, count, seed):
    from distcomm_attention.strategies.sparse_gather import SparseGather
    from distcomm_attention.transport import CountingTransport, TorchTransport

    out = []
    for layout, vis_args in _random_plans(world, local_len, count, seed):
        vis = Visibility(*vis_args, False)
        seq_len = world * local_len
        concrete = balance.resolve(layout, seq_len, world, vis.cu_seqlens) if layout == "balanced" else layout
        ex = exchange_plan(concrete, vis, world, local_len)
        full = _sparse_full(1, seq_len)
        counting = CountingTransport(TorchTransport())
        sparse = SparseGather(counting, ex, concrete)
        (buffer,) = sparse.gather(full[:, layouts.positions(concrete, seq_len, world, rank)])
        weight = torch.randn(buffer.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        out.append({"buffer": buffer, "weight": weight, "grad": sparse.scatter_add(weight, local_len),
                    "sent": counting.total, "calls": dict(counting.calls), "direct": sparse.pieces is not None})
    return out


def test_sparse_gather_on_random_plans():
    """Random documents, windows and layouts on 4 ranks: every rank's buffer, bytes and gradient against the
    float64 reference, whichever way each call's rows go (direct pieces, or the all-to-all-v where a rank has
    no piece)."""
    world, local_len, count, seed = 4, 16, 24, 11
    per_rank = run_world(_random_sparse_rank, world, local_len, count, seed, timeout=120)
    ways = set()
    for i, (layout, vis_args) in enumerate(_random_plans(world, local_len, count, seed)):
        got = [rank_results[i] for rank_results in per_rank]
        op = "exchange" if got[0]["direct"] else "all_to_all_v"
        ways.add(op)
        _check_sparse(got, layout, vis_args + (False,), world, local_len, 1, op)
    assert "exchange" in ways, ways


def test_sparse_gather_over_a_transport_without_exchange():
    """A transport lacking ``exchange`` (here under a counting one) gets the all-to-all-v on every rank, with
    the same rows and gradients."""
    layout, vis_args, world, local_len, direct = SPARSE[0]
    assert direct
    got = run_world(_sparse_rank, world, layout, vis_args, local_len, 16, 64, 2, True, timeout=60)
    _check_sparse(got, layout, vis_args, world, local_len, 2, "all_to_all_v")


def _allgather_rank(rank, world, layout, causal, window, docs, masked):
    import functools

    import distcomm_attention as da
    from tests.counting import counted_attention

    return counted_attention(rank, world, 8, layout, causal, window, docs, masked, 11,
                             functools.partial(da.context_parallel_attn, strategy="allgather"))


ALLGATHER = [
    ("contiguous", True, (-1, -1), (0, 8, 16, 24), False),   # documents on one rank each: nothing moves
    ("contiguous", True, (-1, -1), (0, 5, 13, 24), True),    # documents crossing boundaries, padding
    ("zigzag", True, (3, -1), None, False),                  # a window
    ("balanced", True, (-1, -1), (0, 2, 9, 10, 24), False),
    ("contiguous", False, (2, 2), (0, 11, 24), False),
]


@pytest.mark.parametrize("layout, causal, window, docs, masked", ALLGATHER)
def test_allgather_strategy_moves_only_the_plan(layout, causal, window, docs, masked):
    """context_parallel_attn(strategy="allgather") with documents or windows: out, dQ, dK, dV equal the float64
    reference, and each rank's counted bytes are exactly the exchange plan's (its needed rows out, the
    received rows' gradients back, the keys' rows again for the backward unless the buffers are small enough
    to keep): zero when every document stays on one rank."""
    from distcomm_attention.planning.exchange import GATHER_KEEP_ROWS, gathered_exchange

    world = 3
    got = run_world(_allgather_rank, world, layout, causal, window, docs, masked, timeout=90)
    seq_len = world * 8
    vis = Visibility(causal, window, docs, masked)
    concrete = balance.resolve(layout, seq_len, world, docs) if layout == "balanced" else layout
    ex = gathered_exchange(concrete, vis, world, 8)
    assert ex is not None
    kv_row, grad_row = 2 * 2 * 8 * 8, 2 * 2 * 8 * 8  # (batch 2) x kv heads 2 x head_dim 8 x float64, per k or v
    mask_row = 2 if masked else 0  # (batch 2) x one byte
    # buffers of at most GATHER_KEEP_ROWS x the local rows on every rank are kept: the backward gathers nothing
    # again
    gathers = 1 if max(map(ex.buffer_len, range(world))) <= GATHER_KEEP_ROWS * 8 else 2
    for r, g in enumerate(got):
        assert max(g["errors"]) < 1e-10, g["errors"]
        sent, received = ex.remote_rows(r)
        expected = gathers * sent * (2 * kv_row + mask_row) + received * 2 * grad_row
        assert g["sent"] == expected, (r, g["sent"], expected)
        if ex.moves_nothing:
            assert g["sent"] == 0


def _dense_allgather_rank(rank, world):
    import distcomm_attention as da
    from distcomm_attention._reference import attention_reference
    from tests.counting import counted

    n, seq_len = 8, world * 8
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, seq_len, h, 8, dtype=torch.float64, generator=g) for h in (4, 2, 2))
    pos = layouts.positions("zigzag", seq_len, world, rank)
    local = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
    with counted() as made:
        out = da.context_parallel_attn(*local, strategy="allgather", causal=True, layout="zigzag")
        out.sum().backward()
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    attention_reference(*ref_in, causal=True).sum().backward()
    errors = [max_diff(a.grad, b.grad[:, pos]) for a, b in zip(local, ref_in)]
    return {"errors": errors, "sent": sum(c.total for c in made),
            "calls": {op: sum(c.calls[op] for c in made) for op in ("all_gather", "reduce_scatter")}}


@pytest.mark.parametrize("world", [3, 4])
def test_dense_allgather_goes_through_the_transport(world):
    """Plain causal attention needs every key somewhere: the all-gather stays whole, through the transport
    (gathers of k and v in the forward, and again in the backward unless the whole sequence is at most
    GATHER_KEEP_ROWS shards; one reduce-scatter each of dK, dV), gradients exact."""
    from distcomm_attention.planning.exchange import GATHER_KEEP_ROWS

    got = run_world(_dense_allgather_rank, world, timeout=60)
    row = 1 * 2 * 8 * 8  # batch x kv heads x head dim x float64, per token of k or v
    gathers = 2 if world <= GATHER_KEEP_ROWS else 4  # k and v, once or twice
    assert (world, gathers) in ((3, 2), (4, 4))  # both cases, with the constant as shipped
    for g in got:
        assert max(g["errors"]) < 1e-10, g["errors"]
        assert g["calls"] == {"all_gather": gathers, "reduce_scatter": 2}
        assert g["sent"] == gathers * (world - 1) * 8 * row + 2 * (world - 1) * (world * 8) * row // world


def test_own_rows_as_runs():
    """The runs of own rows: split where either index stops stepping by one; none past MAX_RUNS."""
    from distcomm_attention.strategies import sparse_gather

    t = lambda *xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    assert sparse_gather._runs(t(0, 1, 2, 5, 6, 7), t(3, 4, 5, 6, 7, 8)) == ((0, 3, 3), (5, 6, 3))
    assert sparse_gather._runs(t(0, 1, 2, 3), t(0, 1, 4, 5)) == ((0, 0, 2), (2, 4, 2))
    assert sparse_gather._runs(t(), t()) == ()
    many = torch.arange(0, 2 * (sparse_gather.MAX_RUNS + 1), 2)
    assert sparse_gather._runs(many, torch.arange(many.numel())) is None
