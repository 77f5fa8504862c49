"""ReduceOps: parsing and classification, the checks of the reductions' arguments, backend emulation.

Shared by the reduction family: the autograd Functions and public functions of :mod:`distcomm._reduce`
and :mod:`distcomm._reduce_scatter`, and the raw collectives of :mod:`distcomm._reduce_raw`. Nothing here
communicates except check mode's agreement check (``_agree``).

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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distcomm import _check, _groups

ReduceOp = dist.ReduceOp
_SUM, _AVG, _PRODUCT = ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT
_MIN, _MAX, _PREMUL_SUM = ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PREMUL_SUM
_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
_EXTREMA = (_MIN, _MAX)
_LINEAR = (_SUM, _AVG, _PREMUL_SUM)
_ALL_OPS = "SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM"
_DIFFERENTIABLE_OPS = "SUM, AVG, PREMUL_SUM, PRODUCT, MIN, MAX"


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
        return _premul_op(factor)
    return _Op(kind, factor)


def _premul_op(factor) -> _Op:
    """PREMUL_SUM with its (validated) factor."""
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
    return _Op(_PREMUL_SUM, factor)


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
# Backend emulation (Note [Backend emulation])
# --------------------------------------------------------------------------------------------------------


def _is_nccl(group, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` travels through NCCL: a CUDA tensor on a group with an NCCL backend.

    Decided per tensor: a group created with ``backend="cpu:gloo,cuda:nccl"`` sends CPU tensors through
    gloo, where the NCCL-only choices (native AVG, refusing bitwise ops) do not apply.
    """
    return tensor.is_cuda and group is not None and "nccl" in _groups.backend_name(group).lower()


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
