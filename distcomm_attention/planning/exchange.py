"""Exchange plans: which key/value rows each rank needs from each other rank, for any layout and mask.

Note [Exchange plan]
    Rank d's queries at global positions P_d see, each, one interval of key positions [first(i), stop(i))
    (band and document, Note [Visibility]); the keys d needs are the union of those intervals. Rank s holds
    keys at positions P_s; the rows of s that d needs are those whose position lies in that union:

        need[s][d] = { local row j of s : P_s[j] in U_d },   U_d = union over i in P_d of [first(i), stop(i))

    A sparse exchange moves exactly need[s][d] for s != d (keys forward; their dK/dV back) and nothing when
    every document stays on one rank. The plan is pure (positions and the mask description only), the same
    on every rank, so every rank knows what it sends and receives, and which exchanges carry nothing at all.
    Key padding is not part of it (a padded key is data, not plan): padded keys a query's band reaches move.

    The gathered buffer of rank d holds the union U_d in natural order (global position order), so a block of
    the gathered plan, whose keys [a, b) lie inside U_d, maps to the buffer rows [c(a), c(a) + b - a), with
    c(p) = |{u in U_d : u < p}| (``Exchange.compact``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from distcomm_attention.planning import layouts
from distcomm_attention.planning.plans import gathered_in_natural_order, gathered_plan
from distcomm_attention.planning.visibility import (Block, RingPlan, Visibility, _block, _concrete, _query_bounds,
                                                   ring_plan)

__all__ = ["Exchange", "exchange_plan", "compact_plan", "compact_gathered_plan", "gathered_exchange", "SPARSE_BELOW"]


def _union(first: torch.Tensor, stop: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The union of the intervals [first_i, stop_i) clipped to [0, seq_len), as sorted disjoint ranges
    (starts, stops)."""
    lo, hi = first.clamp(0, seq_len), stop.clamp(0, seq_len)
    keep = hi > lo
    lo, hi = lo[keep], hi[keep]
    if lo.numel() == 0:
        return lo, hi
    order = torch.argsort(lo, stable=True)
    lo, reach = lo[order], hi[order].cummax(0).values  # reach: the furthest stop so far
    new = torch.ones_like(lo, dtype=torch.bool)
    new[1:] = lo[1:] > reach[:-1]  # a gap before this interval: a new range starts
    starts = new.nonzero().flatten()
    ends = torch.cat([starts[1:] - 1, torch.tensor([lo.numel() - 1])])
    return lo[starts], reach[ends]


def _runs(inside: torch.Tensor) -> list[tuple[tuple[int, int], ...]]:
    """Per row of a (rows, n) bool tensor, its runs of True as ranges [start, stop)."""
    rows, n = inside.shape
    padded = torch.zeros(rows, n + 2, dtype=torch.int8)
    padded[:, 1:-1] = inside.to(torch.int8)
    edges = padded.diff(dim=1)  # +1 where a run starts, -1 one past where it ends
    row_s, col_s = (edges == 1).nonzero(as_tuple=True)
    _, col_e = (edges == -1).nonzero(as_tuple=True)
    out: list[list[tuple[int, int]]] = [[] for _ in range(rows)]
    for r, a, b in zip(row_s.tolist(), col_s.tolist(), col_e.tolist()):
        out[r].append((a, b))
    return [tuple(runs) for runs in out]


@dataclass(frozen=True)
class Exchange:
    """A call's exchange plan (Note [Exchange plan]) over ``ring_size`` ranks of ``local_len`` rows each.

    Attributes:
        need: ``need[s][d]``: the local rows of rank s that rank d needs, as ranges [start, stop).
        union: ``union[d]``: the global key positions rank d needs, as sorted disjoint ranges.
    """

    ring_size: int
    local_len: int
    need: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]
    union: tuple[tuple[tuple[int, int], ...], ...]

    def rows(self, src: int, dst: int) -> int:
        """How many rows rank ``src`` sends rank ``dst``."""
        return sum(b - a for a, b in self.need[src][dst])

    def remote_rows(self, rank: int) -> tuple[int, int]:
        """(rows ``rank`` sends to others, rows it receives from others)."""
        sent = sum(self.rows(rank, d) for d in range(self.ring_size) if d != rank)
        received = sum(self.rows(s, rank) for s in range(self.ring_size) if s != rank)
        return sent, received

    @property
    def moves_nothing(self) -> bool:
        """No rank needs a key another rank holds (every document stays on one rank)."""
        return all(self.rows(s, d) == 0 for s in range(self.ring_size) for d in range(self.ring_size) if s != d)

    def buffer_len(self, rank: int) -> int:
        return sum(b - a for a, b in self.union[rank])

    def compact(self, rank: int, position: int) -> int:
        """Rank ``rank``'s buffer row of global key position ``position`` (or of the first needed one after it)."""
        row = 0
        for a, b in self.union[rank]:
            if position < a:
                return row
            if position < b:
                return row + position - a
            row += b - a
        return row


