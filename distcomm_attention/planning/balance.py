"""The document-balanced layout: which global tokens each rank holds, computed from the documents.

Note [Balanced layout]
    The static layouts balance one causal triangle over the whole sequence. With packed documents the work
    is a triangle per document, so the rank holding a long document's tail does several times the mean
    work. ``layout="balanced"`` assigns tokens from ``cu_seqlens`` (and the window) instead:

        tokens     every rank holds exactly S / W tokens (the rest of the model is per-token work)
        work       the kernel's time per rank (``piece_cost``), balanced: within a few percent of the mean
        traffic    a document stays whole on one rank where it fits; a longer one is split over few ranks

    Work model. The kernels tile each run of a document's queries on a rank (a piece) into 128-row query tiles,
    and a piece costs what flash-attn-4's law (Note [Cost model]) says: its 128 x 128 tiles holding a visible
    pair, plus ``QUERY_TILE`` tiles' worth for each query tile, whatever its length, and ``KEY_TILE`` for each
    key tile its queries see (a later share of a long document reads all the keys before it) (``piece_cost``,
    in tiles; without a window the tiles are counted exactly, keys tiled from the document's first; with one,
    its visible pairs over a tile's plus half a tile a query tile, which is low against the exact count, by
    6-12% on average and up to 45%: tokens past the window are under-weighted). Balancing visible pairs alone
    put hundreds of tiny documents on one rank (each costing a query tile, up to 128 times its pairs): on a
    pack of 262 documents of mean ~500 tokens, W = 8, the busiest rank (87 pieces) was 11% above the mean by
    the law, and its own flash-attn-4 call the slowest (docs/bench/emulated.md, runs 17-19); balanced by the
    law it is 2% above. The law does not count everything: the raw calls still spread 1.44-1.68 ms (one
    H200), falling from rank 0 to rank 7, which no count of tiles here explains. The pieces' shapes below are
    chosen by visible pairs: under a
    causal mask a query at offset i of its document sees min(i, left) + 1 keys (left: the window's left edge,
    unbounded without one), so the work per token never falls along a document. A document split over k
    ranks gives each rank a nested share: a piece from the head of the part not yet placed and one from its
    tail. Without a window the two pieces are equal (half of the share each, the zigzag layout per document)
    and every share has the document's work per token, (L + 1) / 2 for L tokens; a share the heavy phase
    sizes in whole query tiles (below) gives the head the odd tile. With a window the cheap tokens are only
    the first ``left`` of each document, so halves would give the head's rank too little: the head piece is
    sized (binary search) so that the share's work per token is again that of the unplaced rest, which keeps
    every share of a document at its density. Bidirectional attention has L visible keys per token, an affine
    function of the same density, so the same assignment balances it too.

    Greedy, densest document first (cost per token: long documents, and documents under a query tile, whose
    tile costs the same whatever their length; deterministic: ties by document index, then rank), rank by
    rank, each rank's target the cost not placed yet over the ranks left. Splitting adds cost (each share's
    pieces pay their own query and key tiles: a later share of a long document all the key tiles before it),
    which the documents' whole costs do not count, so a first pass leaves its last rank the excess; ``PASSES``
    passes each take as the total what the previous one placed, and the assignment whose busiest rank costs
    least is kept. A pass, rank by rank:

        heavy   from the dense end: shares as large as the rank's free tokens allow while its projected
                work (its work + its remaining free tokens filled at the density of the lightest unplaced
                documents) stays within ``TOLERANCE`` of the target; the document that does not fit is
                split: without a window in whole query tiles (a partial tile costs a whole one, so between
                whole tiles the projection is a sawtooth), the head piece taking the odd tile, the share of
                the two around the target whose projection is nearer to it; with a window the largest share
                keeping the projection within the target (binary search)
        light   then the rank's free tokens are filled from the light end: whole documents, the last one
                split (a nested share) to fill the rank exactly

    Ranks then hold their pieces in increasing global order (what the planner requires; adjacent pieces
    merged). The result depends only on (cu_seqlens, W, window), so every rank computes the same; it is
    cached. One document without a window reproduces zigzag exactly. The planner turns any assignment into
    blocks (Note [Ring plan]): pairs of ranks sharing no document are skipped, and a ring step no rank needs
    is not taken.
"""

