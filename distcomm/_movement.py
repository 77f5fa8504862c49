"""Data-movement collectives (gathers, scatters, all-to-all) and their exact transposes.

Every op here is linear, so its backward is the transposed collective (Note [Gradient convention] in
:mod:`distcomm.functional`), built from the other op's autograd Function so double backward works:

    forward                     grad on rank j                            adjoint collective
    gather(dst)                 g_dst[j]                                  scatter from dst
    scatter(src)                src: (g_0, ..., g_{W-1}); others: none    gather to src
    all_gather                  sum_r g_r[j]                              reduce-scatter (SUM)
    _all_gather_base            sum_r g_r[chunk j]                        reduce-scatter (SUM)
    all_gather_tensor(dim)      sum_r g_r[chunk j along dim]              reduce_scatter_tensor (SUM)
    all_gather_variable(dim)    sum_r g_r[slice j along dim]              reduce-scatter (uneven: all_to_all)
    all_to_all(_single)         the grads routed back, splits swapped     all_to_all(_single)

``all_gather_tensor``'s adjoint is the Function behind :func:`distcomm.functional.reduce_scatter_tensor`;
the others use this module's variable-size reduce-scatter, whose own adjoint is ``all_gather_variable``.
A backward builds its adjoint as a graph node only when a graph is being built (double backward);
otherwise it runs the raw collective, skipping the cost of an autograd node nobody uses.

Every rank must agree on whether its input requires grad: the backward is a collective too, and a rank
that skips it leaves the others waiting. Check mode verifies this (scatter needs no check: the source's
tensors decide for every rank).

Note [Writing into output arguments]
    ``_all_gather_base``, ``all_to_all_single`` and ``all_to_all`` write into tensors the caller passes,
    as torch.distributed does, straight from the collective (no staging copy when they are contiguous).
    Autograd is told in the same Function: the outputs are marked dirty, so the returned tensors are the
    caller's objects with their grad_fn set. Autograd cannot mark views dirty from a Function that
    returns several tensors (and forbids in-place writes into multi-output views such as those of
    ``buf.split(...)``), so when an output is a view every returned tensor is instead a new alias of the
    written memory carrying the graph, which is what torch returns: use the returned tensors. Without
    autograd (no input requires grad, or grad mode off) the outputs themselves are returned.

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

from distcomm import _check, _groups, _reduce
from distcomm._reduce import _SUM_OP, _adjoint

__all__ = [
    "gather",
    "scatter",
    "all_gather",
    "_all_gather_base",
    "all_to_all",
    "all_to_all_single",
    "all_gather_tensor",
    "all_gather_variable",
]

# torch >= 2.13 renamed the flat collective (the old name warns); older versions have only the old name.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---------------------------------------------------------------------------------------------------------
# Validation (local, before any communication)
# ---------------------------------------------------------------------------------------------------------


def _setup(group):
    """Resolve ``group`` and return (group, size, rank); ``group`` is None without a process group.

    Raises TypeError for a ``group`` that is not one and ValueError where this process is not a member.
    """
    return _groups.resolve(group)


def _require_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(value).__name__}")


def _require_tensor_list(name: str, value, n: int) -> list[torch.Tensor]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"`{name}` must be a list or tuple of tensors, got {type(value).__name__}")
    for i, t in enumerate(value):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}[{i}]` must be a torch.Tensor, got {type(t).__name__}")
    if len(value) != n:
        raise ValueError(f"`{name}` must hold one tensor per group rank ({n}), got {len(value)}")
    return list(value)


def _require_writable(name: str, output: torch.Tensor, like: torch.Tensor, index: int | None = None) -> None:
    """``output`` may be overwritten for an input ``like``; ``index`` names an entry of the list ``name``."""
    if output.requires_grad:
        if index is not None:
            name = f"{name}[{index}]"
        raise ValueError(
            f"`{name}` requires grad, but it is overwritten by the collective; pass a tensor that does not "
            "require grad (e.g. torch.empty(...) or .detach()) and use the returned tensor for autograd"
        )
    if output.dtype != like.dtype or output.device != like.device:
        if index is not None:
            name = f"{name}[{index}]"
        raise ValueError(
            f"`{name}` has dtype {output.dtype} on {output.device}, but the input has dtype {like.dtype} on "
            f"{like.device}; they must match"
        )


def _require_splits(name: str, splits, n: int, total: int, tensor_name: str) -> list[int] | None:
    """Validate split sizes along dim 0 (None: equal split) and return them as a list (or None)."""
    if splits is None:
        if total % n:
            raise ValueError(
                f"`{tensor_name}` has size {total} along dim 0, which does not split evenly over {n} ranks; "
                f"pass `{name}`"
            )
        return None
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    if not isinstance(splits, Sequence) or any(isinstance(s, bool) or not isinstance(s, int) for s in splits):
        raise TypeError(f"`{name}` must be a list of ints or None, got {splits!r}")
    splits = list(splits)
    if len(splits) != n or any(s < 0 for s in splits):
        raise ValueError(f"`{name}`={splits} must hold {n} non-negative ints (one per group rank)")
    if sum(splits) != total:
        raise ValueError(
            f"`{name}`={splits} adds up to {sum(splits)}, but `{tensor_name}` has size {total} along dim 0"
        )
    return splits


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


def _needs_graph(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ---------------------------------------------------------------------------------------------------------
# Raw communication (no autograd). ``group`` is None without a process group; a group of one copies.
# ---------------------------------------------------------------------------------------------------------


def _is_nccl(group, tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and "nccl" in str(dist.get_backend(group)).lower()


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


def _raw_all_to_all(outputs: list[torch.Tensor], inputs: list[torch.Tensor], group, n: int) -> None:
    """outputs[i] receives rank i's inputs[this rank]; sizes may differ, outputs may be non-contiguous."""
    if n == 1:
        outputs[0].copy_(inputs[0].reshape(outputs[0].shape))
        return
    if _is_nccl(group, inputs[0]):  # NCCL's list form takes uneven sizes and needs no staging buffer
        recv = [o if o.is_contiguous() else torch.empty_like(o, memory_format=torch.contiguous_format) for o in outputs]
        dist.all_to_all(recv, [t.contiguous() for t in inputs], group=group)
        for o, r in zip(outputs, recv):
            if r is not o:
                o.copy_(r)
        return
    # gloo's list form needs equal sizes: go through one flat all_to_all_single.
    send = torch.cat([t.reshape(-1) for t in inputs])
    out_numels = [o.numel() for o in outputs]
    recv = send.new_empty(sum(out_numels))
    dist.all_to_all_single(recv, send, out_numels, [t.numel() for t in inputs], group=group)
    for o, piece in zip(outputs, recv.split(out_numels)):
        o.copy_(piece.view(o.shape))