@functools.lru_cache(maxsize=64)
def exchange_plan(layout, vis: Visibility, ring_size: int, local_len: int) -> Exchange:
    """The exchange plan of a call whose ``ring_size`` ranks hold ``local_len`` tokens each under ``layout`` (a
    static name or a balanced ``Assignment``) with mask ``vis`` (Note [Exchange plan])."""
    seq_len = ring_size * local_len
    layout = _concrete(layout, vis, ring_size, local_len)
    pos = torch.stack([layouts.positions(layout, seq_len, ring_size, r) for r in range(ring_size)])
    cu = None if vis.cu_seqlens is None else torch.tensor(vis.cu_seqlens, dtype=torch.int64)
    unions = [_union(*_query_bounds(vis, p, cu), seq_len) for p in pos]
    union = tuple(tuple(zip(a.tolist(), b.tolist())) for a, b in unions)
    by_dst = []  # by_dst[d][s]: the rows of s that d needs
    for starts, stops in unions:
        if starts.numel() == 0:
            by_dst.append([()] * ring_size)
            continue
        k = torch.searchsorted(starts, pos, right=True) - 1
        by_dst.append(_runs((k >= 0) & (pos < stops[k.clamp(min=0)])))
    need = [tuple(by_dst[d][s] for d in range(ring_size)) for s in range(ring_size)]
    return Exchange(ring_size, local_len, tuple(need), union)


def compact_plan(plan: RingPlan, ex: Exchange, rank: int) -> RingPlan:
    """A one-step gathered plan (keys indexed by global position, Note [Gathered plans]) re-indexed to rank
    ``rank``'s compacted buffer (keys indexed by ``ex.compact``)."""
    blocks = []
    for block in plan.blocks[0]:
        a = ex.compact(rank, block.kv.start)
        blocks.append(Block(block.q, slice(a, a + block.kv.stop - block.kv.start), block.mode, block.intervals))
    return RingPlan(plan.steps, (tuple(blocks),), plan.documents)


SPARSE_BELOW = 0.9  # the sparse exchange replaces the all-gather when its busiest rank receives less than this share


def gathered_exchange(layout, vis: Visibility, ring_size: int, local_len: int) -> Exchange | None:
    """The exchange plan the all-gather strategy moves (Note [Sparse gather]), or None for a plain all-gather:
    a buffer not in natural order (striped), a ring of one, or a sparse exchange whose busiest rank would still
    receive at least ``SPARSE_BELOW`` of what the all-gather brings it (plain causal or full attention)."""
    layout = _concrete(layout, vis, ring_size, local_len)
    if ring_size == 1 or not gathered_in_natural_order(layout):
        return None
    ex = exchange_plan(layout, vis, ring_size, local_len)
    busiest = max(ex.remote_rows(r)[1] for r in range(ring_size))
    return ex if busiest < SPARSE_BELOW * (ring_size - 1) * local_len else None


@functools.lru_cache(maxsize=256)
def compact_gathered_plan(layout, vis: Visibility, ring_size: int, rank: int, local_len: int) -> RingPlan:
    """Rank ``rank``'s gathered plan over its compacted buffer (the one plan object per call signature, so
    that the kernels' derived forms cached on it are made once)."""
    layout = _concrete(layout, vis, ring_size, local_len)
    ex = exchange_plan(layout, vis, ring_size, local_len)
    return compact_plan(gathered_plan(layout, vis, ring_size, rank, local_len), ex, rank)


GATHER_KEEP_ROWS = 3  # the all-gather's buffer is kept for the backward up to this many shards on every rank


def gather_keeps(ex: Exchange | None, ring_size: int, local_len: int) -> bool:
    """Whether the all-gather (Note [All-gather KV]) keeps its forward's buffer for the backward instead of
    gathering again: the whole sequence, or with ``ex`` (Note [Sparse gather]) every rank's compacted buffer,
    at most GATHER_KEEP_ROWS shards. Decided from the plan, alike on every rank."""
    if ex is None:
        return ring_size <= GATHER_KEEP_ROWS
    return max(map(ex.buffer_len, range(ring_size))) <= GATHER_KEEP_ROWS * local_len


# The ring with direct sparse sends (Note [Sparse ring] in strategies/sparse_ring.py): its schedule.

RING_KEEP_ROWS = 2  # the forward's received rows are kept for the backward up to this many shards on every rank


MERGE_GAP = 128  # key runs of a block closer than this many rows travel as one (fewer, larger kernel calls)


