"""scan: a prefix scan over the ranks of a group for an associative combine, with its exact gradient.

    combine          x on rank r               rank r receives (inclusive / exclusive)
    "sum"            a tensor                  x_0 + ... + x_r          / x_0 + ... + x_{r-1}  (rank 0: zeros)
    "affine"         (A, B): H -> H @ A + B    the maps of ranks 0..r   / 0..r-1 composed     (rank 0: (I, 0))
    a callable       a tensor or a tuple       combine(...combine(x_0, x_1)..., x_r) / up to x_{r-1}
                                               (rank 0: ``identity``)

Every combine runs the same algorithm (Note [Scan by gathered summaries]): one differentiable all-gather
of every rank's summary, then the local fold in torch ops, so autograd differentiates it exactly and the
all-gather's backward, a reduce-scatter (SUM), adds up every rank's share of each input's grad. The
gradient that this computes for the affine combine is derived in Note [Gradient of the affine scan].

Note [Scan by gathered summaries]
    Rank r needs the summaries of ranks 0..r. One all-gather hands every rank all W of them (packed into one
    flat tensor when their dtypes agree, so one collective for A and B together); rank r then folds rows
    0..r left to right (r combines; "sum" is one sum over rows):

        rank 0: x_0 ─┐                    ┌─► [x_0 x_1 x_2] ─► x_0                  (inclusive)
        rank 1: x_1 ─┼─ all_gather_tensor ┼─► [x_0 x_1 x_2] ─► x_0 ⊕ x_1
        rank 2: x_2 ─┘                    └─► [x_0 x_1 x_2] ─► (x_0 ⊕ x_1) ⊕ x_2

    Backward: autograd runs each rank's fold backward, giving rank r's grad for every row s <= r, and the
    all-gather's backward, reduce_scatter(SUM), gives row j's owner sum_r of those: the exact
    x̄_j = sum_r (dy_r/dx_j)^T g_r of Note [Gradient convention] in :mod:`distcomm.functional`. The
    identity handed to rank 0 of an exclusive scan is added to an empty sum over the gathered rows, so
    that output too requires grad whenever an input does and every rank joins the backward's collective.
    Traffic: W times the summary per rank, forward and backward, whatever the sequence length behind the
    summaries; "sum" gathers the whole tensor, which for large tensors moves more than a ring or log-depth
    scan would (not implemented).

Note [Gradient of the affine scan]
    Rank r's map M_r = (A_r, B_r) sends a state H (N x K) to H A_r + B_r (A_r: K x K, B_r: N x K). The inclusive scan gives rank r
    P_r = (PA_r, PB_r), M_0 applied first, then M_1, ..., then M_r:

        PA_r = PA_{r-1} A_r,    PB_r = PB_{r-1} A_r + B_r,    (PA_{-1}, PB_{-1}) = (I, 0)

    Let (ga_r, gb_r) be the grads arriving at P_r. P_r also feeds P_{r+1}, so its total adjoint (Ga_r, Gb_r)
    is a scan in reverse rank order with the transposed maps:

        Ga_r = ga_r + Ga_{r+1} A_{r+1}^T,    Gb_r = gb_r + Gb_{r+1} A_{r+1}^T,    (Ga_W, Gb_W) = (0, 0)

    and rank j's inputs receive

        B̄_j = Gb_j,    Ā_j = PA_{j-1}^T Ga_j + PB_{j-1}^T Gb_j

        forward    M_0 ─► P_0 ─► P_1 ─► P_2 ─► P_3          P_r = P_{r-1} then M_r
                          g_0    g_1    g_2    g_3           grads arriving at each rank's output
        backward   G_0 ◄─ G_1 ◄─ G_2 ◄─ G_3 ◄─ 0             G_r = g_r + G_{r+1} through A_{r+1}^T

    For the exclusive scan the grads arriving on rank r belong to P_{r-1}, and rank 0's identity passes
    none back. The gathered fold computes this same sum with the terms grouped by the rank that holds
    g_r (Note [Scan by gathered summaries]); tests/test_scan.py checks the formula above against autograd.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from distcomm import _check, _groups
from distcomm._all_gather import all_gather_tensor
from distcomm._movement_args import _needs_graph

__all__ = ["scan", "local_scan", "compose_affine"]

_NAMES = ("sum", "affine")
Parts = tuple[torch.Tensor, ...]


# ---------------------------------------------------------------------------------------------------------
# The combines and the local fold (pure functions, no communication)
# ---------------------------------------------------------------------------------------------------------


def compose_affine(left: Parts, right: Parts) -> Parts:
    """``left`` applied first, then ``right``: (A0, B0) then (A1, B1) = (A0 @ A1, B0 @ A1 + B1)."""
    (a0, b0), (a1, b1) = left, right
    return a0 @ a1, b0 @ a1 + b1


def _user_combine(combine: Callable, parts: Parts, single: bool) -> Callable[[Parts, Parts], Parts]:
    """The user's ``combine`` on tuples of parts (it sees values shaped like ``x``: a tensor when ``single``),
    raising a TypeError/ValueError naming ``combine`` when its result is not shaped like ``x``."""
    shapes = [tuple(p.shape) for p in parts]
    what = "a tensor" if single else f"a tuple of {len(shapes)} tensors"

    def checked(left: Parts, right: Parts) -> Parts:
        out = combine(left[0], right[0]) if single else combine(left, right)
        if single and isinstance(out, torch.Tensor):
            out = (out,)
        if not isinstance(out, (tuple, list)) or len(out) != len(shapes) or not all(
            isinstance(t, torch.Tensor) for t in out
        ):
            raise TypeError(f"`combine` must return {what}, shaped like `x`; got {type(out).__name__}")
        got = [tuple(t.shape) for t in out]
        if got != shapes:
            raise ValueError(f"`combine` returned shapes {got}; it must keep the shapes of `x`, {shapes}")
        return tuple(out)

    return checked


def _try_combine(fold, parts: Parts) -> None:
    """The user's combine (``_user_combine``'s check of it) tried once on this rank's own summary, before any
    communication: a combine that does not keep the shapes of ``x`` raises here, on every rank alike (each
    runs the same combine on summaries of the same shapes), instead of only on the ranks that combine after
    the exchange while rank 0, which combines nothing there, waits in the next one."""
    with torch.no_grad():
        fold(parts, parts)


def local_scan(
    rows: Parts, rank: int, *, combine: str | Callable[[Parts, Parts], Parts], exclusive: bool, identity: Parts
) -> Parts:
    """Rank ``rank``'s prefix of the gathered ``rows`` (each part shape (W, ...), row s = rank s's part).

    ``combine`` is "sum" or a function of two tuples of parts ("affine": :func:`compose_affine`);
    ``identity`` holds one tensor per part, broadcastable to a row's shape, returned (plus an empty sum
    over ``rows``, keeping it in the graph) when the prefix is empty.
    """
    stop = rank if exclusive else rank + 1
    if combine == "sum":  # in the parts' dtype, as the log-depth path and all_reduce sum (integers wrap alike)
        return tuple(r[:stop].sum(0, dtype=r.dtype) for r in rows)
    if stop == 0:
        return tuple(i + r[:0].sum(0) for i, r in zip(identity, rows))
    acc = tuple(r[0] for r in rows)
    for s in range(1, stop):
        acc = combine(acc, tuple(r[s] for r in rows))
    return acc


# ---------------------------------------------------------------------------------------------------------
# Validation (local, before any communication; Note [Collective verdicts] in distcomm._check)
# ---------------------------------------------------------------------------------------------------------


def _as_parts(name: str, value) -> Parts:
    """``value`` (a tensor or a non-empty tuple/list of tensors) as a tuple of tensors, else a TypeError."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and value:
        for i, t in enumerate(value):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"`{name}[{i}]` must be a torch.Tensor, got {type(t).__name__}")
        return tuple(value)
    raise TypeError(f"`{name}` must be a tensor or a non-empty tuple of tensors, got {type(value).__name__}")


