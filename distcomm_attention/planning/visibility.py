"""Who may attend whom: the one visibility rule of ring attention, and the block plan derived from it.

Note [Visibility]
    A key at global position pk is visible to a query at global position pq iff all of

        band        pq - left <= pk <= pq + right        (window_size = (left, right), -1 = unbounded;
                                                          causal sets right = 0)
        document    doc(pq) == doc(pk)                   (cu_seqlens; one document when absent)
        padding     key_mask[b, pk]                      (attention_mask, True = attend)

    Softcap changes the scores, not the visibility. Every layout stores its tokens in increasing global
    order, so for one query block and one key block (a rank's shard and a source rank's shard):

        keys visible to query row i   = the local key rows [row_lo[i], row_hi[i])   (band and documents)
        rows that see key j           = the local query rows [col_lo[j], col_hi[j])
        row_lo, row_hi, col_lo, col_hi are nondecreasing

    (the band is an interval of positions, a document an interval of positions, and positions increase
    with the local index). The key mask is applied element-wise on top. Kernels only execute this: a
    ``BlockMask`` hands them the intervals, or says the block is one of two shapes that need none:

        "full"      every (row, key) pair of the block is visible
        "causal"    key j visible to row i iff j <= i (top-left; equal lengths)
        "interval"  the arrays above (int32, relative to the block's first row / first key)

    From the intervals a kernel tile of rows [i0, i1] touches keys [row_lo[i0], row_hi[i1]) and sees every
    key of [row_lo[i1], row_hi[i0]) unmasked: the same three-range loop as a causal kernel.

Note [Band pieces]
    Kernels with a sliding window but no per-row intervals (FlashAttention's window_size) execute an
    "interval" block as pieces: runs of consecutive rows whose intervals are one band, each a rectangle
    of rows x keys in which row r sees the keys j with  r + a <= j < r + c  (clipped to the rectangle).
    Inside a run the interval ends move by 0 or 1 per row: the first end stays clipped at the
    rectangle's first key and then advances (0...0 1...1), the second advances and then stays clipped at
    its last key (1...1 0...0). Any other step, a row with no key, or a change of pattern starts a new run.
    A band window, a document of a diagonal block, and each chunk pair of a zigzag block are one piece
    each; pieces partition the block's visible pairs.

Note [Ring plan]
    ``ring_plan`` evaluates the rule for every (rank, source rank) pair of the ring once per distinct
    call signature (cached): a pair with no visible key is skipped, a pair whose visible rows and keys
    form a full or causal rectangle becomes a "full" / "causal" block, anything else an "interval" block.
    A ring step t (rank r attends the keys of rank r - t) that no rank needs is not communicated: the
    key/value blocks jump straight to the next needed step (a send over several ring positions), so a
    window much smaller than the sequence makes fewer hops.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from distcomm_attention._device import on_device
from distcomm_attention.planning import layouts

__all__ = [
    "Visibility",
    "BlockMask",
    "Block",
    "RingPlan",
    "ring_plan",
    "cu_seqlens_from_position_ids",
    "visible_mask",
    "Piece",
    "band_pieces",
    "pieces_of",
    "FULL",
    "CAUSAL",
]


@dataclass(frozen=True)
class Visibility:
    """The call's mask description (hashable): the band and the documents; see Note [Visibility].

    Attributes:
        causal: keys after the query are hidden (sets the band's right edge to 0).
        window: (left, right) as given, -1 = unbounded on that side.
        cu_seqlens: global document boundaries (0, ..., global length), or None for one document.
        key_mask: whether a key padding mask is applied (element-wise; it does not shape the plan).
    """

    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    cu_seqlens: tuple[int, ...] | None = None
    key_mask: bool = False

    @property
    def left(self) -> int | None:
        """Largest visible pq - pk, or None when unbounded."""
        return None if self.window[0] < 0 else self.window[0]

    @property
    def right(self) -> int | None:
        """Largest visible pk - pq, or None when unbounded (0 when causal)."""
        if self.causal:
            return 0 if self.window[1] < 0 else min(self.window[1], 0)
        return None if self.window[1] < 0 else self.window[1]

    @property
    def documents(self) -> bool:
        """Documents or a window: what makes blocks of intervals (key masks aside)."""
        return self.cu_seqlens is not None or self.left is not None or (not self.causal and self.right is not None)

    @property
    def plain(self) -> bool:
        """No window, documents or key mask: plain full or causal attention."""
        return self.left is None and (self.causal or self.right is None) and self.cu_seqlens is None \
            and not self.key_mask


class BlockMask(NamedTuple):
    """The visibility of one kernel call (see Note [Visibility]).

    ``mode`` is "full", "causal" or "interval"; the four arrays are int32 (on the kernel's device) only for
    "interval": ``row_lo``/``row_hi`` (Sq,) relative to the call's first key, ``col_lo``/``col_hi`` (Sk,)
    relative to its first query row. ``pieces``: the planner's ``LazyPieces`` of the block (its intervals as
    band pieces, for kernels that take windows instead of arrays), or None (``pieces_of`` computes them).
    """

    mode: str
    row_lo: torch.Tensor | None = None
    row_hi: torch.Tensor | None = None
    col_lo: torch.Tensor | None = None
    col_hi: torch.Tensor | None = None
    pieces: "LazyPieces | None" = None


class Piece(NamedTuple):
    """Rows [q0, q1) of a block see keys [k0, k1) through a band (see Note [Band pieces]).

    With nq = q1 - q0, nk = k1 - k0, local row r and local key j: visible iff
    ``j >= r + (nk - nq) - left`` (unless left is None) and ``j <= r + (nk - nq) + right`` (unless right is
    None): FlashAttention's ``window_size``, aligned to the bottom-right corner.
    """

    q0: int
    q1: int
    k0: int
    k1: int
    left: int | None
    right: int | None


FULL = BlockMask("full")
CAUSAL = BlockMask("causal")


class Block(NamedTuple):
    """One kernel call of a ring step: query rows, key/value rows (local slices) and their visibility.

    ``intervals`` holds the CPU int32 arrays of an "interval" block; ``mask(device)`` gives the kernels'
    ``BlockMask``.
    """

    q: slice
    kv: slice
    mode: str
    intervals: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def causal(self) -> bool:
        return self.mode == "causal"


@dataclass
class RingPlan:
    """This rank's blocks for every needed ring step (see Note [Ring plan]).

    Attributes:
        steps: the needed ring steps t in increasing order, always starting with 0; at step t this rank
            attends the keys of ring position (rank - t) mod W.
        blocks: blocks[i] are the kernel calls of steps[i] (possibly none for this rank).
        documents: the visibility has documents or a window: a kernel that packs runs each step's blocks as
            packed calls (Note [Packed steps]), also a step whose own blocks are all plain squares.
    """

    steps: tuple[int, ...]
    blocks: tuple[tuple[Block, ...], ...]
    documents: bool = False
    _device_masks: dict = field(default_factory=dict, repr=False)

    def cached(self, key, make):
        """``make()``, computed once per plan and ``key`` (the kernels' derived forms of a step)."""
        key = ("cached", key)
        if key not in self._device_masks:
            self._device_masks[key] = make()
        return self._device_masks[key]

    def _pieces(self, step_index: int, block_index: int) -> "LazyPieces":
        """The block's band pieces, shared by its masks on every device."""
        key = (step_index, block_index, "pieces")
        if key not in self._device_masks:
            self._device_masks[key] = LazyPieces(*self.blocks[step_index][block_index].intervals[:2])
        return self._device_masks[key]

    def mask(self, step_index: int, block_index: int, device: torch.device) -> BlockMask:
        """The kernels' BlockMask of one block, with its arrays on ``device`` (moved once, then cached)."""
        block = self.blocks[step_index][block_index]
        if block.mode == "full":
            return FULL
        if block.mode == "causal":
            return CAUSAL
        key = (step_index, block_index, str(device))
        # on_device on every call, not only the first: a stream other than the copying one must wait for the
        # copy (it returns the same tensors: the plan keeps block.intervals alive)
        arrays = tuple(on_device(a, device) for a in block.intervals)
        if key not in self._device_masks:
            self._device_masks[key] = BlockMask("interval", *arrays, pieces=self._pieces(step_index, block_index))
        return self._device_masks[key]


def _doc_ids(cu: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Document index of each global position (cu: the boundaries, int64)."""
    return torch.searchsorted(cu, pos, right=True) - 1


_BIG = 1 << 40  # "unbounded" in position arithmetic (int64, no overflow)


def _count_below(layout: str, ring_size: int, local_len: int, src: torch.Tensor, bound: torch.Tensor):
    """How many of ring position ``src``'s tokens have a global position < ``bound`` (broadcasting).

    Because every layout stores its tokens in increasing global order, this is also the local index of the
    first of src's tokens at or after ``bound``.
    """
    n = local_len
    if isinstance(layout, layouts.Assignment):  # any assignment: search each rank's sorted positions
        table = layout.table()
        if src.dim() == 0:
            return torch.searchsorted(table[int(src)], bound.contiguous())
        bound = bound.expand(table.shape[0], bound.shape[-1]).contiguous()
        return torch.searchsorted(table[src.flatten()], bound)
    if layout == "contiguous":
        return (bound - src * n).clamp(0, n)
    if layout == "zigzag":
        h = n // 2
        far = 2 * ring_size - 1 - src
        return (bound - src * h).clamp(0, h) + (bound - far * h).clamp(0, h)
    return (-((src - bound) // ring_size)).clamp(0, n)  # striped: ceil((bound - src) / W) tokens


def _query_bounds(vis: Visibility, pq: torch.Tensor, cu: torch.Tensor | None):
    """The global positions [first, last + 1) a query at each of ``pq`` may see (band and document)."""
    first = pq - vis.left if vis.left is not None else torch.full_like(pq, -_BIG)
    stop = pq + vis.right + 1 if vis.right is not None else torch.full_like(pq, _BIG)
    if cu is not None:
        doc = _doc_ids(cu, pq)
        first = torch.maximum(first, cu[doc])
        stop = torch.minimum(stop, cu[doc + 1])
    return first, stop


def _block(row_lo: torch.Tensor, row_hi: torch.Tensor) -> Block | None:
    """The single kernel call covering every visible pair of two shards, or None if there is none."""
    seen = (row_hi > row_lo).nonzero().flatten()
    if seen.numel() == 0:
        return None
    q0, q1 = int(seen[0]), int(seen[-1]) + 1
    row_lo, row_hi = row_lo[q0:q1], row_hi[q0:q1]
    k0, k1 = int(row_lo.min()), int(row_hi.max())
    row_lo, row_hi = row_lo - k0, row_hi - k0
    nq, nk = q1 - q0, k1 - k0
    if bool((row_lo == 0).all()) and bool((row_hi == nk).all()):
        return Block(slice(q0, q1), slice(k0, k1), "full")
    if nq == nk and bool((row_lo == 0).all()) and bool((row_hi == torch.arange(1, nq + 1)).all()):
        return Block(slice(q0, q1), slice(k0, k1), "causal")
    # Rows seeing key j: those with row_lo <= j < row_hi; both bounds are nondecreasing, so they are the
    # rows from (number of rows with row_hi <= j) to (number of rows with row_lo <= j).
    col_lo = torch.bincount(row_hi.clamp(max=nk), minlength=nk + 1).cumsum(0)[:nk]
    col_hi = torch.bincount(row_lo, minlength=nk + 1).cumsum(0)[:nk]
    arrays = tuple(a.to(torch.int32) for a in (row_lo, row_hi, col_lo, torch.maximum(col_hi, col_lo)))
    return Block(slice(q0, q1), slice(k0, k1), "interval", arrays)


def _concrete(layout, vis: Visibility, ring_size: int, local_len: int):
    """The planner's layout: a data-dependent name ("balanced", "auto") placed by the call's documents."""
    if isinstance(layout, str) and layouts.split_spec(layout)[0] in layouts.DATA_DEPENDENT:
        from distcomm_attention.planning import balance  # (balance plans through the cost model)

        return balance.resolve(layout, ring_size * local_len, ring_size, vis.cu_seqlens)
    return layout


@functools.lru_cache(maxsize=64)
def _needed_steps(layout: str, vis: Visibility, ring_size: int, local_len: int) -> tuple[int, ...]:
    """The ring steps at which some rank sees some key of the block it holds (always including 0)."""
    seq_len = local_len * ring_size
    cu = None if vis.cu_seqlens is None else torch.tensor(vis.cu_seqlens, dtype=torch.int64)
    srcs = torch.arange(ring_size)[:, None]
    needed = {0}
    for r in range(ring_size):
        first, stop = _query_bounds(vis, layouts.positions(layout, seq_len, ring_size, r), cu)
        lo = _count_below(layout, ring_size, local_len, srcs, first[None, :])
        hi = _count_below(layout, ring_size, local_len, srcs, stop[None, :])
        for src in (hi > lo).any(dim=1).nonzero().flatten().tolist():
            needed.add((r - src) % ring_size)
    return tuple(sorted(needed))


@functools.lru_cache(maxsize=256)
def ring_plan(layout: str, vis: Visibility, ring_size: int, rank: int, local_len: int) -> RingPlan:
    """The blocks ``rank`` computes at each needed ring step (see Note [Ring plan]); cached per signature."""
    if local_len == 0:
        return RingPlan((0,), ((),))
    layout = _concrete(layout, vis, ring_size, local_len)
    steps = _needed_steps(layout, vis, ring_size, local_len)
    cu = None if vis.cu_seqlens is None else torch.tensor(vis.cu_seqlens, dtype=torch.int64)
    first, stop = _query_bounds(vis, layouts.positions(layout, local_len * ring_size, ring_size, rank), cu)
    blocks = []
    for t in steps:
        src = torch.tensor((rank - t) % ring_size)
        lo = _count_below(layout, ring_size, local_len, src, first)
        hi = torch.maximum(_count_below(layout, ring_size, local_len, src, stop), lo)
        block = _block(lo, hi)
        blocks.append(() if block is None else (block,))
    return RingPlan(steps, tuple(blocks), vis.documents)


_BAND_ROUNDS = 32  # splitting rounds of ``band_pieces`` before it takes the row-by-row pass


def band_pieces(row_lo: torch.Tensor, row_hi: torch.Tensor) -> tuple[Piece, ...]:
    """The visible pairs of an interval block as band pieces (see Note [Band pieces]); rows that see no key
    are in no piece. ``row_lo``/``row_hi``: the block's (Sq,) int arrays (any device). On the host, by whole-array
    operations: a row continues its predecessor's run where both ends move by 0 or 1 and the band overlaps;
    then, round by round, each run is split at its first row where the first end stops after moving or the
    second end moves after stopping (what the row-by-row pass, ``_band_pieces_by_rows``, decides)."""
    lo, hi = row_lo.cpu().to(torch.int64), row_hi.cpu().to(torch.int64)
    n = lo.numel()
    if n == 0:
        return ()
    full = hi > lo
    dlo, dhi = torch.zeros_like(lo), torch.zeros_like(hi)
    dlo[1:], dhi[1:] = lo[1:] - lo[:-1], hi[1:] - hi[:-1]
    cont = torch.zeros(n, dtype=torch.bool)  # row i joins the run of row i - 1 by the local rules
    cont[1:] = (full[1:] & full[:-1] & ((dlo[1:] == 0) | (dlo[1:] == 1)) & ((dhi[1:] == 0) | (dhi[1:] == 1))
                & (lo[1:] < hi[:-1]))
    start = full & ~cont
    for _ in range(_BAND_ROUNDS):
        up, flat = (dlo == 1) & cont & ~start, (dhi == 0) & cont & ~start  # transitions inside runs
        seg = torch.cumsum(start.to(torch.int64), 0)  # each row's run (1-based where a run has begun)
        firsts = torch.nonzero(start).flatten()
        c_up, c_flat = torch.cumsum(up.to(torch.int64), 0), torch.cumsum(flat.to(torch.int64), 0)
        at_up, at_flat = torch.zeros(firsts.numel() + 1, dtype=torch.int64), torch.zeros(firsts.numel() + 1,
                                                                                           dtype=torch.int64)
        at_up[1:], at_flat[1:] = c_up[firsts], c_flat[firsts]
        before_up, before_flat = c_up - up.to(torch.int64), c_flat - flat.to(torch.int64)  # up to row i - 1
        moving, clipped = before_up > at_up[seg], before_flat > at_flat[seg]
        bad = torch.nonzero(cont & ~start & ((moving & (dlo == 0)) | (clipped & (dhi == 1)))).flatten()
        if bad.numel() == 0:
            break
        first_bad = torch.ones(bad.numel(), dtype=torch.bool)  # the first of each run: the rest may be fine
        first_bad[1:] = seg[bad[1:]] != seg[bad[:-1]]
        start[bad[first_bad]] = True
    else:
        return _band_pieces_by_rows(row_lo, row_hi)
    s = torch.nonzero(start).flatten()
    empty = torch.nonzero(~full).flatten()
    to_empty = empty[torch.searchsorted(empty, s).clamp(max=empty.numel() - 1)] if empty.numel() else None
    e = torch.cat([s[1:], torch.tensor([n])])
    if to_empty is not None:
        e = torch.minimum(e, torch.where(to_empty > s, to_empty, torch.full_like(s, n)))
    k0, k1 = lo[s], hi[e - 1]
    nq, nk = e - s, k1 - k0
    last_lo, first_hi = lo[e - 1] - k0, hi[s] - k0
    left, right = (nk - nq) - (last_lo - (nq - 1)), first_hi - 1 - (nk - nq)
    return tuple(Piece(a, z, b, c, None if ll == 0 else lf, None if fh == w else rt)
                 for a, z, b, c, ll, lf, fh, rt, w in zip(*(t.tolist() for t in (s, e, k0, k1, last_lo, left,
                                                                               first_hi, right, nk))))


def _band_pieces_by_rows(row_lo: torch.Tensor, row_hi: torch.Tensor) -> tuple[Piece, ...]:
    """``band_pieces`` by one pass over the rows (where the runs need more than ``_BAND_ROUNDS`` splits)."""
    lo, hi = row_lo.cpu().tolist(), row_hi.cpu().tolist()
    pieces = []

    def close(s: int, e: int) -> None:
        k0, k1 = lo[s], hi[e - 1]
        nq, nk = e - s, k1 - k0
        last_lo, first_hi = lo[e - 1] - k0, hi[s] - k0
        left = None if last_lo == 0 else (nk - nq) - (last_lo - (nq - 1))
        right = None if first_hi == nk else first_hi - 1 - (nk - nq)
        pieces.append(Piece(s, e, k0, k1, left, right))

    start = None  # first row of the open run
    lo_moving = hi_clipped = False  # the run's first end has started advancing / its second end stopped
    for i in range(len(lo)):
        if hi[i] <= lo[i]:  # no key: closes the run
            if start is not None:
                close(start, i)
            start = None
            continue
        if start is not None:
            dlo, dhi = lo[i] - lo[i - 1], hi[i] - hi[i - 1]
            fits = (dlo in (0, 1) and dhi in (0, 1) and lo[i] < hi[i - 1] and not (lo_moving and dlo == 0)
                    and not (hi_clipped and dhi == 1))
            if fits:
                lo_moving |= dlo == 1
                hi_clipped |= dhi == 0
                continue
            close(start, i)
        start, lo_moving, hi_clipped = i, False, False
    if start is not None:
        close(start, len(lo))
    return tuple(pieces)


class LazyPieces:
    """An interval block's band pieces, computed on first use (only kernels that take windows ask)."""

    def __init__(self, row_lo: torch.Tensor, row_hi: torch.Tensor):
        self._arrays = (row_lo, row_hi)

    @functools.cached_property
    def pieces(self) -> tuple[Piece, ...]:
        return band_pieces(*self._arrays)


def pieces_of(mask: BlockMask) -> tuple[Piece, ...]:
    """An "interval" BlockMask's band pieces: the planner's (computed once), else from its arrays."""
    if mask.pieces is not None:
        return mask.pieces.pieces
    return band_pieces(mask.row_lo, mask.row_hi)


def visible_mask(vis: Visibility, pq: torch.Tensor, pk: torch.Tensor) -> torch.Tensor:
    """(len(pq), len(pk)) bool: the band and document rule element-wise (no key mask), on global positions."""
    diff = pq[:, None] - pk[None, :]  # pq - pk
    ok = torch.ones(diff.shape, dtype=torch.bool, device=diff.device)
    if vis.left is not None:
        ok &= diff <= vis.left
    if vis.right is not None:
        ok &= -diff <= vis.right
    if vis.cu_seqlens is not None:
        cu = torch.tensor(vis.cu_seqlens, dtype=torch.int64, device=diff.device)
        ok &= _doc_ids(cu, pq)[:, None] == _doc_ids(cu, pk)[None, :]
    return ok


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document boundaries from Hugging Face style position ids that restart at 0 for each document.

    Args:
        position_ids: (seq_len,) or (1, seq_len) integer tensor over the GLOBAL sequence, e.g.
            ``[0, 1, 2, 0, 1, 0, 1, 2, 3]`` for documents of lengths 3, 2 and 4. A new document starts at
            every 0 (and at position 0 of the sequence).

    Returns:
        int32 (num_docs + 1,) on the same device: ``[0, 3, 5, 9]`` for the example.
    """
    if not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"`position_ids` must be a torch.Tensor, got {type(position_ids).__name__}")
    if position_ids.dim() == 2 and position_ids.shape[0] == 1:
        position_ids = position_ids[0]
    if position_ids.dim() != 1 or position_ids.is_floating_point() or position_ids.is_complex():
        raise ValueError(
            "`position_ids` must be an integer tensor of shape (seq_len,) or (1, seq_len), got "
            f"{tuple(position_ids.shape)} {position_ids.dtype}"
        )
    n = position_ids.shape[0]
    starts = (position_ids == 0).nonzero().flatten()
    if n and (starts.numel() == 0 or int(starts[0]) != 0):
        starts = torch.cat([starts.new_zeros(1), starts])
    end = starts.new_full((1,), n)
    return torch.cat([starts, end]).to(torch.int32)
