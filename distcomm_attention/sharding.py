"""Sharding a sequence across ranks: ``Sharding``, ``shard_sequence``, ``gather_sequence``, ``position_ids``.

``shard_sequence`` keeps this rank's tokens of the full sequence under a layout (Note [Sequence layouts] in
planning/layouts.py), ``gather_sequence`` is its inverse (a ring all-gather) and ``position_ids`` gives the
global positions of the kept tokens, for rotary embeddings and learned positions. ``Sharding`` holds a
layout, group and ring size in one handle with the same three methods, to pass to the attention as well.

With the zigzag and striped layouts a rank's tokens are not a contiguous range of the sequence (see
Note [Sequence layouts] in layouts.py), so position-dependent layers (RoPE, ALiBi, learned position tables)
must be given each token's GLOBAL position. ``position_ids(n, layout)`` returns exactly the positions that
``shard_sequence(x, layout)`` keeps of a sequence of ``n * ring_size`` tokens, in the same order.

Note [Layout record]
    The layout is named twice: when the inputs are sharded and when attention runs over them; shards of one
    layout read as another give a wrong answer without any error. So ``shard_sequence`` (and
    ``Sharding.shard``) records, in this process, the layout it used for each ring: key = (the resolved
    group's name, the ring size); only when it consults a process group (not with ``rank=``), and not for a
    ring of one, where every layout is the identity. A call that leaves ``layout`` out (``ring_flash_attn``,
    ``RingAttention``, ``gather_sequence``, ``position_ids``) resolves it, for its own ring, as:

        layout="..." given           ->  used as given (the record never overrides it)
        sharding=Sharding(...) given ->  its layout
        one layout recorded          ->  that layout
        several layouts recorded     ->  ValueError naming them: pass layout= or sharding=
        nothing recorded             ->  "contiguous"

    The record is per-process state, so ranks may resolve differently: the resolved layout is one of the
    fields the ring verifies (Note [Verified signatures] in _validation.py), and a rank whose record differs
    from its peers', or is ambiguous, raises the same error as every other rank of the ring (the ambiguity
    is raised after the exchange, never by one rank alone). As for any option, a rank whose record changes
    alone after its ring verified a call is caught in check mode only (Note [Verified signatures]). Under
    torch.compile the layout left out is resolved when the compiled op runs. ``Sharding`` is the explicit
    handle, and the way to rely on no process state: shard with ``s.shard(x)`` and attend with
    ``ring_flash_attn(q, k, v, sharding=s)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from distcomm import _check
from distcomm.ring import RingComm
from distcomm_attention import _validation
from distcomm_attention.planning import layouts
from distcomm_attention.strategies.ring import ring_all_gather

__all__ = ["Sharding", "shard_sequence", "gather_sequence", "position_ids", "resolve_layout", "merge_sharding"]

# (group name, ring size) -> the distinct layouts shard_sequence used for that ring, in order (Note [Layout record])
_recorded: dict[tuple[str, int], tuple[str, ...]] = {}


def _ring_key(comm: RingComm) -> tuple[str, int]:
    return _validation._group_key(comm.group), comm.size


def _record(comm: RingComm, layout: str) -> None:
    if comm.size == 1:  # every layout of a ring of one is the identity
        return
    seen = _recorded.get(_ring_key(comm), ())
    if layout not in seen:
        _recorded[_ring_key(comm)] = seen + (layout,)


class ResolvedLayout(NamedTuple):
    """The layout a call uses (Note [Layout record]) and how the ring verifies and shows it."""

    layout: str  # "" when ambiguous
    field: _validation.Shown  # the verified "layout" field
    recorded: tuple[str, ...]  # the layouts shard_sequence recorded for this ring

    @property
    def ambiguous(self) -> bool:
        return not self.layout

    def raise_if_ambiguous(self, op: str) -> None:
        if self.ambiguous:
            raise ValueError(
                f"{op}: `layout` was left out, and shard_sequence recorded several layouts for this ring in this "
                f"process ({' and '.join(map(repr, self.recorded))}), so which one the shards use is ambiguous: "
                f"pass layout= (or sharding=Sharding(layout, ...)) explicitly"
            )


def resolve_layout(layout: str | None, comm: RingComm | None) -> ResolvedLayout:
    """``layout`` as given, or, for ``None``, the one recorded for ``comm``'s ring (Note [Layout record])."""
    if layout is not None:
        layouts.check_layout(layout)
        return ResolvedLayout(layout, _validation.Shown(layout, repr(layout)), ())
    recorded = _recorded.get(_ring_key(comm), ()) if comm is not None else ()
    if len(recorded) > 1:
        text = f"ambiguous (left out; shard_sequence recorded {' and '.join(map(repr, recorded))})"
        return ResolvedLayout("", _validation.Shown(("ambiguous",) + recorded, text), recorded)
    if recorded:
        return ResolvedLayout(recorded[0], _validation.Shown(recorded[0], f"{recorded[0]!r} (left out; recorded "
                                                             "by shard_sequence)"), recorded)
    return ResolvedLayout("contiguous", _validation.Shown("contiguous", "'contiguous' (left out; the default)"), ())


