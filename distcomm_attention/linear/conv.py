"""The short causal depthwise convolution of GDN / Mamba-2 layers over a sharded sequence: a halo exchange.

Note [Conv halo]
    Output t of a causal convolution of width w reads inputs t - w + 1 .. t of its own document. A rank's
    runs (Note [Runs and segments]) need the w - 1 tokens before each run's start, held by other ranks
    (or by this rank, in another run). Every one of them lies in the last w - 1 tokens of the run that holds
    it, so each rank contributes the last min(w - 1, length) tokens of each of its runs, and one all-gather
    gives every rank every halo:

        global     ... 11 12 13 | 14 15 16 17 | 18 ...          w = 3: run [14, 18) reads 12, 13
        rank 1 sends its runs' last 2 tokens -> all-gather -> rank 2 picks positions 12, 13 from rank 1's rows

    Inputs across a document start are zeros (no halo across ``cu_seqlens``), as are inputs before position
    0. Traffic per rank: runs x (w - 1) x channels, independent of the sequence length; the gather's
    backward (a reduce-scatter) returns each halo token's gradient to its owner. ``weight`` and ``bias``
    get this rank's part of their gradient: sum them over the ranks, like every parameter's.
"""

from __future__ import annotations

import functools

import torch

from distcomm_attention import _validation
from distcomm_attention.sharding import mesh_field
from distcomm_attention.linear import _checks
from distcomm_attention._device import on_device
from distcomm_attention.linear.exchange import all_gather_rows
from distcomm_attention.linear.plan import rank_positions

__all__ = ["causal_conv1d_cp", "ACTIVATIONS"]

ACTIVATIONS = (None, "silu", "swish")


@functools.lru_cache(maxsize=64)
def _halo_plan(concrete, seq_len: int, world: int, docs, width: int, rank: int):
    """(rows each rank sends: local indices, slots per rank, (T, width) source rows of this rank's tokens
    into [own tokens | gathered halos | one zero row]). Column j of the table reads global position p - j."""
    positions = rank_positions(concrete, seq_len, world)
    sends = []
    for pos in positions:
        breaks = [0] + ((pos[1:] - pos[:-1]) != 1).nonzero().flatten().add(1).tolist() + [pos.numel()]
        rows = [i for a, b in zip(breaks[:-1], breaks[1:]) for i in range(max(a, b - (width - 1)), b)]
        sends.append(rows)
    slots = max(len(s) for s in sends)
    local = positions[rank].numel()
    where = torch.full((seq_len,), -1, dtype=torch.long)
    for r, rows in enumerate(sends):
        if r != rank and rows:
            where[positions[r][rows]] = local + r * slots + torch.arange(len(rows))
    where[positions[rank]] = torch.arange(local)
    zero_row = local + world * slots
    pos = positions[rank]
    cand = pos[:, None] - torch.arange(width)[None, :]
    bounds = torch.tensor(docs if docs is not None else (0, seq_len))
    doc_of = lambda p: torch.searchsorted(bounds, p, right=True)  # noqa: E731
    valid = (cand >= 0) & (doc_of(cand.clamp(min=0)) == doc_of(pos)[:, None])
    table = torch.where(valid, where[cand.clamp(min=0)], torch.full_like(cand, zero_row))
    if bool((table < 0).any()):  # every needed token is some run's tail (Note [Conv halo])
        raise RuntimeError("causal_conv1d_cp: a halo token is missing from the plan")
    return tuple(torch.tensor(s, dtype=torch.long) for s in sends), slots, table