from __future__ import annotations

import bisect
import functools

from distcomm_attention.planning import layouts
from distcomm_attention.planning.cost import TILE, Hardware, tile_s
from distcomm_attention.planning.layouts import Assignment

__all__ = ["balanced", "work", "piece_cost", "rank_work", "rank_cost", "resolve", "choose_layout", "TOLERANCE",
           "AUTO_CANDIDATES", "QUERY_TILE", "KEY_TILE"]

# what layout="auto" compares with packed documents; striped is not among them: its blocks break into a kernel
# call per document and ring step (measured 0.03-0.36 of one varlen call, docs/bench/balanced.md)
AUTO_CANDIDATES = ("balanced", "zigzag", "contiguous")

TOLERANCE = 0.01  # a whole placement may leave a rank this far above its target work
PASSES = 5  # greedy passes, each counting the cost the previous one's splits added (Note [Balanced layout])

# a query tile's and a key tile's fixed costs in 128 x 128 tiles of work, from the cost model's defaults (each
# against a tile's FLOPs at ``tflops``; all scale with the head dim): 2.88 and 1.56
QUERY_TILE = Hardware().query_tile_s / tile_s(128, Hardware())
KEY_TILE = Hardware().key_tile_s / tile_s(128, Hardware())


def _prefix(x: int, left: int | None) -> int:
    """Visible keys of the first x queries of a document (causal; ``left``: window's left edge or None)."""
    if left is None or x <= left + 1:
        return x * (x + 1) // 2
    return (left + 1) * (left + 2) // 2 + (x - left - 1) * (left + 1)


def work(a: int, b: int, left: int | None) -> int:
    """Visible keys of the queries at document offsets [a, b)."""
    return _prefix(b, left) - _prefix(a, left)