def _check_ring_size(ring_size) -> None:
    if ring_size is not None and (isinstance(ring_size, bool) or not isinstance(ring_size, int) or ring_size < 1):
        raise ValueError(f"`ring_size` must be a positive int or None (the whole group), got {ring_size!r}")


@dataclass(frozen=True)
class Sharding:
    """How a sequence is sharded across a ring: the layout, the ring's group and its size, in one handle.

    Shard with it and pass it to the attention, so the two cannot disagree::

        s = Sharding("zigzag", group=(mesh, "cp"))
        q, k, v = (s.shard(t) for t in (q_full, k_full, v_full))
        out = ring_flash_attn(q, k, v, causal=True, sharding=s)       # or RingAttention(..., sharding=s)

    Args:
        layout: "contiguous" (default), "zigzag" or "striped" (Note [Sequence layouts]).
        group: the ring's process group, a 1-D DeviceMesh or ``(mesh, dim_name)`` (``None``: the default group).
        ring_size: ranks per ring (``None``: the whole group).

    Raises:
        ValueError: an unknown layout or a ring size that is not a positive int.
    """

    layout: str = "contiguous"
    group: Any = field(default=None, kw_only=True)
    ring_size: int | None = field(default=None, kw_only=True)

    def __post_init__(self):
        layouts.check_layout(self.layout)
        _check_ring_size(self.ring_size)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's shard of the full sequence ``x`` (``shard_sequence``; records the layout)."""
        return shard_sequence(x, self.layout, dim=dim, ring_size=self.ring_size, group=self.group)

    def gather(self, x_local: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The full sequence on every rank of the ring from each rank's shard (``gather_sequence``)."""
        return gather_sequence(x_local, self.layout, dim=dim, ring_size=self.ring_size, group=self.group)

    def position_ids(self, local_seq: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of this rank's ``local_seq`` tokens (``position_ids``)."""
        return position_ids(local_seq, self.layout, ring_size=self.ring_size, group=self.group, device=device)


def _same(a, b) -> bool:
    return a is b or (type(a) is type(b) and bool(a == b))


def merge_sharding(sharding: Sharding | None, layout: str | None, group, ring_size) -> tuple[str | None, Any, Any]:
    """(layout, group, ring_size) from ``sharding`` and the separate arguments, which may only repeat it."""
    if sharding is None:
        return layout, group, ring_size
    if not isinstance(sharding, Sharding):
        raise TypeError(f"`sharding` must be a distcomm_attention.Sharding or None, got {type(sharding).__name__}")
    for name, given, held in (("layout", layout, sharding.layout), ("group", group, sharding.group),
                              ("ring_size", ring_size, sharding.ring_size)):
        if given is not None and not _same(given, held):
            raise ValueError(
                f"`{name}`={given!r} conflicts with `sharding`={sharding!r} ({name} {held!r}): pass the {name} "
                f"in one of them only"
            )
    return sharding.layout, sharding.group, sharding.ring_size


def position_ids(
    local_seq: int,
    layout: str | None = None,
    *,
    ring_size: int | None = None,
    group=None,
    rank: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global position ids of the ``local_seq`` tokens this rank holds under ``layout`` (no communication).

    Args:
        local_seq: tokens per rank (the global length is ``local_seq * ring_size``).
        layout: "contiguous", "zigzag" or "striped" (as in ``ring_flash_attn``). ``None``: the layout
            ``shard_sequence`` recorded for this ring in this process, else "contiguous" (Note [Layout
            record]; an explicit layout is never overridden). Required with ``rank``.
        ring_size: ranks per ring (``None``: the whole group).
        group: process group of the ring: a ProcessGroup, a 1-D DeviceMesh or ``(mesh, dim_name)``; a 2-D
            DeviceMesh ("ulysses", "ring"): the positions of this rank's hybrid shard.
        rank: the positions of this ring position instead of this process's (needs ``ring_size`` and
            ``layout``; no process group is consulted), e.g. to prepare every rank's inputs in one process.
        device: where to put the result (default: CPU).

    Returns:
        int64 (local_seq,): entry i is the global position of local token i. For 16 tokens on 4 ranks,
        rank 1 gets ``[4, 5, 6, 7]`` (contiguous), ``[2, 3, 12, 13]`` (zigzag), ``[1, 5, 9, 13]`` (striped).
        Equal to ``shard_sequence(torch.arange(local_seq * ring_size), layout, dim=0)``.

    Raises:
        ValueError / TypeError: unknown layout, a bad ``local_seq``, ``rank`` or ``ring_size``, both ``rank``
            and ``group``, ``rank`` without ``layout``, an odd ``local_seq`` for zigzag, or ``layout`` left out
            while ``shard_sequence`` recorded several layouts for this ring.
    """
    if layout is not None:
        layouts.check_layout(layout)
    if isinstance(local_seq, bool) or not isinstance(local_seq, int) or local_seq < 0:
        raise ValueError(f"`local_seq` must be an int >= 0 (tokens on this rank), got {local_seq!r}")
    if rank is not None and layout is None:
        raise ValueError(
            f"`rank`={rank!r} needs an explicit `layout` (no process group is consulted, so no layout recorded "
            f"by shard_sequence applies); pass one of {', '.join(map(repr, layouts.LAYOUTS))}"
        )
    mesh = _mesh_coords(group, ring_size) if rank is None else None
    if mesh is not None:  # the hybrids' shards of a 2-D mesh
        comm, rings, ring_rank, degree, piece = mesh
        resolved = resolve_layout(layout, comm)
        resolved.raise_if_ambiguous("position_ids")
        seq_len = local_seq * rings * degree
        layouts.check_local_length(resolved.layout, local_seq * degree, rings, name="`local_seq` x ulysses size")
        ids = layouts.hybrid_positions(resolved.layout, seq_len, rings, ring_rank, degree, piece)
        return ids if device is None else ids.to(device)
    comm, ring_size, rank = _ring_position(ring_size, group, rank)
    resolved = resolve_layout(layout, comm)
    resolved.raise_if_ambiguous("position_ids")  # nothing is communicated here: no peer waits
    layouts.check_local_length(resolved.layout, local_seq, ring_size, name="`local_seq`")
    ids = layouts.positions(resolved.layout, local_seq * ring_size, ring_size, rank)
    return ids if device is None else ids.to(device)


def _check_dim(dim) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"`dim` must be an int, got {dim!r}")


def is_2d_mesh(group) -> bool:
    """Whether ``group`` is a 2-D DeviceMesh (the hybrid strategies' group)."""
    return hasattr(group, "mesh_dim_names") and getattr(group, "ndim", 1) == 2


def _mesh_coords(group, ring_size) -> tuple[RingComm, int, int, int, int] | None:
    """For a 2-D DeviceMesh with dimensions "ulysses" and "ring" (the hybrid strategies): (the default
    group's ring, ring size, ring position, Ulysses size, Ulysses position); None for any other group (other
    2-D meshes then get RingComm's "pick the dim" error)."""
    if not is_2d_mesh(group):
        return None
    names = tuple(group.mesh_dim_names or ())
    if sorted(names) != ["ring", "ulysses"]:  # any other 2-D mesh: the caller must pick a dim (RingComm says so)
        return None
    if ring_size is not None:
        raise ValueError("`ring_size` does not apply to a 2-D mesh: its 'ring' dimension is the ring")
    coords = group.get_coordinate()
    ring_rank, ulysses_rank = coords[names.index("ring")], coords[names.index("ulysses")]
    sizes = dict(zip(names, group.mesh.shape))
    return RingComm(None), sizes["ring"], ring_rank, sizes["ulysses"], ulysses_rank


def _mesh_order(group, layout: str, seq_len: int) -> torch.Tensor:
    """Global positions of every rank's shard of a 2-D mesh, concatenated in the default group's rank order."""
    names = tuple(group.mesh_dim_names)
    ranks = group.mesh if names == ("ring", "ulysses") else group.mesh.t()  # (ring, ulysses) -> global rank
    by_rank = {}
    for r in range(ranks.shape[0]):
        for u in range(ranks.shape[1]):
            by_rank[int(ranks[r, u])] = layouts.hybrid_positions(layout, seq_len, ranks.shape[0], r, ranks.shape[1], u)
    return torch.cat([by_rank[g] for g in sorted(by_rank)])


def _ring_position(ring_size, group, rank) -> tuple[RingComm | None, int, int]:
    """(the ring, its size, this ring position), or (None, ring_size, rank) for an explicit ``rank``."""
    if rank is None:
        comm = RingComm(group, ring_size)
        return comm, comm.size, comm.rank
    if group is not None:
        raise ValueError("pass either `rank` (a ring position, no process group consulted) or `group`, not both")
    if ring_size is None:
        raise ValueError("`rank` needs `ring_size` (the number of ring positions)")
    layouts.check_position(ring_size, rank)
    return None, ring_size, rank


def shard_sequence(
    x: torch.Tensor,
    layout: str,
    *,
    dim: int = 1,
    ring_size: int | None = None,
    group=None,
    rank: int | None = None,
) -> torch.Tensor:
    """This rank's shard of the full sequence ``x`` (no communication).

    Records ``layout`` for this ring in this process (unless ``rank`` is given), so that a later
    ``ring_flash_attn`` / ``gather_sequence`` / ``position_ids`` call that leaves ``layout`` out uses the
    same one (Note [Layout record]).

    Args:
        x: the full sequence, e.g. (batch, seq_len, ...) with the sequence along ``dim``.
        layout: "contiguous", "zigzag" or "striped" (as in ``ring_flash_attn``).
        dim: the sequence dimension.
        ring_size: ranks per ring (``None``: the whole group).
        group: process group of the ring (or a 1-D DeviceMesh, or ``(mesh, dim_name)``); a 2-D DeviceMesh
            with dimensions "ulysses" and "ring" shards for the hybrid strategies (the layout over "ring",
            each shard cut into equal contiguous pieces over "ulysses").
        rank: take the shard of this ring position instead of this process's one (needs ``ring_size``;
            no process group is consulted, nothing is recorded), e.g. to shard a reference computed in one
            process.

    Returns:
        ``x`` reduced to seq_len // ring_size positions along ``dim``. Differentiable.

    Raises:
        ValueError: unknown layout, bad ``dim``/``rank``/``ring_size``, or a length the layout cannot split
            (zigzag: divisible by 2 * ring_size; others: by ring_size).
    """
    layouts.check_layout(layout)
    _check_dim(dim)
    mesh = _mesh_coords(group, ring_size) if rank is None else None
    if mesh is not None:  # the hybrids: the layout over the "ring" dimension, pieces over "ulysses"
        comm, rings, ring_rank, degree, piece = mesh
        seq_len, dim = layouts.seq_len_along(x, dim)
        layouts.check_local_length(layout, seq_len // rings, rings)
        if seq_len % (rings * degree):
            raise ValueError(f"sequence length {seq_len} along dim {dim} must divide by the mesh size "
                             f"{rings * degree} (ring {rings} x ulysses {degree})")
        index = layouts.hybrid_positions(layout, seq_len, rings, ring_rank, degree, piece).to(x.device)
        _record(comm, layout)
        return x.index_select(dim, index)
    comm, ring_size, rank = _ring_position(ring_size, group, rank)
    shard = layouts.shard(x, layout, ring_size, rank, dim)
    if comm is not None:
        _record(comm, layout)
    return shard


def gather_sequence(
    x_local: torch.Tensor,
    layout: str | None = None,
    *,
    dim: int = 1,
    ring_size: int | None = None,
    group=None,
) -> torch.Tensor:
    """The full sequence, on every rank of the ring, from each rank's shard (inverse of ``shard_sequence``).

    Only the ring's members communicate (a ring all-gather of W - 1 hops), so with ``ring_size`` smaller
    than the group each ring gathers its own sequence.

    Args:
        x_local: this rank's shard, the sequence along ``dim``; same shape and dtype on every rank of the
            ring (checked once per new shape, or on every call in distcomm's check mode).
        layout: the layout of the shards. ``None``: the layout ``shard_sequence`` recorded for this ring in
            this process, else "contiguous" (Note [Layout record]; an explicit layout is never overridden).
        dim: the sequence dimension.
        ring_size: ranks per ring (``None``: the whole group).
        group: process group of the ring (or a 1-D DeviceMesh, or ``(mesh, dim_name)``); a 2-D DeviceMesh
            ("ulysses", "ring"): the hybrids' shards, gathered over every rank of the mesh.

    Returns:
        The full sequence: local_len * W positions along ``dim``.

    Raises:
        ValueError / TypeError: bad input, raised before any communication; ranks that disagree (shapes,
            dtypes, ``dim``, the resolved layout) or a layout left out while several were recorded: the same
            error on every rank of the ring.

    Gradient (summing convention, total loss = sum of per-rank losses): rank r receives, for each position
    it holds, the sum over the ring's ranks of that position's grad (all_gather <-> reduce_scatter(sum)).
    """
    if layout is not None:
        layouts.check_layout(layout)
    _check_dim(dim)
    mesh = _mesh_coords(group, ring_size)
    comm, ring_size, _rank = (mesh[0], mesh[0].size, None) if mesh is not None else _ring_position(ring_size, group,
                                                                                                   None)
    resolved = resolve_layout(layout, comm)
    local_len, dim = layouts.seq_len_along(x_local, dim)

    def verify() -> None:
        _validation.verify_across_ring(
            "gather_sequence", comm, {"x_local": x_local}, extra={
                "dim": dim,
                "layout": resolved.field,
                "requires_grad": torch.is_grad_enabled() and x_local.requires_grad,
            }
        )

    # cross-rank facts first in check mode, so that every rank raises the same error; an ambiguous layout
    # is raised after the exchange, which every rank of the ring then raises alike (Note [Layout record])
    early = _check.is_check_mode() or resolved.ambiguous
    if early:
        verify()
        resolved.raise_if_ambiguous("gather_sequence")
    if mesh is None:
        layouts.check_local_length(resolved.layout, local_len, ring_size, name=f"local length along dim {dim}")
    else:
        layouts.check_local_length(resolved.layout, local_len * mesh[3], mesh[1],
                                   name=f"local length along dim {dim} x ulysses size")
    if not early:
        verify()
    cat = ring_all_gather(x_local, comm, dim)
    if mesh is not None:  # the hybrids' shards, in the default group's rank order
        order = _mesh_order(group, resolved.layout, local_len * ring_size).to(cat.device)
        return cat.index_select(dim, torch.argsort(order))
    return layouts.unshard_concat(cat, resolved.layout, ring_size, dim)
