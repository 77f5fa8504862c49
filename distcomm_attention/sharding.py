"""Sharding a sequence across ranks: ``shard_sequence``, ``gather_sequence`` and ``position_ids``.

``shard_sequence`` keeps this rank's tokens of the full sequence under a layout (Note [Sequence layouts] in
planning/layouts.py), ``gather_sequence`` is its inverse (a ring all-gather) and ``position_ids`` gives the
global positions of the kept tokens, for rotary embeddings and learned positions.

With the zigzag and striped layouts a rank's tokens are not a contiguous range of the sequence (see
Note [Sequence layouts] in layouts.py), so position-dependent layers (RoPE, ALiBi, learned position tables)
must be given each token's GLOBAL position. ``position_ids(n, layout)`` returns exactly the positions that
``shard_sequence(x, layout)`` keeps of a sequence of ``n * ring_size`` tokens, in the same order.
"""

from __future__ import annotations

import torch

from distcomm import _check
from distcomm.ring import RingComm
from distcomm_attention import _validation
from distcomm_attention.planning import layouts
from distcomm_attention.strategies.ring import ring_all_gather

__all__ = ["shard_sequence", "gather_sequence", "position_ids"]


def position_ids(
    local_seq: int,
    layout: str,
    *,
    ring_size: int | None = None,
    group=None,
    rank: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global position ids of the ``local_seq`` tokens this rank holds under ``layout`` (no communication).

    Args:
        local_seq: tokens per rank (the global length is ``local_seq * ring_size``).
        layout: "contiguous", "zigzag" or "striped" (as in ``ring_flash_attn``).
        ring_size: ranks per ring (``None``: the whole group).
        group: process group of the ring: a ProcessGroup, a 1-D DeviceMesh or ``(mesh, dim_name)``.
        rank: the positions of this ring position instead of this process's (needs ``ring_size``; no process
            group is consulted), e.g. to prepare every rank's inputs in one process.
        device: where to put the result (default: CPU).

    Returns:
        int64 (local_seq,): entry i is the global position of local token i. For 16 tokens on 4 ranks,
        rank 1 gets ``[4, 5, 6, 7]`` (contiguous), ``[2, 3, 12, 13]`` (zigzag), ``[1, 5, 9, 13]`` (striped).
        Equal to ``shard_sequence(torch.arange(local_seq * ring_size), layout, dim=0)``.

    Raises:
        ValueError / TypeError: unknown layout, a bad ``local_seq``, ``rank`` or ``ring_size``, both ``rank``
            and ``group``, or an odd ``local_seq`` for zigzag.
    """
    layouts.check_layout(layout)
    if isinstance(local_seq, bool) or not isinstance(local_seq, int) or local_seq < 0:
        raise ValueError(f"`local_seq` must be an int >= 0 (tokens on this rank), got {local_seq!r}")
    if rank is None:
        comm = RingComm(group, ring_size)
        ring_size, rank = comm.size, comm.rank
    else:
        if group is not None:
            raise ValueError("pass either `rank` (a ring position, no process group consulted) or `group`, not both")
        if ring_size is None:
            raise ValueError("`rank` needs `ring_size` (the number of ring positions)")
        layouts.check_position(ring_size, rank)
    layouts.check_local_length(layout, local_seq, ring_size, name="`local_seq`")
    ids = layouts.positions(layout, local_seq * ring_size, ring_size, rank)
    return ids if device is None else ids.to(device)


def _ring_position(layout, dim, ring_size, group, rank) -> tuple[RingComm | None, int, int]:
    layouts.check_layout(layout)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"`dim` must be an int, got {dim!r}")
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

    Args:
        x: the full sequence, e.g. (batch, seq_len, ...) with the sequence along ``dim``.
        layout: "contiguous", "zigzag" or "striped" (as in ``ring_flash_attn``).
        dim: the sequence dimension.
        ring_size: ranks per ring (``None``: the whole group).
        group: process group of the ring (or a 1-D DeviceMesh, or ``(mesh, dim_name)``).
        rank: take the shard of this ring position instead of this process's one (needs ``ring_size``;
            no process group is consulted), e.g. to shard a reference computed in one process.

    Returns:
        ``x`` reduced to seq_len // ring_size positions along ``dim``. Differentiable.

    Raises:
        ValueError: unknown layout, bad ``dim``/``rank``/``ring_size``, or a length the layout cannot split
            (zigzag: divisible by 2 * ring_size; others: by ring_size).
    """
    _comm, ring_size, rank = _ring_position(layout, dim, ring_size, group, rank)
    return layouts.shard(x, layout, ring_size, rank, dim)


def gather_sequence(
    x_local: torch.Tensor,
    layout: str,
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
        layout: the layout of the shards.
        dim: the sequence dimension.
        ring_size: ranks per ring (``None``: the whole group).
        group: process group of the ring (or a 1-D DeviceMesh, or ``(mesh, dim_name)``).

    Returns:
        The full sequence: local_len * W positions along ``dim``.

    Gradient (summing convention, total loss = sum of per-rank losses): rank r receives, for each position
    it holds, the sum over the ring's ranks of that position's grad (all_gather <-> reduce_scatter(sum)).
    """
    comm, ring_size, _rank = _ring_position(layout, dim, ring_size, group, None)
    local_len, dim = layouts.seq_len_along(x_local, dim)

    def verify() -> None:
        _validation.verify_across_ring(
            "gather_sequence", comm, {"x_local": x_local}, extra={
                "dim": dim,
                "layout": layouts.LAYOUTS.index(layout),
                "requires_grad": int(torch.is_grad_enabled() and x_local.requires_grad),
            }
        )

    check_mode = _check.is_check_mode()
    if check_mode:  # cross-rank facts first, so that every rank raises the same error
        verify()
    layouts.check_local_length(layout, local_len, ring_size, name=f"local length along dim {dim}")
    if not check_mode:
        verify()
    cat = ring_all_gather(x_local, comm, dim)
    return layouts.unshard_concat(cat, layout, ring_size, dim)
