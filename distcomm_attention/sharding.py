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
    fields the ring verifies (Note [Collective verdicts] in _validation.py), and a rank whose record differs
    from its peers', or is ambiguous, raises the same error as every other rank of the ring (the ambiguity
    is raised after the exchange, never by one rank alone). The exchange runs on every call, so a rank whose
    record changes alone after its ring verified a call is caught by the next call (Note [Collective verdicts]). Under
    torch.compile the layout left out is resolved when the compiled op runs. ``Sharding`` is the explicit
    handle, and the way to rely on no process state: shard with ``s.shard(x)`` and attend with
    ``ring_flash_attn(q, k, v, sharding=s)``.

Note [Balanced sharding]
    The data-dependent layouts ("balanced", "auto"; Note [Balanced layout] in planning/balance.py) place tokens
    from the documents (cu_seqlens) and, optionally, a balance window (the attention's left window, which
    changes the work per token). Every call that needs the placement must compute the same one:
    ``shard_sequence``, ``gather_sequence``, ``position_ids``, ``Sharding.shard_labels`` and the attention.
    Each takes ``cu_seqlens``; the balance window travels with a ``Sharding`` (``balance_window=``, carried
    in its ``spec`` as "balanced:1023"), or is looked up: ``shard_sequence`` records, per ring (the key of
    Note [Layout record]), the (cu_seqlens, balance window) pairs it placed, the 32 most recent. A call given
    cu_seqlens that were recorded uses the window recorded with them; with nothing recorded for the ring it
    uses none; with other documents recorded and never these it raises a ValueError naming cu_seqlens (the
    shards cannot be what the call assumes). The placement is cached by (cu_seqlens, S, W, window).

    Across ranks: the attention verifies cu_seqlens and the balance window it placed with (the field
    ``balance_window``) like every other call fact (Note [Collective verdicts]); the lookup's error is found
    before the exchange and raised after it, so a rank whose documents were never sharded ends the call on
    every rank with the same error instead of raising alone while its peers wait.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

import distcomm.functional as dfunc
from distcomm import _groups
from distcomm.ring import RingComm
from distcomm_attention import _validation
from distcomm_attention._device import to_device
from distcomm_attention.planning import balance, layouts
from distcomm_attention.strategies.ring import ring_all_gather

__all__ = ["Sharding", "shard_sequence", "gather_sequence", "position_ids", "resolve_layout", "merge_sharding",
           "concrete_layout", "balance_window_of"]

# (group name, ring size) -> the distinct layouts shard_sequence used for that ring, in order (Note [Layout record])
_recorded: dict[tuple[str, int], tuple[str, ...]] = {}


def _ring_key(comm: RingComm) -> tuple[str, int]:
    return _validation._group_key(comm.group), comm.size


# (group name, ring size) -> the (cu_seqlens, balance window) the data-dependent layouts were computed for,
# most recent last (Note [Balanced sharding])
_specs: dict[tuple[str, int], list[tuple[tuple[int, ...] | None, int | None]]] = {}
_SPECS_KEPT = 32


def _record(comm: RingComm, layout: str, docs: tuple[int, ...] | None = None) -> None:
    if comm.size == 1:  # every layout of a ring of one is the identity
        return
    name, window = layouts.split_spec(layout)
    seen = _recorded.get(_ring_key(comm), ())
    if name not in seen:
        _recorded[_ring_key(comm)] = seen + (name,)
    if name in layouts.DATA_DEPENDENT:
        specs = _specs.setdefault(_ring_key(comm), [])
        if (docs, window) in specs:
            specs.remove((docs, window))
        specs.append((docs, window))
        del specs[:-_SPECS_KEPT]


def _docs_text(docs) -> str:
    if docs is None:
        return "None (one document)"
    return str(list(docs)) if len(docs) <= 8 else f"[{', '.join(map(str, docs[:4]))}, ..., {docs[-1]}] ({len(docs) - 1} documents)"