def _parse(x, combine, exclusive, identity) -> Parts:
    """The checks every rank passes alike (types and options): ``x`` as parts."""
    if not isinstance(exclusive, bool):
        raise TypeError(f"`exclusive` must be a bool, got {type(exclusive).__name__} {exclusive!r}")
    if isinstance(combine, str):
        if combine not in _NAMES:
            raise ValueError(f"`combine`={combine!r} is not recognised; allowed: 'sum', 'affine' or a callable")
        if identity is not None:
            raise ValueError(f"`identity` is only for a callable `combine`; {combine!r} has its own")
    elif not callable(combine):
        raise TypeError(f"`combine` must be 'sum', 'affine' or a callable, got {type(combine).__name__} {combine!r}")
    if combine == "sum":
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"`x` must be a torch.Tensor for combine='sum', got {type(x).__name__}")
        if x.dtype == torch.bool:
            raise TypeError("`x` must be a numeric tensor for combine='sum' (the sum keeps x's dtype), got "
                            "torch.bool: pass x.int() or x.long()")
        return (x,)
    if combine == "affine":
        if not (isinstance(x, (tuple, list)) and len(x) == 2):
            raise TypeError(f"`x` must be a pair (A, B) of tensors for combine='affine', got {type(x).__name__}")
        return _as_parts("x", x)
    parts = _as_parts("x", x)
    if exclusive and identity is None:
        raise ValueError("`identity` is required for an exclusive scan with a callable `combine` (rank 0 gets it)")
    if identity is not None and len(_as_parts("identity", identity)) != len(parts):
        raise ValueError(
            f"`identity` holds {len(_as_parts('identity', identity))} tensors; it must hold one per tensor of "
            f"`x` ({len(parts)})"
        )
    return parts