@torch.compiler.disable(reason=_checks.EAGER)
def causal_conv1d_cp(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    cu_seqlens=None,
    layout: str | None = None,
    group=None,
    sharding=None,
) -> torch.Tensor:
    """Causal depthwise conv1d over a sequence sharded across ``group`` (Note [Conv halo]).

    Args:
        x: (B, T, C) this rank's tokens, in the shards' layout (fla's ``causal_conv1d`` layout; a
            transformers layer's (B, C, T) transposed).
        weight: (C, w) or (C, 1, w) (an ``nn.Conv1d(C, C, w, groups=C)``'s weight): output t of channel c is
            sum_i weight[c, i] x[t - w + 1 + i, c].
        bias: (C,) or None.
        activation: None, "silu" or "swish" (the same).
        cu_seqlens: global document boundaries: no input crosses a document start.
        layout, group, sharding: as for :func:`chunk_gated_delta_rule_cp`.

    Returns:
        (B, T, C) in x's dtype.

    Raises:
        ValueError / TypeError: bad input, before any communication, by every rank alike.
    """
    comm, given_layout, grid, ring_error = _checks.ring_verdict(sharding, layout, group)
    facts = {"layout": None, "cu_seqlens": None, "mesh": mesh_field(grid)}

    def local_checks():
        _validation.check_is_tensor("x", x)
        _validation.check_is_tensor("weight", weight)
        if x.dim() != 3 or x.dtype not in _checks.FLOATS:
            raise ValueError(f"`x` must be a floating (B, T, C) tensor, got shape {tuple(x.shape)} dtype {x.dtype}")
        w = weight.squeeze(1) if weight.dim() == 3 and weight.shape[1] == 1 else weight
        if w.dim() != 2 or w.shape[0] != x.shape[2] or w.shape[1] < 1:
            raise ValueError(f"`weight` must have shape (C, w) or (C, 1, w) with C = {x.shape[2]} channels of `x`, "
                             f"got {tuple(weight.shape)}")
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (x.shape[2],)):
            raise ValueError(f"`bias` must be None or a ({x.shape[2]},) tensor, got "
                             f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"Invalid activation {activation!r}. Must be one of: {', '.join(map(repr, ACTIVATIONS))}")
        field, docs, concrete = _checks.check_layout_call("causal_conv1d_cp", comm, given_layout, x.shape[1],
                                                          cu_seqlens, grid)
        facts.update(layout=field, cu_seqlens=docs)
        return w, _halo_plan(concrete, x.shape[1] * comm.size, comm.size, docs, w.shape[1], comm.rank)

    checked, error = (None, ring_error) if ring_error is not None else _validation.verdict(local_checks)
    needs_grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                 for t in (x, weight, bias))
    _validation.verify_across_ring("causal_conv1d_cp", comm, {"x": x, "weight": weight, "bias": bias},
                                   extra={**facts, "activation": activation, "requires_grad": needs_grad},
                                   error=error, mesh=grid is not None)
    w, (sends, slots, table) = checked
    width = w.shape[1]
    rows = x.transpose(0, 1)  # (T, B, C)
    parts = [rows]
    halo = None
    if width > 1 and comm.size > 1:
        mine = rows.index_select(0, on_device(sends[comm.rank], x.device))
        mine = torch.nn.functional.pad(mine, (0, 0, 0, 0, 0, slots - mine.shape[0]))
        halo = all_gather_rows(mine, comm.group, comm.size, grad=needs_grad)
        parts.append(halo.reshape(comm.size * slots, *rows.shape[1:]))
    else:
        parts.append(rows.new_zeros((comm.size * slots,) + rows.shape[1:]))
    parts.append(rows.new_zeros((1,) + rows.shape[1:]))
    src = torch.cat(parts)
    taps = src[on_device(table, x.device)]  # (T, width, B, C): column j is position p - j (the cached plan's)
    out = torch.einsum("tjbc,cj->tbc", taps, w.flip(-1).to(x.dtype))
    if bias is not None:
        out = out + bias.to(x.dtype)
    if activation is not None:
        out = torch.nn.functional.silu(out)
    if halo is not None and halo.requires_grad:  # every rank joins the gather's backward
        out = out + halo.reshape(-1)[:0].sum()
    return out.transpose(0, 1)
