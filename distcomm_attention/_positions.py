"""``position_ids``: the global positions of this rank's tokens, for rotary embeddings and learned positions.

With the zigzag and striped layouts a rank's tokens are not a contiguous range of the sequence (see
Note [Sequence layouts] in layouts.py), so position-dependent layers (RoPE, ALiBi, learned position tables)
must be given each token's GLOBAL position. ``position_ids(n, layout)`` returns exactly the positions that
``shard_sequence(x, layout)`` keeps of a sequence of ``n * ring_size`` tokens, in the same order.
"""

from __future__ import annotations

import torch

from distcomm.ring import RingComm
from distcomm_attention import layouts

__all__ = ["position_ids"]


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
