"""all_reduce, reduce and broadcast with exact gradients, and the gradient rules of every reduction.

Public (re-exported by :mod:`distcomm.functional`): the drop-ins ``all_reduce``, ``reduce`` and
``broadcast`` of ``torch.distributed.nn.functional``. The per-op gradient factor (``_local_vjp``) and the
helpers every backward uses (``_adjoint``, ``_first_order_only``) live here too. ``reduce_scatter`` and
``reduce_scatter_tensor`` are in :mod:`distcomm._reduce_scatter`; ReduceOp parsing, argument checks and
backend emulation in :mod:`distcomm._reduce_ops`; the raw collectives in :mod:`distcomm._reduce_raw`.
Under ``torch.compile`` the public functions hand their validated arguments to the compiled path (Note
[Import direction of the compiled path] in :mod:`distcomm._dispatch`).

Note [Reduction gradients]
    N ranks in the group; rank j holds x_j; the training loss is the sum of the per-rank losses,
    L = sum_r L_r(y_r), and g_r = dL_r/dy_r arrives on rank r. Every backward returns the exact
    vector-Jacobian product x̄_j = sum_r (dy_r/dx_j)^T g_r, with G = sum_r g_r:

        op           y = all_reduce(x, op)     x̄_j
        SUM          sum_i x_i                 G
        AVG          sum_i x_i / N             G / N  (= all_reduce(g, AVG): AVG is its own adjoint)
        PREMUL_SUM   sum_i f_i x_i             conj(f_j) G
        PRODUCT      prod_i x_i                G * prod_{i != j} x_i                  (zero-safe, below)
        MAX / MIN    max_i / min_i x_i         (G / c) * [x_j == y],  c = #{i : x_i == y}  (ties split)

        rank 0   x_0 ─┐                ┌─ y ── g_0 ─┐
        rank 1   x_1 ─┼─ all_reduce ───┼─ y ── g_1 ─┼─ all_reduce(SUM) = G ─ x̄_j = G · ∂y/∂x_j
        rank 2   x_2 ─┘                └─ y ── g_2 ─┘

    - reduce(dst): the same with G replaced by g_dst. Off dst the output is zeros (a constant), so the
      grads arriving there are rightly ignored: the VJP is exact for every output.
    - broadcast(src): x̄_src = G, zero on the other ranks (their inputs only give the shape).
    - reduce_scatter / reduce_scatter_tensor: the table per slice: slice r of x_j is reduced into y_r, so
      x̄_j[slice r] uses g_r (SUM: x̄_j = all_gather(g)[j's slices]; AVG: the same of g / N, divided
      before the gather, where it touches 1/N of the elements).
    - PRODUCT never divides by zero: with z = the number of ranks whose x_i is 0 and P = the product of
      the non-zero x_i, prod_{i != j} x_i = P / x_j if z = 0, P if z = 1 and x_j = 0, else 0.
    - MAX / MIN follow ``torch.amax``: the result is NaN wherever any rank holds NaN, and there every
      rank's grad is NaN. The backends drop NaN (NCCL always, gloo depending on which rank holds it), so
      on floating tensors MAX / MIN reduce a one-byte NaN mask alongside the values.
    - Double backward: each backward is built from the differentiable Functions of this package (all_reduce
      SUM and AVG <-> themselves, reduce SUM <-> broadcast, reduce_scatter SUM <-> all_gather), so SUM, AVG,
      PREMUL_SUM, MAX, MIN (whose masks are piecewise constant) and broadcast are twice differentiable.
      PRODUCT is differentiable once: differentiating its gradient raises.
    - Gradients are reduced in the dtype they arrive in (bf16 stays bf16).
    - Every rank must agree on whether the input requires grad: the backward is a collective too, and a
      rank that skips it leaves the others waiting. Check mode verifies this.

Note [Collectives per call]
    forward + backward, beyond the op itself and its adjoint (one collective each way):
    - SUM, AVG, PREMUL_SUM, broadcast: none.
    - MAX / MIN: forward + a 1-byte NaN mask (same collective); backward + a 1-byte tie count (all_reduce
      or reduce_scatter); reduce also broadcasts y, reduce_scatter also all-gathers y.
    - PRODUCT: backward + two all_reduces of the full input (a 1-byte zero count, the non-zero product).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Function

from distcomm import _check, _groups
from distcomm._dispatch import compiled_path
from distcomm._reduce_ops import (
    _AVG,
    _DIFFERENTIABLE_OPS,
    _PREMUL_SUM,
    _PRODUCT,
    _SUM,
    _SUM_OP,
    ReduceOp,
    _agree,
    _check_op,
    _conj,
    _needs_grad,
    _Op,
    _parse_op,
    _require_tensor,
)
from distcomm._reduce_raw import _count_dtype, _others_product, _raw_all_reduce, _raw_broadcast, _raw_reduce


__all__ = ["all_reduce", "reduce", "broadcast"]


# --------------------------------------------------------------------------------------------------------
# Autograd Functions (Note [Reduction gradients])
# --------------------------------------------------------------------------------------------------------


class _FirstOrderOnly(Function):
    """Identity whose backward raises: marks a gradient that may be differentiated only once (PRODUCT)."""

    @staticmethod
    def forward(ctx, tensor, what):
        ctx.what = what
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            f"{ctx.what}: the gradient of a PRODUCT reduction is differentiable only once; double backward "
            f"is supported for {', '.join(n for n in _DIFFERENTIABLE_OPS.split(', ') if n != 'PRODUCT')}"
        )


def _first_order_only(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _FirstOrderOnly.apply(tensor, what)
    return tensor


def _adjoint(function: type[Function], raw, *args):
    """Run a backward's adjoint collective: ``function`` while a graph is being built (double backward),
    else its raw op ``raw`` (same arguments), which skips the cost of an autograd node nobody uses."""
    if torch.is_grad_enabled():
        return function.apply(*args)
    return raw(*args)


def _local_vjp(op: _Op, total: torch.Tensor, group, size: int, what: str, x=None, y=None) -> torch.Tensor:
    """x̄_j from ``total`` (G, or g_dst for reduce): the per-op factor of Note [Reduction gradients]."""
    kind = op.kind
    if kind is _SUM:
        return total
    if kind is _AVG:
        return total / size
    if kind is _PREMUL_SUM:
        return total * _conj(op.factor)
    if kind is _PRODUCT:
        return _first_order_only(total * _others_product(x, group, size), what)
    with torch.no_grad():
        mask = x == y
        count = _raw_all_reduce(mask.to(_count_dtype(size)), _SUM_OP, group, size)
    return total / count * mask


def _save_for_vjp(ctx, op, x: torch.Tensor, y: torch.Tensor) -> None:
    """Save what the op's local VJP needs: x and y for MAX/MIN, x for PRODUCT, nothing for linear ops."""
    if op.extrema:
        ctx.save_for_backward(x, y)
    elif op.kind is _PRODUCT:
        ctx.save_for_backward(x)


