"""Reductions and broadcast with exact gradients for every ReduceOp.

Public (re-exported by :mod:`distcomm.functional`): the drop-ins ``all_reduce``, ``reduce``, ``broadcast``
and ``reduce_scatter`` of ``torch.distributed.nn.functional``, plus ``reduce_scatter_tensor``.

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

Note [Backend emulation]
    - AVG: native on NCCL for floating and complex CUDA tensors; otherwise SUM, then division by N
      (truncating for integers, as NCCL's integer AVG does). all_reduce's backward takes the same path.
      Whether a tensor goes through NCCL is decided per tensor (a CUDA tensor on a group whose backend
      includes NCCL): a ``"cpu:gloo,cuda:nccl"`` group sends CPU tensors through gloo.
    - BAND / BOR / BXOR: not offered by NCCL; asking for them on an NCCL group raises before communicating.
    - PREMUL_SUM (built with ``torch.distributed._make_nccl_premul_sum(factor)``): computed everywhere as
      the SUM of factor * x. The scaling replaces the copy every op makes anyway, so it costs nothing, and
      gloo, which lacks the op, works too. The factor is a constant: no gradient flows to it.
    - Uneven reduce_scatter lists: entries are zero-padded to the largest one and reduced with a single
      reduce_scatter_tensor; the pads are dropped. Same path on every backend.

Note [Collectives per call]
    forward + backward, beyond the op itself and its adjoint (one collective each way):
    - SUM, AVG, PREMUL_SUM, broadcast: none.
    - MAX / MIN: forward + a 1-byte NaN mask (same collective); backward + a 1-byte tie count (all_reduce
      or reduce_scatter); reduce also broadcasts y, reduce_scatter also all-gathers y.
    - PRODUCT: backward + two all_reduces of the full input (a 1-byte zero count, the non-zero product).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.autograd import Function

from distcomm import _check, _groups

__all__ = ["all_reduce", "reduce", "broadcast", "reduce_scatter", "reduce_scatter_tensor"]

ReduceOp = dist.ReduceOp
_SUM, _AVG, _PRODUCT = ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT
_MIN, _MAX, _PREMUL_SUM = ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PREMUL_SUM
_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
_EXTREMA = (_MIN, _MAX)
_LINEAR = (_SUM, _AVG, _PREMUL_SUM)
_ALL_OPS = "SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM"
_DIFFERENTIABLE_OPS = "SUM, AVG, PREMUL_SUM, PRODUCT, MIN, MAX"

# torch 2.13 renamed these (the old names warn); older versions only have the old names.
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# --------------------------------------------------------------------------------------------------------
# Ops and validation
# --------------------------------------------------------------------------------------------------------


class _Op:
    """A parsed ReduceOp: its kind, for PREMUL_SUM this rank's factor, and the family it belongs to.

    ``kind`` is always the enum member itself (``ReduceOp.SUM``, ...), never an equal copy, so the hot
    paths compare kinds with ``is`` (an ``==`` between these enums costs a Python-level call).
    """

    __slots__ = ("kind", "factor", "name", "linear", "extrema", "bitwise")

    def __init__(self, kind: ReduceOp.RedOpType, factor: float | complex | torch.Tensor | None = None):
        self.kind, self.factor, self.name = kind, factor, kind.name
        self.linear = kind in _LINEAR
        self.extrema = kind in _EXTREMA
        self.bitwise = kind in _BITWISE


_KINDS = {k.value: k for k in (_SUM, _AVG, _PRODUCT, _MIN, _MAX, *_BITWISE, _PREMUL_SUM)}
_OPS = {value: _Op(kind) for value, kind in _KINDS.items() if kind is not _PREMUL_SUM}
_SUM_OP = _OPS[_SUM.value]


def _parse_op(op) -> _Op:
    if op is _SUM:
        return _SUM_OP
    if isinstance(op, ReduceOp.RedOpType):
        kind, factor = op, None
    elif isinstance(op, ReduceOp) and hasattr(op, "op"):
        kind, factor = op.op, None
        if kind == _PREMUL_SUM:
            # ``.factor`` appeared in torch 2.13; the pickled state (op, factor) is there in older versions too.
            factor = getattr(op, "factor", None)
            if factor is None:
                factor = op.__getstate__()[1]
    else:
        raise TypeError(
            f"`op` must be a torch.distributed.ReduceOp (one of {_ALL_OPS}), got {type(op).__name__} {op!r}"
        )
    parsed = _OPS.get(kind.value)
    if parsed is not None:
        return parsed
    kind = _KINDS.get(kind.value, kind)
    if kind is _PREMUL_SUM:
        if factor is None:
            raise ValueError(
                "`op`=PREMUL_SUM needs a factor: pass torch.distributed._make_nccl_premul_sum(factor) instead of "
                "ReduceOp.PREMUL_SUM"
            )
        if isinstance(factor, torch.Tensor):
            if factor.numel() != 1:
                raise ValueError(f"the PREMUL_SUM factor must be a scalar, got a tensor of shape {tuple(factor.shape)}")
            if factor.requires_grad:
                raise ValueError(
                    "the PREMUL_SUM factor requires grad, but it is treated as a constant; to differentiate with "
                    "respect to it, multiply the tensor by it and reduce with SUM"
                )
            factor = factor.detach().reshape(())
    return _Op(kind, factor)


def _conj(factor):
    return factor.conj() if isinstance(factor, torch.Tensor) else factor.conjugate()


def _require_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(value).__name__}")


def _needs_grad(tensor: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and tensor.requires_grad


def _check_op(fn: str, op: _Op, tensor: torch.Tensor, needs_grad: bool, group) -> None:
    """Reject op/dtype combinations the backends or the gradient cannot handle, before communicating."""
    kind = op.kind
    if kind is _SUM:  # defined and differentiable for every dtype
        return
    dtype = tensor.dtype
    floating = dtype.is_floating_point or dtype.is_complex
    if op.bitwise:
        if needs_grad:
            raise ValueError(
                f"{fn}: `op`={op.name} is not differentiable, but the input requires grad; detach the input or "
                f"use one of {_DIFFERENTIABLE_OPS}"
            )
        if floating:
            raise TypeError(f"{fn}: `op`={op.name} needs an integer or bool tensor, got dtype {dtype}")
        if _is_nccl(group, tensor):
            raise TypeError(
                f"{fn}: `op`={op.name} is not supported by the NCCL backend (it has SUM, AVG, PREMUL_SUM, PRODUCT, "
                "MIN and MAX); use a gloo group for bitwise reductions"
            )
    if dtype.is_complex and (kind is _PRODUCT or op.extrema):
        raise TypeError(
            f"{fn}: `op`={op.name} is not defined for complex tensors (got {dtype}); complex tensors allow SUM, "
            "AVG and PREMUL_SUM"
        )
    if kind is _PREMUL_SUM and not floating:
        raise TypeError(f"{fn}: `op`=PREMUL_SUM needs a floating-point or complex tensor, got dtype {dtype}")
    if kind is _AVG and dtype == torch.bool:
        raise TypeError(f"{fn}: `op`=AVG is not defined for bool tensors")


def _encode_shape(shape) -> list[int]:
    if len(shape) > _check.MAX_DIMS:
        raise ValueError(f"tensors of more than {_check.MAX_DIMS} dims are not supported, got shape {tuple(shape)}")
    return [len(shape), *shape] + [0] * (_check.MAX_DIMS - len(shape))


def _agree(fn: str, tensor: torch.Tensor, group, *, same_shape: bool = True, shapes=(), **ints: int) -> None:
    """Check mode: every rank must pass the same dtype, shape (if ``same_shape``), ``shapes`` and ``ints``.

    One small all-gather; every rank sees the same data and so raises the same ``ValueError``. Called only
    in check mode and on groups of more than one rank.
    """
    names = list(ints)
    extra = [int(v) for v in ints.values()] + [v for s in shapes for v in _encode_shape(s)]
    metas, rows = _check.gather_meta(tensor, group, extra=extra)
    if any(m.dtype != metas[0].dtype for m in metas):
        _check.raise_mismatch(fn, "dtypes", metas)
    if same_shape and any(m.shape != metas[0].shape for m in metas):
        _check.raise_mismatch(fn, "shapes", metas)
    for i, name in enumerate(names):
        show = (lambda v: ReduceOp.RedOpType(v).name) if name == "op" else None
        _check.require_agreement(fn, name, [row[i] for row in rows], show=show)
    width = 1 + _check.MAX_DIMS
    for k in range(len(shapes)):
        start = len(names) + k * width
        seen = [tuple(row[start + 1 : start + 1 + row[start]]) for row in rows]
        if len(set(seen)) > 1:
            detail = ", ".join(f"rank {r}: {s}" for r, s in enumerate(seen))
            raise ValueError(f"{fn}: shapes of `input_list[{k}]` differ across ranks ({detail})")


# --------------------------------------------------------------------------------------------------------
# Raw collectives: never modify their arguments, always return new tensors, world of one = local op.
# --------------------------------------------------------------------------------------------------------


def _is_nccl(group, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` travels through NCCL: a CUDA tensor on a group with an NCCL backend.

    Decided per tensor: a group created with ``backend="cpu:gloo,cuda:nccl"`` sends CPU tensors through
    gloo, where the NCCL-only choices (native AVG, refusing bitwise ops) do not apply.
    """
    return tensor.is_cuda and group is not None and "nccl" in str(dist.get_backend(group)).lower()


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """The view handed to the backend: complex tensors travel as pairs of reals (SUM acts on each part)."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def _owned_copy(x: torch.Tensor, op: _Op) -> torch.Tensor:
    """A contiguous copy of ``x`` (times the factor for PREMUL_SUM, see Note [Backend emulation])."""
    if op.kind is not _PREMUL_SUM:
        if x.is_contiguous():  # the plain clone keeps the (contiguous) layout and is cheaper to call
            return x.clone()
        return x.clone(memory_format=torch.contiguous_format)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    factor = op.factor.to(x.device) if isinstance(op.factor, torch.Tensor) else op.factor
    return torch.mul(x, factor, out=out)


def _backend_op(op: _Op, group, tensor: torch.Tensor, size: int):
    """The op handed to the backend for ``tensor`` and the divisor applied afterwards (AVG emulation) or None."""
    kind = op.kind
    if kind is _AVG and not ((tensor.is_floating_point() or tensor.is_complex()) and _is_nccl(group, tensor)):
        return _SUM, size
    if kind is _PREMUL_SUM:
        return _SUM, None
    return kind, None


def _finish(buf: torch.Tensor, divisor: int | None, nan: torch.Tensor | None) -> torch.Tensor:
    if divisor is not None:
        if buf.dtype.is_floating_point or buf.dtype.is_complex:
            buf.div_(divisor)
        else:
            buf.div_(divisor, rounding_mode="trunc")
    if nan is not None:
        buf.masked_fill_(nan.bool(), float("nan"))
    return buf


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
    """The reduction on global rank ``dst`` (this rank if ``is_dst``), zeros on the other ranks."""
    buf = _owned_copy(x, op)
    if size == 1 or buf.numel() == 0:
        return buf
    backend_op, divisor = _backend_op(op, group, buf, size)
    nan = None
    if op.extrema and buf.dtype.is_floating_point:
        nan = torch.isnan(buf).to(torch.uint8)
        dist.reduce(nan, dst, op=_MAX, group=group)
    dist.reduce(_wire(buf), dst, op=backend_op, group=group)
    if not is_dst:
        return buf.zero_()
    if divisor is None and nan is None:
        return buf
    return _finish(buf, divisor, nan)


def _raw_broadcast(x: torch.Tensor, src: int, group, size: int, is_src: bool) -> torch.Tensor:
    """A new contiguous tensor holding global rank ``src``'s ``x`` (this rank's if ``is_src``)."""
    if size == 1 or is_src:
        buf = _owned_copy(x, _SUM_OP)
    else:
        buf = x.new_empty(x.shape)
    if size > 1 and buf.numel():
        dist.broadcast(_wire(buf), src, group=group)
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


class _AllReduce(Function):
    """y = op_i x_i on every rank. Adjoint: all_reduce(SUM) of the grads, times the local factor (AVG:
    all_reduce(AVG) of the grads, the op itself)."""

    @staticmethod
    def forward(ctx, tensor, op, group, size):
        y = _raw_all_reduce(tensor, op, group, size)
        ctx.op, ctx.group, ctx.size = op, group, size
        if op.extrema:
            ctx.save_for_backward(tensor, y)
        elif op.kind is _PRODUCT:
            ctx.save_for_backward(tensor)
        return y

    @staticmethod
    def backward(ctx, grad):
        op, group, size = ctx.op, ctx.group, ctx.size
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
        ctx.op, ctx.dst, ctx.group, ctx.size, ctx.is_dst = op, dst, group, size, is_dst
        if op.extrema:
            ctx.save_for_backward(tensor, y)
        elif op.kind is _PRODUCT:
            ctx.save_for_backward(tensor)
        return y

    @staticmethod
    def backward(ctx, grad):
        op, dst, group, size, is_dst = ctx.op, ctx.dst, ctx.group, ctx.size, ctx.is_dst
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
        ctx.src, ctx.group, ctx.size, ctx.is_src = src, group, size, is_src
        return _raw_broadcast(tensor, src, group, size, is_src)

    @staticmethod
    def backward(ctx, grad):
        total = _adjoint(
            _Reduce, _raw_reduce, grad.contiguous(), ctx.src, _SUM_OP, ctx.group, ctx.size, ctx.is_src
        )
        return total, None, None, None, None


def _all_gather_list(group, shapes, tensor) -> tuple[torch.Tensor, ...]:
    """Every rank's tensor, rank r's of shape ``shapes[r]``: the raw op of :class:`_AllGatherList`."""
    parts = _raw_all_gather_flat(tensor.reshape(-1), [math.prod(s) for s in shapes], group)
    return tuple(p.view(s) for p, s in zip(parts, shapes))


class _AllGatherList(Function):
    """parts[r] = rank r's tensor, of shape ``shapes[r]`` (sizes may differ). Adjoint: reduce_scatter(SUM)."""

    @staticmethod
    def forward(ctx, group, shapes, tensor):
        ctx.group, ctx.size, ctx.rank = group, len(shapes), _groups.group_rank(group)
        return _all_gather_list(group, shapes, tensor)

    @staticmethod
    def backward(ctx, *grads):
        grads = [g.contiguous() for g in grads]
        total = _adjoint(_ReduceScatter, _reduce_scatter_list, None, _SUM_OP, ctx.group, ctx.size, ctx.rank, *grads)
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
        ctx.op, ctx.group, ctx.size, ctx.rank = op, group, size, rank
        ctx.shapes = [tuple(t.shape) for t in inputs]
        if op.extrema:
            ctx.save_for_backward(*inputs, y)
        elif op.kind is _PRODUCT:
            ctx.save_for_backward(*inputs)
        return y

    @staticmethod
    def backward(ctx, grad):
        op, group, size, shapes = ctx.op, ctx.group, ctx.size, ctx.shapes
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
    # Imported here: distcomm._movement imports this module.
    from distcomm._movement import _AllGatherTensor

    return _adjoint(_AllGatherTensor, _raw_all_gather_dim, tensor, dim, group, size)