def balance_window_of(layout, comm: RingComm | None, docs: tuple[int, ...] | None, op: str) -> int | None:
    """The balance window a data-dependent layout places these documents with (None: no window; also for the
    static layouts): the layout's own ("name:window", a ``Sharding`` with ``balance_window``), else the one
    ``shard_sequence`` recorded for these documents on this ring (Note [Balanced sharding]). ValueError naming
    cu_seqlens when shard_sequence sharded other documents for this ring and never these."""
    name, window = layouts.split_spec(layout)
    if name not in layouts.DATA_DEPENDENT or window is not None or comm is None:
        return window
    specs = _specs.get(_ring_key(comm), [])
    windows = [w for d, w in reversed(specs) if d == docs]
    if specs and not windows:
        raise ValueError(
            f"{op}: layout {name!r} places tokens by their documents, and this call's cu_seqlens="
            f"{_docs_text(docs)} are not documents shard_sequence sharded for this ring (most recent: "
            f"cu_seqlens={_docs_text(specs[-1][0])}): pass the same cu_seqlens to shard_sequence (or "
            "Sharding.shard) and to the attention"
        )
    return windows[0] if windows else None


def concrete_layout(layout, comm: RingComm | None, seq_len: int, ring_size: int,
                    docs: tuple[int, ...] | None, op: str):
    """The planner's layout (a static name or an ``Assignment``) of a resolved layout for this call's documents,
    placed with the window ``balance_window_of`` finds (see Note [Balanced sharding])."""
    name, _ = layouts.split_spec(layout)
    if name not in layouts.DATA_DEPENDENT:
        return name
    window = balance_window_of(layout, comm, docs, op)
    return balance.resolve(layouts.spec(name, window), seq_len, ring_size, docs)


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
        name, window = layouts.split_spec(layout)
        text = repr(layout) if window is None else f"{name!r} with balance_window={window}"
        return ResolvedLayout(layout, _validation.Shown(layout, text), ())
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
    balance_window: int | None = field(default=None, kw_only=True)

    def __post_init__(self):
        layouts.check_layout(self.layout)
        if ":" in self.layout:
            raise ValueError(f"Invalid layout {self.layout!r}: pass the window as balance_window=")
        _check_ring_size(self.ring_size)
        _check_balance_window(self.layout, self.balance_window)

    @property
    def spec(self) -> str:
        """The layout as the attention receives it (with the balance window of a data-dependent layout)."""
        return layouts.spec(self.layout, self.balance_window)

    def shard(self, x: torch.Tensor, dim: int = 1, *, cu_seqlens=None) -> torch.Tensor:
        """This rank's shard of the full sequence ``x`` (``shard_sequence``; records the layout)."""
        return shard_sequence(x, self.layout, dim=dim, ring_size=self.ring_size, group=self.group,
                              cu_seqlens=cu_seqlens, balance_window=self.balance_window)

    def gather(self, x_local: torch.Tensor, dim: int = 1, *, cu_seqlens=None) -> torch.Tensor:
        """The full sequence on every rank of the ring from each rank's shard (``gather_sequence``)."""
        return gather_sequence(x_local, self.layout, dim=dim, ring_size=self.ring_size, group=self.group,
                               cu_seqlens=cu_seqlens, balance_window=self.balance_window)

    def position_ids(self, local_seq: int, device: torch.device | str | None = None, *,
                     cu_seqlens=None) -> torch.Tensor:
        """Global positions of this rank's ``local_seq`` tokens (``position_ids``)."""
        return position_ids(local_seq, self.layout, ring_size=self.ring_size, group=self.group, device=device,
                            cu_seqlens=cu_seqlens, balance_window=self.balance_window)

    def shard_labels(self, labels: torch.Tensor, dim: int = 1, *, cu_seqlens=None,
                     ignore_index: int = -100) -> torch.Tensor:
        """This rank's next-token targets: ``labels`` shifted by one on the FULL sequence (the target of the
        token at global position t is ``labels[t + 1]``; the last token of each document, and of the
        sequence, gets ``ignore_index``), then sharded like the tokens. Shifting after sharding would be
        wrong for every layout but contiguous (a rank's next local token is not the next global one)."""
        return shard_sequence(shift_labels(labels, dim, cu_seqlens=cu_seqlens, ignore_index=ignore_index),
                              self.layout, dim=dim, ring_size=self.ring_size, group=self.group,
                              cu_seqlens=cu_seqlens, balance_window=self.balance_window)


