"""The all-gather strategy's backward runs "others first" (Note [All-gather KV]): the reduction of dK/dV is
posted before the blocks on the rank's own keys run, and waited after them.

Layers, cheapest first:
1. pure functions: the cost model splits the plan as the strategy does and hides the reduction behind the
   own keys' backward (milliseconds);
2. gloo worlds of 2-3 ranks on CPU, float64 against the single-process float64 reference: each rank
   records, in order, what its transport posts and waits and which keys each backward kernel call reads.
"""

import pytest
import torch

from distcomm_attention.planning import balance, cost, layouts
from distcomm_attention.planning.exchange import compact_gathered_plan, gathered_exchange
from distcomm_attention.planning.plans import (gathered_in_natural_order, gathered_plan, natural_order, own_rows,
                                               split_local)
from distcomm_attention.planning.visibility import Visibility

from tests.dist_harness import run_world

# ---------------------------------------------------------------------------------------------------------
# Layer 1: the split and the cost model
# ---------------------------------------------------------------------------------------------------------


def _own(layout, world, rank, n):
    """The dense buffer's rows of ``rank``'s keys, from the buffer order the strategy gathers into."""
    order = natural_order(layout, world, n) if gathered_in_natural_order(layout) else None
    source = torch.arange(world * n) if order is None else order
    return source // n == rank


def _split(plan, own):
    """The own-keys split by its definition: the blocks whose keys are all own rows, then the rest."""
    steps = ([], [])
    for block in plan.blocks[0]:
        steps[not bool(own[block.kv].all())].append(block)
    return steps


def test_own_rows_and_split_shared_by_the_strategy_and_the_cost_model():
    """The own rows of a gathered buffer (``plans.own_rows``, which the strategy and the cost model both use)
    are those the buffer order gives, and ``split_local`` puts the blocks on own keys only first, block for
    block, for every layout and visibility."""
    docs = (0, 5, 13, 30, 32)
    for world in (2, 4):
        n = 8
        for vis in (Visibility(causal=True), Visibility(causal=True, window=(3, -1)), Visibility(),
                    Visibility(causal=True, cu_seqlens=docs if world == 4 else None)):
            for layout in ("contiguous", "zigzag", "striped", "balanced"):
                concrete = balance.resolve(layout, world * n, world, vis.cu_seqlens) if layout == "balanced" else layout
                for rank in range(world):
                    plan = gathered_plan(concrete, vis, world, rank, n)
                    own = _own(concrete, world, rank, n)
                    assert torch.equal(own_rows(concrete, world, rank, n), own)
                    ours, theirs = _split(plan, own), split_local(plan, own)
                    assert theirs.steps == (0, 1)
                    assert [[id(b) for b in step] for step in ours] == \
                        [[id(b) for b in step] for step in theirs.blocks], (layout, vis, world, rank)
                    if vis.causal and vis.cu_seqlens is None and vis.window == (-1, -1):
                        assert theirs.blocks[0]  # the diagonal: own keys only


def test_cost_model_hides_the_reduction_behind_the_own_keys_backward():
    """Dense all-gather: with kernels much faster than the link the reduce-scatter is all exposed; with slow
    kernels the own keys' backward hides it, and only the two gathers remain."""
    c = cost.Call(1, 512, 8, 2, 64, 2, "zigzag", Visibility(causal=True), 4)
    kv = 2 * c.batch * c.local_len * c.kv_heads * c.head_dim * (c.world - 1)  # k and v elements leaving a rank
    link = dict(allgather_gbps=100.0, reduce_scatter_gbps=100.0, latency_s=0.0)
    gathers, reduce = 2 * kv * c.itemsize / 100e9, kv * 4 / 100e9
    fast = cost.Hardware(tflops=1e9, query_tile_s=0.0, key_tile_s=0.0, call_overhead_s=0.0, state_gbps=1e9,
                         **link)
    assert cost.predict(c, "allgather", fast).comm_s == pytest.approx(gathers + reduce)
    slow = cost.Hardware(tflops=1e-3, **link)
    assert cost.predict(c, "allgather", slow).comm_s == pytest.approx(gathers)


# ---------------------------------------------------------------------------------------------------------
# Layer 2: the order of the backward's calls on gloo worlds
# ---------------------------------------------------------------------------------------------------------


class _Recorded:
    """A handle that notes its wait."""

    def __init__(self, handle, log, op):
        self._handle, self._log, self._op = handle, log, op

    def wait(self):
        self._log.append(("wait", self._op))
        return self._handle.wait()


