"""The ring with direct sparse sends (Note [Sparse ring]), on gloo: out, dQ, dK, dV against the float64
reference over the whole sequence, and every rank's bytes on the wire counted and equal to the schedule's
rows, which are the blocks' reads; within 1.1x of the exchange plan's minimum where the blocks read exactly
the visible keys; nothing moves when every document stays on one rank."""

import pytest
import torch

from distcomm_attention.planning import balance
from distcomm_attention.planning.exchange import exchange_plan
from distcomm_attention.planning.visibility import Visibility, ring_plan
from distcomm_attention.planning.exchange import sparse_ring
from tests.dist_harness import run_world
from tests.counting import max_diff

N = 8  # tokens per rank


def _rank(rank, world, layout, causal, window, docs, masked, entry, merge_gap=None):
    import functools

    import distcomm_attention as da
    from distcomm_attention.planning import exchange
    from tests.counting import counted_attention

    if merge_gap is not None:  # split blocks at every gap (the tests' shards are smaller than MERGE_GAP)
        exchange.MERGE_GAP = merge_gap
    call = (da.ring_flash_attn if entry == "ring_flash_attn"
            else functools.partial(da.context_parallel_attn, strategy="ring"))
    return counted_attention(rank, world, N, layout, causal, window, docs, masked, 3, call)


CASES = [  # world, layout, causal, window, documents, key padding
    (3, "contiguous", True, (-1, -1), (0, 5, 13, 24), True),       # documents crossing boundaries, padding
    (3, "contiguous", True, (-1, -1), (0, 8, 16, 24), False),      # documents on one rank each: nothing moves
    (4, "contiguous", True, (3, -1), None, False),                 # a window: the neighbour's last 3 keys
    (3, "zigzag", True, (3, -1), None, False),
    (4, "balanced", True, (-1, -1), (0, 1, 2, 9, 10, 27, 30, 32), False),  # one-token documents
    (3, "contiguous", False, (2, 2), (0, 11, 24), False),          # two-sided window within documents
    (4, "zigzag", True, (14, -1), None, False),                    # buffers too large to keep: sent again
    (2, "contiguous", True, (-1, -1), (0, 3, 16), False),          # W = 2: one rank receives nothing
]


def _schedule_bytes(world, layout, causal, window, docs, masked, rank):
    return _schedule(world, layout, causal, window, docs, masked, rank)


def _call(world, layout, causal, window, docs, masked):
    """(planner's layout, mask description) of a case."""
    concrete = balance.resolve(layout, world * N, world, docs) if layout == "balanced" else layout
    return concrete, Visibility(causal, window, docs, masked)


def _exchange(*case):
    concrete, vis = _call(*case)
    return exchange_plan(concrete, vis, case[0], N)


def _schedule(world, layout, causal, window, docs, masked, rank):
    """The bytes the schedule sends from ``rank`` (k, v and the mask rows each time they move; dK, dV back)."""
    concrete, vis = _call(world, layout, causal, window, docs, masked)
    sp = sparse_ring(concrete, vis, world, rank, N)
    if sp is None:  # no step but the rank's own: nothing moves on any ring
        assert ring_plan(concrete, vis, world, rank, N).steps == (0,)
        return None, 0
    kv_row = 2 * 2 * 8 * 8  # batch 2 x kv heads 2 x head_dim 8 x float64, for k or for v
    mask_row = 2 if masked else 0
    times = 1 if sp.keep else 2
    return sp, times * sp.rows_sent() * (2 * kv_row + mask_row) + sp.rows_received() * 2 * kv_row


@pytest.mark.parametrize("world, layout, causal, window, docs, masked", CASES)
def test_sparse_ring_is_exact_and_moves_the_blocks_reads(world, layout, causal, window, docs, masked):
    got = run_world(_rank, world, layout, causal, window, docs, masked, "context_parallel_attn", timeout=120)
    ex = _exchange(world, layout, causal, window, docs, masked)
    for r, g in enumerate(got):
        assert max(g["errors"]) < 1e-10, (r, g["errors"])
        sp, expected = _schedule_bytes(world, layout, causal, window, docs, masked, r)
        assert sp is not None or ex.moves_nothing, "the case must take the sparse ring"
        assert g["sent"] == expected, (r, g["sent"], expected)
        if sp is None:
            continue
        # the schedule's rows cover the plan's: every key some query of the receiver sees moves
        sent, received = ex.remote_rows(r)
        assert sp.rows_sent() >= sent and sp.rows_received() >= received
        if ex.moves_nothing:
            assert g["sent"] == 0


