"""The linear-attention room's one collective: a differentiable all-gather over the transport (Note [Transport]).

Both exchanges of this room (the run summaries of the recurrences, the conv halos) are one all-gather of a
small fixed-size tensor per rank, so tests count their bytes with a counting transport like every strategy's.
"""

from __future__ import annotations

import torch

from distcomm import _groups
from distcomm_attention import transport

__all__ = ["all_gather_rows"]


class _AllGather(torch.autograd.Function):
    """(rows, ...) per rank -> (W * rows, ...) in rank order."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group = _groups.hold(group)
        (out,) = transport.for_group(group).all_gather(x.contiguous()).wait()
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """Adjoint: all_gather <-> reduce_scatter(sum); rank j receives sum_r grad_r[rows of j]. Every rank's
        backward reaches this gather (``all_gather_rows``' ``grad``), so a backward that would be differentiated
        again is refused here, by every rank alike, before the reduce-scatter: not every rank's gradient would
        depend on the gather, and the ranks' second backwards would reach its adjoint unevenly."""
        if torch.is_grad_enabled():
            raise RuntimeError(
                "context-parallel linear attention and its causal conv are differentiable once: a backward with "
                "create_graph=True (double backward, gradient penalties) is not supported across ranks")
        return _ReduceScatter.apply(grad.contiguous(), _groups.unhold(ctx.group)), None


class _ReduceScatter(torch.autograd.Function):
    """(W * rows, ...) per rank -> (rows, ...): this rank's rows summed over the ranks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group = _groups.hold(group)
        (out,) = transport.for_group(group).reduce_scatter(x.contiguous()).wait()
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """Adjoint: reduce_scatter(sum) <-> all_gather."""
        return _AllGather.apply(grad.contiguous(), _groups.unhold(ctx.group)), None


def all_gather_rows(x: torch.Tensor, group, world: int, grad: bool = False) -> torch.Tensor:
    """Every rank's ``x`` (the same shape everywhere) stacked: (world, *x.shape); differentiable. A world of
    one returns ``x`` unsqueezed, without communication.

    ``grad``: the backward reaches this gather on every rank (the call's grad flag, verified alike on every
    rank). A rank whose ``x`` needs no grad (its rows depend on no input that does: a rank of closed segments
    when only q needs grad, or of open ones when only the initial state does) still gathers rows that do, and
    its peers wait for it in the adjoint reduce-scatter: its ``x`` is then a leaf that needs grad, whose
    gradient nobody reads, so that its gather too has a backward."""
    if world == 1:
        return x.unsqueeze(0)
    if grad and not x.requires_grad:
        x = x.detach().requires_grad_()
    return _AllGather.apply(x.unsqueeze(0), group)