class _AllReduce(Function):
    """y = op_i x_i on every rank. Adjoint: all_reduce(SUM) of the grads, times the local factor (AVG:
    all_reduce(AVG) of the grads, the op itself)."""

    @staticmethod
    def forward(ctx, tensor, op, group, size):
        y = _raw_all_reduce(tensor, op, group, size)
        ctx.op, ctx.group, ctx.size = op, _groups.hold(group), size
        _save_for_vjp(ctx, op, tensor, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        op, group, size = ctx.op, _groups.unhold(ctx.group), ctx.size
        if op.kind is _AVG:  # self-adjoint: the forward's own op (native on NCCL), no separate division
            return _adjoint(_AllReduce, _raw_all_reduce, grad.contiguous(), op, group, size), None, None, None
        total = _adjoint(_AllReduce, _raw_all_reduce, grad.contiguous(), _SUM_OP, group, size)
        if op.linear:
            return _local_vjp(op, total, group, size, "all_reduce"), None, None, None
        x, *y = ctx.saved_tensors
        return _local_vjp(op, total, group, size, "all_reduce", x, *y), None, None, None


class _Reduce(Function):
    """y = op_i x_i on dst, zeros elsewhere. Adjoint: broadcast of dst's grad (reduce SUM <-> broadcast)."""

    @staticmethod
    def forward(ctx, tensor, dst, op, group, size, is_dst):
        y = _raw_reduce(tensor, dst, op, group, size, is_dst)
        ctx.op, ctx.dst, ctx.group, ctx.size, ctx.is_dst = op, dst, _groups.hold(group), size, is_dst
        _save_for_vjp(ctx, op, tensor, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        op, dst, group, size, is_dst = ctx.op, ctx.dst, _groups.unhold(ctx.group), ctx.size, ctx.is_dst
        total = _adjoint(_Broadcast, _raw_broadcast, grad.contiguous(), dst, group, size, is_dst)
        if op.linear:
            return _local_vjp(op, total, group, size, "reduce"), None, None, None, None, None
        x, *y = ctx.saved_tensors
        if y:
            y = [_raw_broadcast(y[0], dst, group, size, is_dst)]
        return _local_vjp(op, total, group, size, "reduce", x, *y), None, None, None, None, None


class _Broadcast(Function):
    """y_r = x_src. Adjoint: reduce(SUM) of the grads to src, zeros elsewhere."""

    @staticmethod
    def forward(ctx, tensor, src, group, size, is_src):
        ctx.src, ctx.group, ctx.size, ctx.is_src = src, _groups.hold(group), size, is_src
        return _raw_broadcast(tensor, src, group, size, is_src)

    @staticmethod
    def backward(ctx, grad):
        total = _adjoint(
            _Reduce, _raw_reduce, grad.contiguous(), ctx.src, _SUM_OP, _groups.unhold(ctx.group), ctx.size, ctx.is_src
        )
        return total, None, None, None, None


# --------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks of ``group``; every rank gets the result.

    Differentiable for SUM, AVG, PREMUL_SUM, PRODUCT, MIN and MAX with the exact gradient of Note
    [Reduction gradients] (torch's version re-applies the forward op in the backward, which is wrong for
    MIN, MAX and PRODUCT).

    Args:
        tensor: any shape (0-d and zero-size included), the same shape and dtype on every rank; not modified.
        op: a ``torch.distributed.ReduceOp``. BAND/BOR/BXOR take integer/bool tensors and no gradient.
        group: process group; ``None`` is the default group. Without a process group: a world of one.

    Returns:
        A new contiguous tensor of ``tensor``'s shape, identical on every rank.
    """
    _require_tensor("tensor", tensor)
    compiling = torch.compiler.is_compiling()
    op = compiled_path().parse_op(op) if compiling else _parse_op(op)
    group, size, _ = _groups.resolve(group)
    needs_grad = _needs_grad(tensor)
    _check.decide("all_reduce", group, size, _check_op, "all_reduce", op, tensor, needs_grad, group)
    if compiling:
        return compiled_path().all_reduce(tensor, op, group)
    if size > 1 and _check.is_check_mode():
        _agree("all_reduce", tensor, group, op=op.kind.value, requires_grad=needs_grad)
    return _AllReduce.apply(tensor, op, group, size)


def _reduce_args(dst, op: _Op, tensor: torch.Tensor, needs_grad: bool, group) -> int:
    """reduce's checks of this rank's arguments: ``dst``'s position in the group."""
    dst_rank = _groups.check_rank_in_group("dst", dst, group)
    _check_op("reduce", op, tensor, needs_grad, group)
    return dst_rank


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks of ``group`` onto the global rank ``dst``.

    Only ``dst``'s output carries gradient: x̄_j is the all_reduce gradient of ``op`` with dst's incoming
    grad in place of the sum of all grads (Note [Reduction gradients]).

    Args:
        tensor: any shape, the same shape and dtype on every rank; not modified.
        dst: the destination as a global rank (as in ``torch.distributed``); must belong to ``group``.
        op: a ``torch.distributed.ReduceOp`` (see :func:`all_reduce`).
        group: process group; ``None`` is the default group.

    Returns:
        A new tensor of ``tensor``'s shape on every rank: the reduction on ``dst``, zeros on the other ranks
        (it requires grad whenever the input does, so every rank takes part in the backward).
    """
    _require_tensor("tensor", tensor)
    compiling = torch.compiler.is_compiling()
    op = compiled_path().parse_op(op) if compiling else _parse_op(op)
    group, size, rank = _groups.resolve(group)
    needs_grad = _needs_grad(tensor)
    dst_rank = _check.decide("reduce", group, size, _reduce_args, dst, op, tensor, needs_grad, group)
    if compiling:
        return compiled_path().reduce(tensor, dst_rank, op, group)
    if size > 1 and _check.is_check_mode():
        _agree("reduce", tensor, group, op=op.kind.value, dst=dst, requires_grad=needs_grad)
    return _Reduce.apply(tensor, dst_rank, op, group, size, rank == dst_rank)


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Send ``tensor`` of the global rank ``src`` to every rank of ``group``.

    Gradient: ``src`` receives the sum of every rank's incoming grad; the other ranks receive zeros (their
    input only supplies the shape and dtype).

    Args:
        tensor: on ``src`` the data; elsewhere a tensor of the same shape and dtype (its values are unused).
        src: the source as a global rank; must belong to ``group``.
        group: process group; ``None`` is the default group.

    Returns:
        A new tensor holding ``src``'s data on every rank.
    """
    _require_tensor("tensor", tensor)
    group, size, rank = _groups.resolve(group)
    src_rank = _check.decide("broadcast", group, size, _groups.check_rank_in_group, "src", src, group)
    if torch.compiler.is_compiling():
        return compiled_path().broadcast(tensor, src_rank, group)
    if size > 1 and _check.is_check_mode():
        _agree("broadcast", tensor, group, src=src, requires_grad=_needs_grad(tensor))
    return _Broadcast.apply(tensor, src_rank, group, size, rank == src_rank)