class _ReduceScatterTensor(Function):
    """y_r = chunk r along ``dim`` of op_j x_j. Adjoint (SUM): all_gather_tensor (concatenation along dim)."""

    @staticmethod
    def forward(ctx, tensor, dim, op, group, size):
        y = _raw_reduce_scatter_dim(tensor, dim, op, group, size)
        ctx.op, ctx.dim, ctx.group, ctx.size = op, dim, group, size
        if op.extrema:
            ctx.save_for_backward(tensor, y)
        elif op.kind is _PRODUCT:
            ctx.save_for_backward(tensor)
        return y

    @staticmethod
    def backward(ctx, grad):
        op, dim, group, size = ctx.op, ctx.dim, ctx.group, ctx.size
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
    op = _parse_op(op)
    group, size, _ = _groups.resolve(group)
    needs_grad = _needs_grad(tensor)
    _check_op("all_reduce", op, tensor, needs_grad, group)
    if size > 1 and _check.is_check_mode():
        _agree("all_reduce", tensor, group, op=op.kind.value, requires_grad=needs_grad)
    return _AllReduce.apply(tensor, op, group, size)


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
    op = _parse_op(op)
    group, size, rank = _groups.resolve(group)
    dst_rank = _groups.check_rank_in_group("dst", dst, group)
    needs_grad = _needs_grad(tensor)
    _check_op("reduce", op, tensor, needs_grad, group)
    if size > 1 and _check.is_check_mode():
        _agree("reduce", tensor, group, op=op.kind.value, dst=dst, requires_grad=needs_grad)
    return _Reduce.apply(tensor, dst, op, group, size, rank == dst_rank)


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
    src_rank = _groups.check_rank_in_group("src", src, group)
    if size > 1 and _check.is_check_mode():
        _agree("broadcast", tensor, group, src=src, requires_grad=_needs_grad(tensor))
    return _Broadcast.apply(tensor, src, group, size, rank == src_rank)


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
    op = _parse_op(op)
    group, size, rank = _groups.resolve(group)
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
    op = _parse_op(op)
    group, size, _ = _groups.resolve(group)
    if tensor.shape[dim] % size:
        raise ValueError(
            f"reduce_scatter_tensor: `tensor` has size {tensor.shape[dim]} along `dim`={dim}, which the group size "
            f"{size} does not divide"
        )
    needs_grad = _needs_grad(tensor)
    _check_op("reduce_scatter_tensor", op, tensor, needs_grad, group)
    if size > 1 and _check.is_check_mode():
        _agree("reduce_scatter_tensor", tensor, group, op=op.kind.value, dim=dim, requires_grad=needs_grad)
    return _ReduceScatterTensor.apply(tensor, dim, op, group, size)