def piece_cost(a: int, b: int, left: int | None) -> float:
    """The kernel's time for the queries at document offsets [a, b), one piece, in 128 x 128 tiles of work
    (Note [Balanced layout]): the tiles holding a visible pair (rows tiled from a, keys from the document's
    first; with a window, the visible pairs over a tile's plus half a tile a query tile) plus ``QUERY_TILE`` per
    query tile and ``KEY_TILE`` per key tile its queries see."""
    if b <= a:
        return 0.0
    q_tiles = -(-(b - a) // TILE)
    if left is None:  # query tile i < q_tiles - 1 sees a + TILE (i + 1) keys; the last sees b
        tiles = (q_tiles - 1) * -(-a // TILE) + (q_tiles - 1) * q_tiles // 2 + -(-b // TILE)
        k_tiles = -(-b // TILE)
    else:
        tiles = work(a, b, left) / TILE ** 2 + q_tiles / 2
        k_tiles = -(-b // TILE) - max(0, a - left) // TILE
    return tiles + QUERY_TILE * q_tiles + KEY_TILE * k_tiles


@functools.lru_cache(maxsize=64)
def balanced(cu_seqlens: tuple[int, ...] | None, seq_len: int, ring_size: int,
             window: tuple[int, int] = (-1, -1)) -> Assignment:
    """The balanced assignment of ``seq_len`` tokens to ``ring_size`` ranks (see Note [Balanced layout]).

    Args:
        cu_seqlens: document boundaries (0, ..., seq_len), or None for one document.
        seq_len: the global length; divisible by ``ring_size``.
        window: the call's (left, right) window; only the left edge shapes the work.
    """
    cu = (0, seq_len) if cu_seqlens is None else tuple(int(c) for c in cu_seqlens)
    if cu[0] != 0 or cu[-1] != seq_len:
        raise ValueError(f"cu_seqlens must run from 0 to the global length {seq_len}, got {cu[0]}..{cu[-1]}")
    if seq_len % ring_size:
        raise ValueError(f"layout='balanced' over a ring of {ring_size} needs a global sequence length divisible "
                         f"by {ring_size}, got {seq_len}")
    n = seq_len // ring_size
    left = None if window[0] < 0 else window[0]
    # documents by density (work per token), heaviest first; ties by index
    docs = [d for d in range(len(cu) - 1) if cu[d + 1] > cu[d]]
    length = {d: cu[d + 1] - cu[d] for d in docs}
    whole = {d: piece_cost(0, length[d], left) for d in docs}
    docs.sort(key=lambda d: (-whole[d] / length[d], d))
    total = sum(whole.values())
    # prefix sums in density order, to project a rank's light fill in O(log D)
    prefix_tokens, prefix_work = [0], [0]
    for d in docs:
        prefix_tokens.append(prefix_tokens[-1] + length[d])
        prefix_work.append(prefix_work[-1] + whole[d])

    def greedy(extra: float):
        """One pass, the targets counting ``extra`` beyond the documents' whole costs -> (pieces, loads)."""
        head = {d: 0 for d in docs}  # offsets [head, tail) of each document not placed yet
        tail = dict(length)
        front, back = 0, len(docs) - 1  # heaviest / lightest document not placed yet
        pieces: list[list[tuple[int, int]]] = [[] for _ in range(ring_size)]
        loads = [0] * ring_size

        def share_work(d: int, x: int, h: int) -> int:
            """Visible pairs of document d's share of x tokens, h of them from the head."""
            return work(head[d], head[d] + h, left) + work(tail[d] - (x - h), tail[d], left)

        def share(d: int, x: int, tiled: bool = False) -> tuple[int, float]:
            """Document d's next nested share of x tokens: (head tokens, its cost), the share's visible pairs per
            token those of the document's unplaced rest (Note [Balanced layout]); ``tiled``: x whole query tiles,
            the head taking the odd one (its pairs per token then a little below the rest's)."""
            if x == tail[d] - head[d]:  # the whole rest: one piece
                return x, piece_cost(head[d], tail[d], left)
            if tiled:
                h = TILE * -(-x // (2 * TILE))
            else:
                h = (x + 1) // 2 if left is None else pairs_share(d, x)
            return h, piece_cost(head[d], head[d] + h, left) + piece_cost(tail[d] - (x - h), tail[d], left)

        def pairs_share(d: int, x: int) -> int:
            """With a window: the head tokens of a share of x whose visible pairs per token are the rest's."""
            rest = tail[d] - head[d]
            goal = x * work(head[d], tail[d], left) / rest
            lo, hi = 0, x  # share_work falls as h grows (head tokens see fewer keys): the last h above the goal
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if share_work(d, x, mid) >= goal:
                    lo = mid
                else:
                    hi = mid - 1
            return min((lo, min(lo + 1, x)), key=lambda c: abs(share_work(d, x, c) - goal))

        def take(r: int, d: int, x: int, tiled: bool = False) -> None:
            h, w = share(d, x, tiled)
            for a, b in ((head[d], head[d] + h), (tail[d] - (x - h), tail[d])):
                if b > a:
                    pieces[r].append((cu[d] + a, cu[d] + b))
            head[d] += h
            tail[d] -= x - h
            loads[r] += w

        def light_work(m: int, lo: int) -> float:
            """Projected work of the next m tokens from the light end (documents at indices (lo, back])."""
            w, i = 0.0, back
            if m > 0 and i > lo:  # the lightest document may be partly placed
                d = docs[i]
                t = min(tail[d] - head[d], m)
                w, m, i = t * whole[d] / length[d], m - t, i - 1
            if m > 0 and i > lo:  # then whole documents j..i, and part of the one before them
                j = bisect.bisect_left(prefix_tokens, prefix_tokens[i + 1] - m, lo + 1, i + 1)
                w += prefix_work[i + 1] - prefix_work[j]
                m -= prefix_tokens[i + 1] - prefix_tokens[j]
                if m > 0 and j - 1 > lo:
                    w += m * whole[docs[j - 1]] / length[docs[j - 1]]
            return w

        for r in range(ring_size):
            # the cost not placed yet (the previous pass's total) spread over the ranks left
            target = (total + extra - sum(loads[:r])) / (ring_size - r)
            free = n
            # heavy shares from the front while the projected load (filled with light work) stays under target
            while free and front <= back:
                d = docs[front]
                rest = tail[d] - head[d]
                most = min(free, rest)

                def projected(x: int, tiled: bool = False) -> float:
                    return loads[r] + share(d, x, tiled)[1] + light_work(free - x, front if x == rest else front - 1)

                tiled = False
                if front == back or projected(most) <= target * (1 + TOLERANCE):
                    x = most
                elif projected(0) >= target * (1 - TOLERANCE):
                    x = 0
                else:
                    # the share in whole query tiles without a window (a partial tile costs a whole one: between
                    # them the projection is a sawtooth), the nearer of the two around the target
                    unit = TILE if left is None and most >= TILE else 1
                    tiled = unit > 1
                    lo, hi = 0, most // unit  # the largest share keeping the projection within the target
                    while lo < hi:
                        mid = (lo + hi + 1) // 2
                        if projected(mid * unit, tiled) <= target:
                            lo = mid
                        else:
                            hi = mid - 1
                    x = lo * unit
                    if tiled and x + unit <= most and \
                            abs(projected(x + unit, tiled) - target) < abs(projected(x, tiled) - target):
                        x += unit
                if x:
                    take(r, d, x, tiled)
                    free -= x
                if tail[d] == head[d]:
                    front += 1
                if x < most:
                    break
            # light fill from the back: whole documents, the last one split to fill the rank exactly
            while free and front <= back:
                d = docs[back]
                x = min(free, tail[d] - head[d])
                take(r, d, x)
                free -= x
                if tail[d] == head[d]:
                    back -= 1
        return pieces, loads

    # The splits add cost (each share's pieces pay their own query and key tiles) that the first pass's targets
    # do not count, so its last rank takes the excess: the next pass counts what the previous one placed.
    pieces, loads = last = greedy(0.0)
    extra = 0.0
    for _ in range(PASSES - 1):
        if sum(last[1]) - total == extra:  # the next pass would repeat this one
            break
        extra = sum(last[1]) - total
        last = greedy(extra)
        if max(last[1]) < max(loads):
            pieces, loads = last

    ranges = []
    for r in range(ring_size):
        merged: list[tuple[int, int]] = []
        for a, b in sorted(pieces[r]):
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        ranges.append(tuple(merged))
    return Assignment("balanced", tuple(ranges), seq_len)


def _per_rank(assignment_or_positions, cu_seqlens, seq_len: int, window: tuple[int, int]):
    """(document boundaries as an int64 tensor, the window's left edge or None, each rank's positions)."""
    import torch

    cu = torch.tensor((0, seq_len) if cu_seqlens is None else cu_seqlens, dtype=torch.int64)
    left = None if window[0] < 0 else window[0]
    if isinstance(assignment_or_positions, Assignment):
        return cu, left, [assignment_or_positions.positions(r) for r in range(assignment_or_positions.ring_size)]
    return cu, left, list(assignment_or_positions)


def rank_work(assignment_or_positions, cu_seqlens: tuple[int, ...] | None, seq_len: int,
              window: tuple[int, int] = (-1, -1)) -> list[int]:
    """Visible (query, key) pairs of each rank's queries under a causal mask (``rank_cost`` is the balance
    metric), from an ``Assignment`` or a list of per-rank position tensors."""
    import torch

    cu, left, per_rank = _per_rank(assignment_or_positions, cu_seqlens, seq_len, window)
    out = []
    for pos in per_rank:
        offset = pos - cu[torch.searchsorted(cu, pos, right=True) - 1]
        keys = offset + 1 if left is None else offset.clamp(max=left) + 1
        out.append(int(keys.sum()))
    return out


def rank_cost(assignment_or_positions, cu_seqlens: tuple[int, ...] | None, seq_len: int,
              window: tuple[int, int] = (-1, -1)) -> list[float]:
    """The kernel's time of each rank's queries in tiles of work (the balance metric, ``piece_cost`` summed over
    the rank's pieces: runs of consecutive positions in one document), from an ``Assignment`` or a list of
    per-rank position tensors."""
    import torch

    cu, left, per_rank = _per_rank(assignment_or_positions, cu_seqlens, seq_len, window)
    out = []
    for pos in per_rank:
        doc = torch.searchsorted(cu, pos, right=True) - 1
        starts = torch.ones(pos.numel(), dtype=torch.bool)
        starts[1:] = (pos[1:] != pos[:-1] + 1) | (doc[1:] != doc[:-1])
        first = starts.nonzero().flatten().tolist()
        total = 0.0
        for i, j in zip(first, first[1:] + [pos.numel()]):
            base = int(cu[doc[i]])
            total += piece_cost(int(pos[i]) - base, int(pos[j - 1]) + 1 - base, left)
        out.append(total)
    return out


def resolve(layout, seq_len: int, ring_size: int, cu_seqlens: tuple[int, ...] | None):
    """The planner's layout for a layout name (or "name:balance_window", ``layouts.split_spec``): static names
    as they are, "balanced" and "auto" computed from the documents (cached)."""
    if isinstance(layout, Assignment):
        return layout
    name, window = layouts.split_spec(layout)
    if name not in layouts.DATA_DEPENDENT:
        return name
    window = (-1, -1) if window is None else (window, 0)
    if name == "balanced":
        return balanced(cu_seqlens, seq_len, ring_size, window)
    return choose_layout(cu_seqlens, seq_len, ring_size, window)[0]


@functools.lru_cache(maxsize=64)
def choose_layout(cu_seqlens: tuple[int, ...] | None, seq_len: int, ring_size: int,
                  window: tuple[int, int] = (-1, -1)):
    """layout="auto": the candidate (``AUTO_CANDIDATES``) with the least predicted time, under the faster of the
    ring and all-gather strategies, for a reference call (bf16, 32 query / 8 kv heads of 128, batch 1, causal,
    NVLink; Note [Cost model]; Ulysses' time does not depend on the layout) ->
    (the planner's layout, {name: predicted seconds}; for a candidate whose lower bound (``cost.lower_bound``:
    its busiest rank's kernel work alone) already exceeds a better one's prediction, that bound: it is not
    planned). Without documents: "balanced" (zigzag's positions)."""
    from distcomm_attention.planning import cost
    from distcomm_attention.planning.visibility import Visibility

    if cu_seqlens is None or len(cu_seqlens) <= 2 or ring_size == 1:
        return balanced(cu_seqlens, seq_len, ring_size, window), {}
    vis = Visibility(True, window, tuple(cu_seqlens))
    concrete, calls, bounds = {}, {}, {}
    for name in AUTO_CANDIDATES:
        if name == "zigzag" and seq_len % (2 * ring_size):
            continue
        concrete[name] = balanced(cu_seqlens, seq_len, ring_size, window) if name == "balanced" else name
        calls[name] = cost.Call(1, seq_len // ring_size, 32, 8, 128, 2, concrete[name], vis, ring_size)
        positions = concrete[name] if name == "balanced" else [
            layouts.positions(name, seq_len, ring_size, r) for r in range(ring_size)]
        bounds[name] = cost.lower_bound(calls[name], max(rank_work(positions, cu_seqlens, seq_len, window)))
    # Candidates in order of their lower bound; one whose bound exceeds the best prediction so far cannot win
    # and is not planned (planning every rank's steps is what costs): it is reported with its bound.
    times, best = {}, float("inf")
    for name in sorted(bounds, key=bounds.get):
        if bounds[name] > best:
            times[name] = bounds[name]
            continue
        times[name] = min(cost.predict(calls[name], strategy).seconds for strategy in ("ring", "allgather"))
        best = min(best, times[name])
    times = {name: times[name] for name in concrete}  # candidate order: ties go to the earlier candidate
    best = min(times, key=times.get)
    return concrete[best], times