class _RecordingTransport:
    """Wraps a transport and notes every post (Note [Transport])."""

    def __init__(self, inner, log):
        self.inner, self.size, self.rank, self._log = inner, inner.size, inner.rank, log

    def _post(self, op, *args):
        self._log.append(("post", op))
        return _Recorded(getattr(self.inner, op)(*args), self._log, op)

    def send_recv(self, tensors, shift, recv_shapes=None):
        return self._post("send_recv", tensors, shift, recv_shapes)

    def all_to_all_v(self, send, send_splits, recv_splits):
        return self._post("all_to_all_v", send, send_splits, recv_splits)

    def exchange(self, sends, recvs):
        return self._post("exchange", sends, recvs)

    def all_gather(self, x):
        return self._post("all_gather", x)

    def reduce_scatter(self, x):
        return self._post("reduce_scatter", x)


class _RecordingBackward:
    """Wraps a block backward and notes, per call, whether every key it reads is one of ``own`` (B, n, Hkv, D):
    ("bwd", "own") or ("bwd", "others")."""

    def __init__(self, inner, own, log):
        self._inner, self._own, self._log = inner, own, log

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _note(self, k):
        # each key row (over batch, heads, dims) against each of this rank's key rows: random float64, no ties
        same = (k[:, :, None] == self._own[:, None, :]).all(-1).all(-1).all(0)  # (keys read, own keys)
        self._log.append(("bwd", "own" if bool(same.any(1).all()) else "others"))

    def step(self, dout, q, k, *args, **kwargs):
        self._note(k)
        return self._inner.step(dout, q, k, *args, **kwargs)

    def packed_step(self, dout, q, k, *args, **kwargs):
        self._note(k)
        return self._inner.packed_step(dout, q, k, *args, **kwargs)


def _overlap_rank(rank, world, layout, causal, window, docs, masked, sparse, runs=True, pieces=True):
    from distcomm_attention import transport
    from distcomm_attention.kernels.torch_exact import TorchBackward, TorchForward
    from distcomm_attention.strategies import allgather as strategy, sparse_gather
    from distcomm_attention.strategies.allgather import allgather_attention
    from distcomm_attention.transport import TorchTransport
    from tests.counting import reference_errors

    n, d = 8, 8
    seq_len = world * n
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, seq_len, h, d, dtype=torch.float64, generator=g) for h in (4, 2, 2))
    dout = torch.randn(2, seq_len, 4, d, dtype=torch.float64, generator=g)
    mask = torch.rand(2, seq_len, generator=g) > 0.2 if masked else None
    vis = Visibility(causal, window, docs, masked)
    concrete = balance.resolve(layout, seq_len, world, docs) if layout == "balanced" else layout
    ex = gathered_exchange(concrete, vis, world, n)
    assert (ex is not None) == sparse, "the case should take the path it names"
    plan = gathered_plan(concrete, vis, world, rank, n) if ex is None else compact_gathered_plan(
        concrete, vis, world, rank, n)
    pos = layouts.positions(concrete, seq_len, world, rank)
    local = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
    log = []
    sparse_gather.MAX_RUNS = 16 if runs else 0  # 0: own rows by index gather / scatter, summed in the buffer
    sparse_gather.MAX_PIECES = 64 if pieces else 0  # 0: the all-to-all-v, not direct pieces
    own_sums = strategy.AllGatherKV._own_sums

    def recorded(self, *args):
        log.append(("own sums", None))
        return own_sums(self, *args)

    strategy.AllGatherKV._own_sums = recorded
    bwd = _RecordingBackward(TorchBackward(), local[1].detach(), log)
    with transport.using(lambda group: _RecordingTransport(TorchTransport(group), log)):
        key_mask = None if mask is None else mask[:, pos]
        out = allgather_attention(*local, None, layout=concrete, plan=plan, key_mask=key_mask, softcap=0.0,
                                  scale=d ** -0.5, fwd=TorchForward(), bwd=bwd, exchange=ex)
        log.append(("backward", None))
        out.backward(dout[:, pos])
    errors = reference_errors(q, k, v, dout, pos, out, local, causal=causal, window=window, docs=docs, mask=mask)
    return {"errors": errors, "log": log[log.index(("backward", None)) + 1:]}


