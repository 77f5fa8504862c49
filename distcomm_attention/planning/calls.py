"""How a step's pieces become kernel calls (Note [Packed steps] in distcomm_attention/kernels/contract.py).

A backend whose varlen calls take each segment's offset and length apart runs every piece of a ring step
(or of a gathered plan) in as few calls as the rules allow; the grouping is pure arithmetic on the plan's
pieces, so the kernels (which run the calls) and the cost model (which counts them) share it.
"""

from __future__ import annotations

from typing import NamedTuple

from distcomm_attention.planning.visibility import Piece, pieces_of

__all__ = ["Fit", "PackedCall", "fits", "packed_calls", "step_calls", "step_pieces"]


class PackedCall(NamedTuple):
    """Pieces of one step run as one varlen call (Note [Packed steps]): rows of the rank's queries and keys of
    the step's key buffer (absolute), in increasing row order; ``window`` the call's (left, right)."""

    pieces: tuple[Piece, ...]
    window: tuple[int | None, int | None]


def step_pieces(blocks, masks) -> list[Piece]:
    """Every block's visible pairs as band pieces with absolute rows and keys (a full block: one unbounded
    piece; a causal one, square: right edge 0)."""
    out = []
    for block, mask in zip(blocks, masks):
        r0, k0 = block.q.start or 0, block.kv.start or 0
        if mask.mode == "interval":
            out.extend(Piece(p.q0 + r0, p.q1 + r0, p.k0 + k0, p.k1 + k0, p.left, p.right) for p in pieces_of(mask))
        else:
            out.append(Piece(r0, block.q.stop, k0, block.kv.stop, None, 0 if mask.mode == "causal" else None))
    return out


def packed_calls(blocks, masks, disjoint_keys: bool) -> tuple[PackedCall, ...]:
    """Group a step's pieces into varlen calls (Note [Packed steps]); ``disjoint_keys`` for the backward."""
    groups: list[tuple[list[Piece], Fit]] = []
    for p in sorted(step_pieces(blocks, masks), key=lambda p: (p.q0, p.k0)):
        if p.q1 <= p.q0 or p.k1 <= p.k0:
            continue
        for i, (g, fit) in enumerate(groups):
            last = g[-1]
            if p.q0 >= last.q1 and p.k0 >= (last.k1 if disjoint_keys else last.k0) and (grown := fit.add(p)).ok:
                g.append(p)
                groups[i] = (g, grown)
                break
        else:
            groups.append(([p], Fit().add(p)))
    return tuple(PackedCall(tuple(g), fit.window) for g, fit in groups)


def step_calls(plan, i: int, device, backward: bool) -> tuple[PackedCall, ...] | None:
    """Step i of ``plan`` as packed calls (masks on ``device``, made once per plan), or None where the step has
    nothing to pack (no documents, no window: no "interval" block, and a plan without ``documents``): one call
    per block then. A step of a plan with documents packs also where its blocks are all plain squares (the
    all-gather's blocks on a rank's own keys, one causal square per document it holds: one call, not one per
    document). Both answers are cached on the plan."""
    def make():
        blocks = plan.blocks[i]
        if not plan.documents and all(b.mode != "interval" for b in blocks):
            return None
        return packed_calls(blocks, [plan.mask(i, j, device) for j in range(len(blocks))], disjoint_keys=backward)

    return plan.cached(("packed", i, backward, str(device)), make)


class _Side(NamedTuple):
    """One window side shared by pieces so far: the finite bound some piece gives (None: none yet), whether two
    pieces gave different ones, and the least bound that clips nothing for the pieces that give none."""

    bound: int | None = None
    clash: bool = False
    least: int | None = None  # None: no piece without a bound yet

    def add(self, bound: int | None, least: int) -> _Side:
        if bound is None:
            return self._replace(least=least if self.least is None else max(self.least, least))
        if self.bound is None:
            return self._replace(bound=bound)
        return self if bound == self.bound else self._replace(clash=True)

    @property
    def ok(self) -> bool:
        return not self.clash and (self.bound is None or self.least is None or self.bound >= self.least)


class Fit(NamedTuple):
    """Whether the pieces added so far can share one window, and that window (left, right): grown one piece
    at a time in constant time, so grouping n pieces costs O(n)."""

    left: _Side = _Side()
    right: _Side = _Side()

    def add(self, p: Piece) -> Fit:
        return Fit(self.left.add(p.left, p.k1 - p.k0 - 1), self.right.add(p.right, p.q1 - p.q0 - 1))

    @property
    def ok(self) -> bool:
        return self.left.ok and self.right.ok

    @property
    def window(self) -> tuple[int | None, int | None]:
        return self.left.bound, self.right.bound


def fits(group: list[Piece]) -> tuple[bool, tuple[int | None, int | None]]:
    """Whether pieces can share one window, and that window."""
    fit = Fit()
    for p in group:
        fit = fit.add(p)
    return fit.ok, fit.window
