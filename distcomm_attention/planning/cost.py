"""The cost model behind ``strategy="auto"``: predicted time and memory of each strategy for one call.

Note [Cost model]
    Pure arithmetic on the call's shapes and the plans (no communication, nothing measured at call time,
    so every rank predicts the same and picks the same strategy). For one forward + backward:

        compute   max over ranks of  sum over the rank's kernel calls of
                  (where the backend packs a step's pieces into varlen calls, flash-attn-4, those calls,
                  forward and backward averaged, by the rules the ring loop runs them with (Note [Packed
                  steps]); else one per block)
                      B * heads * (3.5 * 4 * D * 128^2 * tiles / tflops         (the kernel's work: whole 128 x 128
                                   + (query_tiles * query_tile_s               tiles, and a fixed cost per
                                      + key_tiles * key_tile_s) * D / 128)     128-row query tile and per
                                                                                128-key tile)
                    + call_overhead                                           (launches)
                    + 4 B D (rows * heads + 2 keys * kv_heads) / state_gbps    (fp32 out / lse / dQ / dK /
                                                                                dV state the call touches)
                  (heads: H for the ring and all-gather, H / U for Ulysses' degree U; 3.5 = fwd + bwd)
        ring      per needed step: max(step compute, hop) with hop = bytes / p2p_bw + latency, where a hop
                  carries k, v forward and k, v plus fp32 dK, dV backward (Note [Ring attention loop]);
                  the last hop (dK, dV home) is not hidden
        ulysses   compute + the row copies around the all-to-alls (Note [Ulysses]) of q, k, v and out forward,
                  dout, dq, dk, dv backward, each of a rank's heads over the whole sequence read and written
                  once at copy_gbps: packed for / placed from the all-to-all, and reordered between the shards'
                  order and natural order where the shards are not in it (not contiguous; in two halves always)
                  + four all-to-alls forward (q, k, v, out) and four backward (dout, dq, dk, dv),
                  (U - 1) / U of each tensor leaves the rank, at a2a_bw, not overlapped; in two halves
                  (Note [Ulysses halves]) the two parts' calls, and of each direction's transfers the first
                  piece in and the last piece out, the others less the kernels they hide behind
        allgather compute + k, v gathered twice (forward, backward; once where the buffer is kept) at
                  allgather_bw + fp32 dK, dV reduce-scattered at reduce_scatter_bw, less the backward of the
                  blocks on the rank's own keys, which runs while it is in flight (Note [All-gather KV]:
                  "others first"; 2.5 / 3.5 of their step's cost); the backward's calls those of its two
                  steps (own keys, the rest). Sparse (Note [Sparse gather]): the exchange plan's rows at
                  a2a_bw, the forward's exchange less the forward of the blocks on own keys (1 / 3.5), which
                  run while it arrives
        hybrids   Ulysses over the "ulysses" dimension around a ring / all-gather over "ring"; the ring
                  dimension's transfers at ``Hardware.across``'s links where given (between nodes), the
                  all-to-alls at the hardware's own

        memory    the strategy's extra buffers per rank: ring 2 k/v blocks in flight + fp32 dK/dV
                  accumulators; all-gather S x Hkv x D keys and values (+ fp32 dK/dV in the backward);
                  Ulysses the head-sharded q, k, v, out of the whole sequence

    tiles: the 128 x 128 tiles of each piece the kernel runs (its rows and keys tiled from the piece's first)
    that hold a visible pair; query_tiles: its 128-row tiles that see a key. Per head, flash-attn-4's forward +
    backward over a pack of equal documents follows T = 4.34e-8 s * tiles + 2.25e-7 s * query_tiles within
    10% on average (worst 32%) from 64-token to 128k-token documents (least squares over 40 calls, one H200,
    docs/bench/run17/kernel_law_h200.json, scripts/bench_kernel_law.py): 676 TFLOP/s over whole tiles, and a
    fixed cost per query tile that makes a document under 1k tokens cost 2-4x its FLOPs. The defaults keep
    the law's form and were chosen, with the per-call cost and the state term, by a grid (tflops 615-676,
    query_tile_s 0.18-0.225 us, call_overhead 0.03-0.12 ms, state 618-3000 GB/s) against the recorded
    emulated-link rows of runs 5, 8 and 15-17 (docs/bench/emulated.md; the GPU-only time where recorded, 72
    predictions): 645 TFLOP/s, 0.2 us a query tile, 0.03 ms a call, 1500 GB/s. 70 of 72 within 15% (the
    two outside: run 8's, measured on a tree since changed, -19% / -21%), every pick within 5% of the
    fastest; before, 60 of 72 (outside: the all-gather on a pack of short documents -21% to -28%, the ring
    on an H200 +16% / +20%, a W = 16 mesh row -16%, and five of run 8's) (docs/bench/cost_check_run17.txt).
    Against the kernel alone these defaults are within 11% on average, 36% at worst (documents of 64-128
    tokens at 4 heads). On the compute-only records of scripts/bench_strategies.py (blocks alone, no link,
    no exchange copies; docs/bench/strategies.json and balanced_median_w8.json, 394 per-rank times on one
    H100; scripts/fit_cost_model.py) they are within 9.1% on average, worst -28%; a fit to those alone would
    take 618 TFLOP/s, 0.11 us a query tile, 0.05 ms a call and 490 GB/s (4.9% on average) (these figures:
    the defaults before key tiles).

    Key tiles. The backward's work items are key tiles: a piece of few queries over many keys (a later rank's
    share of a document, the queries of a document whose keys other ranks hold) costs more than its query
    tiles show. Measured (scripts/bench_kernel_law.py --suffixes, one H200, docs/bench/run19/
    kernel_law_suffix_h200.json): documents of 256-16k keys whose last 128-8k tokens are the queries took up to
    2.7x the law above (16k keys, 128 queries: 4.18 ms, predicted 1.55 ms). Fitted over both records (64 calls),
    T = 4.31e-8 s * tiles + 1.48e-7 s * query_tiles + 7.94e-8 s * key_tiles per head: 8.5% on average, 33% at
    worst (was 13% / 63%). The defaults keep the earlier ratios to the law (tflops 645; the two fixed costs at
    0.889 of the fit: 0.131 us a query tile, 0.071 us a key tile, which for a whole document sum to the 0.2 us
    before). Against the recorded emulated-link rows (docs/bench/cost_check_run19.txt; the balanced rows
    predicted on the balanced layout as it now places tokens, Note [Balanced layout]): GPU-only times 37 of 39
    within 15%, mean 5.6%, worst 19% (with the law before: 7.2%, worst 24%); wall times 33 of 33, mean 4.6%,
    worst 13% (4.9%, 14%); every pick within 5% of the fastest.

    The figures below describe the model before this law (visible pairs at 615 TFLOP/s, 0.30 ms a call, 618 GB/s).
    Before: fitted (least squares, 3 parameters) to 112 per-rank times of the
    ring, all-gather and Ulysses plans with flash-attn-4 blocks on one H100 (bf16, d 128, heads 32/32 and
    32/8, 4k-16k tokens per rank; scripts/bench_strategies.py, docs/bench/strategies.md): 615 TFLOP/s,
    0.30 ms per block call, 618 GB/s of fp32 state; mean error 3%, worst 18%. Links: NVLink on 2 H200s (ring
    pass 359 GB/s, all-gather 277, reduce-scatter 272 at 1 GB). ``Hardware`` holds
    them; pass your own (e.g. inter-node links of 50 GB/s per GPU) to ``which_strategy``.

    Checked since on 737 per-rank times of packed mixes (scripts/fit_cost_model.py, docs/bench/cost_fit.txt):
    mean error 8.9%, worst +85% (all-gather) and -35% (ring). A refit with the pairs of the kernel's 128 x 128
    tiles per document piece and a per-piece term lowers the mean to 6.7% but not the worst (-58%, ring at
    W = 32), and its lower per-call cost (0.115 ms) would widen the under-prediction of the real 2-GPU runs
    (docs/bench/real.md): not adopted.

    Against emulated links (scripts/check_cost_model.py over docs/bench/emulated_run2.json, dense, and
    emulated_run4.json, packed, one H100, W = 8): counting packed calls instead of blocks took the all-gather
    on the log-normal and heavy-tailed packs from +52% / +54% to -12% / -17% and its pick from 1.55x the
    fastest to the fastest; the ring on those packs stays under-predicted (-31% / -15%: its many small steps
    are host-bound, which the model does not count), Ulysses -22% / -13% (its whole-sequence copies);
    dense rows within 12% (docs/bench/emulated.md). Against the real 2 x H100 runs (docs/bench/real.md,
    recorded before this change, re-predicted): the packed rows' all-gather goes from -12% / -25% to -25% /
    -23%, and on the heavy-tailed pack the pick moves from the ring (measured fastest) to the all-gather
    (1.08x): the all-gather's index and scatter kernels over its compacted buffer (2.1-3.6 ms at W = 8,
    about 90 ns per buffer row, docs/bench/profile.md) are not modelled, and at W = 2 its buffer is 3x larger.

    Every figure above predates the all-gather's overlapped reduction (Note [All-gather KV]): the model's
    term for that overlap, and for the backward's calls of two steps, is not measured yet.

    Ulysses' row copies (``copy_gbps``, 3500 GB/s: on an H200, with balanced shards of a pack at S = 128k,
    W = 8, heads 32/8, its packs, places and reorders, 2.68 GB read and written, took 0.72 and 0.80 ms,
    docs/bench/profile/profile_lognormal_ulysses_run6.json and profile_pareto_run6.json; not measured on an
    H100 with the current row gathers). Checked against the recorded emulated-link runs in
    docs/bench/emulated.md ("Ulysses' row copies in the cost model").

    Since a block's rows that no block reached before are copied rather than merged in fp32 (Note [Merging
    block outputs]), the sparse all-gather's rank on packs runs 4-10% faster than the state term counts: the
    model over-predicts it by 9-15% on one H100 (docs/bench/emulated.md, run 11; not refitted). With its keys
    moved as direct pieces and its buffer kept up to three shards (Note [Sparse gather], run 12) the model
    (which counts the kept buffer, not the copies the pieces save) over-predicts it by 10-17%: 3 of 8 rows
    within 15%, picks unchanged (every row's pick the fastest). A state term charging only the rows a second
    call reaches would fit these rows, but the term was fitted with every row charged and stands for other
    per-row work of the ring's and Ulysses' calls too: a refit needs new measurements of every strategy.

    Since the all-gather's packed calls write their first terms into their sums (Note [Packed steps]: slots),
    its state term with packing kernels on a plan with documents or windows charges, as that code does, the
    rows two blocks reach (output and dQ sums), and with the sparse exchange the keys likewise plus the rows
    that go home (own keys' first terms are written in place); the ring's and Ulysses' terms are
    unchanged. Against run 13 (docs/bench/emulated.md, one H100, the tree with the slots and f0ee421 before it
    alternating): the all-gather's rows at S = 128k, W = 8 went from +13% to +19% to -10% (a slow-mode run)
    to +12%, 8 of 8 within 15%, picks unchanged. Against the older runs, which measured trees before the
    slots (the all-gather slower there), its packed rows are under-predicted more: emulated_run5.json one
    row +11% -> -19%, emulated_run4.json 4 -> 2 of 6 rows within 15%, the W = 16 packs on the mesh 15 -> 14
    of 16; every pick unchanged.

    The sparse all-gather's forward runs the split plan's two steps (own keys first), and its calls are counted so;
    the exchange's own copies and sums (the own rows placed into the buffer, step 1's terms converted into the rows
    that go home, the pieces coming back read, the own keys' sums written: ``_exchange_bytes``) are charged at
    ``copy_gbps``. (Since run 20 the rows that go home are in the input dtype with flash-attn-4, ``_home_bytes``,
    and the forward places only the own rows its other blocks read where its blocks on own keys read the shard; the
    copies still charge every own row.) On the recorded run 15 rows (docs/bench/emulated.md) 24 of 25 predictions
    within 15% (worst -16%, was -18%), the every-rank pack rows -6% / -15% (were -11% / -20%); on run 16's rows (the
    own sums summed by one kernel) -5% / -5% (heavy-tailed) and -12% / -12% (log-normal), picks the fastest.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from distcomm_attention.planning.calls import step_calls
from distcomm_attention.planning.exchange import gather_keeps, gathered_exchange, sparse_ring
from distcomm_attention.planning import layouts
from distcomm_attention.planning.plans import (gathered_plan, half_plans, local_plan, natural_order, own_rows,
                                               split_local)
from distcomm_attention.planning.visibility import LazyPieces, Piece, RingPlan, Visibility, ring_plan

__all__ = ["Hardware", "Prediction", "StrategyChoice", "Call", "predict", "choose", "choose_among", "links_across",
           "lower_bound", "check_hardware"]


_HOST = torch.device("cpu")  # where the model builds the masks it counts pieces of


@dataclass(frozen=True)
class Hardware:
    """Throughputs the model divides by (defaults: one H100 / H200 node, NVLink).

    Attributes:
        tflops: attention kernel forward + backward throughput on the kernel's 128 x 128 tiles that hold
            visible pairs, TFLOP/s (counted over whole tiles).
        call_overhead_s: fixed cost of one block's forward + backward calls (launches).
        state_gbps: rate at which a block call's fp32 state (out, dQ, dK, dV accumulators) is touched.
        copy_gbps: rate of a row copy on the GPU (bytes read + written per second): Ulysses' packs and
            places around its all-to-alls and its reorders between the shards' order and natural order.
        p2p_gbps, a2a_gbps, allgather_gbps, reduce_scatter_gbps: link bandwidths per GPU, GB/s.
        latency_s: fixed cost of one collective or ring hop.
        across: the links of the hybrids' "ring" dimension where they differ from these (a mesh whose
            "ulysses" dimension stays inside a node and whose "ring" dimension crosses nodes); only its link
            fields are read. None: the same links.
        query_tile_s: the kernel's fixed cost of one 128-row query tile of one head (forward + backward; at
            head_dim 128, scaled with it): what makes short documents cost more than their FLOPs.
        key_tile_s: the same of one 128-key tile that holds a visible pair (the backward's work items): what
            makes a piece of few queries over many keys (a later share of a document) cost more than its
            query tiles show.
    """

    tflops: float = 645.0
    call_overhead_s: float = 0.03e-3
    state_gbps: float = 1500.0
    copy_gbps: float = 3500.0
    p2p_gbps: float = 360.0
    a2a_gbps: float = 250.0
    allgather_gbps: float = 277.0
    reduce_scatter_gbps: float = 272.0
    latency_s: float = 20e-6
    across: Hardware | None = None
    query_tile_s: float = 0.131e-6  # last two: the fields before them keep their positions
    key_tile_s: float = 0.071e-6

    def __post_init__(self):
        for name in ("tflops", "state_gbps", "copy_gbps", "p2p_gbps", "a2a_gbps", "allgather_gbps", "reduce_scatter_gbps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"Hardware: `{name}` must be a positive finite number, got {value!r}")
        for name in ("call_overhead_s", "latency_s", "query_tile_s", "key_tile_s"):  # may be 0
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"Hardware: `{name}` must be a finite number >= 0, got {value!r}")
        if self.across is not None and not isinstance(self.across, Hardware):
            raise TypeError(f"Hardware: `across` must be a Hardware or None, got {type(self.across).__name__}")


def check_hardware(hardware) -> None:
    """Raise TypeError unless ``hardware`` is a ``Hardware`` or None (the entry points' ``hardware=``)."""
    if hardware is not None and not isinstance(hardware, Hardware):
        raise TypeError(f"`hardware` must be a distcomm_attention.Hardware or None, got {type(hardware).__name__}")


_LINK_FIELDS = ("p2p_gbps", "a2a_gbps", "allgather_gbps", "reduce_scatter_gbps", "latency_s")


def links_across(hw: Hardware) -> Hardware:
    """The hardware of transfers that cross ``across``'s links (the hybrids' ring dimension, a 1-D strategy
    over a whole mesh): ``hw`` with ``hw.across``'s links, if any."""
    if hw.across is None:
        return hw
    return dataclasses.replace(hw, across=None, **{f: getattr(hw.across, f) for f in _LINK_FIELDS})


class Prediction(NamedTuple):
    """One strategy's predicted forward + backward: total, compute and exposed communication seconds,
    extra memory bytes per rank."""

    seconds: float
    compute_s: float
    comm_s: float
    memory_bytes: int


class StrategyChoice(NamedTuple):
    """``strategy``: the pick; ``predictions``: every applicable strategy's Prediction; ``reason``: why."""

    strategy: str
    predictions: dict
    reason: str


@dataclass(frozen=True)
class Call:
    """The shapes of one call (hashable, for the caches)."""

    batch: int
    local_len: int
    heads: int
    kv_heads: int
    head_dim: int
    itemsize: int
    layout: str
    vis: Visibility
    world: int
    ulysses: int = 1  # the hybrids' Ulysses degree (world = ulysses * ring)
    packs: bool = False  # the block kernels run a step's pieces as packed varlen calls (Note [Packed steps])
    ulysses_halves: bool = False  # Ulysses in two halves where they apply (Note [Ulysses halves])


def _pairs(block) -> int:
    """Visible (query, key) pairs of one block."""
    nq, nk = block.q.stop - block.q.start, block.kv.stop - block.kv.start
    if block.mode == "full":
        return nq * nk
    if block.mode == "causal":
        return nq * (nq + 1) // 2
    row_lo, row_hi = block.intervals[0], block.intervals[1]
    return int((row_hi - row_lo).clamp(min=0).sum())


def _calls(plan: RingPlan, i: int, packs: bool) -> float:
    """Kernel calls of step i, forward and backward averaged: one per block, or the packed varlen calls of a
    step with documents or windows where the kernels pack (the rules the ring loop runs them by)."""
    calls = [step_calls(plan, i, _HOST, backward) for backward in (False, True)] if packs else [None]
    if calls[0] is None:
        return len(plan.blocks[i])
    return (len(calls[0]) + len(calls[1])) / 2


TILE = 128  # the kernel's tile: 128 query rows x 128 keys (flash-attn-4 on Hopper)


def _piece_tiles(p: Piece) -> tuple[int, int, int]:
    """(tiles holding a visible pair, query tiles that see a key, key tiles that a query sees) of one band
    piece: its rows in tiles of TILE from its first, each seeing the key tiles (from its first key) between its
    first row's left edge and its last row's right edge (FlashAttention's bottom-right window rule); the
    key tiles those between the first seen and the last (a window slides a tile's rows at a time, so no key
    tile between them is skipped)."""
    nq, nk = p.q1 - p.q0, p.k1 - p.k0
    tiles = q_tiles = 0
    first = last = None
    for i in range(0, nq, TILE):
        lo = 0 if p.left is None else max(0, i + nk - nq - p.left)
        hi = nk if p.right is None else min(nk, min(i + TILE, nq) - 1 + nk - nq + p.right + 1)
        if hi > lo:
            tiles += -(-hi // TILE) - lo // TILE
            q_tiles += 1
            first = lo // TILE if first is None else first
            last = -(-hi // TILE)
    return tiles, q_tiles, 0 if first is None else last - first


def _tiles(block, pieces=None) -> tuple[int, int, int]:
    """(tiles holding a visible pair, query tiles that see a key, key tiles that a query sees) of one block
    (``pieces``: an interval block's band pieces where the caller has them, e.g. its plan's, shared with the
    kernels' masks)."""
    nq, nk = block.q.stop - block.q.start, block.kv.stop - block.kv.start
    if block.mode == "full":
        return -(-nq // TILE) * -(-nk // TILE), -(-nq // TILE), -(-nk // TILE)
    if block.mode == "causal":
        return _piece_tiles(Piece(0, nq, 0, nk, None, 0))
    out = [_piece_tiles(p) for p in (LazyPieces(*block.intervals[:2]) if pieces is None else pieces).pieces]
    return tuple(sum(x) for x in zip(*out)) if out else (0, 0, 0)


class _Work(NamedTuple):
    """One step's kernel work and state: tiles holding visible pairs, query tiles, key tiles, kernel calls
    (forward and backward averaged), query rows and key rows of its blocks."""

    tiles: int
    q_tiles: int
    k_tiles: int
    calls: float
    rows: int
    keys: int


def _step_costs(plan: RingPlan, packs: bool = False) -> tuple[_Work, ...]:
    """The ``_Work`` of each step of a plan."""
    out = []
    for i, blocks in enumerate(plan.blocks):
        tiles = plan.cached(("tiles", i), lambda: [_tiles(b, plan._pieces(i, j) if b.mode == "interval" else None)
                                                   for j, b in enumerate(blocks)])
        out.append(_Work(*(sum(x[j] for x in tiles) for j in range(3)), _calls(plan, i, packs),
                         sum(b.q.stop - b.q.start for b in blocks), sum(b.kv.stop - b.kv.start for b in blocks)))
    return tuple(out)


def tile_s(head_dim: int, hw: Hardware) -> float:
    """Seconds of one 128 x 128 tile of one head, forward + backward, at ``tflops``."""
    return 3.5 * 4 * head_dim * TILE * TILE / (hw.tflops * 1e12)


def _kernel_s(tiles: float, q_tiles: int, c: Call, heads: int, hw: Hardware, k_tiles: int = 0) -> float:
    """The kernel law (Note [Cost model]): whole tiles at ``tflops``, plus a fixed cost per query tile and per
    key tile."""
    flops = tile_s(c.head_dim, hw) * tiles
    fixed = q_tiles * hw.query_tile_s + k_tiles * hw.key_tile_s
    return c.batch * heads * (flops + fixed * c.head_dim / 128)


def _compute_s(w: _Work, c: Call, heads: int, kv_heads: int, hw: Hardware) -> float:
    state = 4 * c.batch * c.head_dim * (w.rows * heads + 2 * w.keys * kv_heads)
    return (_kernel_s(w.tiles, w.q_tiles, c, heads, hw, w.k_tiles) + w.calls * hw.call_overhead_s
            + state / (hw.state_gbps * 1e9))


def lower_bound(c: Call, busiest_pairs: int, hw: Hardware = Hardware()) -> float:
    """A lower bound on ``predict(c, "ring")`` and ``predict(c, "allgather")`` seconds: the kernel work of the
    rank with the most visible (query, key) pairs (``busiest_pairs``: they fill at least that many tiles' worth
    of pairs), with no query-tile cost, call overhead, state traffic or communication. Cheap (no plan): what
    layout="auto" uses to skip a candidate that cannot win."""
    return _kernel_s(busiest_pairs / (TILE * TILE), 0, c, c.heads, hw)


def _transfer_s(nbytes: float, gbps: float, hw: Hardware) -> float:
    return 0.0 if nbytes <= 0 else hw.latency_s + nbytes / (gbps * 1e9)


def _ring_s(c: Call, ranks: int, local_len: int, heads: int, kv_heads: int, hw: Hardware,
            sparse_sends: bool = True) -> tuple[float, float]:
    """(compute, exposed communication) of the slowest rank of a ring of ``ranks`` over ``local_len`` tokens:
    whole shards relayed, or the sparse ring's rows (Note [Sparse ring]) where it runs (the ring strategy and
    the hybrid's ring dimension; ``sparse_sends=False``: the relay regardless)."""
    row = 2 * c.batch * kv_heads * c.head_dim  # k and v elements of one token
    worst = (0.0, 0.0)
    for r in range(ranks):
        plan = ring_plan(c.layout, c.vis, ranks, r, local_len)
        sparse = sparse_ring(c.layout, c.vis, ranks, r, local_len) if ranks > 1 and sparse_sends else None
        if sparse is None:  # every hop a whole shard; dK, dV ride along and go home at the end
            rows = [local_len] * (len(plan.steps) + 1)  # a hop beside every step (the backward's accumulators)
            kv_bytes, grad_rows = c.itemsize + 4, [0] * len(rows)
            home = _transfer_s(row * local_len * (c.itemsize + 4), hw.p2p_gbps, hw)
        else:  # the rows each step's blocks read; their dK, dV straight back beside the next step's compute
            rows = [sum(b - a for a, b in runs) for runs in sparse.recv] + [0]
            kv_bytes = 0 if sparse.keep else c.itemsize  # k, v again in the backward unless kept
            grad_rows = [0] + rows[1:]
            home = _transfer_s(row * rows[-2] * _home_bytes(c), hw.p2p_gbps, hw)  # the last step's dK, dV
        compute = total = 0.0
        hops = len(plan.steps) > 1
        for i, costs in enumerate(_step_costs(plan, c.packs)):
            step = _compute_s(costs, c, heads, kv_heads, hw)
            compute += step
            if not hops:
                total += step
                continue
            # forward: 1 / 3.5 of the work against the next step's k, v; backward: the rest against the next
            # step's k, v (relay: with the accumulators) and the previous step's dK, dV (sparse)
            nxt, prev = rows[i + 1], grad_rows[i - 1] if i > 0 else 0
            hop_fwd = _transfer_s(row * nxt * c.itemsize, hw.p2p_gbps, hw) if nxt else 0.0
            moved = row * (nxt * kv_bytes + prev * _home_bytes(c))  # (relay: no prev)
            hop_bwd = _transfer_s(moved, hw.p2p_gbps, hw) if moved else 0.0
            total += max(step / 3.5, hop_fwd) + max(step * 2.5 / 3.5, hop_bwd)
        total += home if hops else 0.0
        if total > sum(worst):
            worst = (compute, total - compute)
    return worst


def _issued(plan: RingPlan, i: int, packs: bool, backward: bool) -> int:
    """Kernel calls of step i in one direction: its blocks, or its packed varlen calls where the kernels pack."""
    calls = step_calls(plan, i, _HOST, backward) if packs else None
    return len(plan.blocks[i]) if calls is None else len(calls)


def _twice(spans) -> int:
    """Rows counted again: the sum of the spans' lengths less the rows they cover."""
    spans = list(spans)
    covered, end = 0, None
    for a, b in sorted(spans):
        start = a if end is None else max(a, end)
        if b > start:
            covered += b - start
            end = b if end is None else max(end, b)
    return sum(b - a for a, b in spans) - covered


def _home_bytes(c: Call) -> int:
    """Bytes an element of the dK/dV rows the sparse exchange sends home: the input dtype's with packing kernels
    (flash-attn-4, whose dK/dV come in it), else fp32 (Note [Sparse gather], "What goes home")."""
    return c.itemsize if c.packs else 4


def _exchange_bytes(c: Call, kv_heads: int, local_len: int, remote_keys: int, sent_rows: int, gathers: int = 1) -> int:
    """Bytes the sparse exchange's own copies and sums read and write on one rank (Note [Sparse gather]), for k
    and v each: its own rows placed into the buffer at each gather (read and written in the input dtype), step
    1's terms on the other ranks' rows (``remote_keys``) copied into the rows that go home (``_home_bytes``),
    the pieces coming back for its keys (``sent_rows``: the rows the others read, once per
    reader) read, and summed first where several ranks return the same rows, and the own keys' sums (one kernel
    over the kept terms: ``RowSum``) writing its rows in the input dtype, read where a kernel wrote them in place."""
    i, home = c.itemsize, _home_bytes(c)
    per_row = 2 * i * local_len * gathers + (i + home) * remote_keys + 2 * home * sent_rows + 2 * i * local_len
    return 2 * c.batch * kv_heads * c.head_dim * per_row


def _gathered_rank_s(c: Call, ranks: int, rank: int, local_len: int, heads: int, kv_heads: int, hw: Hardware,
                     remote_keys: int | None = None, sent_rows: int = 0, gathers: int = 1):
    """(compute, forward of the blocks on own keys only, backward of them) seconds of one rank's gathered plan:
    the backward's calls those of its two steps (Note [All-gather KV]), the forward's those of the one step, or
    with the sparse exchange (``remote_keys``: this rank's buffer rows of other ranks; ``sent_rows``: its rows
    the others read; ``gathers``: 2 where the backward gathers again) of the two it runs there, own keys first,
    plus the exchange's copies and sums (``_exchange_bytes``) at ``copy_gbps``. Where the kernels pack a plan with documents or windows, their
    outputs and dq are written into the sums (Note [Packed steps]: slots): state is charged for the rows two
    blocks reach; with the sparse exchange dK/dV likewise, plus the rows that go home (in the input dtype)."""
    plan = gathered_plan(c.layout, c.vis, ranks, rank, local_len)
    # one split per plan (its tiles and pieces then counted once): own_rows follows from the plan's arguments
    split = plan.cached("own keys first", lambda: split_local(plan, own_rows(c.layout, ranks, rank, local_len)))
    work = _step_costs(plan)[0]
    rows, keys = work.rows, work.keys
    forward = _issued(plan, 0, c.packs, False) if remote_keys is None else \
        sum(_issued(split, i, c.packs, False) for i in (0, 1))
    calls = (forward + sum(_issued(split, i, c.packs, True) for i in (0, 1))) / 2
    exchange = 0.0 if remote_keys is None else \
        _exchange_bytes(c, kv_heads, local_len, remote_keys, sent_rows, gathers) / (hw.copy_gbps * 1e9)
    own_work = _step_costs(split)[0]
    own_q, own_kv = own_work.rows, own_work.keys
    if c.packs and plan.documents:  # packed calls (planning/calls.py: step_calls)
        rows = _twice((b.q.start, b.q.stop) for b in plan.blocks[0])
        own_q = _twice((b.q.start, b.q.stop) for b in split.blocks[0])
        if remote_keys is not None:
            # the rows that go home, in the input dtype: the state term counts fp32 rows
            keys = remote_keys * _home_bytes(c) // 4 + _twice((b.kv.start, b.kv.stop) for b in plan.blocks[0])
            own_kv = _twice((b.kv.start, b.kv.stop) for b in split.blocks[0])
    own = _compute_s(own_work._replace(calls=_issued(split, 0, c.packs, True), rows=own_q, keys=own_kv), c, heads,
                     kv_heads, hw)
    return (_compute_s(work._replace(calls=calls, rows=rows, keys=keys), c, heads, kv_heads, hw) + exchange,
            own / 3.5, own * 2.5 / 3.5)


def _gathered_ranks_s(c: Call, ranks: int, local_len: int, heads: int, kv_heads: int, hw: Hardware):
    """(exchange plan or None, gathers per call, ``_gathered_rank_s`` of every rank): the all-gather's ranks,
    with the sparse exchange's rows of each where it runs."""
    ex = gathered_exchange(c.layout, c.vis, ranks, local_len)
    gathers = 1 if gather_keeps(ex, ranks, local_len) else 2  # again in the backward unless the buffer is kept
    per_rank = [_gathered_rank_s(c, ranks, r, local_len, heads, kv_heads, hw,
                                 *(() if ex is None else (ex.buffer_len(r) - local_len, ex.remote_rows(r)[0], gathers)))
                for r in range(ranks)]
    return ex, gathers, per_rank


def _gathered_s(c: Call, ranks: int, local_len: int, heads: int, kv_heads: int, hw: Hardware):
    row = 2 * c.batch * kv_heads * c.head_dim  # k and v elements of one token
    ex, gathers, per_rank = _gathered_ranks_s(c, ranks, local_len, heads, kv_heads, hw)
    if ex is None:  # all-gathers waited before any block, reduce-scatter of dK, dV in fp32
        kv = row * local_len * (ranks - 1)
        gather = [gathers * _transfer_s(kv * c.itemsize, hw.allgather_gbps, hw)] * ranks
        reduce = [_transfer_s(kv * 4, hw.reduce_scatter_gbps, hw)] * ranks
    else:  # the exchange plan's rows (Note [Sparse gather]): the busiest rank's link, k and v each an exchange,
        # the forward's behind the blocks on own keys, the backward's (if any) waited before its first block
        moved = [max(ex.remote_rows(r)) * row / 2 for r in range(ranks)]
        one = [2 * _transfer_s(m * c.itemsize, hw.a2a_gbps, hw) for m in moved]
        gather = [max(0.0, g - own_fwd) + (gathers - 1) * g for g, (_, own_fwd, _) in zip(one, per_rank)]
        reduce = [2 * _transfer_s(m * _home_bytes(c), hw.a2a_gbps, hw) for m in moved]
    comm = max(g + max(0.0, d - own_bwd) for g, d, (_, _, own_bwd) in zip(gather, reduce, per_rank))
    return max(compute for compute, _, _ in per_rank), comm if ranks > 1 else 0.0


def _a2a_s(c: Call, degree: int, heads: int, kv_heads: int, hw: Hardware) -> float:
    if degree == 1:
        return 0.0
    per_token = c.batch * c.local_len * c.head_dim * c.itemsize * (degree - 1) / degree
    return 2 * (_transfer_s(per_token * (2 * heads + 2 * kv_heads), hw.a2a_gbps, hw) + 3 * hw.latency_s)


def _ulysses_halves_s(c: Call, degree: int, heads: int, kv_heads: int, parts: tuple[float, float],
                      hw: Hardware) -> float:
    """Exposed all-to-all time of Ulysses in two halves (Note [Ulysses halves]), each direction's pieces in
    turn on the link, the second piece in behind the first part's kernels, the first piece out behind the
    second's; ``parts``: the compute of the two parts (fwd + bwd). ``heads``, ``kv_heads``: all of them."""
    per_token = c.batch * c.local_len * c.head_dim * c.itemsize * (degree - 1) / degree
    seq_len = c.world * c.local_len
    cut = seq_len // 2
    before = [int((layouts.positions(c.layout, seq_len, c.world, r) < cut).sum()) for r in range(c.world)]
    share = (max(before) / c.local_len, max(c.local_len - p for p in before) / c.local_len)

    def t(units: int, part: int) -> float:
        return _transfer_s(per_token * units * share[part], hw.a2a_gbps, hw)

    wide, narrow = heads + 2 * kv_heads, heads  # q, k, v (dq, dk, dv) and out (dout)
    fwd = [x / 3.5 for x in parts]
    bwd = [x - f for x, f in zip(parts, fwd)]
    forward = t(wide, 0) + max(0.0, t(wide, 1) - fwd[0]) + max(0.0, t(narrow, 0) - fwd[1]) + t(narrow, 1)
    backward = t(narrow, 1) + max(0.0, t(narrow, 0) - bwd[1]) + max(0.0, t(wide, 1) - bwd[0]) + t(wide, 0)
    return forward + backward


def _copies_s(c: Call, heads: int, kv_heads: int, halves: bool, hw: Hardware) -> float:
    """Plain Ulysses' row copies of q, k, v and out forward and dout, dq, dk, dv backward (Note [Ulysses]),
    each row of a rank's heads over the whole sequence read and written once per pass: one pass to pack for
    or place from the all-to-all, and one to reorder between the shards' (source) order and natural order
    unless the shards are in it (the two halves reorder always). ``heads``, ``kv_heads``: a rank's."""
    if c.world == 1:
        return 0.0
    passes = 1 + (halves or natural_order(c.layout, c.world, c.local_len) is not None)
    moved = passes * 2 * 2 * c.batch * c.local_len * c.world * c.head_dim * c.itemsize * (2 * heads + 2 * kv_heads)
    return moved / (hw.copy_gbps * 1e9)


def _kv_sent(heads: int, kv_heads: int, degree: int) -> int:
    """kv heads sent through Ulysses' all-to-all (Note [Ulysses])."""
    if kv_heads % degree == 0:
        return kv_heads
    return degree if (heads // kv_heads) % (heads // degree) == 0 else heads


def predict(c: Call, strategy: str, hw: Hardware = Hardware()) -> Prediction | None:
    """The predicted forward + backward of ``strategy`` for the call, or None where it cannot run."""
    n, b, d, s = c.local_len, c.batch, c.head_dim, c.local_len * c.world
    item = c.itemsize
    if strategy == "ring":
        compute, comm = _ring_s(c, c.world, n, c.heads, c.kv_heads, hw)
        mem = b * n * c.kv_heads * d * (4 * item + 8)
    elif strategy == "allgather":
        compute, comm = _gathered_s(c, c.world, n, c.heads, c.kv_heads, hw)
        ex = gathered_exchange(c.layout, c.vis, c.world, n)
        rows = s if ex is None else max(ex.buffer_len(r) for r in range(c.world))
        mem = b * rows * c.kv_heads * d * (2 * item + 8)
    elif strategy in ("ulysses", "hybrid", "hybrid_allgather"):
        u = c.world if strategy == "ulysses" else c.ulysses
        if c.heads % u:
            return None
        kv_sent = _kv_sent(c.heads, c.kv_heads, u)
        heads, kv_heads = c.heads // u, kv_sent // u
        comm = _a2a_s(c, u, c.heads, kv_sent, hw)
        if strategy == "ulysses":
            halves = half_plans(c.vis, s, s // 2) if u > 1 and c.ulysses_halves else None
            if halves is None:
                compute = _compute_s(_step_costs(local_plan(c.vis, s), c.packs)[0], c, heads, kv_heads, hw)
            else:  # Note [Ulysses halves]
                parts = tuple(_compute_s(_step_costs(p, c.packs)[0], c, heads, kv_heads, hw) for p in halves)
                compute, comm = sum(parts), _ulysses_halves_s(c, u, c.heads, kv_sent, parts, hw)
            compute += _copies_s(c, heads, kv_heads, halves is not None, hw)
            mem = b * s * d * item * (2 * heads + 2 * kv_heads)
        else:
            rings = c.world // u
            inner = _ring_s if strategy == "hybrid" else _gathered_s
            compute, inner_comm = inner(c, rings, u * n, heads, kv_heads, links_across(hw))
            comm += inner_comm
            mem = b * u * n * d * item * (2 * heads + 2 * kv_heads)
    else:
        raise ValueError(f"unknown strategy {strategy!r}")
    return Prediction(compute + comm, compute, comm, int(mem))


@functools.lru_cache(maxsize=256)
def _predictions(c: Call, candidates: tuple[str, ...], hw: Hardware) -> tuple[tuple[str, Prediction], ...]:
    """Every applicable candidate's prediction, cached per call signature ("auto" asks on every call)."""
    return tuple((name, p) for name in candidates if (p := predict(c, name, hw)) is not None)


def choose(c: Call, candidates: tuple[str, ...], hw: Hardware = Hardware()) -> StrategyChoice:
    """The candidate with the least predicted time (ties: the earlier candidate)."""
    return _least(dict(_predictions(c, tuple(candidates), hw)))


def choose_among(*asked: tuple[Call, tuple[str, ...], Hardware]) -> StrategyChoice:
    """``choose`` over several (call, candidates, hardware): the least predicted time of all (the names must
    differ; ties: the earlier). A 2-D mesh asks for the hybrids on it and the 1-D strategies over its ranks."""
    predictions: dict = {}
    for c, candidates, hw in asked:
        predictions.update(_predictions(c, tuple(candidates), hw))
    return _least(predictions)


def _least(predictions: dict) -> StrategyChoice:
    best = min(predictions, key=lambda name: predictions[name].seconds)
    others = ", ".join(f"{k} {v.seconds * 1e3:.3f} ms" for k, v in predictions.items())
    return StrategyChoice(best, predictions, f"least predicted fwd+bwd time ({others})")