SPLIT_CASES = [  # blocks split at the rows no query sees (MERGE_GAP 0)
    (4, "balanced", True, (-1, -1), (0, 1, 2, 9, 10, 27, 30, 32), False),
    (3, "zigzag", True, (3, -1), None, False),
    (3, "contiguous", False, (1, 1), (0, 4, 11, 15, 20, 24), True),
]


@pytest.mark.parametrize("world, layout, causal, window, docs, masked", SPLIT_CASES)
def test_split_blocks_are_exact_and_move_only_the_plan(world, layout, causal, window, docs, masked, monkeypatch):
    """With every gap split out, each rank sends exactly the exchange plan's rows (and their dK/dV back), and
    the split blocks still compute the reference."""
    from distcomm_attention.planning import exchange

    monkeypatch.setattr(exchange, "MERGE_GAP", 0)
    exchange.sparse_ring.cache_clear()
    try:
        got = run_world(_rank, world, layout, causal, window, docs, masked, "context_parallel_attn", 0, timeout=120)
        ex = _exchange(world, layout, causal, window, docs, masked)
        for r, g in enumerate(got):
            assert max(g["errors"]) < 1e-10, (r, g["errors"])
            sp, expected = _schedule(world, layout, causal, window, docs, masked, r)
            assert g["sent"] == expected
            assert (sp.rows_sent(), sp.rows_received()) == ex.remote_rows(r)
    finally:
        exchange.sparse_ring.cache_clear()


def test_ring_flash_attn_takes_the_sparse_ring_too():
    got = run_world(_rank, 3, "contiguous", True, (-1, -1), (0, 5, 13, 24), False, "ring_flash_attn", timeout=120)
    for r, g in enumerate(got):
        assert max(g["errors"]) < 1e-10
        assert g["sent"] == _schedule_bytes(3, "contiguous", True, (-1, -1), (0, 5, 13, 24), False, r)[1]


def test_schedule_is_the_plain_rings_when_nothing_is_saved():
    """Plain causal or full attention reads every row of every needed step: no sparse schedule."""
    for causal in (True, False):
        for layout in ("contiguous", "zigzag"):
            assert sparse_ring(layout, Visibility(causal), 4, 0, N) is None


@pytest.mark.parametrize("layout", ["contiguous", "balanced", "zigzag"])
def test_sparse_ring_traffic_is_the_plan_on_packed_documents(layout):
    """Packed documents of a few hundred to a few thousand tokens: the schedule's rows are within 1.1x of
    the exchange plan's (runs closer than MERGE_GAP travel joined while the joins add at most a tenth of the
    rows: before that cap, on the balanced layout one rank received 549 rows for the plan's 492), exactly its
    rows where no two runs of a block lie closer than MERGE_GAP; nothing moves for a rank whose documents stay
    home."""
    import random

    rng = random.Random(0)
    for world in (2, 4, 8):
        n = 4096
        seq_len = world * n
        cuts = sorted(rng.sample(range(1, seq_len), 4 * world))
        docs = (0, *cuts, seq_len)
        vis = Visibility(True, cu_seqlens=docs)
        concrete = balance.resolve(layout, seq_len, world, docs) if layout == "balanced" else layout
        ex = exchange_plan(concrete, vis, world, n)
        for r in range(world):
            sp = sparse_ring(concrete, vis, world, r, n)
            if sp is None:  # the relay: only where the plan itself moves nearly every row
                busiest = max(ex.remote_rows(d)[1] for d in range(world))
                assert busiest >= 0.5 * n, (world, r, busiest)
                continue
            sent, received = ex.remote_rows(r)
            for plan_rows, moved in ((sent, sp.rows_sent()), (received, sp.rows_received())):
                assert plan_rows <= moved <= 1.1 * plan_rows, (world, r, plan_rows, moved)


