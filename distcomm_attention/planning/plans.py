"""Block plans of the strategies that hold whole key/value sequences: all-gather KV, Ulysses and the hybrid.

Note [Gathered plans]
    A rank that holds every key (all-gather KV, or Ulysses after its all-to-all) computes its queries against
    one key buffer in a single step. ``gathered_plan`` covers exactly the visible pairs with as few, large
    kernel calls as the rule allows. The buffer is in natural order (global position = buffer index) for the
    contiguous and zigzag layouts; each maximal run of consecutive query positions is one or two calls:

        causal, no window / documents:   keys [0, p0)  full        +   keys [p0, p0 + m)  causal
                                          (run of m queries starting at global position p0)
        anything else:                    one call over the run's visible key range: "full" when every row
                                          sees the same keys, else "interval" (per-row key ranges, which
                                          window kernels run as band pieces, Note [Band pieces])

    so a contiguous rank makes 2 calls (1 without a mask) and a zigzag rank 4, where the ring makes up to W.
    The striped layout has a run per token; its buffer stays in source order (rank 0's tokens, rank 1's, ...)
    and its plan is the ring plan's blocks of every source, shifted to the source's place in the buffer.
"""

from __future__ import annotations

import functools

import torch

from distcomm_attention.planning import layouts
from distcomm_attention.planning.visibility import (Block, RingPlan, Visibility, _block, _concrete, _query_bounds,
                                                    ring_plan)

__all__ = ["natural_order", "gathered_in_natural_order", "gathered_plan", "half_plans", "local_plan", "own_rows",
           "split_local"]


def gathered_in_natural_order(layout: str) -> bool:
    """Whether a gathered key buffer of this layout is re-ordered to natural order (see Note [Gathered plans])."""
    return layout != "striped"


@functools.lru_cache(maxsize=64)
def _source_positions(layout: str, ring_size: int, local_len: int) -> torch.Tensor:
    """The global position of each row of the source-order concatenation of every rank's shard (cached)."""
    seq_len = local_len * ring_size
    return torch.cat([layouts.positions(layout, seq_len, ring_size, r) for r in range(ring_size)])


@functools.lru_cache(maxsize=64)
def natural_order(layout: str, ring_size: int, local_len: int) -> torch.Tensor | None:
    """Index that puts the source-order concatenation of every rank's shard into natural order
    (``natural = concat[:, index]``), or None when it already is (contiguous, a ring of one, or any layout
    whose shards follow each other: no reorder to run). Cached: the same tensor for the same arguments (read
    only)."""
    if layout == "contiguous" or ring_size == 1:
        return None
    positions = _source_positions(layout, ring_size, local_len)
    return None if torch.equal(positions, torch.arange(positions.numel())) else torch.argsort(positions)


@functools.lru_cache(maxsize=64)
def natural_inverse(layout: str, ring_size: int, local_len: int) -> torch.Tensor | None:
    """The inverse of ``natural_order`` (source-order row j's place in natural order: the shards' positions,
    concatenated), or None; cached like it."""
    if natural_order(layout, ring_size, local_len) is None:
        return None
    return _source_positions(layout, ring_size, local_len)


def _causal_split(q0: int, row_lo: torch.Tensor, row_hi: torch.Tensor) -> tuple[Block, ...] | None:
    """A run whose rows see [a, c + i + 1) as a full block [a, c) and a causal block [c, c + m), or None."""
    m = row_lo.numel()
    a, c = int(row_lo[0]), int(row_hi[0]) - 1
    if c < a or not bool((row_lo == a).all()) or not bool((row_hi == c + 1 + torch.arange(m)).all()):
        return None
    rows = slice(q0, q0 + m)
    diag = Block(rows, slice(c, c + m), "causal")
    return (Block(rows, slice(a, c), "full"), diag) if c > a else (diag,)


def _shifted(block: Block, q0: int, k0: int) -> Block:
    return Block(slice(block.q.start + q0, block.q.stop + q0), slice(block.kv.start + k0, block.kv.stop + k0),
                 block.mode, block.intervals)