OVERLAP = [  # (layout, causal, window, documents, key padding, world, sparse exchange, own rows by runs,
    #            direct pieces)
    ("zigzag", True, (-1, -1), None, False, 3, False, True, True),             # the whole sequence gathered again
    ("striped", True, (-1, -1), None, True, 2, False, True, True),             # buffer in source order, kept
    ("contiguous", True, (-1, -1), (0, 5, 13, 24), True, 3, True, True, True),  # documents across boundaries
    ("contiguous", True, (-1, -1), (0, 5, 13, 24), True, 3, True, False, True),  # the same, own rows by index
    ("contiguous", True, (-1, -1), (0, 5, 13, 24), True, 3, True, True, False),  # the same, by all-to-all-v
    ("balanced", True, (-1, -1), (0, 2, 9, 10, 24), False, 3, True, True, True),
    ("zigzag", True, (3, -1), None, False, 3, True, True, True),               # a window: blocks across ranks
    ("zigzag", True, (3, -1), None, False, 3, True, False, False),
]


@pytest.mark.parametrize("layout, causal, window, docs, masked, world, sparse, runs, pieces", OVERLAP)
def test_dkv_reduction_is_posted_before_the_own_key_blocks(layout, causal, window, docs, masked, world, sparse,
                                                           runs, pieces):
    """In the backward, the dK/dV reduction (reduce-scatter, or the sparse exchange's direct pieces, dK's and dV's
    in one group of transfers, or its all-to-all-v) is the last thing posted; every block reading another rank's
    key runs before it is posted, every block reading only this rank's keys after it and before its wait: that
    is the overlap. Out, dQ, dK, dV stay exact, with the sparse exchange's own rows summed per shard row (by runs:
    ``_own_sums``) or in the buffer (by index)."""
    got = run_world(_overlap_rank, world, layout, causal, window, docs, masked, sparse, runs, pieces, timeout=90)
    reduction = ("exchange" if pieces else "all_to_all_v") if sparse else "reduce_scatter"
    for r, g in enumerate(got):
        assert max(g["errors"]) < 1e-10, (r, g["errors"])
        log = g["log"]
        assert (("own sums", None) in log) == (sparse and runs), (r, log)
        posts = [i for i, (what, _) in enumerate(log) if what == "post"]
        # dK's, then dV's; one group of transfers for both with direct pieces
        first, second = posts[-1:] * 2 if sparse and pieces else posts[-2:]
        assert log[first] == log[second] == ("post", reduction), (r, log)
        if sparse and pieces:
            assert sum(log[i] == ("post", reduction) for i in posts[-2:]) == 1, (r, log)
        own = [i for i, e in enumerate(log) if e == ("bwd", "own")]
        others = [i for i, e in enumerate(log) if e == ("bwd", "others")]
        assert all(i < first for i in others), (r, log)
        assert all(i > second for i in own), (r, log)  # the reduction is in flight while the own keys' blocks run
        waits = [i for i, e in enumerate(log) if e == ("wait", reduction) and i > second]
        assert len(waits) == 2 and all(i < waits[0] for i in own), (r, log)
        if not sparse:  # plain causal attention: every rank's diagonal blocks read its own keys only
            assert own, (r, log)
    # (a block across a rank boundary reads both and runs before the post: a rank may have no own-key block)
    assert any(e == ("bwd", "own") for g in got for e in g["log"])
    assert any(e == ("bwd", "others") for g in got for e in g["log"])  # some rank's dK/dV had to travel


def test_cost_model_charges_state_for_rows_reached_twice():
    """With packing kernels the all-gather's calls write first terms into their sums (Note [Packed steps]:
    slots), so its state term counts each row once less than the blocks reaching it (``cost._twice`` against a
    count over every row), and the remote keys once with the sparse exchange: its packed prediction is below
    the per-block one on a pack of documents crossing ranks."""
    import random

    rng = random.Random(3)
    for _ in range(300):
        spans = [(a, a + rng.randint(0, 12)) for a in (rng.randint(0, 40) for _ in range(rng.randint(0, 6)))]
        reach = [0] * 64
        for a, b in spans:
            for i in range(a, b):
                reach[i] += 1
        assert cost._twice(spans) == sum(max(0, k - 1) for k in reach), spans
    docs = (0, 100, 700, 720, 1500, 1501, 2048)
    c = cost.Call(1, 512, 8, 2, 64, 2, "zigzag", Visibility(causal=True, cu_seqlens=docs), 4, packs=True)
    assert gathered_exchange(c.layout, c.vis, 4, 512) is not None  # the sparse exchange
    per_block = cost.Call(**{**c.__dict__, "packs": False})
    assert cost.predict(c, "allgather").compute_s < cost.predict(per_block, "allgather").compute_s