def test_cost_model_counts_the_sparse_rows():
    """The ring's predicted communication falls with the sparse schedule, and so does the hybrid's, whose ring
    dimension sends sparsely too."""
    import functools

    from distcomm_attention.planning import cost

    world, n = 4, 4096
    docs = (0, 3000, 5000, 9000, 12000, 16384)
    vis = Visibility(True, cu_seqlens=docs)
    assert sparse_ring("contiguous", vis, world, 0, n) is not None
    c = cost.Call(1, n, 32, 8, 128, 2, "contiguous", vis, world)
    hw = cost.Hardware(p2p_gbps=10.0)  # slow links: communication shows
    sparse = cost._ring_s(c, world, n, 32, 8, hw)
    relay = functools.partial(cost._ring_s, sparse_sends=False)(c, world, n, 32, 8, hw)
    assert sum(sparse) < sum(relay)  # (compute, exposed communication) of each one's slowest rank
    assert cost.predict(c, "ring", hw).seconds == pytest.approx(sum(sparse))
    mesh = cost.Call(1, n // 2, 32, 8, 128, 2, "contiguous", vis, 2 * world, ulysses=2)  # 4 rings of 2 x n / 2
    ring_dim = cost._ring_s(mesh, world, n, 16, 4, hw)  # its ring dimension: 4 ranks of n, 16 / 4 heads each
    relay_dim = functools.partial(cost._ring_s, sparse_sends=False)(mesh, world, n, 16, 4, hw)
    assert sum(ring_dim) < sum(relay_dim)
    hybrid = cost.predict(mesh, "hybrid", hw)
    assert hybrid.comm_s == pytest.approx(cost._a2a_s(mesh, 2, 32, 8, hw) + ring_dim[1])


def _sub_ring_rank(rank, world):
    import distcomm_attention as da
    from distcomm_attention._reference import attention_reference

    ring = rank // 2  # two rings of two, each with its own sequence
    g = torch.Generator().manual_seed(50 + ring)
    q, k, v, dout = (torch.randn(1, 16, h, 8, dtype=torch.float64, generator=g) for h in (2, 1, 1, 2))
    local = [da.shard_sequence(t, "contiguous", ring_size=2).clone().requires_grad_() for t in (q, k, v)]
    out = da.ring_flash_attn(*local, causal=True, window_size=(2, -1), layout="contiguous", ring_size=2)
    out.backward(da.shard_sequence(dout, "contiguous", ring_size=2))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*ref_in, causal=True, window_size=(2, -1))
    ref.backward(dout)
    pos = slice((rank % 2) * 8, (rank % 2 + 1) * 8)
    return max(max_diff(a.detach(), b[:, pos].detach()) for a, b in
               zip([out] + [t.grad for t in local], [ref] + [t.grad for t in ref_in]))


def test_sparse_ring_on_rings_smaller_than_the_group():
    """ring_size=2 in a world of 4: the sparse ring's sends stay inside each ring (a window of 2: the
    neighbour's last 2 keys), and each ring computes its own sequence's reference."""
    assert sparse_ring("contiguous", Visibility(True, (2, -1)), 2, 1, 8) is not None
    errors = run_world(_sub_ring_rank, 4, timeout=120)
    assert max(errors) < 1e-10, errors


CACHED_PACKS = [(0, 5, 13, 24), (0, 4, 11, 15, 20, 24), (0, 5, 13, 24)]  # A, B, A again


def _packs_rank(rank, world, packs):
    import functools

    import distcomm_attention as da
    from distcomm_attention.planning import exchange
    from tests.counting import counted_attention

    exchange.MERGE_GAP = 0  # every gap split out: steps of two runs, sent through index tensors
    exchange.sparse_ring.cache_clear()
    call = functools.partial(da.context_parallel_attn, strategy="ring")
    return [counted_attention(rank, world, N, "zigzag", False, (1, 1), docs, False, 3, call) for docs in packs]