def _affine_shapes(a: torch.Tensor, b: torch.Tensor) -> None:
    """A: (..., K, K), B: (..., N, K), the same leading dims and dtype (this rank's data)."""
    if a.dim() < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"`x` = (A, B): A must have shape (..., K, K), got {tuple(a.shape)}")
    k = a.shape[-1]
    if b.dim() != a.dim() or b.shape[:-2] != a.shape[:-2] or b.shape[-1] != k:
        raise ValueError(
            f"`x` = (A, B): B must have shape ({''.join(f'{d}, ' for d in a.shape[:-2])}N, {k}) for A of shape "
            f"{tuple(a.shape)}, got {tuple(b.shape)}"
        )
    if a.dtype != b.dtype or a.device != b.device:
        raise ValueError(
            f"`x` = (A, B): A ({a.dtype} on {a.device}) and B ({b.dtype} on {b.device}) must have the same "
            "dtype and device"
        )


def _identity_parts(combine, identity, parts: Parts) -> Parts:
    """The identity of the combine for ``parts``, checked against them (this rank's data)."""
    if combine == "sum":
        return (torch.zeros((), dtype=parts[0].dtype, device=parts[0].device),)
    if combine == "affine":
        a, b = parts
        _affine_shapes(a, b)
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        return eye, torch.zeros((), dtype=b.dtype, device=b.device)
    if identity is None:
        return ()
    ids = _as_parts("identity", identity)
    for i, (e, p) in enumerate(zip(ids, parts)):
        if e.dtype != p.dtype or e.device != p.device:
            raise ValueError(f"`identity[{i}]` has dtype {e.dtype} on {e.device}; `x[{i}]` has {p.dtype} on {p.device}")
        try:
            fits = torch.broadcast_shapes(e.shape, p.shape) == p.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"`identity[{i}]` of shape {tuple(e.shape)} does not broadcast to `x[{i}]`'s shape {tuple(p.shape)}"
            )
    return ids


