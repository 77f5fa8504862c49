"""reduce_scatter and reduce_scatter_tensor with exact gradients for every ReduceOp.

Public (re-exported by :mod:`distcomm.functional`): the drop-in ``reduce_scatter`` of
``torch.distributed.nn.functional`` (entries may differ in shape), plus ``reduce_scatter_tensor``. Slice r
of x_j is reduced into y_r, so x̄_j[slice r] uses g_r through the per-op factor of Note [Reduction
gradients] in :mod:`distcomm._reduce`: the backward all-gathers the grads (SUM: that alone). The adjoints:

    reduce_scatter          <->  _AllGatherList (every rank's grad, shapes may differ), defined here
    reduce_scatter_tensor   <->  _AllGatherTensor, defined here too (each backward is written with the
                                 other); its public function ``all_gather_tensor`` is in :mod:`distcomm._all_gather`

Under ``torch.compile`` the public functions hand their validated arguments to the compiled path (Note
[Import direction of the compiled path] in :mod:`distcomm._dispatch`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.autograd import Function

from distcomm import _check, _groups
from distcomm._dispatch import compiled_path
from distcomm._reduce import _adjoint, _first_order_only, _local_vjp, _save_for_vjp
from distcomm._reduce_ops import (
    _AVG,
    _PRODUCT,
    _SUM_OP,
    ReduceOp,
    _agree,
    _check_op,
    _needs_grad,
    _Op,
    _parse_op,
    _require_tensor,
)
from distcomm._reduce_raw import (
    _count_dtype,
    _others_product,
    _raw_all_gather_dim,
    _raw_all_gather_flat,
    _raw_reduce_scatter_dim,
    _raw_reduce_scatter_stacked,
    _stack_padded,
)


__all__ = ["reduce_scatter", "reduce_scatter_tensor"]


# --------------------------------------------------------------------------------------------------------
# Autograd Functions (Note [Reduction gradients])
# --------------------------------------------------------------------------------------------------------


def _all_gather_list(group, shapes, tensor) -> tuple[torch.Tensor, ...]:
    """Every rank's tensor, rank r's of shape ``shapes[r]``: the raw op of :class:`_AllGatherList`."""
    parts = _raw_all_gather_flat(tensor.reshape(-1), [math.prod(s) for s in shapes], group)
    return tuple(p.view(s) for p, s in zip(parts, shapes))


class _AllGatherList(Function):
    """parts[r] = rank r's tensor, of shape ``shapes[r]`` (sizes may differ). Adjoint: reduce_scatter(SUM)."""

    @staticmethod
    def forward(ctx, group, shapes, tensor):
        ctx.group, ctx.size, ctx.rank = _groups.hold(group), len(shapes), _groups.group_rank(group)
        return _all_gather_list(group, shapes, tensor)

    @staticmethod
    def backward(ctx, *grads):
        grads = [g.contiguous() for g in grads]
        total = _adjoint(_ReduceScatter, _reduce_scatter_list, None, _SUM_OP, _groups.unhold(ctx.group), ctx.size,
                         ctx.rank, *grads)
        return None, None, total


def _reduce_scatter_list(output, op: _Op, group, size: int, rank: int, *inputs) -> torch.Tensor:
    """Entry ``rank`` of every rank's ``inputs``, reduced; written into ``output`` when one is given."""
    mine = inputs[rank]
    stacked = _stack_padded(inputs)
    if output is not None and output.is_contiguous() and stacked.shape[1] == mine.numel():
        _raw_reduce_scatter_stacked(stacked, op, group, size, out=output.view(-1))
        return output
    flat = _raw_reduce_scatter_stacked(stacked, op, group, size)[: mine.numel()]
    return flat.view(mine.shape) if output is None else output.copy_(flat.view(output.shape))


