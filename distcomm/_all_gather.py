"""The all_gather family and its exact transposes, the reduce-scatters.

    forward                     grad on rank j                            adjoint collective
    all_gather                  sum_r g_r[j]                              reduce-scatter (SUM)
    _all_gather_base            sum_r g_r[chunk j]                        reduce-scatter (SUM)
    all_gather_tensor(dim)      sum_r g_r[chunk j along dim]              reduce_scatter_tensor (SUM)
    all_gather_variable(dim)    sum_r g_r[slice j along dim]              reduce-scatter (uneven: all_to_all)

Every op here is linear, so its backward is the transposed collective (Note [Gradient convention] in
:mod:`distcomm.functional`), built from the other op's autograd Function so double backward works.
``all_gather_tensor``'s Function lives in :mod:`distcomm._reduce_scatter`, beside its adjoint, the Function
behind :func:`distcomm.functional.reduce_scatter_tensor` (an adjoint pair in one module, so the two modules
do not import each other); the others use this module's variable-size reduce-scatter, whose own adjoint is
``all_gather_variable``. ``_all_gather_base`` writes into its output argument (Note [Writing into output
arguments] in :mod:`distcomm._movement_args`).

Under ``torch.compile`` the public functions hand their validated arguments to the compiled path (Note
[Import direction of the compiled path] in :mod:`distcomm._dispatch`).

Note [Variable sizes]
    ``all_gather_variable`` with equal sizes is one all_gather_into_tensor. With uneven sizes (gloo and
    NCCL have no uneven all_gather into one tensor, and padding to the largest size moves max/mean times
    the bytes) every rank sends its whole tensor to every rank in one all_to_all, straight into the
    rank's block of the output (on NCCL the same input tensor serves every peer: no copies):

        rank 0: [a a a]                          all_to_all, input [x_r] * W,
        rank 1: [b]          ------------->      outputs = the W blocks of y:      y = [a a a | b | c c]
        rank 2: [c c]

    The backward is the transpose: rank r sends slice j of its grad to rank j, which sums the W slices it
    receives (a reduce-scatter with uneven sizes). With ``dim`` 0, or only size-1 dims before ``dim``,
    the blocks are contiguous pieces of the output and of the grad (no copy); otherwise one local copy
    rearranges them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.autograd import Function

from distcomm import _check, _groups
from distcomm._all_to_all import _raw_all_to_all
from distcomm._dispatch import compiled_path
from distcomm._movement_args import _needs_graph, _require_tensor, _require_writable, _setup, _written
from distcomm._reduce import _adjoint
from distcomm._reduce_ops import _SUM_OP
from distcomm._reduce_raw import _raw_all_gather_dim, _raw_reduce_scatter_dim, _raw_reduce_scatter_into
from distcomm._reduce_scatter import _AllGatherTensor


__all__ = ["all_gather", "_all_gather_base", "all_gather_tensor", "all_gather_variable"]

# torch >= 2.13 renamed the flat collective (the old name warns); older versions have only the old name.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---------------------------------------------------------------------------------------------------------
# Validation (local, before any communication)
# ---------------------------------------------------------------------------------------------------------


def _normalize_dim(dim, tensor: torch.Tensor) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"`dim` must be an int, got {dim!r}")
    if tensor.dim() == 0:
        raise ValueError("a 0-d tensor has no dim to concatenate along; unsqueeze it first")
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(
            f"`dim`={dim} is out of range for a tensor of {tensor.dim()} dims "
            f"(allowed: {-tensor.dim()} to {tensor.dim() - 1})"
        )
    return dim % tensor.dim()


# ---------------------------------------------------------------------------------------------------------
# Raw communication (no autograd). ``group`` is None without a process group; a group of one copies.
# ---------------------------------------------------------------------------------------------------------


def _raw_all_gather_flat(out: torch.Tensor, x: torch.Tensor, group, n: int) -> None:
    """``out`` (contiguous, n * x.numel() elements) receives every rank's contiguous ``x``, in rank order."""
    if n == 1:
        out.view(-1).copy_(x.reshape(-1))
    else:  # 1-d views: gloo accepts only the concatenated output layout
        _all_gather_flat(out.view(-1), x.view(-1), group=group)