def _check_balance_window(layout: str, balance_window) -> None:
    layouts.check_balance_window(balance_window)
    if balance_window is not None and layouts.split_spec(layout)[0] not in layouts.DATA_DEPENDENT:
        raise ValueError(f"`balance_window`={balance_window!r} applies to layout 'balanced' or 'auto' (tokens "
                         f"placed by their documents), not to layout={layout!r}")


def _with_window(layout: str, balance_window) -> str:
    """``layout`` carrying ``balance_window`` (``layouts.split_spec``), after checking it."""
    _check_balance_window(layout, balance_window)
    return layout if balance_window is None else layouts.spec(layouts.split_spec(layout)[0], balance_window)


def shift_labels(labels: torch.Tensor, dim: int = 1, *, cu_seqlens=None, ignore_index: int = -100) -> torch.Tensor:
    """Next-token targets of the full sequence: position t gets ``labels[t + 1]``; the last position of each
    document (``cu_seqlens``) and of the sequence gets ``ignore_index``."""
    seq_len, dim = layouts.seq_len_along(labels, dim)
    docs = _validation.check_cu_seqlens(cu_seqlens, seq_len)
    out = torch.full_like(labels, ignore_index)
    out.narrow(dim, 0, seq_len - 1).copy_(labels.narrow(dim, 1, seq_len - 1))
    if docs is not None:
        ends = to_device(torch.tensor(docs[1:], dtype=torch.long), labels.device) - 1
        out.index_fill_(dim, ends, ignore_index)
    return out


def _same(a, b) -> bool:
    return a is b or (type(a) is type(b) and bool(a == b))


def fallback_group(sharding, group):
    """The group an input error is decided over when the arguments could not be read (``merge_sharding``
    raised): ``group`` if given, else a ``Sharding``'s own."""
    return group if group is not None or not isinstance(sharding, Sharding) else sharding.group


def merge_sharding(sharding: Sharding | None, layout: str | None, group, ring_size) -> tuple[str | None, Any, Any]:
    """(layout, group, ring_size) from ``sharding`` and the separate arguments, which may only repeat it."""
    if sharding is None:
        return layout, group, ring_size
    if not isinstance(sharding, Sharding):
        raise TypeError(f"`sharding` must be a distcomm_attention.Sharding or None, got {type(sharding).__name__}")
    for name, given, held in (("layout", layout, sharding.layout), ("group", group, sharding.group),
                              ("ring_size", ring_size, sharding.ring_size)):
        if given is not None and not _same(given, held) and not (name == "layout" and given == sharding.spec):
            raise ValueError(
                f"`{name}`={given!r} conflicts with `sharding`={sharding!r} ({name} {held!r}): pass the {name} "
                f"in one of them only"
            )
    return sharding.spec, sharding.group, sharding.ring_size


def position_ids(
    local_seq: int,
    layout: str | None = None,
    *,
    ring_size: int | None = None,
    group=None,
    rank: int | None = None,
    device: torch.device | str | None = None,
    cu_seqlens=None,
    balance_window: int | None = None,
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
        device: where to put the result (default: CPU). On CUDA it is copied without blocking the host, in
            order on the current stream: read it on that stream (or wait for it on another).
        cu_seqlens, balance_window: the documents (and window) of layout "balanced" / "auto", as given to
            ``shard_sequence`` (Note [Balanced sharding]); ignored by the other layouts.

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
        layout = _with_window(layout, balance_window)
    elif balance_window is not None:
        raise ValueError("`balance_window` needs an explicit layout ('balanced' or 'auto')")
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
        docs = _validation.check_cu_seqlens(cu_seqlens, seq_len)
        concrete = concrete_layout(resolved.layout, comm, seq_len, rings, docs, "position_ids")
        ids = layouts.hybrid_positions(concrete, seq_len, rings, ring_rank, degree, piece)
        return ids if device is None else to_device(ids, torch.device(device))
    comm, ring_size, rank = _ring_position(ring_size, group, rank)
    resolved = resolve_layout(layout, comm)
    resolved.raise_if_ambiguous("position_ids")  # nothing is communicated here: no peer waits
    layouts.check_local_length(resolved.layout, local_seq, ring_size, name="`local_seq`")
    docs = _validation.check_cu_seqlens(cu_seqlens, local_seq * ring_size)
    concrete = concrete_layout(resolved.layout, comm, local_seq * ring_size, ring_size, docs, "position_ids")
    ids = layouts.positions(concrete, local_seq * ring_size, ring_size, rank)
    return ids if device is None else to_device(ids, torch.device(device))


def _check_dim(dim) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"`dim` must be an int, got {dim!r}")