class _ReduceScatter(Function):
    """y_r = op_j x_j[r]: entry r of every rank's list, reduced, lands on rank r. Adjoint (SUM): all_gather.

    Writes into ``output`` and returns it when one is given (autograd is told via mark_dirty).
    """

    @staticmethod
    def forward(ctx, output, op, group, size, rank, *inputs):
        y = _reduce_scatter_list(output, op, group, size, rank, *inputs)
        if output is not None:
            ctx.mark_dirty(output)
        ctx.op, ctx.group, ctx.size, ctx.rank = op, _groups.hold(group), size, rank
        ctx.shapes = [tuple(t.shape) for t in inputs]
        if op.extrema:
            ctx.save_for_backward(*inputs, y)
        elif op.kind is _PRODUCT:
            ctx.save_for_backward(*inputs)
        return y

    @staticmethod
    def backward(ctx, grad):
        op, group, size, shapes = ctx.op, _groups.unhold(ctx.group), ctx.size, ctx.shapes
        grad = grad.contiguous()
        if op.kind is _AVG:  # the same 1/N for every slice: divide this rank's slice, 1/N of the elements
            grads = _adjoint(_AllGatherList, _all_gather_list, group, shapes, grad / size)
        elif op.linear:
            parts = _adjoint(_AllGatherList, _all_gather_list, group, shapes, grad)
            grads = [_local_vjp(op, p, group, size, "reduce_scatter") for p in parts]
        elif op.kind is _PRODUCT:
            inputs = ctx.saved_tensors
            others = _others_product(torch.cat([t.reshape(-1) for t in inputs]), group, size)
            others = others.split([t.numel() for t in inputs])
            parts = _adjoint(_AllGatherList, _all_gather_list, group, shapes, grad)
            grads = [_first_order_only(p * q.view(p.shape), "reduce_scatter") for p, q in zip(parts, others)]
        else:
            *inputs, y = ctx.saved_tensors
            with torch.no_grad():
                ys = _raw_all_gather_flat(y.reshape(-1), [t.numel() for t in inputs], group)
                masks = [t == yr.view(t.shape) for t, yr in zip(inputs, ys)]
                counts = _stack_padded([m.to(_count_dtype(size)) for m in masks])
                count = _raw_reduce_scatter_stacked(counts, _SUM_OP, group, size)
                count = count[: grad.numel()].view(grad.shape)
            parts = _adjoint(_AllGatherList, _all_gather_list, group, shapes, grad / count)
            grads = [p * m for p, m in zip(parts, masks)]
        return (None, None, None, None, None, *grads)