@dataclass(frozen=True)
class SparseRing:
    """One rank's sparse ring schedule (Note [Sparse ring]).

    Attributes:
        plan: this rank's ring plan; each remote block split at the rows its queries do not see and re-based
            to the received buffer (the step's runs, concatenated).
        recv: recv[i]: the runs (row ranges) of src = rank - steps[i] this rank's blocks read at step i.
        send: send[i]: this rank's runs that rank + steps[i]'s blocks read at step i.
        keep: the forward's received rows are kept for the backward (decided alike on every rank).
    """

    plan: RingPlan
    recv: tuple[tuple[tuple[int, int], ...], ...]
    send: tuple[tuple[tuple[int, int], ...], ...]
    keep: bool
    _derived: dict = field(default_factory=dict, compare=False, repr=False)

    def cached(self, key, make):
        """``make()``, computed once per schedule and ``key`` (what the loop derives from the schedule: its
        index tensors on a device, its row counts)."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def rows_received(self) -> int:
        return sum(b - a for runs in self.recv[1:] for a, b in runs)

    def rows_sent(self) -> int:
        return sum(b - a for runs in self.send[1:] for a, b in runs)


def _merged(need: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The rows some query sees (the exchange plan's ranges), runs closer than MERGE_GAP joined while the rows
    the joins add stay within a tenth of the needed rows (what travels stays within 1.1x of the plan). A step's
    ring block spans exactly these rows' hull (both come from the same query bounds), so these are what it
    reads."""
    merged: list[tuple[int, int]] = []
    union, end = 0, None
    for a, b in sorted(need):
        union += max(0, b - (a if end is None else max(a, end)))
        end = b if end is None else max(end, b)
    allowance = union // 10
    for a, b in sorted(need):
        gap = a - merged[-1][1] if merged else MERGE_GAP
        if gap < MERGE_GAP and max(gap, 0) <= allowance:
            allowance -= max(gap, 0)
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return tuple(merged)


def split_block(block: Block, runs: tuple[tuple[int, int], ...], at: dict) -> list[Block]:
    """``block``'s visible pairs within each run, as blocks reading another buffer of those rows (``at``: its
    row of each run's first row): the received buffer of a ring step, or a shard's own keys."""
    lo, hi = block.kv.start, block.kv.stop
    inside = [(a, b) for a, b in runs if a < hi and b > lo]
    if not inside:
        return []
    if block.mode != "interval" or len(inside) == 1:
        a, _ = inside[0]
        start = at[a] + lo - a
        return [Block(block.q, slice(start, start + hi - lo), block.mode, block.intervals)]
    row_lo, row_hi = (x.to(torch.int64) for x in block.intervals[:2])
    out = []
    for a, b in inside:
        c, w = max(a, lo) - lo, min(b, hi) - max(a, lo)
        sub = _block((row_lo - c).clamp(0, w), (row_hi - c).clamp(0, w))
        if sub is None:
            continue
        start = at[a] + max(a, lo) - a
        out.append(Block(slice(block.q.start + sub.q.start, block.q.start + sub.q.stop),
                         slice(start + sub.kv.start, start + sub.kv.stop), sub.mode, sub.intervals))
    return out


def _compact(plan: RingPlan, recv) -> RingPlan:
    """``plan`` with every block after step 0 split at its runs and reading the received buffer."""
    steps = [plan.blocks[0]]
    for i in range(1, len(plan.steps)):
        at, row = {}, 0
        for a, b in recv[i]:
            at[a], row = row, row + b - a
        steps.append(tuple(sub for block in plan.blocks[i] for sub in split_block(block, recv[i], at)))
    return RingPlan(plan.steps, tuple(steps), plan.documents)


@functools.lru_cache(maxsize=128)
def sparse_ring(layout, vis: Visibility, ring_size: int, rank: int, local_len: int) -> SparseRing | None:
    """The sparse ring schedule of ``rank``, or None where the plain ring's relay moves about as little (the
    busiest rank would receive at least SPARSE_BELOW of the relay's rows), or for a ring of one."""
    if ring_size == 1 or local_len == 0:
        return None
    plan = ring_plan(layout, vis, ring_size, rank, local_len)
    steps = plan.steps
    if len(steps) == 1:
        return None
    ex = exchange_plan(layout, vis, ring_size, local_len)
    received = [sum(b - a for t in steps[1:] for a, b in _merged(ex.need[(d - t) % ring_size][d]))
                for d in range(ring_size)]
    if max(received) >= SPARSE_BELOW * (len(steps) - 1) * local_len:
        return None
    recv = tuple(_merged(ex.need[(rank - t) % ring_size][rank]) for t in steps)
    send = tuple(_merged(ex.need[rank][(rank + t) % ring_size]) for t in steps)
    return SparseRing(_compact(plan, recv), recv, send, max(received) <= RING_KEEP_ROWS * local_len)