def test_schedules_derived_once_serve_every_later_call(monkeypatch):
    """The loop derives its per-step tables (index tensors on the device, row counts, block lists) once per
    schedule and plan and reuses them: packs A, B and A again in one process each compute the reference and
    send exactly their own schedule's rows (a table keyed too loosely would give B A's rows, or A B's)."""
    from distcomm_attention.planning import exchange

    monkeypatch.setattr(exchange, "MERGE_GAP", 0)
    exchange.sparse_ring.cache_clear()
    try:
        got = run_world(_packs_rank, 3, CACHED_PACKS, timeout=120)
        multi_run = False
        for r, per_pack in enumerate(got):
            for docs, g in zip(CACHED_PACKS, per_pack):
                assert max(g["errors"]) < 1e-10, (r, docs, g["errors"])
                sp, expected = _schedule(3, "zigzag", False, (1, 1), docs, False, r)
                assert g["sent"] == expected, (r, docs, g["sent"], expected)
                multi_run |= any(len(runs) > 1 for runs in sp.send)
        assert multi_run  # the case sends some step's rows through an index tensor
        a, b = (sparse_ring("zigzag", Visibility(False, (1, 1), docs), 3, 0, N) for docs in CACHED_PACKS[:2])
        assert a.recv != b.recv  # the two packs' schedules differ on this rank
    finally:
        exchange.sparse_ring.cache_clear()


def _home_rank(rank, world, docs, flagged):
    """bf16 fwd+bwd of the ring (sparse sends) with flash-attn-4 stand-ins whose dK/dV come in the inputs' dtype
    (``flagged``) or not: out, dq, dk, dv, the bytes this rank sent and the float64 reference's errors."""
    import distcomm_attention as da
    from distcomm_attention.kernels import dispatch
    from tests.counting import counted, reference_errors
    from tests.test_gradient_slots import _Grad, _plan_inputs, _whole_span_kernels

    fwd, bwd = _whole_span_kernels([])
    bwd.dkv_in_input_dtype = flagged
    dispatch.select_kernels = lambda backend, q, vis=None, softcap=0.0: ("fa4", fwd, bwd)
    q, k, v, dout, pos = _plan_inputs(rank, world, "contiguous", docs, 5)
    local = [t[:, pos].bfloat16().requires_grad_() for t in (q, k, v)]
    with counted() as made:
        o = da.context_parallel_attn(*local, causal=True, cu_seqlens=docs, layout="contiguous", strategy="ring")
        o.backward(dout[:, pos].bfloat16())
    grads = [o.detach()] + [t.grad for t in local]
    errors = reference_errors(q, k, v, dout, pos, grads[0].double(), [_Grad(t) for t in grads[1:]], causal=True,
                              window=(-1, -1), docs=docs, mask=None)
    return {"grads": grads, "sent": sum(c.total for c in made), "errors": errors}


def test_sparse_ring_gradients_go_home_in_the_kernels_dtype():
    """With a backward kernel whose dK/dV come in the inputs' dtype (flash-attn-4), each step's dK, dV go back to
    their source in bf16 (Note [Sparse ring], "What goes home"): every rank sends exactly 2 bytes an element
    less for the rows it returns than with a kernel returning fp32, and both runs are within bf16 tolerance of
    float64 and of each other (one rounding of each returned row apart)."""
    world = 3
    docs = (0, 5, 13, 40, 41, 72)  # documents across both boundaries of the contiguous shards (24 tokens each)
    flagged = run_world(_home_rank, world, docs, True, timeout=120)
    fp32 = run_world(_home_rank, world, docs, False, timeout=120)
    vis = Visibility(True, cu_seqlens=docs)
    returned = 0
    for r in range(world):
        sp = sparse_ring("contiguous", vis, world, r, 24)
        assert sp is not None, "the case must take the sparse ring"
        elements = 2 * sp.rows_received() * 2 * 8  # the dK and dV rows it returns: kv heads 2 x head_dim 8
        assert fp32[r]["sent"] - flagged[r]["sent"] == 2 * elements, (r, fp32[r]["sent"], flagged[r]["sent"])
        returned += sp.rows_received()
        for res in (flagged[r], fp32[r]):
            assert max(res["errors"]) < 5e-2, (r, res["errors"])
        apart = [max_diff(a.double(), b.double()) for a, b in zip(flagged[r]["grads"], fp32[r]["grads"])]
        assert apart[0] == apart[1] == 0.0, (r, apart)  # the forward and dq do not depend on what goes home
        assert max(apart[2:]) < 2e-2, (r, apart)
    assert returned > 0