def _all_gather_tensor(tensor: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """all_gather_tensor along ``dim`` (the adjoint of reduce_scatter_tensor SUM) of ``tensor``."""
    return _adjoint(_AllGatherTensor, _raw_all_gather_dim, tensor, dim, group, size)


class _ReduceScatterTensor(Function):
    """y_r = chunk r along ``dim`` of op_j x_j. Adjoint (SUM): all_gather_tensor (concatenation along dim)."""

    @staticmethod
    def forward(ctx, tensor, dim, op, group, size):
        y = _raw_reduce_scatter_dim(tensor, dim, op, group, size)
        ctx.op, ctx.dim, ctx.group, ctx.size = op, dim, _groups.hold(group), size
        _save_for_vjp(ctx, op, tensor, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        op, dim, group, size = ctx.op, ctx.dim, _groups.unhold(ctx.group), ctx.size
        grad = grad.contiguous()
        if op.kind is _AVG:  # divide the chunk before gathering: 1/N of the elements of the full grad
            return _all_gather_tensor(grad / size, dim, group, size), None, None, None, None
        if op.linear:
            full = _all_gather_tensor(grad, dim, group, size)
            return _local_vjp(op, full, group, size, "reduce_scatter_tensor"), None, None, None, None
        if op.kind is _PRODUCT:
            (x,) = ctx.saved_tensors
            full = _all_gather_tensor(grad, dim, group, size) * _others_product(x, group, size)
            return _first_order_only(full, "reduce_scatter_tensor"), None, None, None, None
        x, y = ctx.saved_tensors
        with torch.no_grad():
            mask = x == _raw_all_gather_dim(y, dim, group, size)
            count = _raw_reduce_scatter_dim(mask.to(_count_dtype(size)), dim, _SUM_OP, group, size)
        return _all_gather_tensor(grad / count, dim, group, size) * mask, None, None, None, None


class _AllGatherTensor(Function):
    """y = cat(x_0, ..., x_{W-1}; dim) on every rank. Adjoint: reduce_scatter_tensor(SUM) along dim.

    The Function behind :func:`distcomm.functional.all_gather_tensor` (public in :mod:`distcomm._all_gather`),
    kept beside its adjoint :class:`_ReduceScatterTensor`: each backward is written with the other.
    """

    @staticmethod
    def forward(ctx, tensor, dim, group, n):
        ctx.dim, ctx.group, ctx.n = dim, _groups.hold(group), n
        return _raw_all_gather_dim(tensor, dim, group, n)

    @staticmethod
    def backward(ctx, grad):
        args = (grad, ctx.dim, _SUM_OP, _groups.unhold(ctx.group), ctx.n)
        return _adjoint(_ReduceScatterTensor, _raw_reduce_scatter_dim, *args), None, None, None


# --------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------


def _list_args(output: torch.Tensor, input_list, op: _Op, group, size: int, rank: int) -> bool:
    """reduce_scatter's checks of this rank's arguments; returns whether an input needs a backward."""
    if len(input_list) != size:
        raise ValueError(
            f"reduce_scatter: `input_list` has {len(input_list)} tensors, expected {size} (one per rank of the group)"
        )
    if torch.is_grad_enabled() and output.requires_grad:
        raise ValueError(
            "reduce_scatter: `output` requires grad, but it is a buffer written in place; pass a plain tensor "
            "(e.g. torch.empty(...)): the returned tensor carries the gradient"
        )
    for i, t in enumerate(input_list):
        if t.dtype != output.dtype or t.device != output.device:
            raise ValueError(
                f"reduce_scatter: `input_list[{i}]` is {t.dtype} on {t.device}, but `output` is {output.dtype} on "
                f"{output.device}; all must match"
            )
    if input_list[rank].shape != output.shape:
        raise ValueError(
            f"reduce_scatter: `output` has shape {tuple(output.shape)}, but `input_list[{rank}]` (the entry this "
            f"rank receives) has shape {tuple(input_list[rank].shape)}; they must match"
        )
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in input_list)
    _check_op("reduce_scatter", op, output, needs_grad, group)
    return needs_grad


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op=ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Reduce entry r of every rank's ``input_list`` over the ranks and write it into rank r's ``output``.

    Entries may differ in shape (uneven), zero-size included; entry r has the same shape on every rank.
    Gradient: slice r of x_j gets rank r's incoming grad through the per-op factor of Note [Reduction
    gradients] (SUM: an all_gather of the grads).

    Args:
        output: the buffer to write, shaped like ``input_list[rank]``; must not require grad.
        input_list: one tensor per rank of ``group`` (group-rank order), all of ``output``'s dtype and device.
        op: a ``torch.distributed.ReduceOp`` (see :func:`all_reduce`).
        group: process group; ``None`` is the default group.

    Returns:
        ``output`` itself, holding the result and, when an input requires grad, a ``grad_fn``.
    """
    _require_tensor("output", output)
    if not isinstance(input_list, (list, tuple)):
        raise TypeError(f"`input_list` must be a list of tensors, got {type(input_list).__name__}")
    for i, t in enumerate(input_list):
        if not isinstance(t, torch.Tensor):
            _require_tensor(f"input_list[{i}]", t)
    compiling = torch.compiler.is_compiling()
    op = compiled_path().parse_op(op) if compiling else _parse_op(op)
    group, size, rank = _groups.resolve(group)
    needs_grad = _check.decide("reduce_scatter", group, size, _list_args, output, input_list, op, group, size, rank)
    if compiling:
        return compiled_path().reduce_scatter(output, input_list, op, group, rank)
    if size > 1 and _check.is_check_mode():
        _agree(
            "reduce_scatter",
            output,
            group,
            same_shape=False,
            shapes=[t.shape for t in input_list],
            op=op.kind.value,
            requires_grad=needs_grad,
        )
    return _ReduceScatter.apply(output, op, group, size, rank, *input_list)


def _tensor_args(tensor: torch.Tensor, dim: int, op: _Op, needs_grad: bool, group, size: int) -> None:
    """reduce_scatter_tensor's checks of this rank's arguments."""
    if tensor.shape[dim] % size:
        raise ValueError(
            f"reduce_scatter_tensor: `tensor` has size {tensor.shape[dim]} along `dim`={dim}, which the group size "
            f"{size} does not divide"
        )
    _check_op("reduce_scatter_tensor", op, tensor, needs_grad, group)


def reduce_scatter_tensor(
    tensor: torch.Tensor, dim: int = 0, op=ReduceOp.SUM, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks of ``group`` and keep chunk r along ``dim`` on rank r.

    The transpose of :func:`distcomm.functional.all_gather_tensor` (for SUM).

    Args:
        tensor: shape (..., N * c, ...) with N = group size at position ``dim``, the same on every rank.
        dim: the dimension to split (negative counts from the end).
        op: a ``torch.distributed.ReduceOp`` (see :func:`all_reduce`).
        group: process group; ``None`` is the default group.

    Returns:
        A new contiguous tensor of shape (..., c, ...): chunk ``rank`` of the reduction.
    """
    _require_tensor("tensor", tensor)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"`dim` must be an int, got {type(dim).__name__} {dim!r}")
    ndim = tensor.dim()
    if ndim == 0:
        raise ValueError("reduce_scatter_tensor: `tensor` is 0-d; it needs a dimension to split")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"reduce_scatter_tensor: `dim`={dim} is out of range for a tensor of {ndim} dims "
            f"(allowed: {-ndim} to {ndim - 1})"
        )
    dim %= ndim
    compiling = torch.compiler.is_compiling()
    op = compiled_path().parse_op(op) if compiling else _parse_op(op)
    group, size, _ = _groups.resolve(group)
    needs_grad = _needs_grad(tensor)
    _check.decide("reduce_scatter_tensor", group, size, _tensor_args, tensor, dim, op, needs_grad, group, size)
    if compiling:
        return compiled_path().reduce_scatter_tensor(tensor, dim, op, group)
    if size > 1 and _check.is_check_mode():
        _agree("reduce_scatter_tensor", tensor, group, op=op.kind.value, dim=dim, requires_grad=needs_grad)
    return _ReduceScatterTensor.apply(tensor, dim, op, group, size)