def _raw_all_gather_into(output: torch.Tensor, x: torch.Tensor, group, n: int) -> None:
    """Like :func:`_raw_all_gather_flat` for an ``output`` of any layout."""
    if output.is_contiguous():
        _raw_all_gather_flat(output, x.contiguous(), group, n)
    else:
        staged = torch.empty_like(output, memory_format=torch.contiguous_format)
        _raw_all_gather_flat(staged, x.contiguous(), group, n)
        output.copy_(staged)


# ---------------------------------------------------------------------------------------------------------
# all_gather family <-> reduce_scatter
# ---------------------------------------------------------------------------------------------------------


def _sum_entries(grads: tuple[torch.Tensor, ...], group, n: int) -> torch.Tensor:
    """sum_r of rank r's ``grads[this rank]`` (a reduce-scatter, SUM): the raw adjoint of :class:`_AllGather`."""
    first = grads[0]
    if first.dim() == 0:  # the backends need a dim to split
        out = first.new_empty(1)
        return _raw_reduce_scatter_into(out, torch.stack(grads), _SUM_OP, group, n).view(())
    out = first.new_empty(first.shape)
    return _raw_reduce_scatter_into(out, torch.cat(grads), _SUM_OP, group, n)


class _AllGather(Function):
    """y_r = (x_0, ..., x_{W-1}) on every rank. Adjoint: reduce-scatter (SUM) of the stacked grads."""

    @staticmethod
    def forward(ctx, group, n, rank, tensor):
        ctx.group, ctx.n, ctx.rank = _groups.hold(group), n, rank
        x = tensor.contiguous()
        outs = [torch.empty_like(x) for _ in range(n)]
        if n == 1:
            outs[0].copy_(x)
        else:
            dist.all_gather(outs, x, group=group)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        group, n = _groups.unhold(ctx.group), ctx.n
        if not torch.is_grad_enabled():
            return None, None, None, _sum_entries(grads, group, n)
        stacked = torch.stack(grads)
        return None, None, None, _ReduceScatterVariable.apply(stacked, 0, (1,) * n, group, ctx.rank).squeeze(0)


def _gather_concat(x: torch.Tensor, dim: int, sizes: tuple[int, ...], group) -> torch.Tensor:
    """cat over ranks along ``dim`` of x_r, whose size along ``dim`` is sizes[r] (Note [Variable sizes])."""
    n = len(sizes)
    if sizes.count(sizes[0]) == n:
        return _raw_all_gather_dim(x, dim, group, n)
    # Uneven: every rank sends its whole tensor to every rank (the same tensor, no copies on NCCL).
    shape = list(x.shape)
    out_shape = shape.copy()
    out_shape[dim] = sum(sizes)
    x = x.contiguous()
    shapes = [[*shape[:dim], s, *shape[dim + 1 :]] for s in sizes]
    numels = [math.prod(s) for s in shapes]
    if math.prod(shape[:dim]) <= 1:  # rank r's block is one contiguous piece of the output
        out = x.new_empty(out_shape)
        _raw_all_to_all(list(out.view(-1).split(numels)), [x.view(-1)] * n, group, n)
        return out
    blocks = x.new_empty(sum(numels)).split(numels)
    _raw_all_to_all(list(blocks), [x.view(-1)] * n, group, n)
    return torch.cat([b.view(s) for b, s in zip(blocks, shapes)], dim=dim)


def _reduce_scatter_concat(grad: torch.Tensor, dim: int, sizes: tuple[int, ...], group, rank: int) -> torch.Tensor:
    """Rank j's slice (sizes[j] along ``dim``) of the SUM over ranks of ``grad``: the transpose of the above."""
    n = len(sizes)
    if sizes.count(sizes[0]) == n:
        return _raw_reduce_scatter_dim(grad, dim, _SUM_OP, group, n)
    # Uneven: rank j receives the other ranks' grads of its slice and adds them to its own.
    if math.prod(grad.shape[:dim]) <= 1:
        grad = grad.contiguous()  # then every rank's slice is a contiguous view
    offsets = [sum(sizes[:r]) for r in range(n)]
    pieces = [grad.narrow(dim, o, s) for o, s in zip(offsets, sizes)]
    own = pieces[rank]
    pieces[rank] = grad.new_empty(0)  # nothing travels to itself
    received = grad.new_empty((n - 1, *own.shape))
    slots = list(received.unbind(0))
    slots.insert(rank, grad.new_empty(0))
    _raw_all_to_all(slots, pieces, group, n)
    if n == 2:
        return torch.add(own, received[0])
    return received.sum(0).add_(own)


