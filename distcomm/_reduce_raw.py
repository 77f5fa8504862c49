"""Raw reductions: the collectives behind the reduction family's autograd Functions, without autograd.

all_reduce, reduce, broadcast and reduce-scatter for every ReduceOp (emulated where a backend lacks it,
Note [Backend emulation] in :mod:`distcomm._reduce_ops`), the all-gathers that reduce-scatter's backward
and ``all_gather_tensor`` use, and the zero-safe product of the other ranks' inputs (PRODUCT's gradient).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from distcomm._reduce_ops import (
    _MAX,
    _OPS,
    _PREMUL_SUM,
    _PRODUCT,
    _SUM_OP,
    _backend_op,
    _finish,
    _is_nccl,
    _Op,
    _owned_copy,
    _wire,
)

# torch 2.13 renamed these (the old names warn); older versions only have the old names.
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# --------------------------------------------------------------------------------------------------------
# Raw collectives: never modify their arguments, always return new tensors, world of one = local op.
# --------------------------------------------------------------------------------------------------------


def _raw_all_reduce(x: torch.Tensor, op: _Op, group, size: int) -> torch.Tensor:
    buf = _owned_copy(x, op)
    if size == 1 or buf.numel() == 0:
        return buf
    backend_op, divisor = _backend_op(op, group, buf, size)
    nan = None
    if op.extrema and buf.dtype.is_floating_point:
        nan = torch.isnan(buf).to(torch.uint8)
        dist.all_reduce(nan, op=_MAX, group=group)
    dist.all_reduce(_wire(buf), op=backend_op, group=group)
    if divisor is None and nan is None:
        return buf
    return _finish(buf, divisor, nan)


def _raw_reduce(x: torch.Tensor, dst: int, op: _Op, group, size: int, is_dst: bool) -> torch.Tensor:
    """The reduction on group rank ``dst`` (this rank if ``is_dst``), zeros on the other ranks."""
    if (not is_dst and size > 1 and op.kind is _SUM_OP.kind and x.numel() and x.is_contiguous()
            and not x.is_conj() and _is_nccl(group, x)):
        # NCCL only reads a non-root rank's buffer (its receive buffer is used on the root alone): no copy.
        # (A lazily conjugated tensor still needs the copy that resolves it before view_as_real.)
        dist.reduce(_wire(x), op=_SUM_OP.kind, group=group, group_dst=dst)
        return torch.zeros_like(x, memory_format=torch.contiguous_format)
    buf = _owned_copy(x, op)
    if size == 1 or buf.numel() == 0:
        return buf
    backend_op, divisor = _backend_op(op, group, buf, size)
    nan = None
    if op.extrema and buf.dtype.is_floating_point:
        nan = torch.isnan(buf).to(torch.uint8)
        dist.reduce(nan, op=_MAX, group=group, group_dst=dst)
    dist.reduce(_wire(buf), op=backend_op, group=group, group_dst=dst)
    if not is_dst:
        return buf.zero_()
    if divisor is None and nan is None:
        return buf
    return _finish(buf, divisor, nan)


def _raw_broadcast(x: torch.Tensor, src: int, group, size: int, is_src: bool) -> torch.Tensor:
    """A new contiguous tensor holding group rank ``src``'s ``x`` (this rank's if ``is_src``)."""
    if size == 1 or is_src:
        buf = _owned_copy(x, _SUM_OP)
    else:
        buf = x.new_empty(x.shape)
    if size > 1 and buf.numel():
        dist.broadcast(_wire(buf), group=group, group_src=src)
    return buf


def _stack_padded(tensors) -> torch.Tensor:
    """(N, m) rows holding the flattened tensors, zero-padded to the largest numel m (one copy each)."""
    numels = [t.numel() for t in tensors]
    width = max(numels)
    make = torch.empty if all(n == width for n in numels) else torch.zeros
    out = make((len(tensors), width), dtype=tensors[0].dtype, device=tensors[0].device)
    for row, t, n in zip(out, tensors, numels):
        row[:n].view(t.shape).copy_(t)
    return out


def _raw_reduce_scatter_into(out: torch.Tensor, src: torch.Tensor, op: _Op, group, size: int) -> torch.Tensor:
    """``out`` receives chunk ``rank`` (along dim 0) of the reduction of the contiguous ``src``; returns ``out``.

    Shapes follow the backends' concatenated layout: ``src`` is (size * k, ...) for an ``out`` of (k, ...).
    """
    if op.kind is _PREMUL_SUM:
        src = _owned_copy(src, op)
    if size == 1:
        return out.copy_(src)
    if out.numel() == 0:
        return out
    backend_op, divisor = _backend_op(op, group, src, size)
    nan = None
    if op.extrema and src.dtype.is_floating_point:
        nan = torch.empty(out.shape, dtype=torch.uint8, device=src.device)
        _reduce_scatter_into(nan, torch.isnan(src).to(torch.uint8), op=_MAX, group=group)
    _reduce_scatter_into(_wire(out), _wire(src), op=backend_op, group=group)
    if divisor is None and nan is None:
        return out
    return _finish(out, divisor, nan)


def _raw_reduce_scatter_stacked(stacked: torch.Tensor, op: _Op, group, size: int, out: torch.Tensor | None = None):
    """Row r of the (N, m) ``stacked`` tensor, reduced over the ranks, lands on rank r: returns (m,).

    ``out`` (contiguous, m elements, 1-D) receives the result when given.
    """
    if out is None:
        out = stacked.new_empty(stacked.shape[1])
    return _raw_reduce_scatter_into(out, stacked.reshape(-1), op, group, size)


def _raw_all_gather_flat(flat: torch.Tensor, numels: list[int], group) -> list[torch.Tensor]:
    """Every rank's 1-D tensor (rank r's has ``numels[r]`` elements), gathered by padding to the largest."""
    width = max(numels)
    padded = flat
    if flat.numel() < width:
        padded = flat.new_zeros(width)
        padded[: flat.numel()].copy_(flat)
    out = flat.new_empty(len(numels) * width)
    if len(numels) == 1:
        out.copy_(padded)
    elif width:
        _all_gather_into(_wire(out), _wire(padded.contiguous()), group=group)
    return [out[r * width : r * width + n] for r, n in enumerate(numels)]


def _layout(shape, dim: int) -> tuple[int, int, int]:
    """(elements before, size along, elements after) ``dim``."""
    return math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])


def _raw_reduce_scatter_dim(x: torch.Tensor, dim: int, op: _Op, group, size: int) -> torch.Tensor:
    """Chunk r along ``dim`` of the reduction lands on rank r, in a new tensor (no staging copy for dim 0)."""
    shape = x.shape
    if dim == 0:  # chunk r is the r-th block of rows: the backend reads it in place
        out = x.new_empty((shape[0] // size, *shape[1:]))
        return _raw_reduce_scatter_into(out, x.contiguous(), op, group, size)
    pre, along, post = _layout(shape, dim)
    chunk = along // size
    stacked = x.reshape(pre, size, chunk * post).transpose(0, 1).reshape(-1)
    out = x.new_empty((*shape[:dim], chunk, *shape[dim + 1 :]))
    _raw_reduce_scatter_into(out.view(-1), stacked, op, group, size)
    return out


def _raw_all_gather_dim(y: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """Concatenation along ``dim`` of every rank's (equally shaped) ``y``, in a new tensor (never a view)."""
    if size == 1:
        return _owned_copy(y, _SUM_OP)
    y = y.contiguous()
    shape = y.shape
    if dim == 0:  # rank r's block is the r-th block of rows: the backend writes it in place
        out = y.new_empty((size * shape[0], *shape[1:]))
        if y.numel():
            _all_gather_into(_wire(out), _wire(y), group=group)
        return out
    pre, chunk, post = _layout(shape, dim)
    full_shape = (*shape[:dim], size * chunk, *shape[dim + 1 :])
    if pre <= 1 or y.numel() == 0:  # rank r's block is one contiguous piece of the output
        out = y.new_empty(full_shape)
        if y.numel():
            _all_gather_into(_wire(out.view(-1)), _wire(y.view(-1)), group=group)
        return out
    blocks = y.new_empty(size * pre * chunk * post)
    _all_gather_into(_wire(blocks), _wire(y.view(-1)), group=group)
    return blocks.view(size, pre, chunk * post).transpose(0, 1).reshape(full_shape)  # a copy, as pre > 1


def _count_dtype(size: int) -> torch.dtype:
    """The narrowest dtype that counts up to the group size (counts travel in it)."""
    return torch.uint8 if size < 256 else torch.int32


@torch.no_grad()
def _others_product(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """prod_{i != j} x_i on rank j, zero-safe (Note [Reduction gradients]); two all_reduces."""
    zero = x == 0
    zeros = _raw_all_reduce(zero.to(_count_dtype(size)), _SUM_OP, group, size)
    safe = torch.where(zero, torch.ones_like(x), x)
    nonzero_product = _raw_all_reduce(safe, _OPS[_PRODUCT.value], group, size)
    return torch.where(
        zeros == 0,
        nonzero_product / safe,
        torch.where((zeros == 1) & zero, nonzero_product, torch.zeros_like(nonzero_product)),
    )