@functools.lru_cache(maxsize=256)
def gathered_plan(layout: str, vis: Visibility, ring_size: int, rank: int, local_len: int) -> RingPlan:
    """One step: ``rank``'s queries against the whole gathered key buffer (see Note [Gathered plans])."""
    n, seq_len = local_len, local_len * ring_size
    if n == 0:
        return RingPlan((0,), ((),))
    layout = _concrete(layout, vis, ring_size, n)
    if not gathered_in_natural_order(layout):
        ring = ring_plan(layout, vis, ring_size, rank, n)
        blocks = [_shifted(b, 0, ((rank - t) % ring_size) * n) for t, step in zip(ring.steps, ring.blocks) for b in step]
        return RingPlan((0,), (tuple(blocks),), ring.documents)
    return _rows_plan(vis, seq_len, layouts.positions(layout, seq_len, ring_size, rank))


def _rows_plan(vis: Visibility, seq_len: int, pos: torch.Tensor) -> RingPlan:
    """One step: queries at the increasing global positions ``pos`` (row i of the call: pos[i]) against keys
    in natural order (see Note [Gathered plans])."""
    n = pos.numel()
    cu = None if vis.cu_seqlens is None else torch.tensor(vis.cu_seqlens, dtype=torch.int64)
    first, stop = _query_bounds(vis, pos, cu)
    lo, hi = first.clamp(0, seq_len), stop.clamp(0, seq_len)
    hi = torch.maximum(hi, lo)
    cuts = [0] + ((pos[1:] - pos[:-1]) != 1).nonzero().flatten().add(1).tolist() + [n]
    blocks: list[Block] = []
    whole = _block(lo, hi)  # every row seeing the same keys: one call for the whole rank
    if whole is not None and whole.mode == "full" and whole.q == slice(0, n):
        return RingPlan((0,), ((whole,),), vis.documents)
    for s, e in zip(cuts, cuts[1:]):
        split = _causal_split(s, lo[s:e], hi[s:e]) if vis.plain and vis.causal else None
        if split is not None:
            blocks.extend(split)
            continue
        block = _block(lo[s:e], hi[s:e])
        if block is not None:
            blocks.append(_shifted(block, s, 0))
    return RingPlan((0,), (tuple(blocks),), vis.documents)


@functools.lru_cache(maxsize=64)
def half_plans(vis: Visibility, seq_len: int, cut: int) -> tuple[RingPlan, RingPlan] | None:
    """The whole sequence's plan in natural order (``local_plan``) as two: queries [0, cut) against keys [0, cut)
    and queries [cut, seq_len) (rows re-based to 0) against every key; None when a query before ``cut`` sees a
    key at or after it (Note [Ulysses halves])."""
    if not 0 < cut < seq_len:
        return None
    first = _rows_plan(vis, seq_len, torch.arange(cut))
    if any(block.kv.stop > cut for block in first.blocks[0]):
        return None
    return first, _rows_plan(vis, seq_len, torch.arange(cut, seq_len))


def local_plan(vis: Visibility, seq_len: int) -> RingPlan:
    """The plan of one rank holding the whole sequence in natural order (Ulysses after its all-to-all)."""
    return gathered_plan("contiguous", vis, 1, 0, seq_len)


def own_rows(layout, ranks: int, rank: int, local_len: int) -> torch.Tensor:
    """(ranks * local_len,) bool: the rows of the whole gathered key buffer holding ``rank``'s keys (in natural
    order the buffer's rows are global positions, else the shards in source order; Note [Gathered plans])."""
    seq_len = ranks * local_len
    own = torch.zeros(seq_len, dtype=torch.bool)
    if gathered_in_natural_order(layout):
        own[layouts.positions(layout, seq_len, ranks, rank)] = True
    else:
        own[rank * local_len:(rank + 1) * local_len] = True
    return own


def split_local(plan: RingPlan, own: torch.Tensor) -> RingPlan:
    """A one-step gathered plan as two steps: the blocks reading own rows only (``own``: the buffer's own
    rows), then the rest, so that the first run while the other ranks' keys arrive (the forward) and the
    second run first, their gradients leaving while the first run (the backward, Note [All-gather KV]).
    The cost model splits by the same rule."""
    covered = torch.cat([torch.zeros(1, dtype=torch.int64), own.to(torch.int64).cumsum(0)])
    local, remote = [], []
    for block in plan.blocks[0]:
        a, b = block.kv.start, block.kv.stop
        (local if int(covered[b] - covered[a]) == b - a else remote).append(block)
    return RingPlan((0, 1), (tuple(local), tuple(remote)), plan.documents)