class _AllGatherVariable(Function):
    """y = cat(x_0, ..., x_{W-1}; dim), uneven sizes. Adjoint: _ReduceScatterVariable."""

    @staticmethod
    def forward(ctx, tensor, dim, sizes, group, rank):
        ctx.dim, ctx.sizes, ctx.group, ctx.rank = dim, sizes, _groups.hold(group), rank
        return _gather_concat(tensor, dim, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        args = (grad, ctx.dim, ctx.sizes, _groups.unhold(ctx.group), ctx.rank)
        return _adjoint(_ReduceScatterVariable, _reduce_scatter_concat, *args), None, None, None, None


class _ReduceScatterVariable(Function):
    """x̄_j = sum_r g_r[slice j along dim]. Adjoint: _AllGatherVariable."""

    @staticmethod
    def forward(ctx, grad, dim, sizes, group, rank):
        ctx.dim, ctx.sizes, ctx.group, ctx.rank = dim, sizes, _groups.hold(group), rank
        return _reduce_scatter_concat(grad, dim, sizes, group, rank)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if torch.is_grad_enabled():
            return (_AllGatherVariable.apply(grad, ctx.dim, ctx.sizes, _groups.unhold(ctx.group), ctx.rank), None, None,
                    None, None)
        return _gather_concat(grad, ctx.dim, ctx.sizes, _groups.unhold(ctx.group)), None, None, None, None


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, ...]:
    """Gather every rank's tensor on every rank; differentiable.

    Args:
        tensor: this rank's input, shape S, the same shape and dtype on every rank (checked in check mode;
            use :func:`all_gather_variable` for sizes that differ).
        group: process group (``None``: the default group); any subgroup works.

    Returns:
        A tuple of W separate tensors of shape S, (x_0, ..., x_{W-1}). The backward is reduce_scatter(SUM):
        rank j receives sum_r g_r[j] (incoming grads of any layout).
    """
    _require_tensor("tensor", tensor)
    group, n, rank = _setup(group)
    if torch.compiler.is_compiling():
        return compiled_path().all_gather(tensor, group)
    if n > 1 and _check.is_check_mode():
        _check.check_same("all_gather", tensor, group, requires_grad=_needs_graph(tensor))
    return _AllGather.apply(group, n, rank, tensor)