def is_2d_mesh(group) -> bool:
    """Whether ``group`` is a 2-D DeviceMesh (the hybrid strategies' group)."""
    return hasattr(group, "mesh_dim_names") and getattr(group, "ndim", 1) == 2


def mesh_grid(mesh) -> tuple[tuple[int, ...], ...]:
    """The default group's rank at each (ring, ulysses) coordinate of a hybrid mesh (``resolve_mesh``'s)."""
    grid = mesh.mesh
    if tuple(mesh.mesh_dim_names).index("ring") != 0:
        grid = grid.t()
    return tuple(tuple(int(x) for x in row) for row in grid.tolist())


def mesh_field(grid) -> tuple[int, ...]:
    """The verified field "mesh": the grid's ranks row by row (the ranks of a call agree on its grid); () for
    no mesh."""
    return tuple(rank for row in grid or () for rank in row)


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
    cu_seqlens=None,
    balance_window: int | None = None,
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
        cu_seqlens: the documents' boundaries over the full sequence, for layout "balanced" / "auto"
            (Note [Balanced sharding]); the attention must be given the same. Ignored by the static layouts.
        balance_window: "balanced" / "auto" only: the attention's left window (``window_size[0]``) the work
            is balanced for; ``None``: no window.

    Returns:
        ``x`` reduced to seq_len // ring_size positions along ``dim``. Differentiable.

    Raises:
        ValueError: unknown layout, bad ``dim``/``rank``/``ring_size``, or a length the layout cannot split
            (zigzag: divisible by 2 * ring_size; others: by ring_size).
    """
    layouts.check_layout(layout)
    layout = _with_window(layout, balance_window)
    _check_dim(dim)
    seq_len, dim = layouts.seq_len_along(x, dim)
    docs = _validation.check_cu_seqlens(cu_seqlens, seq_len)
    mesh = _mesh_coords(group, ring_size) if rank is None else None
    if mesh is not None:  # the hybrids: the layout over the "ring" dimension, pieces over "ulysses"
        comm, rings, ring_rank, degree, piece = mesh
        layouts.check_local_length(layout, seq_len // rings, rings)
        if seq_len % (rings * degree):
            raise ValueError(f"sequence length {seq_len} along dim {dim} must divide by the mesh size "
                             f"{rings * degree} (ring {rings} x ulysses {degree})")
        concrete = balance.resolve(layout, seq_len, rings, docs)
        index = to_device(layouts.hybrid_positions(concrete, seq_len, rings, ring_rank, degree, piece), x.device)
        _record(comm, layout, docs)
        return x.index_select(dim, index)
    comm, ring_size, rank = _ring_position(ring_size, group, rank)
    layouts.check_global_length(layout, seq_len, ring_size)
    shard = layouts.shard(x, balance.resolve(layout, seq_len, ring_size, docs), ring_size, rank, dim)
    if comm is not None:
        _record(comm, layout, docs)
    return shard


def _gather_ring(group, ring_size):
    """(mesh coordinates or None, the ring, its size) of a ``gather_sequence`` call."""
    mesh = _mesh_coords(group, ring_size)
    if mesh is not None:
        return mesh, mesh[0], mesh[0].size
    comm, size, _ = _ring_position(ring_size, group, None)
    return None, comm, size


def gather_sequence(
    x_local: torch.Tensor,
    layout: str | None = None,
    *,
    dim: int = 1,
    ring_size: int | None = None,
    group=None,
    cu_seqlens=None,
    balance_window: int | None = None,
) -> torch.Tensor:
    """The full sequence, on every rank of the ring, from each rank's shard (inverse of ``shard_sequence``).

    One all-gather over the group; with ``ring_size`` smaller than the group only the ring's members
    communicate (W - 1 ring hops), so each ring gathers its own sequence.

    Args:
        x_local: this rank's shard, the sequence along ``dim``; same shape and dtype on every rank of the
            ring (checked on every call, Note [Collective verdicts] in distcomm_attention/_validation.py).
        layout: the layout of the shards. ``None``: the layout ``shard_sequence`` recorded for this ring in
            this process, else "contiguous" (Note [Layout record]; an explicit layout is never overridden).
        dim: the sequence dimension.
        ring_size: ranks per ring (``None``: the whole group).
        group: process group of the ring (or a 1-D DeviceMesh, or ``(mesh, dim_name)``); a 2-D DeviceMesh
            ("ulysses", "ring"): the hybrids' shards, gathered over every rank of the mesh.
        cu_seqlens, balance_window: the documents (and window) of layout "balanced" / "auto", as given to
            ``shard_sequence``; ignored by the other layouts.

    Returns:
        The full sequence: local_len * W positions along ``dim``.

    Raises:
        ValueError / TypeError: bad input, raised before any communication; ranks that disagree (shapes,
            dtypes, ``dim``, the resolved layout) or a layout left out while several were recorded: the same
            error on every rank of the ring.

    Gradient (summing convention, total loss = sum of per-rank losses): rank r receives, for each position
    it holds, the sum over the ring's ranks of that position's grad (all_gather <-> reduce_scatter(sum)).
    """
    ring, error = _validation.verdict(_gather_ring, group, ring_size)
    mesh, comm, ring_size = ring or (None, RingComm(None) if is_2d_mesh(group) else RingComm(group), 1)
    facts: dict = {"dim": dim, "layout": None, "cu_seqlens": None}

    def local_checks():
        nonlocal layout, dim
        if error is not None:
            raise error
        if layout is not None:
            layouts.check_layout(layout)
            layout = _with_window(layout, balance_window)
        elif balance_window is not None:
            raise ValueError("`balance_window` needs an explicit layout ('balanced' or 'auto')")
        _validation.check_is_tensor("x_local", x_local)
        _check_dim(dim)
        resolved = resolve_layout(layout, comm)
        local_len, dim = layouts.seq_len_along(x_local, dim)
        seq_len = local_len * (ring_size if mesh is None else mesh[1] * mesh[3])
        docs = _validation.check_cu_seqlens(cu_seqlens, seq_len)
        facts.update(dim=dim, layout=resolved.field,
                     cu_seqlens=docs if layouts.split_spec(resolved.layout)[0] in layouts.DATA_DEPENDENT else None)
        if not resolved.ambiguous:  # raised after the exchange, by every rank alike (Note [Layout record])
            if mesh is None:
                layouts.check_local_length(resolved.layout, local_len, ring_size,
                                           name=f"local length along dim {dim}")
            else:
                layouts.check_local_length(resolved.layout, local_len * mesh[3], mesh[1],
                                           name=f"local length along dim {dim} x ulysses size")
            rings = ring_size if mesh is None else mesh[1]
            return resolved, seq_len, concrete_layout(resolved.layout, comm, seq_len, rings, docs, "gather_sequence")
        return resolved, seq_len, None

    checked, local_error = _validation.verdict(local_checks)
    requires_grad = torch.is_grad_enabled() and isinstance(x_local, torch.Tensor) and x_local.requires_grad
    _validation.verify_across_ring("gather_sequence", comm, {"x_local": x_local},
                                   extra={**facts, "requires_grad": requires_grad}, error=local_error)
    resolved, seq_len, concrete = checked
    resolved.raise_if_ambiguous("gather_sequence")
    if comm.size == _groups.group_size(comm.group):  # one all-gather (a ring inside a larger group: W - 1 hops)
        cat = dfunc.all_gather_tensor(x_local.contiguous(), dim, comm.group)
    else:
        cat = ring_all_gather(x_local, comm, dim)
    if mesh is not None:  # the hybrids' shards, in the default group's rank order
        return cat.index_select(dim, to_device(torch.argsort(_mesh_order(group, concrete, seq_len)), cat.device))
    return layouts.unshard_concat(cat, concrete, ring_size, dim)