def _raw_all_to_all_single(output, x, out_splits, in_splits, group, n: int) -> None:
    if n == 1:
        output.copy_(x)
        return
    recv = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
    dist.all_to_all_single(recv, x.contiguous(), out_splits, in_splits, group=group)
    if recv is not output:
        output.copy_(recv)


def _written(ctx, outputs: list[torch.Tensor], direct: bool) -> tuple[torch.Tensor, ...]:
    """Return freshly written ``outputs`` from a Function's forward (Note [Writing into output arguments])."""
    if direct:
        ctx.mark_dirty(*outputs)
        return tuple(outputs)
    return tuple(o.view_as(o) for o in outputs)


def _is_direct(outputs: list[torch.Tensor]) -> bool:
    return all(o._base is None for o in outputs)


# ---------------------------------------------------------------------------------------------------------
# gather <-> scatter
# ---------------------------------------------------------------------------------------------------------


def _raw_gather(dst: int, group, n: int, rank: int, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.contiguous()
    if rank != dst:
        if n > 1:
            dist.gather(x, None, dst=_groups.to_global_rank(group, dst), group=group)
        return tuple(torch.zeros_like(x) for _ in range(n))
    outs = [torch.empty_like(x) for _ in range(n)]
    if n == 1:
        outs[0].copy_(x)
    else:
        dist.gather(x, outs, dst=_groups.to_global_rank(group, dst), group=group)
    return tuple(outs)


def _raw_scatter(src: int, group, n: int, rank: int, like, *tensors: torch.Tensor) -> torch.Tensor:
    shape, dtype, device = like
    out = torch.empty(shape, dtype=dtype, device=device)
    if n == 1:
        out.copy_(tensors[0])
    elif rank == src:
        dist.scatter(out, [t.contiguous() for t in tensors], src=_groups.to_global_rank(group, src), group=group)
    else:
        dist.scatter(out, None, src=_groups.to_global_rank(group, src), group=group)
    return out


class _Gather(Function):
    """y_r = (x_0, ..., x_{W-1}) on r = dst, zeros elsewhere. Adjoint: scatter of g_dst from dst."""

    @staticmethod
    def forward(ctx, dst, group, n, rank, tensor):
        ctx.dst, ctx.group, ctx.n, ctx.rank = dst, group, n, rank
        ctx.like = (tensor.shape, tensor.dtype, tensor.device)
        return _raw_gather(dst, group, n, rank, tensor)

    @staticmethod
    def backward(ctx, *grads):
        args = (ctx.dst, ctx.group, ctx.n, ctx.rank, ctx.like)
        if torch.is_grad_enabled():
            return None, None, None, None, _Scatter.apply(*args, True, *grads)
        return None, None, None, None, _raw_scatter(*args, *grads)


class _Scatter(Function):
    """y_r = tensors[r] of the source rank. Adjoint: gather to src (other ranks' unused inputs get None).

    ``like`` = (shape, dtype, device) of the output; ``differentiable`` False marks the output as not
    requiring grad (when the source's tensors do not), so no rank waits in a backward its peers skip.
    """

    @staticmethod
    def forward(ctx, src, group, n, rank, like, differentiable, *tensors):
        ctx.src, ctx.group, ctx.n, ctx.rank = src, group, n, rank
        ctx.n_inputs, ctx.is_src = len(tensors), rank == src
        ctx.placeholder_likes = [(t.shape, t.dtype, t.device) for t in tensors[:n]]
        out = _raw_scatter(src, group, n, rank, like, *tensors)
        if not differentiable:
            ctx.mark_non_differentiable(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        grads = _adjoint(_Gather, _raw_gather, ctx.src, ctx.group, ctx.n, ctx.rank, grad.contiguous())
        head = (None,) * 6
        if ctx.is_src:
            return (*head, *grads)
        # Off the source the gathered grads are zeros that stay in the graph: a double backward then runs
        # the scatter its source waits in. Placeholders of another shape (or none) get no grad.
        return head + tuple(
            g if like == (g.shape, g.dtype, g.device) else None for g, like in zip(grads, ctx.placeholder_likes)
        ) + (None,) * (ctx.n_inputs - len(grads))


def gather(tensor: torch.Tensor, dst: int = 0, group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, ...]:
    """Gather every rank's tensor on ``dst``; differentiable.

    Args:
        tensor: this rank's input, shape S, the same shape and dtype on every rank (checked in check mode).
        dst: destination, a global rank of ``group``.
        group: process group (``None``: the default group).

    Returns:
        A tuple of W tensors of shape S on every rank: (x_0, ..., x_{W-1}) on ``dst``, zeros elsewhere.
        Whenever ``tensor`` requires grad every one of them does, on every rank (the zeros included).
        The backward scatters g_dst from ``dst``: rank j receives g_dst[j]. Every rank must backpropagate
        through its result (the backward is a collective), even where it holds only zeros.
    """
    _require_tensor("tensor", tensor)
    group, n, rank = _setup(group)
    dst_rank = _groups.check_rank_in_group("dst", dst, group)
    if n > 1 and _check.is_check_mode():
        _check.check_same("gather", tensor, group, requires_grad=_needs_graph(tensor))
    return _Gather.apply(dst_rank, group, n, rank, tensor)


def scatter(
    tensors: Sequence[torch.Tensor] | None, src: int = 0, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Send ``tensors[r]`` of the source rank to rank r; differentiable.

    Args:
        tensors: on ``src``, W tensors of one shape S and dtype. Elsewhere the values are ignored: pass
            W placeholder tensors as torch requires, or ``None`` / ``[]``.
        src: source, a global rank of ``group``.
        group: process group (``None``: the default group).

    Returns:
        This rank's tensor, shape S. One small exchange first tells every rank S, the dtype and whether
        the source's tensors require grad: every rank's output requires grad exactly when they do (so
        every rank takes part in the backward), and malformed source tensors raise the same ValueError on
        every rank. Receivers that pass ``None`` get their output on the CUDA device for NCCL, else CPU.
        The backward gathers every rank's grad to ``src``: ``tensors[r]`` there receives g_r; the other
        ranks' placeholders get no grad.
    """
    group, n, rank = _setup(group)
    src_rank = _groups.check_rank_in_group("src", src, group)
    is_src = rank == src_rank
    if tensors is None or (not is_src and isinstance(tensors, (list, tuple)) and len(tensors) == 0):
        if is_src:
            raise ValueError(f"`tensors` must hold {n} tensors on the source rank (global rank {src}), got None")
        tensors = []
    else:
        tensors = _require_tensor_list("tensors", tensors, n)
    ok = 1
    differentiable = 0
    if is_src:
        first = tensors[0]
        ok = int(all(t.shape == first.shape and t.dtype == first.dtype and t.device == first.device for t in tensors))
        differentiable = int(_needs_graph(*tensors))
    if n == 1:
        like = (tensors[0].shape, tensors[0].dtype, tensors[0].device)
    else:
        metas, extras = _check.gather_meta(tensors[0] if is_src else None, group, extra=[ok, differentiable])
        ok, differentiable = extras[src_rank]
        if not ok:
            raise ValueError(
                f"scatter: the tensors passed on the source rank (global rank {src}) differ in shape, dtype or "
                "device; all of them must match"
            )
        meta = metas[src_rank]
        if meta.dtype is None:
            raise ValueError("scatter: the source rank's dtype is not supported by the shape exchange")
        device = tensors[0].device if tensors else _groups.comm_device(None, group)
        like = (torch.Size(meta.shape), meta.dtype, device)
    inputs = tensors
    if differentiable and not _needs_graph(*inputs):
        inputs = [*inputs, torch.zeros((), requires_grad=True)]  # makes this rank's output require grad
    return _Scatter.apply(src_rank, group, n, rank, like, bool(differentiable), *inputs)


# ---------------------------------------------------------------------------------------------------------
# all_gather family <-> reduce_scatter
# ---------------------------------------------------------------------------------------------------------


def _sum_entries(grads: tuple[torch.Tensor, ...], group, n: int) -> torch.Tensor:
    """sum_r of rank r's ``grads[this rank]`` (a reduce-scatter, SUM): the raw adjoint of :class:`_AllGather`."""
    first = grads[0]
    if first.dim() == 0:  # the backends need a dim to split
        out = first.new_empty(1)
        return _reduce._raw_reduce_scatter_into(out, torch.stack(grads), _SUM_OP, group, n).view(())
    out = first.new_empty(first.shape)
    return _reduce._raw_reduce_scatter_into(out, torch.cat(grads), _SUM_OP, group, n)


class _AllGather(Function):
    """y_r = (x_0, ..., x_{W-1}) on every rank. Adjoint: reduce-scatter (SUM) of the stacked grads."""

    @staticmethod
    def forward(ctx, group, n, rank, tensor):
        ctx.group, ctx.n, ctx.rank = group, n, rank
        x = tensor.contiguous()
        outs = [torch.empty_like(x) for _ in range(n)]
        if n == 1:
            outs[0].copy_(x)
        else:
            dist.all_gather(outs, x, group=group)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        group, n = ctx.group, ctx.n
        if not torch.is_grad_enabled():
            return None, None, None, _sum_entries(grads, group, n)
        stacked = torch.stack(grads)
        return None, None, None, _ReduceScatterVariable.apply(stacked, 0, (1,) * n, group, ctx.rank).squeeze(0)


class _AllGatherTensor(Function):
    """y = cat(x_0, ..., x_{W-1}; dim) on every rank. Adjoint: reduce_scatter_tensor(SUM) along dim."""

    @staticmethod
    def forward(ctx, tensor, dim, group, n):
        ctx.dim, ctx.group, ctx.n = dim, group, n
        return _reduce._raw_all_gather_dim(tensor, dim, group, n)

    @staticmethod
    def backward(ctx, grad):
        args = (grad, ctx.dim, _SUM_OP, ctx.group, ctx.n)
        return _adjoint(_reduce._ReduceScatterTensor, _reduce._raw_reduce_scatter_dim, *args), None, None, None


def _gather_concat(x: torch.Tensor, dim: int, sizes: tuple[int, ...], group) -> torch.Tensor:
    """cat over ranks along ``dim`` of x_r, whose size along ``dim`` is sizes[r] (Note [Variable sizes])."""
    n = len(sizes)
    if sizes.count(sizes[0]) == n:
        return _reduce._raw_all_gather_dim(x, dim, group, n)
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
        return _reduce._raw_reduce_scatter_dim(grad, dim, _SUM_OP, group, n)
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
        ctx.dim, ctx.sizes, ctx.group, ctx.rank = dim, sizes, group, rank
        return _gather_concat(tensor, dim, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        args = (grad, ctx.dim, ctx.sizes, ctx.group, ctx.rank)
        return _adjoint(_ReduceScatterVariable, _reduce_scatter_concat, *args), None, None, None, None


class _ReduceScatterVariable(Function):
    """x̄_j = sum_r g_r[slice j along dim]. Adjoint: _AllGatherVariable."""

    @staticmethod
    def forward(ctx, grad, dim, sizes, group, rank):
        ctx.dim, ctx.sizes, ctx.group, ctx.rank = dim, sizes, group, rank
        return _reduce_scatter_concat(grad, dim, sizes, group, rank)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if torch.is_grad_enabled():
            return _AllGatherVariable.apply(grad, ctx.dim, ctx.sizes, ctx.group, ctx.rank), None, None, None, None
        return _gather_concat(grad, ctx.dim, ctx.sizes, ctx.group), None, None, None, None


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
    dim = _normalize_dim(dim, tensor)
    group, n, _ = _setup(group)
    if n > 1 and _check.is_check_mode():
        _check.check_same("all_gather_tensor", tensor, group, requires_grad=_needs_graph(tensor))
    return _AllGatherTensor.apply(tensor, dim, group, n)


def _learn_sizes(
    tensor: torch.Tensor, dim: int, sizes: list[int] | None, needs_grad: bool, group, n: int
) -> list[int]:
    """Exchange shapes (and the given ``sizes``), raising the same ValueError on every rank on a mismatch.

    In check mode the ranks must also agree on whether the input needs a backward (``needs_grad``).
    """
    op = "all_gather_variable"
    metas, rows = _check.gather_meta(tensor, group, extra=[int(needs_grad), *(sizes or [])])
    extras = None if sizes is None else [row[1:] for row in rows]
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
            raise ValueError(f"{op}: the `sizes` passed differ across ranks ({detail})")
        if learned != list(extras[0]):
            raise ValueError(f"{op}: `sizes`={list(extras[0])} but the tensors have sizes {learned} along dim {dim}")
    if _check.is_check_mode():
        _check.require_agreement(op, "requires_grad", [row[0] for row in rows])
    return learned


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
            rank on a mismatch. Given: no exchange and no host sync (check mode verifies them).
        group: process group (``None``: the default group).

    Returns:
        (y, sizes): y of shape (..., sum_r s_r, ...), rank r's tensor at offset s_0 + ... + s_{r-1}, and
        the list of sizes. The backward is the transpose, a variable-size reduce-scatter: rank j
        receives sum_r g_r[slice j]. See Note [Variable sizes] for the communication.
    """
    _require_tensor("tensor", tensor)
    dim = _normalize_dim(dim, tensor)
    group, n, rank = _setup(group)
    if sizes is not None:
        if type(sizes) is not list and (isinstance(sizes, torch.Tensor) or not isinstance(sizes, Sequence)):
            raise TypeError(f"`sizes` must be a list of ints or None, got {type(sizes).__name__}")
        sizes = list(sizes)
        for s in sizes:
            if isinstance(s, bool) or not isinstance(s, int):
                raise TypeError(f"`sizes` must be a list of ints or None, got {sizes!r}")
        if len(sizes) != n or min(sizes) < 0:
            raise ValueError(f"`sizes`={sizes} must hold {n} non-negative ints (one per group rank)")
        # In check mode the exchange below compares every rank's size on every rank: a rank raising here
        # alone would leave its peers waiting in that exchange.
        if sizes[rank] != tensor.shape[dim] and not (n > 1 and _check.is_check_mode()):
            raise ValueError(
                f"`sizes`[{rank}]={sizes[rank]} but this rank's tensor has size {tensor.shape[dim]} along dim {dim}"
            )
    if n == 1:
        sizes = [tensor.shape[dim]]
    elif sizes is None or _check.is_check_mode():
        sizes = _learn_sizes(tensor, dim, sizes, _needs_graph(tensor), group, n)
    return _AllGatherVariable.apply(tensor, dim, tuple(sizes), group, rank), sizes


class _AllGatherBaseWrite(Function):
    """Writes cat(x_0, ..., x_{W-1}) into the caller's output. Adjoint: reduce-scatter (SUM)."""

    @staticmethod
    def forward(ctx, output, tensor, group, n, rank, direct):
        ctx.group, ctx.n, ctx.rank, ctx.shape = group, n, rank, tensor.shape
        _raw_all_gather_into(output, tensor, group, n)
        return _written(ctx, [output], direct)[0]

    @staticmethod
    def backward(ctx, grad):
        n = ctx.n
        rows = grad.reshape(n, math.prod(ctx.shape))
        chunk = _adjoint(_ReduceScatterVariable, _reduce_scatter_concat, rows, 0, (1,) * n, ctx.group, ctx.rank)
        return None, chunk.reshape(ctx.shape), None, None, None, None


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
    _require_writable("output_tensor", output_tensor, input_tensor)
    allowed = [(n, *input_tensor.shape)]
    if input_tensor.dim():
        allowed.insert(0, (n * input_tensor.shape[0], *input_tensor.shape[1:]))
    if tuple(output_tensor.shape) not in allowed:
        raise ValueError(
            f"`output_tensor` has shape {tuple(output_tensor.shape)}; for an input of shape "
            f"{tuple(input_tensor.shape)} on {n} ranks it must be one of {allowed}"
        )
    needs_grad = _needs_graph(input_tensor)
    if n > 1 and _check.is_check_mode():
        _check.check_same("_all_gather_base", input_tensor, group, requires_grad=needs_grad)
    if not needs_grad:
        _raw_all_gather_into(output_tensor, input_tensor, group, n)
        return output_tensor
    direct = output_tensor._base is None
    return _AllGatherBaseWrite.apply(output_tensor, input_tensor, group, n, rank, direct)


# ---------------------------------------------------------------------------------------------------------
# all_to_all <-> all_to_all (splits swapped)
# ---------------------------------------------------------------------------------------------------------


def _all_to_all_single_fresh(group, n: int, out_shape, out_splits, in_splits, tensor) -> torch.Tensor:
    out = tensor.new_empty(out_shape)
    _raw_all_to_all_single(out, tensor, out_splits, in_splits, group, n)
    return out


class _AllToAllSingle(Function):
    """Fresh-output form: y = all_to_all_single(x). Adjoint: itself with the splits swapped."""

    @staticmethod
    def forward(ctx, group, n, out_shape, out_splits, in_splits, tensor):
        ctx.group, ctx.n, ctx.in_shape, ctx.out_splits, ctx.in_splits = group, n, tensor.shape, out_splits, in_splits
        return _all_to_all_single_fresh(group, n, out_shape, out_splits, in_splits, tensor)

    @staticmethod
    def backward(ctx, grad):
        args = (ctx.group, ctx.n, ctx.in_shape, ctx.in_splits, ctx.out_splits, grad.contiguous())
        return None, None, None, None, None, _adjoint(_AllToAllSingle, _all_to_all_single_fresh, *args)


class _AllToAllSingleWrite(Function):
    """Writes all_to_all_single(x) into the caller's output. Adjoint: _AllToAllSingle, splits swapped."""

    @staticmethod
    def forward(ctx, output, tensor, group, n, out_splits, in_splits, direct):
        ctx.group, ctx.n, ctx.in_shape, ctx.out_splits, ctx.in_splits = group, n, tensor.shape, out_splits, in_splits
        _raw_all_to_all_single(output, tensor, out_splits, in_splits, group, n)
        if direct:
            ctx.mark_dirty(output)
            return output
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        args = (ctx.group, ctx.n, ctx.in_shape, ctx.in_splits, ctx.out_splits, grad.contiguous())
        return None, _adjoint(_AllToAllSingle, _all_to_all_single_fresh, *args), None, None, None, None, None


def _all_to_all_fresh(group, n: int, out_likes, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    outs = [torch.empty(s, dtype=dt, device=dev) for s, dt, dev in out_likes]
    _raw_all_to_all(outs, list(tensors), group, n)
    return tuple(outs)


class _AllToAll(Function):
    """Fresh-output list form: y[i] = rank i's x[this rank]. Adjoint: itself, shapes swapped."""

    @staticmethod
    def forward(ctx, group, n, out_likes, *tensors):
        ctx.group, ctx.n, ctx.in_likes = group, n, [(t.shape, t.dtype, t.device) for t in tensors]
        return _all_to_all_fresh(group, n, out_likes, *tensors)

    @staticmethod
    def backward(ctx, *grads):
        back = _adjoint(_AllToAll, _all_to_all_fresh, ctx.group, ctx.n, ctx.in_likes, *[g.contiguous() for g in grads])
        return (None, None, None, *back)


class _AllToAllWrite(Function):
    """Writes y[i] = rank i's x[this rank] into the caller's outputs. Adjoint: _AllToAll, shapes swapped."""

    @staticmethod
    def forward(ctx, group, direct, n, *tensors):
        outputs, inputs = list(tensors[:n]), list(tensors[n:])
        ctx.group, ctx.n, ctx.in_likes = group, n, [(t.shape, t.dtype, t.device) for t in inputs]
        _raw_all_to_all(outputs, inputs, group, n)
        return _written(ctx, outputs, direct)

    @staticmethod
    def backward(ctx, *grads):
        back = _adjoint(_AllToAll, _all_to_all_fresh, ctx.group, ctx.n, ctx.in_likes, *[g.contiguous() for g in grads])
        return (None, None, None) + (None,) * ctx.n + tuple(back)


def _check_all_to_all(
    op: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor], needs_grad: bool, group, n: int
) -> None:
    """Check mode: rank i's inputs[j] must match rank j's outputs[i] in shape and dtype, and every rank's
    inputs must agree on needing a backward, on every rank."""
    if n == 1 or not _check.is_check_mode():
        return
    rows = [_check.encode_meta(t) for t in [*inputs, *outputs]]
    _, extras = _check.gather_meta(None, group, extra=[int(needs_grad), *(v for row in rows for v in row)])
    width = len(rows[0])

    def meta(rank: int, k: int):
        return _check.decode_meta(extras[rank][1 + k * width : 1 + (k + 1) * width])

    for i in range(n):
        for j in range(n):
            sent, received = meta(i, j), meta(j, n + i)
            if sent != received:
                raise ValueError(
                    f"{op}: rank {i}'s input for rank {j} has shape {tuple(sent.shape)} and dtype {sent.dtype}, "
                    f"but rank {j}'s output for rank {i} has shape {tuple(received.shape)} and dtype "
                    f"{received.dtype}; they must match"
                )
    _check.require_agreement(op, "requires_grad", [e[0] for e in extras])


def all_to_all(
    output_tensor_list: Sequence[torch.Tensor],
    input_tensor_list: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, ...]:
    """Send ``input_tensor_list[j]`` to rank j and receive rank i's tensor into ``output_tensor_list[i]``.

    Sizes may differ per pair (uneven), on gloo too; differentiable.

    Args:
        output_tensor_list: W tensors; entry i has the shape of rank i's ``input_tensor_list[this rank]``
            and this rank's dtype and device; must not require grad. Overwritten.
        input_tensor_list: W tensors of one dtype and device, any shapes.
        group: process group (``None``: the default group).

    Returns:
        The tuple of outputs, with autograd told of the writes (Note [Writing into output arguments]).
        The backward routes the grads back: ``input_tensor_list[j]`` receives rank j's grad of its output
        from this rank.
    """
    group, n, _ = _setup(group)
    outputs = _require_tensor_list("output_tensor_list", output_tensor_list, n)
    inputs = _require_tensor_list("input_tensor_list", input_tensor_list, n)
    for i, t in enumerate(inputs):
        if t.dtype != inputs[0].dtype or t.device != inputs[0].device:
            raise ValueError(
                f"`input_tensor_list[{i}]` has dtype {t.dtype} on {t.device}, but `input_tensor_list[0]` has "
                f"dtype {inputs[0].dtype} on {inputs[0].device}; all must match"
            )
    for i, o in enumerate(outputs):
        _require_writable("output_tensor_list", o, inputs[0], i)
    needs_grad = _needs_graph(*inputs)
    _check_all_to_all("all_to_all", inputs, outputs, needs_grad, group, n)
    if not needs_grad:
        _raw_all_to_all(outputs, inputs, group, n)
        return tuple(outputs)
    return _AllToAllWrite.apply(group, _is_direct(outputs), n, *outputs, *inputs)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Split ``input`` along dim 0, send piece j to rank j, and concatenate the received pieces into ``output``.

    Args:
        output: shape (sum(output_split_sizes), *input.shape[1:]), same dtype and device as the input;
            must not require grad. Overwritten.
        input: shape (sum(input_split_sizes), ...).
        output_split_sizes: rows received from each rank (``None``: ``output.shape[0] / W`` each).
        input_split_sizes: rows sent to each rank (``None``: ``input.shape[0] / W`` each). Rank i's
            ``input_split_sizes[j]`` must equal rank j's ``output_split_sizes[i]`` (checked in check mode).
        group: process group (``None``: the default group).

    Returns:
        ``output`` with autograd told of the write (Note [Writing into output arguments]). The backward is
        all_to_all_single of the grad with the split sizes swapped.
    """
    _require_tensor("output", output)
    _require_tensor("input", input)
    group, n, _ = _setup(group)
    if input.dim() == 0 or output.dim() == 0:
        raise ValueError("all_to_all_single splits along dim 0: `input` and `output` need at least 1 dim")
    _require_writable("output", output, input)
    if output.shape[1:] != input.shape[1:]:
        raise ValueError(
            f"`output` has shape {tuple(output.shape)}; its dims after the first must equal the input's "
            f"{tuple(input.shape[1:])}"
        )
    out_splits = _require_splits("output_split_sizes", output_split_sizes, n, output.shape[0], "output")
    in_splits = _require_splits("input_split_sizes", input_split_sizes, n, input.shape[0], "input")
    needs_grad = _needs_graph(input)
    if n > 1 and _check.is_check_mode():
        _check_all_to_all_single(input, out_splits or [output.shape[0] // n] * n,
                                 in_splits or [input.shape[0] // n] * n, needs_grad, group, n)
    if not needs_grad:
        _raw_all_to_all_single(output, input, out_splits, in_splits, group, n)
        return output
    return _AllToAllSingleWrite.apply(output, input, group, n, out_splits, in_splits, output._base is None)


def _check_all_to_all_single(
    tensor, out_splits: list[int], in_splits: list[int], needs_grad: bool, group, n: int
) -> None:
    """Check mode: dtypes, trailing dims, matching splits and the requires_grad flag, on every rank."""
    metas, extras = _check.gather_meta(tensor, group, extra=[*in_splits, *out_splits, int(needs_grad)])
    ref = metas[0]
    if any(m.dtype != ref.dtype or tuple(m.shape[1:]) != tuple(ref.shape[1:]) for m in metas):
        _check.raise_mismatch("all_to_all_single", "dtypes or sizes of the dims after the first", metas)
    for i in range(n):
        for j in range(n):
            if extras[i][j] != extras[j][n + i]:
                raise ValueError(
                    f"all_to_all_single: rank {i} sends {extras[i][j]} rows to rank {j} (its input_split_sizes), "
                    f"but rank {j} expects {extras[j][n + i]} rows from rank {i} (its output_split_sizes)"
                )
    _check.require_agreement("all_to_all_single", "requires_grad", [e[2 * n] for e in extras])