# ---------------------------------------------------------------------------------------------------------
# Communication
# ---------------------------------------------------------------------------------------------------------


def _gather_rows(parts: Parts, group, n: int) -> Parts:
    """Every rank's parts stacked in rank order, each (W, *part.shape); differentiable (Note [Scan by
    gathered summaries]). Parts of one dtype and device travel in one all-gather."""
    if n == 1:
        return tuple(p.unsqueeze(0) for p in parts)
    first = parts[0]
    if any(p.dtype != first.dtype or p.device != first.device for p in parts):
        return tuple(all_gather_tensor(p.unsqueeze(0), 0, group) for p in parts)
    flat = torch.cat([p.reshape(-1) for p in parts]) if len(parts) > 1 else first.reshape(-1)
    rows = all_gather_tensor(flat.unsqueeze(0), 0, group)
    pieces = rows.split([p.numel() for p in parts], dim=1)
    return tuple(piece.reshape(n, *p.shape) for piece, p in zip(pieces, parts))


def scan(
    x: torch.Tensor | tuple[torch.Tensor, ...],
    *,
    combine: str | Callable = "sum",
    exclusive: bool = False,
    identity: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
    group: dist.ProcessGroup | None = None,
    positions: torch.Tensor | Sequence[int] | None = None,
    algorithm: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Prefix scan over the ranks of ``group``, in group-rank order; differentiable with the exact gradient.

    With ``positions`` each rank holds any number of pieces (a zigzag or balanced shard holds several runs of
    one sequence) and the scan runs over every piece of every rank in the order of their positions
    (Note [Scan of pieces]).

    Args:
        x: this rank's summary, the same shapes and dtypes on every rank (checked in check mode):
            ``combine="sum"``: a tensor of any shape S.
            ``combine="affine"``: a pair (A, B), A of shape (..., K, K) and B of shape (..., N, K) with the
            same leading (batch, heads) dims, standing for the map H -> H @ A + B on states H of shape
            (..., N, K) (for a linear-attention state S of shape (K, V): H = S^T, N = V, A = the transposed
            transition).
            a callable: a tensor or a tuple of tensors.
        combine: "sum" (elementwise), "affine" (map composition in rank order: (A0, B0) then (A1, B1) =
            (A0 @ A1, B0 @ A1 + B1)), or an associative ``combine(left, right)`` taking and returning
            values shaped like ``x`` (``left`` holds the lower ranks), written in differentiable torch ops.
            It is tried once on this rank's own summary before any communication, so a result not shaped
            like ``x`` raises the same error on every rank.
        exclusive: False: rank r receives x_0 ⊕ ... ⊕ x_r. True: x_0 ⊕ ... ⊕ x_{r-1}, and rank 0 the
            identity (zeros for "sum", (I, 0) for "affine", ``identity`` for a callable).
        identity: for a callable ``combine`` only: the identity, shaped like ``x`` (each tensor
            broadcastable to the matching tensor of ``x``); required when ``exclusive``.
        group: None (the default group, or a world of one without a process group), a ProcessGroup, a 1-D
            DeviceMesh or (mesh, dim).
        algorithm: "gather" (one all-gather of every rank's summary, then a local fold: one round, each rank
            moving W - 1 summaries), "log" (log-depth, Note [Log-depth scan]: ceil(log2 W) rounds of ring
            passes, each rank moving one summary a round; with ``positions`` not available), or "auto":
            "log" from 4 ranks when a summary is at least LOG_DEPTH_BYTES (eagerly), else "gather".
        positions: ``None``: one summary per rank, in rank order. Else this rank's P pieces' places in the
            scan order (P >= 0 distinct ints, distinct across ranks too; P may differ between ranks), and
            every tensor of ``x`` (and of the result) has a leading dim of P, one row per piece.

    Returns:
        Shaped like ``x``: a tensor for "sum", a pair (A, B) for "affine" (the composed map, so that
        H_after_r = H_in @ A + B), and for a callable a tensor or a tuple as ``x`` is. The backward is the
        reverse scan of the grads: for "sum", rank r receives sum_{s >= r} g_s (exclusive: s > r); for
        "affine" Note [Gradient of the affine scan]. One all-gather of W summaries forward and one
        reduce-scatter backward (Note [Scan by gathered summaries]); the combine runs in the inputs' dtype
        ("sum" of integers too, wrapping as all_reduce's sum does, whichever algorithm; bool is refused).
    """
    parts = _parse(x, combine, exclusive, identity)
    group, n, rank = _groups.resolve(group)
    if algorithm not in ("auto", "gather", "log"):
        raise ValueError(f"`algorithm`={algorithm!r} is not recognised; allowed: 'auto', 'gather' or 'log'")
    if positions is not None:
        if algorithm == "log":
            raise ValueError("`algorithm`='log' scans one summary per rank; with `positions` use 'gather' or 'auto'")
        return _scan_pieces(x, parts, positions, combine, exclusive, identity, group, n, rank)
    ident = _check.decide("scan", group, n, _identity_parts, combine, identity, parts)
    if n > 1 and _check.is_check_mode() and not torch.compiler.is_compiling():
        needs_grad = _needs_graph(*parts)
        for i, p in enumerate(parts):
            _check.check_same(f"scan (`x`[{i}])" if len(parts) > 1 else "scan", p, group, requires_grad=needs_grad)
    if combine == "affine":
        fold = compose_affine
    elif callable(combine):
        fold = _user_combine(combine, parts, isinstance(x, torch.Tensor))
        if n > 1:
            _try_combine(fold, parts)
    else:
        fold = combine
    size = sum(p.numel() * p.element_size() for p in parts)
    big = n >= 4 and size >= LOG_DEPTH_BYTES and not torch.compiler.is_compiling()  # compiled: the tested path
    if algorithm == "log" or (algorithm == "auto" and big):
        out = _log_scan(parts, fold, exclusive, ident, group, n, rank)
    else:
        out = local_scan(_gather_rows(parts, group, n), rank, combine=fold, exclusive=exclusive, identity=ident)
    if combine == "sum" or (callable(combine) and isinstance(x, torch.Tensor)):
        return out[0]
    return tuple(out)


# ---------------------------------------------------------------------------------------------------------
# Log depth
# ---------------------------------------------------------------------------------------------------------

LOG_DEPTH_BYTES = 1 << 16  # "auto" scans summaries of at least this many bytes in log depth (from 4 ranks)

"""
Note [Log-depth scan]
    Hillis and Steele's scan: every rank starts from its own summary y = x_r; in round d = 1, 2, 4, ... < W
    each rank passes y to rank r + d (``ring_pass``, differentiable) and, when r >= d, combines what it
    received in front of its own: y = recv ⊕ y, which then covers ranks max(0, r - 2d + 1) .. r. After
    ceil(log2 W) rounds y is the inclusive prefix; the exclusive one is one more pass by 1 (rank 0: the
    identity). Each rank moves one summary a round instead of W - 1 at once. The ranks r < d ignore what they
    received, but add an empty sum of it, so that their backward still runs the pass's adjoint their
    neighbours wait for (and no value of it, NaN or not, reaches their result). The backward is autograd
    through the rounds: the passes' adjoints send the grads back the other way.

        round 1:  y_r = x_{r-1} ⊕ x_r            round 2:  y_r = x_{r-3..r-2} ⊕ x_{r-1..r}     ...
"""


def _untouched(y: Parts, received: Parts) -> Parts:
    """``y`` with an empty sum of ``received`` added: the same values, ``received`` kept in the graph."""
    return tuple(p + q.reshape(-1)[:0].sum() for p, q in zip(y, received))


def _pass(parts: Parts, shift: int, group) -> Parts:
    from distcomm.ring import ring_pass

    if len(parts) > 1 and all(p.dtype == parts[0].dtype for p in parts):
        flat = torch.cat([p.reshape(-1) for p in parts])
        got = ring_pass(flat, shift, group, recv_shape=tuple(flat.shape))
        return tuple(g.reshape(p.shape) for g, p in zip(got.split([p.numel() for p in parts]), parts))
    return tuple(ring_pass(p, shift, group, recv_shape=tuple(p.shape)) for p in parts)


def _log_scan(parts: Parts, fold, exclusive: bool, ident: Parts, group, n: int, rank: int) -> Parts:
    """Rank ``rank``'s prefix by Note [Log-depth scan]."""
    y = parts
    d = 1
    while d < n:
        got = _pass(y, d, group)
        if rank >= d:
            y = tuple(a + b for a, b in zip(got, y)) if fold == "sum" else fold(got, y)
        else:
            y = _untouched(y, got)
        d *= 2
    if not exclusive:
        return y
    got = _pass(y, 1, group) if n > 1 else y
    if rank >= 1:
        return got
    return _untouched(tuple(i.expand_as(p).clone() for i, p in zip(ident, parts)), got)


# ---------------------------------------------------------------------------------------------------------
# Several pieces per rank
# ---------------------------------------------------------------------------------------------------------

"""
Note [Scan of pieces]
    Rank r holds P_r pieces with places p (ints, distinct over the group). One all-gather of the places (it
    also learns every P_r: a host sync) and one variable all-gather of the summaries give every rank every
    piece; each rank sorts them by place, folds them in that order once (prefix of every piece), and keeps
    its own pieces' prefixes. Differentiable like the one-piece scan: autograd through the fold, and the
    variable all-gather's backward (a variable reduce-scatter) sums each piece's grad on its owner.
    Duplicated places are seen alike by every rank after the exchange and raise the same ValueError there.

        rank 0: pieces at places 0 and 3     gathered, sorted: x_0 x_1 x_2 x_3     rank 0 keeps P_0, P_3
        rank 1: pieces at places 1 and 2     prefixes P_0 .. P_3 on every rank      rank 1 keeps P_1, P_2
"""


def _piece_places(positions, count: int, device: torch.device) -> torch.Tensor:
    """``positions`` as a 1-D int64 tensor of ``count`` distinct places (this rank's data)."""
    if isinstance(positions, torch.Tensor):
        if positions.dim() != 1 or positions.dtype.is_floating_point or positions.dtype == torch.bool:
            raise ValueError(f"`positions` must be a 1-D tensor of ints, got {positions.dtype} of shape "
                             f"{tuple(positions.shape)}")
        places = positions.to(device=device, dtype=torch.int64)
    else:
        try:
            values = [int(p) for p in positions]
        except (TypeError, ValueError):
            raise TypeError(f"`positions` must be a sequence of ints or a 1-D int tensor, got {positions!r}") from None
        if any(not isinstance(p, int) and not (isinstance(p, torch.Tensor) and p.dim() == 0) for p in positions):
            raise TypeError(f"`positions` must hold ints, got {list(positions)!r}")
        places = torch.tensor(values, dtype=torch.int64, device=device)
    if places.numel() != count:
        raise ValueError(f"`positions` holds {places.numel()} places; `x` has {count} pieces (its leading dim)")
    if places.numel() and torch.unique(places).numel() != places.numel():
        raise ValueError(f"`positions` must be distinct, got {places.tolist()}")
    return places


def _pieces_parts(combine, identity, parts: Parts, positions):
    """This rank's checks of a scan of pieces: (identity of one piece, places)."""
    count = parts[0].shape[0] if parts[0].dim() else None
    if count is None or any(p.dim() == 0 or p.shape[0] != count for p in parts):
        raise ValueError(f"with `positions`, every tensor of `x` has a leading dim of pieces; got shapes "
                         f"{[tuple(p.shape) for p in parts]}")
    one = tuple(p[0] if count else p.new_zeros(p.shape[1:]) for p in parts)
    return _identity_parts(combine, identity, one), _piece_places(positions, count, parts[0].device)


def _scan_pieces(x, parts: Parts, positions, combine, exclusive: bool, identity, group, n: int, rank: int):
    from distcomm._all_gather import all_gather_variable

    if n == 1:
        ident, places = _pieces_parts(combine, identity, parts, positions)
        every, sizes = places.tolist(), [places.numel()]
    else:  # this rank's verdict travels with its places: a bad `positions` raises on every rank
        try:
            (ident, places), error = _pieces_parts(combine, identity, parts, positions), None
            if callable(combine):  # tried on one piece (zeros where this rank has none)
                one = tuple(p[0] if places.numel() else p.new_zeros(p.shape[1:]) for p in parts)
                _try_combine(_user_combine(combine, one, isinstance(x, torch.Tensor)), one)
        except (TypeError, ValueError) as e:
            ident, places, error = None, torch.zeros(0, dtype=torch.int64, device=parts[0].device), e
        verdict = torch.tensor(_check.encode_verdict(error), dtype=torch.int64, device=places.device)
        gathered, lengths = all_gather_variable(torch.cat([verdict, places]), 0, None, group)
        rows = gathered.tolist()
        starts = [sum(lengths[:r]) for r in range(n)]
        _check.raise_verdicts("scan", [rows[a:a + _check.VERDICT_WIDTH] for a in starts])
        sizes = [length - _check.VERDICT_WIDTH for length in lengths]
        every = [p for a, length in zip(starts, lengths) for p in rows[a + _check.VERDICT_WIDTH:a + length]]
    count = places.numel()
    if len(set(every)) != len(every):
        seen = sorted({p for p in every if every.count(p) > 1})
        raise ValueError(f"scan: `positions` must be distinct across the group; places {seen} are given by more "
                         "than one piece (every rank raises this error)")
    flat = [p.reshape(p.shape[0], math.prod(p.shape[1:])) for p in parts]
    widths = [f.shape[1] for f in flat]
    same = all(p.dtype == parts[0].dtype and p.device == parts[0].device for p in parts)
    if n == 1:
        rows = flat
    elif same:
        joined = torch.cat(flat, dim=1) if len(flat) > 1 else flat[0]
        rows = list(all_gather_variable(joined, 0, sizes, group)[0].split(widths, dim=1))
    else:
        rows = [all_gather_variable(f, 0, sizes, group)[0] for f in flat]
    rows = [r.reshape(r.shape[0], *p.shape[1:]) for r, p in zip(rows, parts)]
    order = sorted(range(len(every)), key=every.__getitem__)
    if combine == "affine":
        fold = compose_affine
    elif callable(combine):
        fold = _user_combine(combine, tuple(r[0] for r in rows) if rows[0].shape[0] else parts,
                             isinstance(x, torch.Tensor))
    else:
        fold = None  # "sum"
    prefix: dict[int, Parts] = {}
    acc = None
    for j in order:
        piece = tuple(r[j] for r in rows)
        if exclusive:
            # the identity plus an empty sum over the gathered rows: in the graph, so every rank's backward
            # reaches the all-gather's reduce-scatter (Note [Scan by gathered summaries])
            prefix[j] = tuple(i + r[:0].sum(0) for i, r in zip(ident, rows)) if acc is None else acc
        if fold is None:
            acc = piece if acc is None else tuple(a + b for a, b in zip(acc, piece))
        else:
            acc = piece if acc is None else fold(acc, piece)
        if not exclusive:
            prefix[j] = acc
    first = sum(sizes[:rank])
    mine = [prefix[first + i] for i in range(count)]
    if count:
        out = tuple(torch.stack([m[k] for m in mine]) for k in range(len(parts)))
    else:
        out = tuple(p.new_zeros(p.shape) + r[:0].sum() for p, r in zip(parts, rows))
    if combine == "sum" or (callable(combine) and isinstance(x, torch.Tensor)):
        return out[0]
    return tuple(out)
