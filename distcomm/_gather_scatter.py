"""gather and scatter, each the exact transpose of the other.

    forward                     grad on rank j                            adjoint collective
    gather(dst)                 g_dst[j]                                  scatter from dst
    scatter(src)                src: (g_0, ..., g_{W-1}); others: none    gather to src

Both are linear: the backward is the transposed collective (Note [Gradient convention] in
:mod:`distcomm.functional`), built from the other op's autograd Function so double backward works.

Under ``torch.compile`` the public functions hand their validated arguments to the compiled path (Note
[Import direction of the compiled path] in :mod:`distcomm._dispatch`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.autograd import Function

from distcomm import _check, _groups
from distcomm._dispatch import compiled_path
from distcomm._movement_args import _needs_graph, _require_tensor, _require_tensor_list, _setup
from distcomm._reduce import _adjoint


__all__ = ["gather", "scatter"]


def _raw_gather(dst: int, group, n: int, rank: int, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.contiguous()
    if rank != dst:
        if n > 1:
            dist.gather(x, None, group=group, group_dst=dst)
        return tuple(torch.zeros_like(x) for _ in range(n))
    outs = [torch.empty_like(x) for _ in range(n)]
    if n == 1:
        outs[0].copy_(x)
    else:
        dist.gather(x, outs, group=group, group_dst=dst)
    return tuple(outs)


def _raw_scatter(src: int, group, n: int, rank: int, like, *tensors: torch.Tensor) -> torch.Tensor:
    shape, dtype, device = like
    out = torch.empty(shape, dtype=dtype, device=device)
    if n == 1:
        out.copy_(tensors[0])
    elif rank == src:
        dist.scatter(out, [t.contiguous() for t in tensors], group=group, group_src=src)
    else:
        dist.scatter(out, None, group=group, group_src=src)
    return out


class _Gather(Function):
    """y_r = (x_0, ..., x_{W-1}) on r = dst, zeros elsewhere. Adjoint: scatter of g_dst from dst."""

    @staticmethod
    def forward(ctx, dst, group, n, rank, tensor):
        ctx.dst, ctx.group, ctx.n, ctx.rank = dst, _groups.hold(group), n, rank
        ctx.like = (tensor.shape, tensor.dtype, tensor.device)
        return _raw_gather(dst, group, n, rank, tensor)

    @staticmethod
    def backward(ctx, *grads):
        args = (ctx.dst, _groups.unhold(ctx.group), ctx.n, ctx.rank, ctx.like)
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
        ctx.src, ctx.group, ctx.n, ctx.rank = src, _groups.hold(group), n, rank
        ctx.n_inputs, ctx.is_src = len(tensors), rank == src
        ctx.placeholder_likes = [(t.shape, t.dtype, t.device) for t in tensors[:n]]
        out = _raw_scatter(src, group, n, rank, like, *tensors)
        if not differentiable:
            ctx.mark_non_differentiable(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        grads = _adjoint(_Gather, _raw_gather, ctx.src, _groups.unhold(ctx.group), ctx.n, ctx.rank, grad.contiguous())
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
    dst_rank = _check.decide("gather", group, n, _groups.check_rank_in_group, "dst", dst, group)
    if torch.compiler.is_compiling():
        return compiled_path().gather(tensor, dst_rank, group)
    if n > 1 and _check.is_check_mode():
        _check.check_same("gather", tensor, group, requires_grad=_needs_graph(tensor), dst=dst)
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

    Under ``torch.compile`` every rank passes W tensors (placeholders off the source, of the output's
    shape and dtype, requiring grad when the source's tensors do: a compiled output requires grad when this
    rank's tensors do); the exchange checks them and raises the same ValueError on every rank if they
    disagree with the source's. ``None`` off the source runs the call eagerly (a graph break; an error under
    ``fullgraph=True``).
    """
    group, n, rank = _setup(group)
    if n == 1 or torch.compiler.is_compiling():
        src_rank, given = _scatter_args(tensors, src, group, n, rank)
        if given is None and n > 1:
            return compiled_path().scatter_eagerly(None, src, group)
        tensors = given or []
        if torch.compiler.is_compiling():
            return compiled_path().scatter(tensors, src_rank, _needs_graph(*tensors), group)
        if not _same_kind(tensors):
            raise _differing_source_tensors(src)
        like = (tensors[0].shape, tensors[0].dtype, tensors[0].device)
        differentiable = _needs_graph(*tensors)
    else:
        try:
            (src_rank, given), error = _scatter_args(tensors, src, group, n, rank), None
        except _check.collective_errors() as e:
            src_rank, given, error = -1, None, e
        tensors = given or []
        is_src = rank == src_rank
        meta, differentiable = _exchange(
            tensors, is_src, src_rank, group, is_src and _needs_graph(*tensors), error=error
        )
        device = tensors[0].device if tensors else _groups.comm_device(None, group)
        like = (torch.Size(meta.shape), meta.dtype, device)
    inputs = tensors
    if differentiable and not _needs_graph(*inputs):
        inputs = [*inputs, torch.zeros((), requires_grad=True)]  # makes this rank's output require grad
    return _Scatter.apply(src_rank, group, n, rank, like, bool(differentiable), *inputs)