def all_gather_tensor(tensor: torch.Tensor, dim: int = 0, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's tensor along ``dim``; differentiable.

    Args:
        tensor: this rank's input, shape (..., d, ...) with d at ``dim``, the same shape and dtype on
            every rank (checked in check mode).
        dim: the dim to concatenate along (negative counts from the end).
        group: process group (``None``: the default group).

    Returns:
        Shape (..., W*d, ...): rank r's tensor at positions [r*d, (r+1)*d) along ``dim``. With ``dim`` 0
        the gather lands in the output with no copy; other dims cost one local copy. The backward is
        ``reduce_scatter_tensor(grad, dim, SUM)``: rank j receives sum_r g_r[chunk j].
    """
    _require_tensor("tensor", tensor)
    group, n, _ = _setup(group)
    dim = _check.decide("all_gather_tensor", group, n, _normalize_dim, dim, tensor)
    if torch.compiler.is_compiling():
        return compiled_path().all_gather_tensor(tensor, dim, group)
    if n > 1 and _check.is_check_mode():
        _check.check_same("all_gather_tensor", tensor, group, requires_grad=_needs_graph(tensor))
    return _AllGatherTensor.apply(tensor, dim, group, n)


def _learn_sizes(
    tensor: torch.Tensor, dim: int | None, sizes: list[int] | None, needs_grad: bool, group, n: int,
    error: Exception | None = None,
) -> list[int]:
    """Exchange shapes (and the given ``sizes``), raising the same error on every rank on a mismatch.

    ``error`` is this rank's verdict on its own arguments (None: they passed), raised on every rank
    (Note [Collective verdicts] in :mod:`distcomm._check`). In check mode the ranks must also agree on
    whether the input needs a backward (``needs_grad``).
    """
    op = "all_gather_variable"
    given = sizes if sizes is not None and error is None else [0] * n
    extra = [int(needs_grad), int(sizes is not None), *given, *_check.encode_verdict(error)]
    metas, rows = _check.gather_meta(tensor, group, extra=extra)
    _check.raise_verdicts(op, [row[2 + n :] for row in rows])
    _check.require_agreement(op, "sizes given", [row[1] for row in rows], show=lambda v: "a list" if v else "None")
    extras = None if sizes is None else [row[2 : 2 + n] for row in rows]
    ref = metas[0]
    for m in metas:
        if m.dtype != ref.dtype:
            _check.raise_mismatch(op, "dtypes", metas)
        if len(m.shape) != len(ref.shape):
            _check.raise_mismatch(op, "numbers of dims", metas)
        if any(a != b for d, (a, b) in enumerate(zip(m.shape, ref.shape)) if d != dim):
            _check.raise_mismatch(op, f"sizes of the dims other than dim {dim}", metas)
    learned = [m.shape[dim] for m in metas]
    if extras is not None:
        if any(e != extras[0] for e in extras):
            detail = ", ".join(f"rank {r}: {e}" for r, e in enumerate(extras))
            raise ValueError(f"{op}: the `sizes` passed differ across ranks ({detail}); every rank must pass the same")
        if learned != list(extras[0]):
            raise ValueError(f"{op}: `sizes`={list(extras[0])} but the tensors have sizes {learned} along dim {dim}")
    if _check.is_check_mode():
        _check.require_agreement(op, "requires_grad", [row[0] for row in rows])
    return learned


def _variable_args(tensor: torch.Tensor, dim, sizes, n: int, rank: int, checking: bool):
    """all_gather_variable's checks of this rank's arguments: (dim normalised, sizes as a list or None)."""
    dim = _normalize_dim(dim, tensor)
    if sizes is None:
        return dim, None
    if type(sizes) is not list and (isinstance(sizes, torch.Tensor) or not isinstance(sizes, Sequence)):
        raise TypeError(f"`sizes` must be a list of ints or None, got {type(sizes).__name__}")
    sizes = list(sizes)
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"`sizes` must be a list of ints or None, got {sizes!r}")
    if len(sizes) != n or min(sizes, default=0) < 0:
        raise ValueError(f"`sizes`={sizes} must hold {n} non-negative ints (one per group rank)")
    # In check mode the exchange compares every rank's size on every rank, naming them all.
    if sizes[rank] != tensor.shape[dim] and not checking:
        raise ValueError(
            f"`sizes`[{rank}]={sizes[rank]} but this rank's tensor has size {tensor.shape[dim]} along dim {dim}"
        )
    return dim, sizes


def all_gather_variable(
    tensor: torch.Tensor,
    dim: int = 0,
    sizes: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """Concatenate every rank's tensor along ``dim`` where the sizes along ``dim`` may differ; differentiable.

    Args:
        tensor: this rank's input, shape (..., s_r, ...) with s_r (zero allowed) at ``dim``; every other
            dim and the dtype must agree across ranks.
        dim: the dim to concatenate along (negative counts from the end).
        sizes: every rank's s_r, in group-rank order, if known. ``None``: one small exchange learns them
            (a host sync) and checks the other dims and the dtype, raising the same ValueError on every
            rank on a mismatch (and any rank's bad ``dim``, on every rank). Given: no exchange and no host
            sync (check mode verifies them). Every rank passes ``sizes`` or every rank passes ``None``.
        group: process group (``None``: the default group).

    Returns:
        (y, sizes): y of shape (..., sum_r s_r, ...), rank r's tensor at offset s_0 + ... + s_{r-1}, and
        the list of sizes. The backward is the transpose, a variable-size reduce-scatter: rank j
        receives sum_r g_r[slice j]. See Note [Variable sizes] for the communication.
    """
    _require_tensor("tensor", tensor)
    group, n, rank = _setup(group)
    compiling = torch.compiler.is_compiling()
    if sizes is None and n > 1 and compiling:
        return compiled_path().all_gather_variable_eagerly(tensor, _normalize_dim(dim, tensor), None, group)
    checking = n > 1 and _check.is_check_mode() and not compiling
    if n > 1 and not compiling and (sizes is None or checking):
        try:
            (dim, sizes), error = _variable_args(tensor, dim, sizes, n, rank, checking), None
        except _check.collective_errors() as e:
            error, dim = e, None
        sizes = _learn_sizes(tensor, dim, sizes, _needs_graph(tensor), group, n, error)
    else:
        dim, sizes = _variable_args(tensor, dim, sizes, n, rank, checking)
        if n == 1:
            sizes = [tensor.shape[dim]]
    if compiling:
        return compiled_path().all_gather_variable(tensor, dim, sizes, group), sizes
    return _AllGatherVariable.apply(tensor, dim, tuple(sizes), group, rank), sizes


class _AllGatherBaseWrite(Function):
    """Writes cat(x_0, ..., x_{W-1}) into the caller's output. Adjoint: reduce-scatter (SUM)."""

    @staticmethod
    def forward(ctx, output, tensor, group, n, rank, direct):
        ctx.group, ctx.n, ctx.rank, ctx.shape = _groups.hold(group), n, rank, tensor.shape
        _raw_all_gather_into(output, tensor, group, n)
        return _written(ctx, [output], direct)[0]

    @staticmethod
    def backward(ctx, grad):
        n = ctx.n
        rows = grad.reshape(n, math.prod(ctx.shape))
        chunk = _adjoint(_ReduceScatterVariable, _reduce_scatter_concat, rows, 0, (1,) * n, _groups.unhold(ctx.group),
                         ctx.rank)
        return None, chunk.reshape(ctx.shape), None, None, None, None


def _base_args(output_tensor: torch.Tensor, input_tensor: torch.Tensor, n: int) -> None:
    """_all_gather_base's checks of this rank's arguments."""
    _require_writable("output_tensor", output_tensor, input_tensor)
    allowed = [(n, *input_tensor.shape)]
    if input_tensor.dim():
        allowed.insert(0, (n * input_tensor.shape[0], *input_tensor.shape[1:]))
    if tuple(output_tensor.shape) not in allowed:
        raise ValueError(
            f"`output_tensor` has shape {tuple(output_tensor.shape)}; for an input of shape "
            f"{tuple(input_tensor.shape)} on {n} ranks it must be one of {allowed}"
        )


def _all_gather_base(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-gather into ``output_tensor`` and return it; differentiable (unlike torch's, on every backend).

    Args:
        output_tensor: shape (W*s0, ...) or (W, *input.shape), same dtype and device as the input; must not
            require grad. Overwritten.
        input_tensor: this rank's input, shape (s0, ...), the same on every rank (checked in check mode).
        group: process group (``None``: the default group).

    Returns:
        ``output_tensor`` with autograd told of the write (Note [Writing into output arguments]). The
        backward is a reduce-scatter (SUM): rank j receives sum_r g_r[chunk j].
    """
    _require_tensor("output_tensor", output_tensor)
    _require_tensor("input_tensor", input_tensor)
    group, n, rank = _setup(group)
    _check.decide("_all_gather_base", group, n, _base_args, output_tensor, input_tensor, n)
    if torch.compiler.is_compiling():
        return compiled_path().all_gather_base(output_tensor, input_tensor, group)
    needs_grad = _needs_graph(input_tensor)
    if n > 1 and _check.is_check_mode():
        _check.check_same("_all_gather_base", input_tensor, group, requires_grad=needs_grad)
    if not needs_grad:
        _raw_all_gather_into(output_tensor, input_tensor, group, n)
        return output_tensor
    direct = output_tensor._base is None
    return _AllGatherBaseWrite.apply(output_tensor, input_tensor, group, n, rank, direct)