def _scatter_args(tensors, src, group, n: int, rank: int):
    """scatter's checks of this rank's arguments: (``src``'s position in the group, ``tensors`` as a list,
    or None off the source when none are given)."""
    src_rank = _groups.check_rank_in_group("src", src, group)
    if tensors is None or (rank != src_rank and isinstance(tensors, (list, tuple)) and len(tensors) == 0):
        if rank == src_rank:
            raise ValueError(f"`tensors` must hold {n} tensors on the source rank (global rank {src}), got None")
        return src_rank, None
    return src_rank, _require_tensor_list("tensors", tensors, n)


def _same_kind(tensors) -> bool:
    first = tensors[0]
    return all(t.shape == first.shape and t.dtype == first.dtype and t.device == first.device for t in tensors)


def _exchange(
    tensors, is_src: bool, src_rank: int, group, requires_grad: bool, *, placeholders: bool = False, error=None
):
    """scatter's small exchange: every rank learns the source's (shape, dtype) and whether its tensors
    require grad, and raises the same error when they are malformed, when the ranks name different
    sources, or when any rank's own arguments were rejected (``error``, this rank's verdict: Note
    [Collective verdicts] in :mod:`distcomm._check`). With ``placeholders`` (the compiled op) this rank also
    sends its placeholders' (shape, dtype) and ``requires_grad``, which every rank checks against the
    source's. Returns (the source's TensorMeta, whether its tensors require grad).
    """
    sent = tensors[0] if (is_src or placeholders) and tensors and error is None else None
    ok = int(_same_kind(tensors)) if is_src and error is None else 1
    verdict = _check.encode_verdict(error)
    metas, extras = _check.gather_meta(sent, group, extra=[ok, int(requires_grad), src_rank, *verdict])
    _check.raise_verdicts("scatter", [e[3:] for e in extras])
    _check.require_agreement(
        "scatter", "src", [e[2] for e in extras], show=lambda v: f"{_groups.to_global_rank(group, v)}"
    )
    ok, differentiable = extras[src_rank][:2]
    src = _groups.to_global_rank(group, src_rank)
    if not ok:
        raise _differing_source_tensors(src)
    meta = metas[src_rank]
    if meta.dtype is None:
        raise ValueError("scatter: the source rank's dtype is not supported by the shape exchange")
    for r, (m, extra) in enumerate(zip(metas, extras)):
        if r != src_rank and m is not None and (m != meta or extra[1] != differentiable):
            raise ValueError(
                f"scatter: the placeholders of group rank {r} have shape {tuple(m.shape)}, dtype {m.dtype} and "
                f"requires_grad={bool(extra[1])}, but the source's tensors (global rank {src}) have shape "
                f"{tuple(meta.shape)}, dtype {meta.dtype} and requires_grad={bool(differentiable)}; under "
                "torch.compile a rank's output takes its placeholders' shape and requires grad when they do, so "
                "they must match"
            )
    return meta, bool(differentiable)


def _differing_source_tensors(src: int) -> ValueError:
    return ValueError(
        f"scatter: the tensors passed on the source rank (global rank {src}) differ in shape, dtype or device; "
        "all of them must match"
    )
